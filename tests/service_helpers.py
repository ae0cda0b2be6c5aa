"""Helpers for the end-to-end service tests: read streams, wait for conditions, build requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Callable

import grpc
import pytest

from specrpc.edges.server import Running
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

LONG_TOKENS = 256
"""The test server's --max-new-tokens: with the `long_streams` fixture such a stream runs for seconds."""

GREEDY_K0 = pb.SpeculationParams(num_draft_tokens=0)


def long_request(**fields: object) -> pb.GenerateRequest:
    """A request that runs until cancelled (under `long_streams`): one token per step, the most tokens allowed."""
    request = pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=LONG_TOKENS, speculation=GREEDY_K0)
    for name, value in fields.items():
        if isinstance(value, pb.SpeculationParams | pb.SamplingParams):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


async def collect(stream: AsyncIterable[pb.GenerateResponse]) -> tuple[list[pb.TokenChunk], pb.GenerationSummary]:
    """All chunks and the summary of a Generate/Infill stream, checking the shape: chunks, then exactly one summary."""
    chunks: list[pb.TokenChunk] = []
    summary: pb.GenerationSummary | None = None
    async for response in stream:
        assert summary is None, f"an event followed the summary: {response}"
        if response.WhichOneof("event") == "chunk":
            chunks.append(response.chunk)
        else:
            assert response.WhichOneof("event") == "summary", response
            summary = response.summary
    assert summary is not None, "the stream ended without a summary"
    return chunks, summary


async def read_rest(call: grpc.aio.UnaryStreamCall) -> tuple[list[pb.TokenChunk], pb.GenerationSummary]:
    """Like `collect` for a call already read with `read()` (aio calls do not mix read() and iteration)."""
    chunks: list[pb.TokenChunk] = []
    while True:
        response = await call.read()
        assert response is not grpc.aio.EOF, "the stream ended without a summary"
        if response.WhichOneof("event") == "summary":
            assert await call.read() is grpc.aio.EOF, "an event followed the summary"
            return chunks, response.summary
        chunks.append(response.chunk)


async def first_tokens(call: grpc.aio.UnaryStreamCall) -> pb.TokenChunk:
    """Read until the first chunk with tokens (the stream is then running on the device)."""
    while True:
        response = await asyncio.wait_for(call.read(), timeout=30)
        assert response is not grpc.aio.EOF and response.WhichOneof("event") == "chunk", response
        if response.chunk.token_ids:
            return response.chunk


def ids_of(chunks: list[pb.TokenChunk]) -> list[int]:
    """Concatenated token ids of the chunks."""
    return [i for chunk in chunks for i in chunk.token_ids]


def text_of(chunks: list[pb.TokenChunk]) -> str:
    """Concatenated text of the chunks."""
    return "".join(chunk.text for chunk in chunks)


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> float:
    """Poll `condition` every 5 ms; return the seconds it took, fail after `timeout`."""
    start = time.perf_counter()
    while not condition():
        if time.perf_counter() - start > timeout:
            pytest.fail(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.005)
    return time.perf_counter() - start


CLIENT_WRITE_RACE = (grpc.StatusCode.INTERNAL, "Internal error from Core")
"""What grpcio's client reports when it writes to a stream the server has just ended: a client-side race."""


async def status_of(call: object) -> tuple[grpc.StatusCode, str]:
    """Read a call to its end (a stream to its last message); its status code and details."""
    try:
        if isinstance(call, AsyncIterable):
            async for _ in call:
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def rpc_error(awaitable: object) -> grpc.aio.AioRpcError:
    """The AioRpcError a call ends with (a stream is read to its end)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if isinstance(awaitable, AsyncIterable):
            async for _ in awaitable:
                pass
        else:
            await awaitable  # type: ignore[misc]
    return info.value


class Conversation:
    """A Converse stream driven by a test."""

    def __init__(self, stub: pb_grpc.GeneratorStub, timeout: float = 60.0) -> None:
        self.call = stub.Converse(timeout=timeout)

    async def send(self, **action: object) -> None:
        await self.call.write(pb.ConverseRequest(**action))  # type: ignore[arg-type]

    async def read(self) -> pb.ConverseResponse:
        response = await asyncio.wait_for(self.call.read(), timeout=30)
        assert response is not grpc.aio.EOF, "the Converse stream ended"
        return response  # type: ignore[no-any-return]

    async def start(self, **fields: object) -> pb.SessionStarted:
        await self.send(start=pb.SessionStart(**fields))  # type: ignore[arg-type]
        response = await self.read()
        assert response.WhichOneof("event") == "started", response
        return response.started

    async def reply(self) -> tuple[list[pb.TokenChunk], list[pb.Phrase], pb.TurnSummary]:
        """Events of one reply up to its summary."""
        chunks: list[pb.TokenChunk] = []
        phrases: list[pb.Phrase] = []
        while True:
            response = await self.read()
            kind = response.WhichOneof("event")
            if kind == "chunk":
                chunks.append(response.chunk)
            elif kind == "phrase":
                phrases.append(response.phrase)
            else:
                assert kind == "summary", response
                return chunks, phrases, response.summary

    async def turn(self, text: str, **fields: object) -> tuple[list[pb.TokenChunk], list[pb.Phrase], pb.TurnSummary]:
        await self.send(turn=pb.Turn(text=text, **fields))  # type: ignore[arg-type]
        return await self.reply()

    async def close(self) -> None:
        """Half-close and read to the end (OK status)."""
        await self.call.done_writing()
        assert await asyncio.wait_for(self.call.read(), timeout=30) is grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK


def base_url(server: Running) -> str:
    """The in-process server's HTTP edge."""
    return f"http://127.0.0.1:{server.http_port}"
