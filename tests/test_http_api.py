"""The HTTP edge against the live test server (same runtime and sessions as gRPC): the official `openai` SDK, the
exact requests llama.vim sends to /infill, disconnects, authentication and malformed requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from conftest import free_port
from process_helpers import have_openssl, make_certs, serve_process, wait_serving
from service_helpers import LONG_TOKENS, Conversation, base_url, collect, text_of, wait_until

from specrpc.config import build_config
from specrpc.edges.auth import StreamQuota, TokenAuth
from specrpc.edges.gateway import Gateway
from specrpc.edges.http.api import HttpApi, HttpServer
from specrpc.edges.server import Running
from specrpc.prompts.fim import ExtraFile, InfillInput
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

Stub = pb_grpc.GeneratorStub

LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
"""The response_fields of llama.vim's completion request (autoload/llama.vim, llama#fim)."""


def assert_openai_error(response: httpx2.Response, status: int, *words: str) -> dict[str, Any]:
    """OpenAI's error shape with `status`, its message naming `words`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    for word in words:
        assert word in error["message"], error
    return error  # type: ignore[no-any-return]


def test_http_port_is_off_by_default_and_set_by_flag_env_or_toml(tmp_path: Path) -> None:
    assert build_config(None, env={}).server.http_port == 0
    assert build_config(None, env={"SPECRPC_HTTP_PORT": "8080"}).server.http_port == 8080
    toml = tmp_path / "specrpc.toml"
    toml.write_text("[server]\nhttp_port = 8081\nhttp_user_session = false\n")
    args = argparse.Namespace(config=toml)
    config = build_config(args, env={})
    assert (config.server.http_port, config.server.http_user_session) == (8081, False)
    with pytest.raises(ValueError, match="--http-port"):
        build_config(None, env={"SPECRPC_HTTP_PORT": "70000"})


# ---- OpenAI, with the official SDK ---------------------------------------------------------------------------------


async def test_sdk_streams_chat_with_usage_equal_to_grpc_converse(client: openai.AsyncOpenAI, stub: Stub) -> None:
    question = "What is the capital of France?"
    stream = await client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    deltas: list[str] = []
    finish: list[str | None] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        deltas.append(chunk.choices[0].delta.content or "")
        finish.append(chunk.choices[0].finish_reason)
    assert usage is not None and finish[-1] in ("stop", "length") and all(f is None for f in finish[:-1])
    conversation = Conversation(stub)
    await conversation.start(max_new_tokens=12)
    chunks, _, summary = await conversation.turn(question)
    await conversation.close()
    assert "".join(deltas) == text_of(chunks) == summary.reply_text
    assert usage.prompt_tokens == summary.generation.prompt_tokens
    assert usage.completion_tokens == summary.generation.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_sdk_streams_completion_with_suffix_equal_to_grpc_infill(client: openai.AsyncOpenAI,
                                                                       stub: Stub) -> None:
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    stream = await client.completions.create(model="any", prompt=prefix, suffix=suffix, max_tokens=10,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
    chunks, summary = await collect(stub.Infill(pb.InfillRequest(prefix=prefix, suffix=suffix, max_new_tokens=10)))
    assert text == text_of(chunks)
    assert usage is not None and usage.prompt_tokens == summary.prompt_tokens
    assert usage.completion_tokens == summary.completion_tokens
    # and without streaming, the same
    whole = await client.completions.create(model="any", prompt=prefix, suffix=suffix, max_tokens=10, temperature=0)
    assert whole.choices[0].text == text and whole.usage is not None
    assert whole.usage.completion_tokens == summary.completion_tokens


async def test_sdk_sends_a_prediction_and_reads_the_accepted_and_rejected_prediction_tokens(
        client: openai.AsyncOpenAI, stub: Stub) -> None:
    """OpenAI's Predicted Outputs through the official SDK: the same output as without a prediction, the counts in
    usage (whole and streamed, with include_usage) and, over gRPC, in the summary. The prediction is the plain
    output with one line changed: most of its tokens appear in the completion, the changed line's do not."""
    messages: list[Any] = [{"role": "user", "content": "Write a Python class for a stack."}]
    plain = await client.chat.completions.create(model="any", messages=messages, max_tokens=60, temperature=0)
    text = plain.choices[0].message.content or ""
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    lines = text.split("\n")
    predicted = "\n".join([*lines[:1], "    unrelated = 12345", *lines[2:]]) if len(lines) > 2 else text + " extra"
    whole = await client.chat.completions.create(model="any", messages=messages, max_tokens=60, temperature=0,
                                                 prediction={"type": "content", "content": predicted})
    assert whole.choices[0].message.content == text
    details = whole.usage.completion_tokens_details if whole.usage is not None else None
    assert details is not None and details.accepted_prediction_tokens and details.rejected_prediction_tokens
    assert details.accepted_prediction_tokens > details.rejected_prediction_tokens
    stream = await client.chat.completions.create(
        model="any", messages=messages, max_tokens=60, temperature=0, stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": predicted[:10]},
                                                   {"type": "text", "text": predicted[10:]}]})
    streamed, usage = "", None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            streamed += choice.delta.content or ""
    assert streamed == text and usage is not None and usage.completion_tokens_details == details
    # the legacy completions route takes it too (the SDK sends it as an extra field), as does gRPC Generate
    completion = await client.completions.create(model="any", prompt="class Stack:\n", max_tokens=40,
                                                 temperature=0)
    again = await client.completions.create(model="any", prompt="class Stack:\n", max_tokens=40, temperature=0,
                                            extra_body={"prediction": {"type": "content",
                                                                       "content": completion.choices[0].text}})
    assert again.choices[0].text == completion.choices[0].text
    assert again.usage is not None and again.usage.completion_tokens_details is not None
    assert again.usage.completion_tokens_details.accepted_prediction_tokens
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(
        prompt="class Stack:\n", max_new_tokens=40, prediction=completion.choices[0].text)))
    assert text_of(chunks) == completion.choices[0].text
    assert summary.accepted_prediction_tokens == again.usage.completion_tokens_details.accepted_prediction_tokens
    assert summary.rejected_prediction_tokens == again.usage.completion_tokens_details.rejected_prediction_tokens
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=4, prediction="word " * 2000)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prediction" in str(refused.value.details())


async def test_session_second_turn_reuses_the_first_despite_other_clients(
    client: openai.AsyncOpenAI, server: Running
) -> None:
    session = f"voice-{uuid.uuid4().hex}"
    first = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    reply = await client.chat.completions.create(model="any", messages=first, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                                 extra_headers={"x-session-id": session})
    assert reply.usage is not None
    first_prompt = reply.usage.prompt_tokens
    # other clients fill every other slot meanwhile
    others = [client.completions.create(model="any", prompt=f"Story {i}: once upon a time", max_tokens=6,
                                        temperature=0) for i in range(server.runtime.registry.total - 1)]
    await asyncio.gather(*others)
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": "Another one?"}]
    again = await client.chat.completions.create(model="any", messages=second, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                                 user=session)  # `user` names the same session
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= first_prompt


async def test_a_long_chat_history_is_trimmed_by_whole_messages_keeping_the_system_prompt(
    http: httpx2.AsyncClient, server: Running
) -> None:
    system = "You are a patient assistant who answers every question."
    system_tokens = len(server.runtime.encode(f"System: {system}\n"))
    messages = [{"role": "system", "content": system}]
    for i in range(40):
        messages += [{"role": "user", "content": f"Question {i} about the mountains and the sea?"},
                     {"role": "assistant", "content": f"Answer {i}: they are far apart."}]
    headers = {"x-session-id": f"chat-{uuid.uuid4().hex}"}
    room = server.runtime.config.engine.max_context - 1
    for turn in ("And the rivers?", "And the lakes?"):
        messages.append({"role": "user", "content": turn})
        response = await http.post("/v1/chat/completions", headers=headers,
                                   json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] <= room
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    # the second prompt begins as the first did, with the system prompt (a cut from the front would share nothing)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= system_tokens, usage


async def test_sdk_chat_logprobs_per_token(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert reply.usage is not None and reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content or []
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen token is the best
    completion = await client.completions.create(model="any", prompt="def add(a, b):", max_tokens=4, temperature=0,
                                                 logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and "".join(logprobs.tokens or []) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in (logprobs.tokens or [])[:i]) for i in range(4)]


async def test_header_and_user_disagreeing_is_a_400(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", headers={"x-session-id": "a"},
                               json={"messages": [{"role": "user", "content": "hi"}], "user": "b"})
    assert_openai_error(response, 400, "x-session-id", "user")


async def test_models_and_health(http: httpx2.AsyncClient, client: openai.AsyncOpenAI, server: Running) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.runtime.target_info.name]
    health = await http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


# ---- llama.cpp's /infill as llama.vim calls it ---------------------------------------------------------------------


def llama_vim_request(extra: list[dict[str, Any]], prefix: str, middle: str, suffix: str) -> dict[str, Any]:
    """llama#fim's request body, field for field."""
    return {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
            "n_predict": 256, "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1500, "response_fields": LLAMA_VIM_FIELDS}


def llama_vim_warmup(extra: list[dict[str, Any]]) -> dict[str, Any]:
    """s:ring_update's cache warm-up request body, field for field."""
    return {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""]}


async def test_llama_vim_warmup_then_completion_reads_flattened_fields(
    http: httpx2.AsyncClient, server: Running
) -> None:
    if server.runtime.fim is None:
        pytest.skip("the served model has no FIM tokens")
    extra = [{"text": f"def helper_{uuid.uuid4().hex[:8]}(x):\n    return x * 2\n", "time": [1, 2],
              "filename": "util.py"}]
    warm = await http.post("/infill", json=llama_vim_warmup(extra))
    assert warm.status_code == 200 and warm.json() == {}  # response_fields [""] names nothing
    prefix, middle, suffix = "import util\n\n", "    total = ", "\nprint(total)\n"
    response = await http.post("/infill", json=llama_vim_request(extra, prefix, middle, suffix))
    assert response.status_code == 200, response.text
    reply = response.json()
    assert set(reply) == set(LLAMA_VIM_FIELDS)
    assert isinstance(reply["content"], str) and reply["truncated"] is False
    rt = server.runtime
    files = (ExtraFile("util.py", extra[0]["text"]),)
    prompt = rt.infill_prompt(InfillInput(prefix, suffix, files, typed_line=middle), truncate=True).ids
    warmed = rt.infill_prompt(InfillInput("", "", files), truncate=True).ids
    shared = next((i for i, (a, b) in enumerate(zip(prompt, warmed, strict=False)) if a != b), len(warmed))
    assert shared > 0 and reply["timings/prompt_n"] <= len(prompt) - shared  # the warmed-up extra files were cached
    assert len(prompt) <= reply["tokens_cached"] <= len(prompt) + reply["timings/predicted_n"]
    assert reply["timings/predicted_n"] >= 1 and reply["timings/predicted_ms"] >= 0


async def test_llama_infill_trims_extra_context_that_does_not_fit(http: httpx2.AsyncClient, server: Running) -> None:
    if server.runtime.fim is None:
        pytest.skip("the served model has no FIM tokens")
    extra = [{"filename": f"f{i}.py", "text": f"def f{i}(x):\n    return x + {i}\n" * 12} for i in range(8)]
    body = {"input_prefix": "import f0\n", "input_suffix": "\n", "input_extra": extra, "prompt": "y = ",
            "n_predict": 4, "temperature": 0, "response_fields": ["content", "truncated", "tokens_cached"]}
    reply = (await http.post("/infill", json=body)).json()
    assert reply["truncated"] is True and reply["tokens_cached"] < server.runtime.context_limit

async def test_llama_warmup_generates_nothing(http: httpx2.AsyncClient, server: Running) -> None:
    if server.runtime.fim is None:
        pytest.skip("the served model has no FIM tokens")
    extra = [{"text": f"x_{uuid.uuid4().hex[:8]} = 1\n", "time": [1, 2], "filename": "a.py"}]
    body = {**llama_vim_warmup(extra), "response_fields": ["content", "tokens_cached", "timings/predicted_n",
                                                            "timings/prompt_n", "timings/cache_n"]}
    reply = (await http.post("/infill", json=body)).json()
    assert reply["content"] == "" and reply["timings/predicted_n"] == 0 and reply["timings/prompt_n"] > 0
    assert reply["tokens_cached"] == reply["timings/prompt_n"] + reply["timings/cache_n"]  # kept, nothing generated


EDITOR_PREFIX = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"


async def test_llama_n_indent_and_time_budget_end_completions_on_a_line(http: httpx2.AsyncClient, server: Running,
                                                                         long_streams: float) -> None:
    """As over gRPC (tests/test_service.py): n_indent one more than the indentation of the reply's second line
    ends it before that line; a 1 ms budget ends it at the first newline after the first chunk."""
    base = {"prompt": EDITOR_PREFIX, "n_predict": 48, "temperature": 0}
    reference = (await http.post("/completion", json=base)).json()["content"]
    lines = reference.split("\n")
    at, line = next((i, line) for i, line in enumerate(lines) if i > 0 and line.strip())
    n_indent = len(line) - len(line.lstrip(" \t")) + 1
    cut = (await http.post("/completion", json={**base, "n_indent": n_indent})).json()
    assert cut["content"] == "\n".join(lines[:at]) + "\n" and cut["stop_type"] == "limit"
    timed = (await http.post("/completion", json={**base, "t_max_predict_ms": 1})).json()
    assert timed["content"].endswith("\n") and reference.startswith(timed["content"])
    assert timed["content"].count("\n") <= 2 and timed["stop_type"] == "limit"


async def test_llama_infill_streams_when_asked(http: httpx2.AsyncClient, server: Running) -> None:
    if server.runtime.fim is None:
        pytest.skip("the served model has no FIM tokens")
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    return ", "n_predict": 8,
            "temperature": 0, "stream": True}
    events = []
    async with http.stream("POST", "/infill", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events and all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    whole = await http.post("/infill", json={**body, "stream": False})
    assert "".join(e["content"] for e in events) == whole.json()["content"]
    assert events[-1]["timings"]["predicted_n"] == whole.json()["timings"]["predicted_n"]


async def test_llama_speculative_n_max_caps_each_steps_draft_and_0_is_target_only(
    http: httpx2.AsyncClient, client: openai.AsyncOpenAI, stub: Stub
) -> None:
    """llama.cpp's per-request `speculative.n_max`: 0 decodes target-only (gRPC num_draft_tokens 0's tokens, and no
    `draft_n` in `timings`, as llama.cpp leaves it out when nothing was drafted); 3 verifies at most 3 draft tokens
    a step with the same greedy tokens. The OpenAI routes take it as an extra body field.

    Steps are counted from `timings`, not from streamed events: a reader that falls behind gets the steps it missed
    as one event, whatever the stream interval. The first token comes from the prefill and each verify step gives its
    accepted tokens and one more (the last at least one), so `predicted_n` >= 1 + (steps - 1) + 1 + accepted - 3,
    i.e. steps <= predicted_n - accepted + 2, and a cap of 3 keeps draft_n <= 3 * steps within that."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    body = {"prompt": prompt, "n_predict": 40, "temperature": 0}
    off = (await http.post("/completion", json={**body, "speculative.n_max": 0})).json()
    assert "draft_n" not in off["timings"] and off["generation_settings"]["speculative.n_max"] == 0
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(
        prompt=prompt, max_new_tokens=40, sampling=pb.SamplingParams(temperature=0),
        speculation=pb.SpeculationParams(num_draft_tokens=0))))
    assert off["content"] == "".join(c.text for c in chunks) and summary.speculation.draft_tokens_proposed == 0
    events = []
    async with http.stream("POST", "/completion", json={**body, "speculative.n_max": 3, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    timings = events[-1]["timings"]
    assert "".join(e["content"] for e in events) == off["content"]
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert sum(len(e["tokens"]) for e in events) == timings["predicted_n"] == 40
    assert timings["draft_n"] <= 3 * (timings["predicted_n"] - timings["draft_n_accepted"] + 2)
    assert events[-1]["generation_settings"]["speculative.n_max"] == 3
    sdk = await client.completions.create(model="any", prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body={"speculative.n_max": 0, "speculative.n_min": 0})
    assert sdk.choices[0].text == off["content"]


async def test_a_request_sets_its_own_stream_interval_on_every_route(
    http: httpx2.AsyncClient, stream_interval: Callable[[float], None]
) -> None:
    """`stream_interval_ms` in the body, as gRPC's field: under a server interval of a minute a stream's first
    tokens come at once and the rest with its end (two content events), while 0 hands each step's tokens over at
    once (target-only here: about one event a token); outside 0..1000 is a 400 naming the field, on the OpenAI and
    llama.cpp routes alike."""
    stream_interval(60.0)
    body = {"prompt": "def add(a, b):\n", "n_predict": 24, "temperature": 0, "speculative.n_max": 0,
            "ignore_eos": True, "stream": True}

    async def events(extra: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        async with http.stream("POST", "/completion", json={**body, **extra}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    out.append(json.loads(line[6:]))
        return [e for e in out if e["tokens"]]

    held = await events({})
    assert len(held) == 2 and sum(len(e["tokens"]) for e in held) == 24
    each = await events({"stream_interval_ms": 0})
    assert len(each) >= 12 and "".join(e["content"] for e in each) == "".join(e["content"] for e in held)
    for route, request in (("/completion", {"prompt": "x", "stream_interval_ms": 1001}),
                           ("/v1/completions", {"prompt": "x", "stream_interval_ms": -1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "stream_interval_ms": 2000})):
        response = await http.post(route, json=request)
        assert response.status_code == 400, (route, response.text)
        assert "stream_interval_ms must be in 0..1000" in response.text, (route, response.text)


# ---- cancel, auth, bad requests ------------------------------------------------------------------------------------


async def test_disconnect_mid_stream_frees_the_slot(http: httpx2.AsyncClient, server: Running,
                                                    long_streams: float) -> None:
    registry = server.runtime.registry
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": LONG_TOKENS,
            "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.aiter_lines()
        while '"content": "' not in (line := await anext(lines)) or '"content": ""' in line:
            pass
        assert registry.in_use >= 1
    took = await wait_until(lambda: registry.in_use == 0 and not server.service.quota.open, timeout=3,
                            what="the slot freed after the client went away")
    assert took < 1.0


async def test_a_new_request_on_a_session_cancels_the_one_in_flight(http: httpx2.AsyncClient, server: Running,
                                                                   long_streams: float) -> None:
    session = {"x-session-id": f"keys-{uuid.uuid4().hex}"}
    body = {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "temperature": 0}
    first = asyncio.create_task(http.post("/v1/completions", json=body, headers=session))
    await wait_until(lambda: server.runtime.registry.in_use == 1, what="the first request running")
    second = await http.post("/v1/completions", json={**body, "max_tokens": 3}, headers=session)
    assert second.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert (await first).json()["choices"][0]["finish_reason"] == "cancelled"


async def test_streams_per_client_limit_covers_http(http: httpx2.AsyncClient, server: Running, long_streams: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.service, "quota", StreamQuota(1, by_token=False))
    body = {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as running:
        await anext(running.aiter_lines())
        refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert_openai_error(refused, 429, "--max-streams-per-client", "at most 1")
    await wait_until(lambda: not server.service.quota.open and server.runtime.registry.in_use == 0,
                     what="quota and slot released")


async def test_unauthenticated_requests_get_401_when_tokens_are_configured(server: Running, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    config = replace(server.service.config, server=replace(server.service.config.server, http_port=free_port(),
                                                           auth_tokens_file=str(tokens)))
    http_server = HttpServer(config, HttpApi(config, server.service.gateway, TokenAuth(tokens)))
    port = await http_server.start()
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            body = {"prompt": "x", "max_tokens": 1}
            assert_openai_error(await c.post("/v1/completions", json=body), 401, "Authorization: Bearer")
            assert_openai_error(await c.post("/infill", json=body, headers={"Authorization": "Bearer nope"}), 401,
                                "invalid")
            assert (await c.get("/health")).status_code == 200  # exempt, like gRPC health
            ok = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    finally:
        await http_server.stop()


async def test_one_tenants_outputs_never_draft_for_another(server: Running, tmp_path: Path) -> None:
    """With auth tokens each token's requests draft from their own earlier outputs only (the suffix source): after
    one tenant's request, the other's trie holds nothing of its text. Without tokens, a session's own, or every
    client's with --shared-suffix-drafts."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nbob-token\n")
    base = server.service.config
    config = replace(base, server=replace(base.server, http_port=free_port(), auth_tokens_file=str(tokens)))
    gateway = Gateway(config, server.service.gateway.metrics, server.runtime)
    alice, bob = ([("authorization", f"Bearer {name}-token")] for name in ("alice", "bob"))
    scope_a, scope_b = gateway.draft_scope(alice, "s"), gateway.draft_scope(bob, "s")
    assert scope_a is not None and scope_b is not None and scope_a != scope_b
    http_server = HttpServer(config, HttpApi(config, gateway, TokenAuth(tokens)))
    port = await http_server.start()
    body = {"prompt": "def tool_call(name, arguments):\n", "max_tokens": 30, "temperature": 0}
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            first = await c.post("/v1/completions", json=body, headers=dict(alice))
            assert first.status_code == 200, first.text
            trie_a, trie_b = server.runtime.suffixes.trie(scope_a), server.runtime.suffixes.trie(scope_b)
            output = server.runtime.encode_plain(first.json()["choices"][0]["text"])
            assert trie_a.nodes > 0 and trie_a.draft(output[:8], 4)[0], "alice's output drafts for alice"
            assert trie_b.nodes == 0 and trie_b.draft(output[:8], 4) == ([], 0), "and never for bob"
            second = await c.post("/v1/completions", json=body, headers=dict(bob))
            assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        await http_server.stop()
    off = server.service.gateway
    assert off.draft_scope(alice, "") is None and off.draft_scope(alice, "s") == "session:s"
    shared = Gateway(replace(base, server=replace(base.server, shared_suffix_drafts=True)), off.metrics, server.runtime)
    assert shared.draft_scope(None, "") == shared.draft_scope(None, "other") == "shared"


@pytest.mark.skipif(not have_openssl(), reason="no openssl")
async def test_tls_and_mutual_tls_from_the_same_certificate_flags(server: Running, tmp_path: Path) -> None:
    await asyncio.to_thread(make_certs, tmp_path)
    base = server.service.config
    config = replace(base, server=replace(base.server, http_port=free_port(), tls_cert=str(tmp_path / "server.pem"),
                                          tls_key=str(tmp_path / "server.key"),
                                          tls_client_ca=str(tmp_path / "ca.pem")))
    http_server = HttpServer(config, HttpApi(config, server.service.gateway, None))
    port = await http_server.start()

    async def health(client_cert: str | None) -> int:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        if client_cert:
            context.load_cert_chain(str(tmp_path / f"{client_cert}.pem"), str(tmp_path / f"{client_cert}.key"))
        async with httpx2.AsyncClient(verify=context, timeout=10) as c:
            return (await c.get(f"https://localhost:{port}/health")).status_code

    try:
        assert await health("client") == 200
        for refused in (None, "client2"):  # no certificate; one from another CA
            with pytest.raises(httpx2.HTTPError):
                await health(refused)
    finally:
        await http_server.stop()


async def test_serve_on_uvloop_answers_both_edges_and_drains(tmp_path: Path) -> None:
    """`specrpc serve --event-loop uvloop --http-port`: gRPC and HTTP on the same uvloop loop; SIGTERM exits 0."""
    http_port = free_port()
    with serve_process(tmp_path, ["--event-loop", "uvloop", "--http-port", str(http_port)]) as served:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            await wait_serving(channel, served)
            _, summary = await collect(pb_grpc.GeneratorStub(channel).Generate(
                pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=4), timeout=30))
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as c:
            reply = (await c.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4,
                                                           "temperature": 0})).json()
        assert reply["usage"]["completion_tokens"] == summary.completion_tokens
        served.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(served.process.wait, 30) == 0, served.log_text()


async def test_sampling_parameters_at_the_edges_of_float32_behave_as_documented(http: httpx2.AsyncClient) -> None:
    async def content(path: str, **sampling: Any) -> str:
        body = {"prompt": "The weather today is", "seed": 7, **sampling}
        if path == "/completion":
            body |= {"n_predict": 12, "top_k": sampling.get("top_k", 0), "top_p": sampling.get("top_p", 1.0)}
        else:
            body |= {"max_tokens": 12}
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        reply = response.json()
        return str(reply["content"] if path == "/completion" else reply["choices"][0]["text"])

    for path in ("/completion", "/v1/completions"):
        floor = await content(path, temperature=0.01)  # validation.MIN_TEMPERATURE
        assert floor
        for tiny in (1e-38, 1e-40, 1e-300, 5e-324):
            assert await content(path, temperature=tiny) == floor, (path, tiny)
        plain = await content(path, temperature=0.9)
        for same in ({"top_p": 1 - 1e-9}, {"top_p": 0.0}):
            assert await content(path, temperature=0.9, **same) == plain, (path, same)
    plain = await content("/completion", temperature=0.9)
    assert await content("/completion", temperature=0.9, top_k=2**31 - 1) == plain  # top_k >= vocabulary: off


async def test_chat_roles_and_a_chat_template_error_are_400s(http: httpx2.AsyncClient, chat_server: Running) -> None:
    tool = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "Sunny."}]
    assert (await http.post("/v1/chat/completions", json={"messages": tool, "max_tokens": 2})).status_code == 200
    bogus = await http.post("/v1/chat/completions", json={"messages": [{"role": "bogus-role", "content": "hi"}]})
    assert_openai_error(bogus, 400, "messages[0].role", "system, user, assistant, tool")
    async with httpx2.AsyncClient(base_url=base_url(chat_server), timeout=60) as templated:
        twice = [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Hello?"}]
        refused = await templated.post("/v1/chat/completions", json={"messages": twice, "max_tokens": 2})
        assert_openai_error(refused, 400, "roles must alternate")
        fine = await templated.post("/v1/chat/completions", json={"messages": twice[1:], "max_tokens": 2})
        assert fine.status_code == 200, fine.text
    assert chat_server.runtime.registry.in_use == 0 and not chat_server.service.quota.open


BAD_REQUESTS: list[tuple[str, Any, int, tuple[str, ...]]] = [
    ("/v1/chat/completions", b"{not json", 400, ("not valid JSON",)),
    ("/v1/chat/completions", b"[1, 2]", 400, ("JSON object",)),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ("messages[0].role",)),
    ("/v1/chat/completions", {"messages": []}, 400, ("messages",)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e9}, 400,
     ("temperature", "--max-temperature")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, 400,
     ("max_tokens",)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": "high"}, 400, ("top_p",)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10**6}, 400, ("n",)),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 100}, 400, ("--max-stop-strings",)),
    ("/v1/completions", {"prompt": 42}, 400, ("prompt",)),
    ("/v1/completions", {"prompt": "x", "temperature": 1e38}, 400, ("temperature", "--max-temperature")),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, ("temperature",)),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, ("temperature",)),
    ("/v1/completions", {"prompt": "x", "top_p": -1e-9}, 400, ("top_p",)),
    ("/completion", {"prompt": "x", "top_k": -1}, 400, ("top_k",)),
    ("/infill", {"input_prefix": "x", "n_predict": 10**6}, 400, ("n_predict", "--max-new-tokens")),
    ("/infill", {"input_extra": [{"filename": "a", "text": "b"}] * 1000}, 400, ("input_extra", "--max-extra-files")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prediction": {"type": "text", "content": "x"}}, 400, ("prediction.type", "content")),
    ("/v1/completions", {"prompt": "x", "prediction": {"type": "content"}}, 400, ("prediction.content",)),
    ("/v1/completions", {"prompt": "x", "prediction": "x"}, 400, ("prediction",)),
    ("/v1/completions", {"prompt": "x", "prediction": {"type": "content", "content": [{"type": "image_url"}]}}, 400,
     ("prediction.content[0].type",)),
    ("/v1/completions", {"prompt": "x", "prediction": {"type": "content", "content": "word " * 2000}}, 400,
     ("prediction", "context length")),
    ("/completion", {"prompt": "x", "speculative.n_max": -1}, 400, ("speculative.n_max", "--max-draft-tokens")),
    ("/infill", {"input_prefix": "x", "speculative.n_max": 10**6}, 400, ("speculative.n_max", "--max-draft-tokens")),
    ("/completion", {"prompt": "x", "speculative.n_max": "8"}, 400, ("speculative.n_max", "integer")),
    ("/completion", {"prompt": "x", "speculative.n_max": 2, "speculative.n_min": 3}, 400,
     ("speculative.n_min", "at most speculative.n_max")),
    ("/v1/completions", {"prompt": "x", "speculative.n_min": -2}, 400, ("speculative.n_min",)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "speculative.n_max": 1.5}, 400,
     ("speculative.n_max", "integer")),
    # a lone surrogate (JSON's "\ud800") is text no tokenizer takes: a 400 naming the field, wherever it is
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, ("prompt", "lone surrogate")),
    ("/v1/completions", b'{"prompt": ["a\\udfff"]}', 400, ("prompt", "lone surrogate")),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     ("messages[0].content", "lone surrogate")),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", '
     b'"type": "function", "function": {"name": "f", "arguments": "\\ud800"}}]}, {"role": "user", "content": "x"}]}',
     400, ("messages[0].tool_calls[0].function.arguments", "lone surrogate")),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD_REQUESTS)
async def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    http: httpx2.AsyncClient, server: Running, path: str, body: Any, status: int, words: tuple[str, ...]
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await http.post(path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, status, *words)
    assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200
    assert server.runtime.registry.in_use == 0 and not server.service.quota.open


async def test_oversized_body_is_413(http: httpx2.AsyncClient, server: Running) -> None:
    limit = server.service.limits.max_message_bytes
    response = await http.post("/v1/completions", json={"prompt": "a" * (limit + 10)})
    assert_openai_error(response, 413, "--max-message-bytes")
    assert (await http.get("/health")).status_code == 200


async def test_http_requests_are_counted_with_the_protocol_label(http: httpx2.AsyncClient, server: Running) -> None:
    def count(code: str) -> float:
        return server.metrics.registry.get_sample_value(
            "specrpc_requests_total", {"rpc": "Completions", "code": code, "protocol": "http"}) or 0.0

    ok, bad = count("OK"), count("INVALID_ARGUMENT")
    await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    await http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    assert (count("OK"), count("INVALID_ARGUMENT")) == (ok + 1, bad + 1)


async def test_connections_send_each_write_at_once(server: Running) -> None:
    """Every accepted connection has TCP_NODELAY (asyncio sets it only for sockets whose proto is IPPROTO_TCP, which
    the listening socket's accepted ones are not): else the first SSE event after the headers waits for the
    client's delayed ACK on a kept-alive connection."""
    import socket

    assert server.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: specrpc\r\n\r\n")
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")  # the connection is open and served
        sockets = [p.transport.get_extra_info("socket") for p in server.http.server.server_state.connections]
        assert sockets
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    finally:
        writer.close()
