"""Fuzzing every request message with hypothesis against a real server: random fields, extreme numbers (NaN, inf,
huge ints), odd Unicode, empty and huge values, random token ids, Converse action sequences, unknown fields and raw
bytes. Whatever comes in, a call ends OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, no KV slot or stream quota
leaks, and the server stays healthy. The HTTP endpoints get the same treatment with random JSON bodies (and
non-JSON bytes): 200, or 400 / 413 / 429 in OpenAI's error shape. Predictions (gRPC `prediction`, OpenAI
`prediction`) and next-edit rewrites (gRPC Rewrite, POST /v1/rewrite) get odd, huge and mismatched values too.

Deterministic for CI: every test is derandomized (a fixed seed per test), with no example database. The server has
small limits (max_new_tokens ≤ 6, 256-position context) so the 1,000+ requests stay fast.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio
from conftest import models_missing
from conftest import test_config as make_config
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import CLIENT_WRITE_RACE, collect, status_of, wait_until

from specrpc.config import Limits
from specrpc.edges.server import Running, start_server
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

OK_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
SENT: Counter[str] = Counter()
"""Requests sent per test (the suite must send at least 1,000)."""
OUTCOMES: Counter[tuple[str, str]] = Counter()
"""(test, status) of every call, printed at the end (with -s) to see that most requests get past validation."""
FUZZ_TESTS = ("generate", "infill", "rewrite", "converse", "model_info", "raw", "http")
MIN_REQUESTS = 1000


def fuzz(examples: int) -> Any:
    """Hypothesis settings for a fuzz test: deterministic, no deadline (one example is one or more RPCs)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# ---- strategies -----------------------------------------------------------------------------------------------------

def mostly(valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` 9 times in 10, else `wild`: most requests get past validation and run, the rest probe the edges."""
    return st.integers(0, 9).flatmap(lambda i: wild if i == 0 else valid)


UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 7, 255, 2**31 - 1, 2**31, 2**32 - 1]))
INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([-(2**31), -1, 0, 1, 40, 2**31 - 1]))
UINT64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]))
FLOAT32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e-7, 0.5, 1.0, 1.0000001, 100.0, 100.00001, 3.4e38, -1.0,
                     math.nan, math.inf, -math.inf]),
)
TEMPERATURE = mostly(st.one_of(st.just(0.0), st.floats(0.0, 2.0, width=32), st.sampled_from([1e-45, 1e-30, 100.0])),
                     FLOAT32)
TOP_P = mostly(st.one_of(st.just(0.0), st.floats(0.0, 1.0, width=32)), FLOAT32)
TOP_K = mostly(st.integers(0, 100), INT32)
NEW_TOKENS = mostly(st.integers(0, 6), UINT32)
NUM_DRAFT = mostly(st.integers(0, 8), UINT32)
ODD_TEXT = st.sampled_from([
    "", " ", "\x00", "\x00\x01\x7f", "\u202e", "\ufeff", "\u200b", "é", "e\u0301", "😀", "👩‍👩‍👧", "\U0010ffff",
    "\ufffd", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>", "<|file_sep|>", "\nUser:",
    "Assistant:", "\r\n", "\t", "\n\n\n", "Ω≈ç√∫", "日本語のテキスト", "مرحبا", "ﷺ", "🏳️‍🌈", "\u0301" * 30,
])
CHARS = st.characters(exclude_categories=("Cs",))  # surrogates cannot be UTF-8 encoded, so protobuf refuses them
HUGE_TEXT = st.sampled_from(["a", "é", "😀", "\u202e", " ", "x = 1\n", "\x00"]).flatmap(
    lambda piece: st.sampled_from([piece * 2_000, piece * 60_000]))


def texts(max_size: int = 48) -> st.SearchStrategy[str]:
    """Odd, random, glued-together or (1 in 20) huge text."""
    normal = st.one_of(ODD_TEXT, st.text(CHARS, max_size=max_size), st.lists(ODD_TEXT, max_size=6).map("".join))
    return st.integers(0, 19).flatmap(lambda i: HUGE_TEXT if i == 0 else normal)


SHORT_TEXT = st.one_of(ODD_TEXT, st.text(CHARS, max_size=30))
STOPS = mostly(st.lists(st.text(CHARS, min_size=1, max_size=24), max_size=4), st.lists(SHORT_TEXT, max_size=6))
SESSION_IDS = mostly(st.one_of(st.just(""), st.sampled_from(["s1", "s2", "s3", "editor:main.py"])),
                     st.text(CHARS, max_size=140))
TOKEN_IDS = mostly(
    st.lists(st.integers(0, 255), min_size=1, max_size=40),
    st.one_of(st.lists(st.one_of(st.integers(0, 8191), UINT32), max_size=40),
              st.integers(1, 600).map(lambda n: [(i * 37) % 256 for i in range(n)])),  # up to over the context
)
PROPOSER = mostly(st.sampled_from(list(pb.Proposer.values())), st.integers(-3, 50))
N_INDENT = mostly(st.one_of(st.just(0), st.integers(0, 12)), st.one_of(INT32, st.sampled_from([1024, 1025])))
MAX_TIME_MS = mostly(st.one_of(st.just(0), st.integers(0, 50)), st.one_of(INT32, st.sampled_from([600_000, 600_001])))
TOP_LOGPROBS = mostly(st.integers(0, 5), st.one_of(INT32, st.sampled_from([20, 21])))
SOURCE = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def __init__(self):\n        self.items = []\n",
          "for i in range(10):\n    print(i)\n"]
PREDICTION = mostly(st.one_of(st.just(""), st.sampled_from(SOURCE)), texts())
"""A predicted output: none or code (valid), else odd, glued or huge text (over the context: INVALID_ARGUMENT)."""


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams | None:
    if draw(st.booleans()):
        return None
    msg = pb.SamplingParams(temperature=draw(TEMPERATURE), top_p=draw(TOP_P), top_k=draw(TOP_K))
    if draw(st.booleans()):
        msg.seed = draw(UINT64)
    return msg


@st.composite
def speculation(draw: st.DrawFn) -> pb.SpeculationParams | None:
    if draw(st.booleans()):
        return None
    msg = pb.SpeculationParams(proposer=draw(PROPOSER))
    if draw(st.booleans()):
        msg.num_draft_tokens = draw(NUM_DRAFT)
    return msg


def _set_common(msg: Any, draw: st.DrawFn) -> None:
    msg.max_new_tokens = draw(NEW_TOKENS)
    msg.stop.extend(draw(STOPS))
    for name, value in (("sampling", draw(sampling())), ("speculation", draw(speculation()))):
        if value is not None:
            getattr(msg, name).CopyFrom(value)


def _set_editor(msg: pb.GenerateRequest | pb.InfillRequest, draw: st.DrawFn) -> None:
    """The editor fields: n_indent, max_time_ms, logprobs and top_logprobs, and (1 in 8) prefill_only, which more
    often than not comes alone, as editors send it."""
    if draw(st.integers(0, 7)) == 0:
        msg.prefill_only = True
        if draw(st.booleans()):
            msg.max_new_tokens = 0
            del msg.stop[:]
            return
    msg.n_indent = draw(N_INDENT)
    msg.max_time_ms = draw(MAX_TIME_MS)
    msg.logprobs = draw(st.booleans())
    msg.top_logprobs = draw(TOP_LOGPROBS) if msg.logprobs or draw(st.integers(0, 9)) == 0 else 0


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(session_id=draw(SESSION_IDS), truncate_prompt=draw(st.booleans()))
    if draw(st.booleans()):
        msg.prompt = draw(texts())
    else:
        msg.prompt_token_ids.extend(draw(TOKEN_IDS))
    _set_common(msg, draw)
    _set_editor(msg, draw)
    msg.prediction = draw(PREDICTION)
    return msg


FIM_LAYOUT = mostly(st.sampled_from(list(pb.FimLayout.values())), st.integers(-3, 50))
REPO_NAMES = mostly(st.one_of(st.just(""), st.sampled_from(["specrpc", "org/lib"])),
                    st.one_of(SHORT_TEXT, st.text(CHARS, min_size=250, max_size=300)))


@st.composite
def infill_requests(draw: st.DrawFn) -> pb.InfillRequest:
    msg = pb.InfillRequest(prefix=draw(texts()), suffix=draw(texts()), path=draw(SHORT_TEXT),
                           session_id=draw(SESSION_IDS), typed_line=draw(mostly(SHORT_TEXT, texts())),
                           repo_name=draw(REPO_NAMES), truncate=draw(st.booleans()), layout=draw(FIM_LAYOUT))
    for _ in range(draw(mostly(st.integers(0, 3), st.integers(0, 6)))):
        msg.extra.add(path=draw(SHORT_TEXT), text=draw(texts(24)))
    _set_common(msg, draw)
    _set_editor(msg, draw)
    msg.prediction = draw(PREDICTION)
    return msg


EDITS = ["@@ -1,2 +1,2 @@\n-def add(a, b):\n+def add(a, b, c):\n", "@@ -3 +3 @@\n-    print(i)\n+    print(i * 2)\n"]


@st.composite
def rewrite_requests(draw: st.DrawFn) -> pb.RewriteRequest:
    """A next-edit rewrite: mostly code with offsets that fit (region within the file, cursor within the region),
    else any text and any offsets (past the file, region reversed, cursor outside it), and edits as diffs or odd
    text."""
    text = draw(mostly(st.sampled_from(["".join(SOURCE), SOURCE[0]]), texts()))
    if draw(st.integers(0, 9)):
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, len(text)))
        cursor = draw(st.integers(start, end))
    else:
        start, end, cursor = draw(UINT32), draw(UINT32), draw(UINT32)
    msg = pb.RewriteRequest(path=draw(SHORT_TEXT), text=text, region_start=start, region_end=end, cursor=cursor,
                            session_id=draw(SESSION_IDS), max_new_tokens=draw(NEW_TOKENS))
    msg.recent_edits.extend(draw(mostly(st.lists(st.sampled_from(EDITS), max_size=2), st.lists(texts(), max_size=4))))
    for name, value in (("sampling", draw(sampling())), ("speculation", draw(speculation()))):
        if value is not None:
            getattr(msg, name).CopyFrom(value)
    return msg


@st.composite
def session_starts(draw: st.DrawFn) -> pb.SessionStart:
    msg = pb.SessionStart(session_id=draw(SESSION_IDS), system=draw(texts(24)), phrase_mode=draw(st.booleans()))
    _set_common(msg, draw)
    return msg


@st.composite
def turns(draw: st.DrawFn) -> pb.Turn:
    msg = pb.Turn(text=draw(texts()), role=draw(st.one_of(st.sampled_from(["", "user", "assistant", "system"]),
                                                          SHORT_TEXT)),
                  max_new_tokens=draw(NEW_TOKENS))
    for name, value in (("sampling", draw(sampling())), ("speculation", draw(speculation()))):
        if value is not None:
            getattr(msg, name).CopyFrom(value)
    return msg


TURN = turns().map(lambda t: pb.ConverseRequest(turn=t))
ACTIONS = mostly(
    st.one_of(TURN, TURN, TURN, st.just(pb.ConverseRequest(cancel=pb.Cancel())),
              st.integers(0, 40).map(lambda n: pb.ConverseRequest(rewind=pb.Rewind(spoken_chars=n)))),
    st.one_of(session_starts().map(lambda s: pb.ConverseRequest(start=s)), st.just(pb.ConverseRequest()),
              st.builds(lambda n, s: pb.ConverseRequest(rewind=pb.Rewind(spoken_chars=n, session_id=s)), UINT32,
                        SESSION_IDS)),
)


@st.composite
def conversations(draw: st.DrawFn) -> list[pb.ConverseRequest]:
    actions = draw(st.lists(ACTIONS, max_size=6))
    if draw(st.integers(0, 9)):  # mostly well-started streams, so the actions after `start` get exercised
        actions.insert(0, pb.ConverseRequest(start=draw(session_starts())))
    return actions


ANY_MESSAGE = st.one_of(generate_requests(), infill_requests(), rewrite_requests(), session_starts(), turns(),
                        conversations().map(lambda a: a[0] if a else pb.ConverseRequest()))
RAW_BYTES = st.one_of(st.binary(max_size=512), ANY_MESSAGE.map(lambda m: m.SerializeToString()))


JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), FLOAT32, SHORT_TEXT)
JSON_ANY = st.recursive(JSON_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(SHORT_TEXT, inner, max_size=3)),
                        max_leaves=8)
MESSAGES = mostly(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": texts(24)}),
             min_size=1, max_size=4),
    st.one_of(JSON_ANY, st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), JSON_ANY),
                                 max_size=3)),
)
SCHEMAS = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}),
    st.recursive(st.just({"type": "string"}), lambda inner: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)}),
        max_leaves=6),
    st.fixed_dictionaries({"enum": st.lists(SHORT_TEXT, max_size=50)}),
    st.fixed_dictionaries({"type": st.just("string"), "pattern": SHORT_TEXT}),
    JSON_ANY)
TOOLS = mostly(st.lists(st.fixed_dictionaries({"type": mostly(st.just("function"), JSON_ANY), "function": mostly(
    st.fixed_dictionaries({"name": mostly(st.sampled_from(["f", "get_weather"]), SHORT_TEXT), "parameters": SCHEMAS}),
    JSON_ANY)}), max_size=3), JSON_ANY)
TOOL_CHOICES = st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "x"])})}),
    JSON_ANY)
RESPONSE_FORMATS = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                             st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                                    st.fixed_dictionaries({"schema": SCHEMAS})}), JSON_ANY)
OPENAI_FIELDS = {
    "tools": TOOLS, "tool_choice": TOOL_CHOICES, "parallel_tool_calls": JSON_ANY, "response_format": RESPONSE_FORMATS,
    "max_tokens": mostly(st.integers(1, 6), JSON_ANY), "temperature": TEMPERATURE, "top_p": TOP_P,
    "seed": mostly(st.integers(0, 2**32), JSON_ANY), "stop": mostly(STOPS, JSON_ANY), "stream": st.booleans(),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_ANY),
    "user": SESSION_IDS, "n": mostly(st.just(1), JSON_ANY), "logprobs": JSON_ANY, "model": JSON_ANY,
    "prediction": mostly(st.fixed_dictionaries({"type": st.just("content"), "content": st.one_of(
        PREDICTION, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": PREDICTION}), max_size=3))}),
        st.one_of(JSON_ANY, st.fixed_dictionaries({"type": JSON_ANY, "content": JSON_ANY}),
                  st.fixed_dictionaries({"type": st.just("content"), "content": st.lists(JSON_ANY, max_size=3)}))),
}
OFFSET = mostly(st.integers(0, 120), st.one_of(JSON_ANY, st.sampled_from([-1, 2**31, 2**64, 1.5, "3"])))
LLAMA_FIELDS = {
    "n_predict": mostly(st.integers(-1, 6), JSON_ANY), "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K,
    "stream": st.booleans(), "n_indent": mostly(st.integers(0, 8), JSON_ANY), "cache_prompt": JSON_ANY,
    "t_max_predict_ms": mostly(st.integers(0, 2000), JSON_ANY), "samplers": JSON_ANY, "stop": mostly(STOPS, JSON_ANY),
    "response_fields": mostly(st.lists(st.sampled_from(["content", "timings/prompt_n", "tokens_cached", "", "a/b"])),
                              JSON_ANY),
    "input_extra": mostly(st.lists(st.fixed_dictionaries({"filename": SHORT_TEXT, "text": texts(24)}), max_size=5),
                          JSON_ANY),
}
HTTP_BODIES = {
    "/v1/chat/completions": {"messages": MESSAGES, **OPENAI_FIELDS},
    "/v1/completions": {"prompt": mostly(texts(), JSON_ANY), "suffix": mostly(texts(), JSON_ANY), **OPENAI_FIELDS},
    "/infill": {"input_prefix": texts(), "input_suffix": texts(), "prompt": mostly(SHORT_TEXT, JSON_ANY),
                **LLAMA_FIELDS},
    "/completion": {"prompt": mostly(texts(), JSON_ANY), **LLAMA_FIELDS},
    "/v1/rewrite": {"text": mostly(st.sampled_from(["".join(SOURCE), SOURCE[0]]), st.one_of(texts(), JSON_ANY)),
                    "path": mostly(SHORT_TEXT, JSON_ANY), "region_start": OFFSET, "region_end": OFFSET,
                    "cursor": OFFSET, "recent_edits": mostly(st.lists(st.sampled_from(EDITS), max_size=2),
                                                             st.one_of(JSON_ANY, st.lists(texts(), max_size=4))),
                    "max_tokens": mostly(st.integers(0, 6), JSON_ANY), "temperature": TEMPERATURE, "top_p": TOP_P,
                    "seed": mostly(st.integers(0, 2**32), JSON_ANY), "stream": st.booleans()},
}


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(path, body, session header): mostly JSON objects with the endpoint's fields (the main one nearly always; the
    others some missing, some wild, some unknown), else any JSON value or bytes."""
    path = draw(st.sampled_from(sorted(HTTP_BODIES)))
    if draw(st.integers(0, 9)) == 0:
        body = draw(st.one_of(st.binary(max_size=256), JSON_ANY.map(lambda v: json.dumps(v).encode())))
    else:
        fields = HTTP_BODIES[path]
        required = next(iter(fields))  # messages / prompt / input_prefix: present unless dropped 1 time in 10
        chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
        if draw(st.integers(0, 9)) and required not in chosen:
            chosen.append(required)
        data = {name: draw(fields[name]) for name in chosen}
        data.update(draw(st.dictionaries(SHORT_TEXT, JSON_ANY, max_size=2)))
        body = json.dumps(data).encode()
    return path, body, draw(mostly(st.just(""), SESSION_IDS))


# ---- the server under fuzz --------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def fuzz_server() -> AsyncIterator[Running]:
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    base = make_config()
    config = replace(base, engine=replace(base.engine, max_context=256, max_sessions=4),
                     server=replace(base.server, metrics_port=0),
                     limits=Limits(max_message_bytes=1024 * 1024, max_new_tokens=6, default_max_new_tokens=3,
                                   max_stop_strings=4, max_stop_chars=24, max_extra_files=4,
                                   max_streams_per_client=8))
    running = await start_server(config)
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture(scope="module")
async def fuzz_channel(fuzz_server: Running) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fuzz_server.port}") as channel:
        yield channel


LAYOUT_ORDER = {pb.FIM_LAYOUT_PSM: "psm", pb.FIM_LAYOUT_TYPED_LINE: "psm", pb.FIM_LAYOUT_SPM: "spm"}


def allowed(server: Running, rpc: str, request: Any = None) -> set[grpc.StatusCode]:
    """Infill may also be FAILED_PRECONDITION: without FIM tokens, or for a layout the model was not trained for."""
    fim = server.runtime.fim
    if rpc == "Infill":
        order = LAYOUT_ORDER.get(request.layout) if isinstance(request, pb.InfillRequest) else None
        if fim is None or order not in (None, *fim.orders) or request is None:
            return OK_CODES | {grpc.StatusCode.FAILED_PRECONDITION}
    return OK_CODES


def server_codes(server: Running, rpc: str) -> Counter[grpc.StatusCode]:
    """How many `rpc` calls the server has ended with each status code (its requests counter)."""
    registry = server.metrics.registry
    return Counter({code: int(registry.get_sample_value("specrpc_requests_total",
                                                        {"rpc": rpc, "code": code.name, "protocol": "grpc"}) or 0)
                    for code in grpc.StatusCode})


async def settled(server: Running) -> None:
    """No slot in use and no stream counted once the call has ended (released on the loop shortly after)."""
    service = server.service
    await wait_until(lambda: server.runtime.registry.in_use == 0 and not service.quota.open, timeout=10,
                     what="slots and stream quota released")
    assert service.gateway.streams == 0


async def still_healthy(server: Running, channel: grpc.aio.Channel) -> None:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    _, summary = await collect(pb_grpc.GeneratorStub(channel).Generate(
        pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=3), timeout=30))
    assert 1 <= summary.completion_tokens <= 3
    await settled(server)
    registry = server.runtime.registry
    held = {s.slot.index for s in registry.sessions.values()}
    assert not (registry.free & held) and registry.free | held == set(range(registry.total)), "slot bookkeeping"


async def converse_status(server: Running, start: Any, requests: list[Any]) -> tuple[grpc.StatusCode, str]:
    """Status of a Converse call sending `requests`. grpc.aio's client reports INTERNAL ("Internal error from Core")
    when it is still writing requests as the server ends the call, and the status the server sent is lost on the
    client: then the status the server recorded (its requests counter) is returned instead."""
    before = server_codes(server, "Converse")
    code, details = await status_of(start(iter(requests), timeout=30))
    if (code, details) == CLIENT_WRITE_RACE:
        # the server counts the call when gRPC has ended it on its side, which can come after the client's status
        await wait_until(lambda: bool(server_codes(server, "Converse") - before), what="the server's count")
        [code] = (server_codes(server, "Converse") - before).elements()
        details = "(the server's details are lost in this client-side race)"
    return code, details


# ---- the fuzz tests -------------------------------------------------------------------------------------------------


@fuzz(320)
@given(request=generate_requests())
async def test_fuzz_generate(fuzz_server: Running, fuzz_channel: grpc.aio.Channel, request: pb.GenerateRequest
                             ) -> None:
    SENT["generate"] += 1
    code, details = await status_of(pb_grpc.GeneratorStub(fuzz_channel).Generate(request, timeout=30))
    OUTCOMES["generate", code.name] += 1
    assert code in allowed(fuzz_server, "Generate"), (code, details)
    await settled(fuzz_server)


@fuzz(260)
@given(request=infill_requests())
async def test_fuzz_infill(fuzz_server: Running, fuzz_channel: grpc.aio.Channel, request: pb.InfillRequest) -> None:
    SENT["infill"] += 1
    code, details = await status_of(pb_grpc.GeneratorStub(fuzz_channel).Infill(request, timeout=30))
    OUTCOMES["infill", code.name] += 1
    assert code in allowed(fuzz_server, "Infill", request), (code, details)
    await settled(fuzz_server)


@fuzz(160)
@given(request=rewrite_requests())
async def test_fuzz_rewrite(fuzz_server: Running, fuzz_channel: grpc.aio.Channel, request: pb.RewriteRequest
                            ) -> None:
    SENT["rewrite"] += 1
    code, details = await status_of(pb_grpc.GeneratorStub(fuzz_channel).Rewrite(request, timeout=30))
    OUTCOMES["rewrite", code.name] += 1
    assert code in allowed(fuzz_server, "Rewrite"), (code, details)
    await settled(fuzz_server)


@fuzz(150)
@given(actions=conversations())
async def test_fuzz_converse(fuzz_server: Running, fuzz_channel: grpc.aio.Channel,
                             actions: list[pb.ConverseRequest]) -> None:
    SENT["converse"] += 1
    code, details = await converse_status(fuzz_server, pb_grpc.GeneratorStub(fuzz_channel).Converse,
                                          actions)
    OUTCOMES["converse", code.name] += 1
    assert code in allowed(fuzz_server, "Converse"), (code, details)
    if actions and actions[0].WhichOneof("action") != "start":
        assert code == grpc.StatusCode.INVALID_ARGUMENT and ("start" in details or "race" in details), details
    await settled(fuzz_server)


@fuzz(100)
@given(payload=ANY_MESSAGE)
async def test_fuzz_model_info_with_unknown_fields(fuzz_server: Running, fuzz_channel: grpc.aio.Channel,
                                                   payload: Any) -> None:
    """GetModelInfoRequest has no fields: another message's bytes arrive as unknown fields and are ignored."""
    SENT["model_info"] += 1
    call = fuzz_channel.unary_unary("/specrpc.v1.Generator/GetModelInfo",
                                    response_deserializer=pb.ModelInfo.FromString)
    info = await call(payload.SerializeToString(), timeout=10)
    assert info.kv_slots_total == fuzz_server.runtime.registry.total


RAW_METHODS = {
    "Generate": (pb.GenerateRequest, "unary_stream"),
    "Infill": (pb.InfillRequest, "unary_stream"),
    "Rewrite": (pb.RewriteRequest, "unary_stream"),
    "GetModelInfo": (pb.GetModelInfoRequest, "unary_unary"),
    "Converse": (pb.ConverseRequest, "stream_stream"),
}


def parses(kind: Any, data: bytes) -> bool:
    try:
        kind.FromString(data)
    except DecodeError:
        return False
    return True


@fuzz(200)
@given(method=st.sampled_from(sorted(RAW_METHODS)), payloads=st.lists(RAW_BYTES, min_size=1, max_size=3))
async def test_fuzz_raw_bytes(fuzz_server: Running, fuzz_channel: grpc.aio.Channel, method: str,
                              payloads: list[bytes]) -> None:
    """Arbitrary bytes, or one message's bytes sent as another's: a message that does not decode is
    INVALID_ARGUMENT naming the method (specrpc.edges.grpc.wire; grpc.aio alone answers UNKNOWN and logs a
    traceback); one that decodes is handled like any other request."""
    SENT["raw"] += 1
    kind, shape = RAW_METHODS[method]
    path = f"/specrpc.v1.Generator/{method}"
    if shape == "stream_stream":
        code, details = await converse_status(fuzz_server, fuzz_channel.stream_stream(path), payloads)
    else:
        code, details = await status_of(getattr(fuzz_channel, shape)(path)(payloads[0], timeout=30))
    OUTCOMES["raw", code.name] += 1
    request = kind.FromString(payloads[0]) if method == "Infill" and parses(kind, payloads[0]) else None
    assert code in allowed(fuzz_server, method, request), (code, details)
    if not parses(kind, payloads[0]) and code != grpc.StatusCode.RESOURCE_EXHAUSTED and "race" not in details:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf message" in details, details
    await settled(fuzz_server)


@fuzz(250)
@given(request=http_requests())
async def test_fuzz_http(fuzz_server: Running, request: tuple[str, bytes, str]) -> None:
    """Loopback only; each answer is 200, or 4xx in OpenAI's error shape (never a 5xx), and nothing leaks."""
    SENT["http"] += 1
    path, body, session = request
    headers = {"content-type": "application/json"}
    if session and session.isprintable() and session.isascii():
        headers["x-session-id"] = session
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{fuzz_server.http_port}", timeout=30) as client:
        response = await client.post(path, content=body, headers=headers)
    OUTCOMES["http", str(response.status_code)] += 1
    assert response.status_code in (200, 400, 413, 429), (response.status_code, response.text)
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.startswith("data: ") and '"error"' not in response.text, response.text
    else:
        assert isinstance(response.json(), dict)
    await settled(fuzz_server)


async def test_server_healthy_and_at_least_1000_requests_after_fuzzing(
    fuzz_server: Running, fuzz_channel: grpc.aio.Channel
) -> None:
    await still_healthy(fuzz_server, fuzz_channel)
    print("fuzz outcomes:", dict(sorted(OUTCOMES.items())))
    if set(SENT) != set(FUZZ_TESTS):
        pytest.skip(f"only part of the fuzz suite ran ({dict(SENT)})")
    assert sum(SENT.values()) >= MIN_REQUESTS, dict(SENT)
