"""Large requests are prepared off the event loop (specrpc/edges/offload.py): tokenizing a megabyte takes about a
second on a small CPU, and on the loop that second would stall every stream in flight. Checked by where the tokenizer
runs, on both edges: a worker thread for a large request, the loop itself for a small one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx2
import pytest

from specrpc.edges.offload import INLINE_BYTES
from specrpc.edges.server import Running
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

LARGE = "x = 1\n" * (4 * INLINE_BYTES // 6)  # four times the inline bound, and over the context: refused after tokenizing


class WhereTokenized:
    """The server's tokenizer, recording the thread of each call (and otherwise the tokenizer itself)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: list[threading.Thread] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@pytest.fixture
def tokenized(server: Running, monkeypatch: pytest.MonkeyPatch) -> Iterator[WhereTokenized]:
    spy = WhereTokenized(server.runtime.tokenizer)
    monkeypatch.setattr(server.runtime, "tokenizer", spy)
    yield spy


async def test_grpc_tokenizes_a_large_prompt_in_a_worker_and_a_small_one_on_the_loop(
        stub: pb_grpc.GeneratorStub, tokenized: WhereTokenized) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(pb.GenerateRequest(prompt=LARGE, max_new_tokens=1)).read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # too long: tokenized, then refused
    assert tokenized.threads and threading.current_thread() not in tokenized.threads
    tokenized.threads.clear()
    async for _ in stub.Generate(pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=1)):
        pass
    assert tokenized.threads and set(tokenized.threads) == {threading.current_thread()}


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "m", "prompt": LARGE, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": LARGE}], "max_tokens": 1}),
    ("/completion", {"prompt": LARGE, "n_predict": 1}),
])
async def test_http_tokenizes_a_large_request_in_a_worker(http: httpx2.AsyncClient, tokenized: WhereTokenized,
                                                          route: str, body: dict[str, Any]) -> None:
    response = await http.post(route, json=body)
    assert response.status_code in (200, 400), response.text
    assert tokenized.threads and threading.current_thread() not in tokenized.threads
