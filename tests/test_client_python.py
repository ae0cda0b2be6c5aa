"""The Python client (clients/python/specrpc_client) against a real in-process server, and the CLI against it."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from conftest import free_port
from specrpc_client import (
    NO_RETRY,
    AsyncClient,
    Client,
    Constraint,
    DeadlineExceeded,
    FimLayout,
    FinishReason,
    InvalidArgument,
    LineChange,
    Phrase,
    RetryPolicy,
    RewriteResult,
    Sampling,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
    TurnSummary,
    Unavailable,
)
from test_structured_output import SCHEMA as CITY
from test_tool_formats import SCHEMAS, TIME, WEATHER

from specrpc.edges.server import Running
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent
FAST_RETRY = RetryPolicy(max_attempts=10, initial_backoff_s=0.05, max_backoff_s=0.4)
StartServer = Callable[..., Awaitable[int]]


@pytest.fixture
async def client(server: Running) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=30) as c:
        yield c


class Recorder(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Records (method, metadata) of every call it sees."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        self.calls.append((details.method, dict(details.invocation_metadata or ())))
        return await continuation(details)


# ---- streaming ---------------------------------------------------------------------------------------------------

async def test_generate_streams_typed_chunks_then_summary(client: AsyncClient, long_streams: float) -> None:
    gen = client.generate("def fibonacci(n):", max_new_tokens=16)
    chunks = [chunk async for chunk in gen]
    s = gen.summary
    assert chunks and s is not None
    assert s.finish_reason is FinishReason.LENGTH  # (long_streams: the end-of-sequence token does not end it)
    assert s.completion_tokens == sum(len(c.token_ids) for c in chunks) == 16
    assert s.prompt_tokens > 0 and s.timing.total_ms >= s.timing.ttft_ms > 0
    assert gen.text == "".join(c.text for c in chunks)
    assert gen.ttft_ms is not None and gen.ttft_ms > 0


async def test_generate_with_a_path_frames_the_prompt_as_that_file(client: AsyncClient) -> None:
    plain = client.generate("def fibonacci(n):", max_new_tokens=2)
    framed = client.generate("def fibonacci(n):", max_new_tokens=2, path="maths/fib.py")
    _ = [c async for c in plain], [c async for c in framed]
    assert plain.summary is not None and framed.summary is not None
    assert framed.summary.prompt_tokens > plain.summary.prompt_tokens  # [SEP] maths/fib.py\n in front


async def test_model_info_is_typed(client: AsyncClient) -> None:
    info = await client.model_info()
    assert info.target.vocab_size > 0 and info.kv_slots_total >= 1 and info.max_context > 0


async def test_infill_streams_the_middle(client: AsyncClient, long_streams: float) -> None:
    if not (await client.model_info()).supports_infill:
        pytest.skip("the served tokenizer has no fill-in-the-middle tokens")
    gen = client.infill("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n",
                        extra_files=[("util.py", "def sub(a, b):\n    return a - b\n")], path="main.py",
                        max_new_tokens=12)
    summary = await gen.result()
    assert summary is not None and summary.completion_tokens == 12
    assert summary.finish_reason is FinishReason.LENGTH and summary.prompt_tokens > 0


async def test_infill_fim_fields_round_trip(client: AsyncClient) -> None:
    info = await client.model_info()
    if not info.supports_infill:
        pytest.skip("the served tokenizer has no fill-in-the-middle tokens")
    assert info.fim_template and info.fim_orders and info.fim_default_layout is not FimLayout.UNSPECIFIED
    lines = "".join(f"item_{i} = build({i}, size={i * 5})\n" for i in range(120))
    summary = await client.infill(lines + "last = ", "\n" + lines, typed_line="build(", repo_name="demo",
                                  truncate=True, layout="psm", max_new_tokens=4).result()
    assert summary is not None and summary.fim_layout is FimLayout.PSM
    assert summary.trimmed_prompt_tokens > 0 and summary.trimmed_prefix_chars > 0
    with pytest.raises(InvalidArgument, match="truncate"):
        await client.infill(lines + "last = ", "\n" + lines, max_new_tokens=4).result()


async def test_sync_client_streams_too(server: Running, long_streams: float) -> None:
    def run() -> tuple[int, int, str]:
        with Client(f"127.0.0.1:{server.port}", timeout=30) as c:
            gen = c.generate("hello", max_new_tokens=8, sampling=Sampling(temperature=0.8, seed=1))
            text = "".join(chunk.text for chunk in gen)
            assert gen.summary is not None
            return gen.summary.completion_tokens, c.model_info().kv_slots_total, text

    tokens, slots, _ = await asyncio.to_thread(run)  # blocking calls off the loop the server runs on
    assert tokens == 8 and slots >= 1


async def test_editor_fields_travel_and_come_back_typed(client: AsyncClient) -> None:
    gen = client.generate("def fibonacci(n):", max_new_tokens=6, logprobs=True, top_logprobs=2)
    chunks = [chunk async for chunk in gen]
    logprobs = [lp for chunk in chunks for lp in chunk.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for chunk in chunks for t in chunk.token_ids]
    assert all(isinstance(lp, TokenLogprob) and lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in logprobs)
    session = f"open-{uuid.uuid4().hex}"
    warm = await client.generate("def fibonacci(n):\n", session_id=session, prefill_only=True).result()
    assert warm is not None and warm.completion_tokens == 0 and warm.tokens_cached == warm.prompt_tokens
    summary = await client.generate("def fibonacci(n):\n", max_new_tokens=40, n_indent=40, max_time_ms=5000,
                                    session_id=session).result()
    assert summary is not None and summary.finish_reason in (FinishReason.INDENT, FinishReason.STOP)
    assert summary.cached_prompt_tokens == warm.prompt_tokens - 1
    with pytest.raises(InvalidArgument) as err:
        await client.infill("a", "b", top_logprobs=3).result()
    assert "logprobs" in err.value.details


async def test_the_stream_interval_travels_only_when_set(client: AsyncClient) -> None:
    """`stream_interval_ms=` on generate, infill and a session's start is sent as the request's field (0 included)
    and left unset by default (the server's interval); the server's check reaches the client typed."""
    from specrpc_client import _core

    assert not _core.generate_request("x").HasField("stream_interval_ms")
    assert _core.generate_request("x", editor=_core.EditorFields(stream_interval_ms=0)).HasField("stream_interval_ms")
    assert _core.infill_request("x", editor=_core.EditorFields(stream_interval_ms=40)).stream_interval_ms == 40
    assert not _core.session_start("s").start.HasField("stream_interval_ms")
    assert _core.session_start("s", stream_interval_ms=0).start.HasField("stream_interval_ms")
    fast = client.generate("def fibonacci(n):", max_new_tokens=8, stream_interval_ms=0)
    assert sum([len(chunk.token_ids) async for chunk in fast]) == 8
    for call in (client.generate("x", max_new_tokens=4, stream_interval_ms=1001),
                 client.infill("a", "b", max_new_tokens=4, stream_interval_ms=5000)):
        with pytest.raises(InvalidArgument, match=r"stream_interval_ms must be in 0\.\.1000"):
            await call.result()


async def test_prediction_and_rewrite_travel_and_come_back_typed(client: AsyncClient, server: Running) -> None:
    """`prediction=` on generate and infill reaches the server (its tokens counted in the typed summary); `rewrite()`
    streams the region and ends with it whole and its changed lines, on the async and the blocking client."""
    plain = client.generate("class Stack:\n", max_new_tokens=30)
    text = "".join([chunk.text async for chunk in plain])
    predicted = client.generate("class Stack:\n", max_new_tokens=30, prediction=text)
    assert "".join([chunk.text async for chunk in predicted]) == text
    assert predicted.summary is not None and predicted.summary.accepted_prediction_tokens > 0
    infill = await client.infill("def add(a, b):\n    return ", "\n", max_new_tokens=8, prediction="a + b").result()
    assert infill is not None and infill.accepted_prediction_tokens + infill.rejected_prediction_tokens > 0
    source = "def area(w, h):\n    return w * h\n"
    rewrite = client.rewrite("area.py", source, 0, len(source), 4, recent_edits=["-def size(w, h):\n+def area(w, h):"],
                             max_new_tokens=24)
    streamed = "".join([chunk.text async for chunk in rewrite])
    assert rewrite.rewrite is not None and rewrite.rewrite.region == streamed.removesuffix("\n")
    assert all(isinstance(change, LineChange) for change in rewrite.rewrite.changes)

    def blocking() -> RewriteResult | None:
        with Client(f"127.0.0.1:{server.port}", timeout=30) as c:
            gen = c.rewrite("area.py", source, 0, len(source), 4, max_new_tokens=24)
            for _ in gen:
                pass
            return gen.rewrite

    assert await asyncio.to_thread(blocking) is not None


async def test_invalid_argument_is_a_typed_error(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument) as err:
        await client.generate("x", sampling=Sampling(temperature=-1.0)).result()
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details
    assert isinstance(err.value, ValueError)


# ---- structured output and tool calls ----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"name": "get_time", "description": "Time in a zone", "parameters": TIME}]  # both shapes Tool.parse reads


async def test_constraints_travel_on_generate_infill_and_the_editor_session(client: AsyncClient,
                                                                            server: Running) -> None:
    """A JSON Schema (a dict on the async client, JSON text on the blocking one) gives JSON that validates and ends
    with STOP; a regex is matched whole, through a completion session's defaults too."""
    for seed in range(2):
        gen = client.generate("A city record: ", max_new_tokens=120, sampling=Sampling(temperature=1.0, seed=seed),
                              constraint=Constraint(json_schema=CITY))
        summary = await gen.result()
        jsonschema.validate(json.loads(gen.text), CITY)
        assert summary is not None and summary.finish_reason is FinishReason.STOP
    async with client.completion_session(max_new_tokens=20, constraint=Constraint(regex=r"[0-9]{1,6}")) as editor:
        number = editor.complete("x = ", sampling=Sampling(temperature=1.0, seed=3))
        assert await number.result() is not None and re.fullmatch(r"[0-9]{1,6}", number.text)
    if (await client.model_info()).supports_infill:
        yes_no = Constraint(grammar='root ::= "yes" | "no"')
        middle = client.infill("answer = ", "\n", max_new_tokens=8, constraint=yes_no)
        assert await middle.result() is not None and middle.text in ("yes", "no")

    def blocking() -> str:
        with Client(f"127.0.0.1:{server.port}", timeout=30) as c:
            gen = c.generate("A city record: ", max_new_tokens=120, constraint=Constraint(json_schema=json.dumps(CITY)))
            return "".join(chunk.text for chunk in gen)

    jsonschema.validate(json.loads(await asyncio.to_thread(blocking)), CITY)


async def test_bad_constraints_are_refused(client: AsyncClient) -> None:
    """Two kinds at once (or none) are a ValueError before any call; a schema the server cannot compile is
    InvalidArgument naming the problem."""
    for kinds in ({}, {"regex": "a", "grammar": "root ::= \"a\""}, {"json_schema": CITY, "json_object": True}):
        with pytest.raises(ValueError, match="exactly one of json_schema, regex, grammar, json_object"):
            Constraint(**kinds)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as err:
        await client.generate("x", max_new_tokens=4, constraint=Constraint(json_schema={"type": "strange"})).result()
    assert "invalid json_schema" in err.value.details
    with pytest.raises(InvalidArgument, match="invalid regex"):
        await client.infill("x", "y", max_new_tokens=4, constraint=Constraint(regex="(unclosed")).result()


async def test_converse_tool_call_then_a_tool_result_turn(client: AsyncClient) -> None:
    """tool_choice required on the shipped pair (the plain tool format): the reply's call is a typed ToolCall event,
    in the summary too, whose arguments parse and validate; the result goes back as a tool turn and the next reply
    continues the conversation."""
    async with client.voice_session(tools=[Tool("get_weather", "Weather in a city", WEATHER)],
                                    tool_choice="required", parallel_tool_calls=False, max_new_tokens=200) as voice:
        reply = voice.say("What is the weather in Paris?", sampling=Sampling(temperature=1.0, seed=5))
        events = [event async for event in reply.events()]
        summary = events[-1]
        assert isinstance(summary, TurnSummary)
        calls = [event for event in events if isinstance(event, ToolCall)]
        assert len(calls) == 1 and summary.tool_calls == tuple(calls) == tuple(reply.tool_calls)
        call = calls[0]
        assert call.name == "get_weather" and call.id and call.index == 0
        jsonschema.validate(call.parsed_arguments(), WEATHER)
        assert call.arguments not in reply.text  # a call's text is not reply text

        answer = voice.tool_result(call, {"temperature": 21}, tool_choice="none", max_new_tokens=6)
        done = await answer.done()
        assert done.turn_index == 1 and not done.tool_calls and done.reply_text == answer.text
        assert done.generation.completion_tokens > 0


async def test_converse_parallel_calls_answered_in_one_tool_results_turn(client: AsyncClient,
                                                                        server: Running) -> None:
    """A reply's two calls on the shipped pair (plain format) answered with one `tool_results` turn: one reply
    follows, and the session's history holds both results in order, the non-text one as JSON."""
    for seed in range(12):  # a random model makes several calls about one reply in two
        async with client.voice_session(tools=TOOLS, tool_choice="required", max_new_tokens=250) as voice:
            reply = voice.say("Weather in Paris and the time there?", sampling=Sampling(temperature=1.0, seed=seed))
            calls = (await reply.done()).tool_calls
            if len(calls) < 2:
                continue
            answer = voice.tool_results([(calls[0], {"temperature": 21}), (calls[1].id, "09:00")],
                                        tool_choice="none", max_new_tokens=6)
            done = await answer.done()
            assert done.turn_index == 1 and not done.tool_calls and done.generation.completion_tokens > 0
        state = server.runtime.registry.sessions[voice.session_id].conversation  # saved once the stream ended
        assert state is not None and state[1] == 2  # two replies: the calls, then one to both results
        assert [(m[0], m[1], m[3]) for m in state[0][-3:]] == [("tool", '{"temperature": 21}', calls[0].id),
                                                               ("tool", "09:00", calls[1].id),
                                                               ("assistant", done.reply_text, "")]
        return
    pytest.fail("no reply made several calls")


async def test_sync_conversation_calls_a_named_function_from_openai_declarations(server: Running) -> None:
    def run() -> tuple[list[ToolCall], TurnSummary]:
        with Client(f"127.0.0.1:{server.port}", timeout=60) as c, c.conversation(tools=TOOLS,
                                                                                 max_new_tokens=200) as conv:
            events = list(conv.say("What time is it in Tokyo?", sampling=Sampling(temperature=1.0, seed=2),
                                   tool_choice={"type": "function", "function": {"name": "get_time"}}))
            calls = [event for event in events if isinstance(event, ToolCall)]
            last = list(conv.tool_result(calls[0].id, "09:00", tool_choice=ToolChoice.parse("none"),
                                         max_new_tokens=4))[-1]
            assert isinstance(last, TurnSummary)
            return calls, last

    calls, after = await asyncio.to_thread(run)
    assert calls and all(call.name == "get_time" for call in calls)
    for call in calls:
        jsonschema.validate(call.parsed_arguments(), SCHEMAS[call.name])
    assert after.turn_index == 1 and not after.tool_calls


# ---- editors -----------------------------------------------------------------------------------------------------

async def test_cancel_on_keystroke_reuses_the_cached_prefix(client: AsyncClient, long_streams: float) -> None:
    prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    async with client.completion_session(max_new_tokens=200) as session:
        first = session.complete(prefix)
        got = [chunk async for chunk in _take(first, 1)]
        second = session.complete(prefix + " fib", max_new_tokens=8)  # the next keystroke cancels the first
        assert [c async for c in first] == []  # the first stream ends quietly...
        assert first.finish_reason is FinishReason.CANCELLED and first.cancelled  # ...as cancelled
        summary = await second.result()
    assert got and summary is not None
    assert summary.session_id == session.session_id
    assert summary.cached_prompt_tokens > 0  # the first request's prompt stayed in the session's KV cache
    assert summary.finish_reason is FinishReason.LENGTH


async def _take(gen: Any, n: int) -> AsyncIterator[Any]:
    async for item in gen:
        yield item
        n -= 1
        if n == 0:
            return


async def test_completion_session_infill_cancels_too(client: AsyncClient, long_streams: float) -> None:
    if not (await client.model_info()).supports_infill:
        pytest.skip("the served tokenizer has no fill-in-the-middle tokens")
    session = client.completion_session(max_new_tokens=100)
    first = session.infill("def f(x):\n    return ", "\n", extra_files=[("a.py", "x = 1\n")])
    second = session.infill("def f(x):\n    return x", "\n", max_new_tokens=4)
    assert await first.result() is None and first.finish_reason is FinishReason.CANCELLED
    summary = await second.result()
    assert summary is not None and summary.completion_tokens == 4


# ---- voice -------------------------------------------------------------------------------------------------------

async def test_voice_session_phrases_barge_in_and_rewind(client: AsyncClient, long_streams: float) -> None:
    async with client.voice_session(system="Answer briefly.", max_new_tokens=24) as voice:
        assert voice.started is not None and voice.started.session_id == voice.session_id
        reply = voice.say("Hello! How are you today?")
        phrases = [p async for p in reply]
        done = await reply.done()
        assert all(isinstance(p, Phrase) for p in phrases) and (phrases or not done.reply_text.strip())
        assert "".join(p.text for p in phrases) == done.reply_text == reply.text
        assert [p.start_char for p in phrases[1:]] == [p.end_char for p in phrases[:-1]]
        assert all(a.time_ms <= b.time_ms for a, b in itertools.pairwise(phrases))
        assert done.time_to_first_phrase_ms > 0 and reply.time_to_first_phrase_ms is not None

        long = voice.say("Tell me a very long story.", max_new_tokens=200)
        async for event in long.events():  # wait until it streams, then the user speaks
            if not isinstance(event, TurnSummary) and event.text:
                break
        summary = await voice.barge_in()
        assert summary is not None
        # cancelled, unless the reply hit the conversation's stop string before the barge-in landed
        assert summary.generation.finish_reason is FinishReason.CANCELLED or summary.generation.stop_sequence
        assert 0 < summary.generation.completion_tokens < 200
        assert [p async for p in long] == []  # nothing more to speak after a barge-in

        rewound = await voice.rewind(spoken_chars=3)
        assert rewound.kept_chars == min(3, len(summary.reply_text))
        assert rewound.history_tokens > 0


async def test_sync_conversation_skips_a_reply_left_unread(server: Running, long_streams: float) -> None:
    def run() -> tuple[TurnSummary, int]:
        with Client(f"127.0.0.1:{server.port}", timeout=30) as c, c.conversation(max_new_tokens=100) as conv:
            next(iter(conv.say("Tell me a long story.")))  # read one event, then move on (the user spoke again)
            events = list(conv.say("Short answer, please.", max_new_tokens=4))
            last = events[-1]
            assert isinstance(last, TurnSummary)
            return last, conv.rewind(1).kept_chars

    summary, kept = await asyncio.to_thread(run)
    assert summary.turn_index == 1 and summary.generation.completion_tokens <= 4  # the second turn's own events
    assert kept == min(1, len(summary.reply_text))


# ---- connection behaviour ---------------------------------------------------------------------------------------

async def test_retries_unavailable_until_a_late_server_starts(server: Running, extra_server: StartServer) -> None:
    port = free_port()
    async with AsyncClient(f"127.0.0.1:{port}", retry=FAST_RETRY, timeout=20) as c:
        gen = c.generate("hello", max_new_tokens=4)
        late = asyncio.create_task(_start_later(extra_server, port, 0.4))
        summary = await gen.result()
        await late
    assert summary is not None and summary.finish_reason is not FinishReason.CANCELLED
    assert gen._attempts > 1


async def _start_later(extra_server: StartServer, port: int, delay: float) -> None:
    await asyncio.sleep(delay)
    await extra_server(port=port)


async def test_unavailable_without_retries_is_immediate() -> None:
    async with AsyncClient(f"127.0.0.1:{free_port()}", retry=NO_RETRY, timeout=10) as c:
        t0 = time.perf_counter()
        with pytest.raises(Unavailable) as err:
            await c.model_info()
    assert isinstance(err.value, ConnectionError) and time.perf_counter() - t0 < 5


class FlakyGenerator(pb_grpc.GeneratorServicer):  # type: ignore[misc]
    """UNAVAILABLE for the first `failures` calls; then one chunk, then UNAVAILABLE mid-stream if `break_after`."""

    def __init__(self, failures: int, break_after: bool) -> None:
        self.calls = 0
        self.failures = failures
        self.break_after = break_after

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        yield pb.GenerateResponse(chunk=pb.TokenChunk(text="a", token_ids=[1]))
        if self.break_after:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gone mid-stream")
        yield pb.GenerateResponse(summary=pb.GenerationSummary(finish_reason=pb.FINISH_REASON_LENGTH,
                                                               completion_tokens=1))


async def test_retry_only_before_the_first_response(extra_server: StartServer) -> None:
    flaky = FlakyGenerator(failures=2, break_after=False)
    port = await extra_server(servicer=flaky)
    async with AsyncClient(f"127.0.0.1:{port}", retry=FAST_RETRY, timeout=10) as c:
        assert (await c.generate("x").result()) is not None
        assert flaky.calls == 3  # two UNAVAILABLE answers retried

        broken = FlakyGenerator(failures=0, break_after=True)
        c2 = AsyncClient(f"127.0.0.1:{await extra_server(servicer=broken)}", retry=FAST_RETRY, timeout=10)
        gen = c2.generate("x")
        with pytest.raises(Unavailable):
            await gen.result()
        await c2.close()
    assert broken.calls == 1 and gen.text == "a"  # a stream that has answered is never replayed


class StallingGenerator(pb_grpc.GeneratorServicer):  # type: ignore[misc]
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await asyncio.sleep(30)
        yield pb.GenerateResponse()


async def test_deadline_exceeded_is_a_clear_timeout(extra_server: StartServer) -> None:
    port = await extra_server(servicer=StallingGenerator())
    async with AsyncClient(f"127.0.0.1:{port}", timeout=5) as c:
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded) as err:
            await c.generate("x", timeout=0.2).result()
    assert time.perf_counter() - t0 < 3
    assert isinstance(err.value, TimeoutError)
    assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and "0.2 s deadline" in str(err.value)


async def test_session_id_and_token_travel_as_metadata(server: Running, extra_server: StartServer) -> None:
    recorder = Recorder()
    port = await extra_server(interceptors=[recorder])
    async with AsyncClient(f"127.0.0.1:{port}", token="s3cret", timeout=30) as c:
        session = c.completion_session(max_new_tokens=2)
        await session.complete("x = ").result()
        await c.model_info()
        async with c.voice_session(max_new_tokens=2) as voice:
            await voice.say("hi").done()
    by_method = {method.rsplit("/", 1)[1]: md for method, md in recorder.calls}
    assert by_method["Generate"]["x-session-id"] == session.session_id
    assert by_method["Converse"]["x-session-id"] == voice.session_id
    assert "x-session-id" not in by_method["GetModelInfo"]
    assert all(md["authorization"] == "Bearer s3cret" for md in by_method.values())


async def test_round_robin_over_endpoints_and_session_affinity(server: Running, extra_server: StartServer) -> None:
    recorders = [Recorder(), Recorder()]
    ports = [await extra_server(interceptors=[r]) for r in recorders]
    async with AsyncClient([f"127.0.0.1:{p}" for p in ports], timeout=30) as c:
        assert c.connection.target == f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
        for _ in range(40):  # round_robin spreads calls once both subchannels are connected
            await c.model_info()
            if all(r.calls for r in recorders):
                break
        assert all(r.calls for r in recorders)
        for r in recorders:
            r.calls.clear()
        session = c.completion_session(max_new_tokens=2)
        for word in ("a", "ab", "abc"):
            await session.complete(word).result()
    assert sorted(len(r.calls) for r in recorders) == [0, 3]  # one session, one server (its KV cache)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certs(d: Path) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", *ext, cwd=d)


@pytest.mark.skipif(not any((Path(p) / "openssl").exists() for p in os.get_exec_path()), reason="no openssl")
async def test_mutual_tls(server: Running, extra_server: StartServer, tmp_path: Path) -> None:
    await asyncio.to_thread(_make_certs, tmp_path)
    key, cert, ca = ((tmp_path / name).read_bytes() for name in ("server.key", "server.pem", "ca.pem"))
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    port = await extra_server(credentials=creds)
    async with AsyncClient(f"127.0.0.1:{port}", root_certificates=tmp_path / "ca.pem",
                           client_cert=tmp_path / "client.pem", client_key=tmp_path / "client.key",
                           timeout=30) as c:
        assert (await c.generate("hi", max_new_tokens=2).result()) is not None
    async with AsyncClient(f"127.0.0.1:{port}", root_certificates=tmp_path / "ca.pem", retry=NO_RETRY,
                           timeout=10) as c:
        with pytest.raises(Unavailable):  # no client certificate: the handshake fails
            await c.model_info()


# ---- the CLI and the client without the server package ----------------------------------------------------------

async def _run(*args: str, stdin: bytes = b"", timeout: float = 60) -> tuple[int, str, str]:
    """Run a command without blocking the event loop the in-process server runs on."""
    proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_cli_complete_streams_and_prints_stats(server: Running) -> None:
    rc, out, err = await _run(str(BIN / "specrpc"), "complete", "def fibonacci(n):", "--port", str(server.port),
                              "--max-new-tokens", "8", "--num-draft-tokens", "2", "--proposer", "draft",
                              "--temperature", "0.7", "--seed", "3", "--timeout", "30")
    assert rc == 0, err
    stats = err.strip().splitlines()[-1]
    for word in ("tokens ·", "TTFT", "tokens/s", "acceptance"):
        assert word in stats
    assert out.endswith("\n")


async def test_cli_complete_fills_in_the_middle_with_repository_context(server: Running, tmp_path: Path) -> None:
    util = tmp_path / "util.py"
    util.write_text("def square(x):\n    return x * x\n")
    rc, _, err = await _run(str(BIN / "specrpc"), "complete", "def area(w, h):\n    return ", "--suffix", "\n",
                            "--extra", str(util), "--repo-name", "geometry", "--layout", "typed_line", "--truncate",
                            "--port", str(server.port), "--max-new-tokens", "6", "--timeout", "30")
    assert rc == 0, err
    assert "TTFT" in err.strip().splitlines()[-1]


async def test_cli_complete_editor_flags(server: Running) -> None:
    rc, out, err = await _run(str(BIN / "specrpc"), "complete", "def fibonacci(n):", "--port", str(server.port),
                              "--max-new-tokens", "4", "--logprobs", "--top-logprobs", "2", "--n-indent", "4",
                              "--max-time-ms", "1000", "--timeout", "30")
    assert rc == 0, err
    lines = err.strip().splitlines()
    stats = next(i for i, line in enumerate(lines) if "TTFT" in line)
    assert 1 <= len(lines) - stats - 1 <= 4 and all("[" in line for line in lines[stats + 1 :]), err
    rc, out, err = await _run(str(BIN / "specrpc"), "complete", "def fibonacci(n):", "--port", str(server.port),
                              "--prefill-only", "--session-id", "cli-open", "--timeout", "30")
    assert rc == 0 and out == "\n" and "0 tokens" in err, err


async def test_cli_complete_takes_a_prediction_file(server: Running, tmp_path: Path) -> None:
    predicted = tmp_path / "predicted.txt"
    predicted.write_text("    def __init__(self):\n        self.items = []\n")
    rc, out, err = await _run(str(BIN / "specrpc"), "complete", "class Stack:\n", "--port", str(server.port),
                              "--max-new-tokens", "12", "--prediction", str(predicted), "--timeout", "30")
    assert rc == 0 and out.strip() and "prediction " in err and "used" in err, err


async def test_cli_complete_structured_output(server: Running, tmp_path: Path) -> None:
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    rc, out, err = await _run(str(BIN / "specrpc"), "complete", "A city record: ", "--json-schema", str(schema),
                              "--port", str(server.port), "--max-new-tokens", "120", "--temperature", "1",
                              "--seed", "4", "--timeout", "30")
    assert rc == 0, err
    jsonschema.validate(json.loads(out), CITY)
    assert "· stop" in err
    rc, out, err = await _run(str(BIN / "specrpc"), "complete", "x = ", "--regex", "[0-9]{1,6}", "--port",
                              str(server.port), "--max-new-tokens", "20", "--timeout", "30")
    assert rc == 0 and re.fullmatch(r"[0-9]{1,6}\n", out), err
    schema.write_text('{"type": "strange"}')
    rc, _, err = await _run(str(BIN / "specrpc"), "complete", "x", "--json-schema", str(schema), "--port",
                            str(server.port), "--max-new-tokens", "4", "--timeout", "30")
    assert rc == 1 and "INVALID_ARGUMENT" in err and "json_schema" in err


async def test_cli_chat_prints_a_tool_call_and_sends_the_typed_result(server: Running, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS[:1]))
    rc, out, err = await _run(str(BIN / "specrpc"), "chat", "--tools", str(tools), "--tool-choice", "required",
                              "--no-parallel-tool-calls", "--port", str(server.port), "--max-new-tokens", "200",
                              "--temperature", "1", "--seed", "5", "--timeout", "60",
                              stdin=b'What is the weather in Paris?\n{"temperature": 21}\n')
    assert rc == 0, err
    call = re.search(r"^\[tool call (\S+)\] get_weather (.*)$", out, re.MULTILINE)
    assert call is not None, out
    jsonschema.validate(json.loads(call.group(2)), WEATHER)
    assert err.count("TTFT") == 2 and "[session: 2 turns" in err  # the result turn got a reply


async def test_cli_chat_sends_a_replys_several_results_in_one_turn(server: Running, tmp_path: Path) -> None:
    """A reply with several calls: chat --tools reads a result line for each, then sends them in one turn, so the
    session has two replies (not one per result) and its history ends with the results in order, then one reply."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))

    async def chat(seed: int, session: str, lines: list[str]) -> tuple[int, str, str]:
        return await _run(str(BIN / "specrpc"), "chat", "--tools", str(tools), "--tool-choice", "required",
                          "--port", str(server.port), "--max-new-tokens", "200", "--temperature", "1",
                          "--seed", str(seed), "--timeout", "60", "--session-id", session,
                          stdin="".join(f"{line}\n" for line in ["Weather in Paris and the time there?", *lines])
                          .encode())

    for seed in range(12):  # a random model makes several calls about one reply in two
        rc, out, err = await chat(seed, f"cli-calls-{seed}", [])  # EOF at the first result: the calls only
        assert rc == 0, err
        calls = re.findall(r"^\[tool call (\S+)\] ", out, re.MULTILINE)
        if len(calls) < 2:
            continue
        session = f"cli-results-{seed}"
        results = [f"result {i}" for i in range(len(calls))]
        rc, out, err = await chat(seed, session, results)  # the same seed: the same calls
        assert rc == 0, err
        assert "[session: 2 turns" in err, err  # the calls' reply, then one reply to all their results
        state = server.runtime.registry.sessions[session].conversation
        assert state is not None
        assert [(m[0], m[1]) for m in state[0][-len(calls) - 1:-1]] == [("tool", r) for r in results]
        assert state[0][-1][0] == "assistant"
        return
    pytest.fail("no reply made several calls")


async def test_cli_complete_reports_errors(server: Running) -> None:
    rc, _, err = await _run(str(BIN / "specrpc"), "complete", "x", "--port", str(server.port), "--temperature", "-1")
    assert rc == 1 and "INVALID_ARGUMENT" in err and "temperature" in err


async def test_cli_chat_reads_turns_from_stdin(server: Running) -> None:
    rc, _, err = await _run(str(BIN / "specrpc"), "chat", "--port", str(server.port), "--max-new-tokens", "6",
                            "--phrases", stdin=b"Hello there\n/rewind 2\nAnd again\n")
    assert rc == 0, err
    assert err.count("TTFT") == 2 and "[rewound: kept" in err and "[session: 2 turns" in err


async def test_client_runs_without_the_server_package(server: Running) -> None:
    """With `specrpc` unimportable the client falls back to its own stub copy (specrpc_client._gen)."""
    code = ("import sys; sys.modules['specrpc'] = None\n"
            "from specrpc_client import Client\n"
            "import specrpc_client._stubs as s; assert s.pb.__name__.startswith('specrpc_client._gen')\n"
            f"c = Client('127.0.0.1:{server.port}', timeout=30)\n"
            "print(c.generate('hi', max_new_tokens=2).result().completion_tokens)\n")
    rc, out, err = await _run(sys.executable, "-c", code)
    assert rc == 0, err
    assert int(out) >= 0
