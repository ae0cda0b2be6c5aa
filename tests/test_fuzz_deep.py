"""Fuzzing that reaches deep paths: start from valid requests of every RPC and route and mutate some of them, so that
most requests get past validation and run to completion (where test_fuzz.py's random fields mostly stop at the
first check). Generate; Infill with every layout the model takes and every editor field; both with a predicted
output (`prediction`) now and then; Rewrite (next-edit: file, region, cursor, recent edits); Converse streams with
several turns, barge-in (cancel mid-reply), rewind and sessions resumed on later streams; the OpenAI and llama.cpp
routes (OpenAI's with `prediction`) and POST /v1/rewrite, streamed and not; sessions reused across requests; calls
the fuzzer itself cancels or drops mid-stream.

Two servers, batching on (the default), several requests in flight at once: the shipped pair (draft, speculation,
prompt lookup) and a target with Mistral's chat template (conftest's `chat_server`: roles must alternate, so a
mutated role or an unbalanced history reaches the template's own refusal).

Asserted: gRPC ends OK / INVALID_ARGUMENT / RESOURCE_EXHAUSTED / FAILED_PRECONDITION (CANCELLED only for calls the
fuzzer cancelled); HTTP answers 2xx or a client 4xx with a JSON error body; a request built valid and left
unmutated never fails except RESOURCE_EXHAUSTED (every slot busy); at least half of all requests run to completion;
no slot or stream quota in use afterwards; both servers healthy. Each worker's request sequence is fixed
by the seed (SPECRPC_FUZZ_SEED, a `random.Random` per worker). SPECRPC_FUZZ_REQUESTS requests (CI: 2,000; a Converse
turn counts as one); `make fuzz N=100000` runs the long one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio
from conftest import models_missing
from conftest import test_config as make_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import CLIENT_WRITE_RACE, wait_until

from specrpc.config import Limits
from specrpc.edges.server import Running, start_server
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

REQUESTS = int(os.environ.get("SPECRPC_FUZZ_REQUESTS", "2000"))
SEED = int(os.environ.get("SPECRPC_FUZZ_SEED", "34"))
WORKERS = 4  # requests in flight at once on the pair (batched steps)
CHAT_WORKERS = 2  # and on the chat server (two KV slots)
MUTATE = 0.3  # share of requests with one mutation (the rest are sent as built: valid)
CANCEL = 0.05  # share of streams the fuzzer cancels (gRPC) or drops (HTTP) after the first event

GRPC_ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION}

SERVER_FORBIDDEN = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNIMPLEMENTED"}
"""Codes no request may end with, as the servers count them (both protocols)."""

pytestmark = pytest.mark.timeout(max(600, REQUESTS // 4))

# ---- valid material -----------------------------------------------------------------------------------------------

CODE = ["def fibonacci(n):\n    ", "import os\n\n", "class Stack:\n    def __init__(self):\n        self.items = []\n",
        "for i in range(10):\n    print(i)\n", "# utils\n", "return a + b\n", "x = {'a': 1, 'b': [1, 2]}\n",
        "async def main():\n    await asyncio.sleep(1)\n", "if __name__ == '__main__':\n    main()\n", "    "]
WORDS = ["Hello!", "What is a stack?", "Tell me about Python.", "Thanks, and then?", "Why?", "Summarise that.",
         "Écris une phrase.", "日本語で答えて", "ok", "Give me a list of three fruits."]
STOPS = ["\n\n", "return", ")", "def ", "."]
EDITS = ["@@ -1,2 +1,2 @@\n-def add(a, b):\n+def add(a, b, c):\n", "@@ -3 +3 @@\n-    print(i)\n+    print(i * 2)\n"]


def code(r: random.Random, pieces: int = 3) -> str:
    return "".join(r.choice(CODE) for _ in range(r.randint(1, pieces)))


def maybe(r: random.Random, p: float = 0.5) -> bool:
    return r.random() < p


@dataclass
class Case:
    """One request as sent: what it is, and what the fuzzer knows of it."""

    kind: str  # Generate, Infill, Converse, or an HTTP path
    server: str  # "pair" or "chat"
    payload: Any
    session: str = ""
    mutation: str = ""  # "" when sent as built (valid)
    cancel: bool = False  # the fuzzer cancels / drops it after the first event
    http_method: str = "POST"
    http_raw: bytes | None = None
    http_content_type: str = "application/json"


@dataclass
class Stats:
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    completed: int = 0
    sent: int = 0
    chat_sent: int = 0
    mutated: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, case: Case, outcome: str, completed: bool, problem: str = "") -> None:
        """A Converse stream counts as one request per turn it sends (at least one)."""
        n = max(1, sum(kind == "turn" for kind, _ in case.payload)) if case.kind == "Converse" else 1
        self.sent += n
        self.chat_sent += n * (case.server == "chat")
        self.mutated += n * bool(case.mutation)
        self.completed += n * completed
        self.outcomes[(case.kind, outcome)] += 1
        if problem and len(self.failures) < 20:
            self.failures.append(f"{case.kind} [{case.server}] mutation={case.mutation or '-'}: {problem} "
                                 f"payload={str(case.payload)[:300]!r}")


# ---- building valid requests --------------------------------------------------------------------------------------

def sampling(r: random.Random) -> pb.SamplingParams | None:
    if maybe(r, 0.4):
        return None
    msg = pb.SamplingParams(temperature=r.choice([0.0, 0.0, 0.7, 1.0, 1.5]), top_p=r.choice([0.0, 0.9, 1.0]),
                            top_k=r.choice([0, 0, 5, 40]))
    if maybe(r, 0.3):
        msg.seed = r.randint(0, 2**32)
    if maybe(r, 0.3):  # the controls the logits transform applies, at valid values
        msg.repetition_penalty = r.choice([0.0, 1.0, 1.3, 0.8])
        msg.presence_penalty, msg.frequency_penalty = r.choice([0, 0.5, -2, 2]), r.choice([0, 1.0, -0.5])
        msg.penalty_last_n = r.choice([0, 1, 8, -1])
        msg.logit_bias.update({r.randrange(0, 64): r.choice([-100.0, 5.0, 100.0]) for _ in range(r.randint(0, 3))})
        msg.min_p, msg.min_keep = r.choice([0.0, 0.05, 1.0]), r.choice([0, 1, 3])
        msg.min_tokens, msg.ignore_eos = r.choice([0, 0, 1]), maybe(r, 0.2)
    return msg


def speculation(r: random.Random, draft: bool) -> pb.SpeculationParams | None:
    if maybe(r, 0.4):
        return None
    proposers = list(pb.Proposer.values()) if draft else [pb.PROPOSER_UNSPECIFIED, pb.PROPOSER_PROMPT_LOOKUP]
    msg = pb.SpeculationParams(proposer=r.choice(proposers))
    if maybe(r):
        msg.num_draft_tokens = r.randint(0, 5)
    return msg


def common(msg: Any, r: random.Random, max_new: int, draft: bool) -> None:
    msg.max_new_tokens = r.randint(1, max_new)
    if maybe(r, 0.3):
        msg.stop.extend(r.sample(STOPS, r.randint(1, 2)))
    for name, value in (("sampling", sampling(r)), ("speculation", speculation(r, draft))):
        if value is not None:
            getattr(msg, name).CopyFrom(value)


def editor(msg: pb.GenerateRequest | pb.InfillRequest, r: random.Random) -> None:
    """The editor fields, valid together: prefill-only alone (as editors warm the cache), else n_indent,
    max_time_ms, logprobs with top_logprobs."""
    if maybe(r, 0.1):
        msg.prefill_only = True
        msg.max_new_tokens = 0
        del msg.stop[:]
        return
    msg.n_indent = r.choice([0, 0, 4, 8])
    msg.max_time_ms = r.choice([0, 0, 50, 500])
    msg.logprobs = maybe(r, 0.3)
    if msg.logprobs:
        msg.top_logprobs = r.randint(0, 5)


@dataclass
class Target:
    """What the generator needs to know of a server to build valid requests."""

    name: str
    layouts: list[int]  # FimLayout values this model takes (empty: no FIM)
    limits: Limits
    templated: bool
    vocab: int
    draft: bool


def build_generate(r: random.Random, t: Target, session: str) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(session_id=session, truncate_prompt=maybe(r, 0.2))
    if maybe(r, 0.8):
        msg.prompt = code(r)
    else:
        msg.prompt_token_ids.extend(r.randrange(3, min(t.vocab, 256)) for _ in range(r.randint(1, 30)))
    common(msg, r, 4, t.draft)
    editor(msg, r)
    if maybe(r, 0.25):
        msg.prediction = code(r)
    return msg


def build_infill(r: random.Random, t: Target, session: str) -> pb.InfillRequest:
    layout = r.choice(t.layouts)
    msg = pb.InfillRequest(prefix=code(r), suffix=code(r, 2), path=r.choice(["", "main.py", "src/app.py"]),
                           session_id=session, repo_name=r.choice(["", "specrpc"]), truncate=True, layout=layout)
    if layout in (pb.FIM_LAYOUT_TYPED_LINE, pb.FIM_LAYOUT_UNSPECIFIED) and maybe(r):
        msg.typed_line = r.choice(["    ret", "x = ", "print(", ""])
    for i in range(r.randint(0, min(2, t.limits.max_extra_files))):
        msg.extra.add(path=f"lib{i}.py", text=code(r, 2))
    common(msg, r, 4, t.draft)
    editor(msg, r)
    if maybe(r, 0.25):
        msg.prediction = code(r)
    return msg


def region(r: random.Random, text: str) -> tuple[int, int, int]:
    """A region of whole lines of `text` (start, end) and a cursor within it, in characters."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    first = r.randrange(len(starts))
    last = r.randint(first, len(starts) - 1)
    start, end = starts[first], starts[last]
    return start, end, r.randint(start, end)


def build_rewrite(r: random.Random, t: Target, session: str) -> pb.RewriteRequest:
    text = code(r, 2)  # with an edit, at most 218 tokens of prompt: within the pair's context
    start, end, cursor = region(r, text)
    msg = pb.RewriteRequest(path=r.choice(["", "main.py", "src/app.py"]), text=text, region_start=start,
                            region_end=end, cursor=cursor, session_id=session, max_new_tokens=r.randint(1, 6))
    msg.recent_edits.extend(r.sample(EDITS, r.randint(0, 1)))
    for name, value in (("sampling", sampling(r)), ("speculation", speculation(r, t.draft))):
        if value is not None:
            getattr(msg, name).CopyFrom(value)
    return msg


def build_conversation(r: random.Random, t: Target, session: str) -> list[tuple[str, Any]]:
    """A Converse script: start, then turns (user roles, so a template's alternation holds), barge-ins (cancel
    after the first chunk), rewinds of the last reply."""
    start = pb.SessionStart(session_id=session, phrase_mode=maybe(r))
    if maybe(r, 0.4):
        start.system = "You are terse."
    if maybe(r, 0.2):
        start.tools.extend(pb.Tool(name=f["function"]["name"], parameters_json=json.dumps(f["function"]["parameters"]))
                           for f in FUZZ_TOOLS)
        start.tool_choice.mode = r.choice(list(pb.ToolChoiceMode.values()))
    common(start, r, 4, t.draft)
    script: list[tuple[str, Any]] = [("start", start)]
    for _ in range(r.randint(1, 4)):
        turn = pb.Turn(text=r.choice(WORDS), max_new_tokens=r.randint(1, 4))
        if maybe(r, 0.2):
            turn.role = "user"
        if (s := sampling(r)) is not None:
            turn.sampling.CopyFrom(s)
        script.append(("turn", turn))
        if start.tools:  # tool calls are a constraint, which decides where a reply ends
            for s in (start.sampling, turn.sampling):
                s.min_tokens, s.ignore_eos = 0, False
        step = r.random()
        if step < 0.25:
            script.append(("barge_in", pb.Cancel()))
        elif step < 0.45:
            script.append(("rewind", pb.Rewind(spoken_chars=r.randint(0, 12))))
    return script


def chat_messages(r: random.Random) -> list[dict[str, Any]]:
    """A history the strictest template takes: optional system, then user/assistant alternating, ending on user."""
    messages: list[dict[str, Any]] = []
    if maybe(r, 0.3):
        messages.append({"role": r.choice(["system", "developer"]), "content": "You are terse."})
    for _ in range(r.randint(0, 3)):
        messages.append({"role": "user", "content": r.choice(WORDS)})
        messages.append({"role": "assistant", "content": r.choice(WORDS) * r.randint(1, 3)})
    content: Any = r.choice(WORDS)
    if maybe(r, 0.2):
        content = [{"type": "text", "text": content}]
    messages.append({"role": "user", "content": content})
    return messages


FUZZ_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def tool_fields(r: random.Random, body: dict[str, Any]) -> None:
    """Valid `tools` (with a choice and parallel_tool_calls) or `response_format` on a chat request."""
    if maybe(r, 0.25):
        body["tools"] = FUZZ_TOOLS[:r.randint(1, 2)]
        if maybe(r, 0.7):
            body["tool_choice"] = r.choice(["auto", "none", "required",
                                            {"type": "function", "function": {"name": "get_weather"}}])
        if maybe(r, 0.3):
            body["parallel_tool_calls"] = maybe(r)
    elif maybe(r, 0.15):
        body["response_format"] = r.choice([{"type": "text"}, {"type": "json_object"}, {
            "type": "json_schema", "json_schema": {"name": "n", "strict": maybe(r), "schema": FUZZ_TOOLS[0][
                "function"]["parameters"]}}])


def hostile_schema(r: random.Random) -> Any:
    """A schema that is deeply nested, enormous, self-referring, malformed or not a schema at all."""
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(r.choice([50, 300])):
        deep = {"type": "object", "properties": {"a": deep}}
    return r.choice([
        deep, {"enum": list(range(r.choice([1000, 20_000])))},
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}}}},
        {"type": "string", "pattern": r.choice(["(unclosed", "[z-a]", "\\"])}, {"type": "strange"},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}},
        [], "x", None, 5, {"$ref": "http://example.invalid/schema"},
    ])


TOOL_MUTATIONS: list[Callable[[dict[str, Any], random.Random], None]] = [
    lambda b, r: b.__setitem__("tools", [{"type": "function", "function": {"name": "f",
                                                                            "parameters": hostile_schema(r)}}]),
    lambda b, r: b.__setitem__("tools", r.choice([[{"type": "function", "function": {"name": r.choice(
        ["", "a b", "x" * 65, "ünï"])}}], [FUZZ_TOOLS[0]] * 2, "tools", [None], [{"type": "retrieval"}], 7])),
    lambda b, r: b.update(tools=FUZZ_TOOLS, tool_choice=r.choice(
        ["sometimes", {"type": "function", "function": {"name": "missing"}}, {"type": "function"}, 3, []])),
    lambda b, r: b.update(tool_choice=r.choice(["required", {"type": "function", "function": {"name": "f"}}])),
    lambda b, r: b.update(tools=FUZZ_TOOLS, tool_choice="required", parallel_tool_calls=r.choice(["yes", 1, {}])),
    lambda b, r: b.__setitem__("response_format", r.choice([
        {"type": "json_schema", "json_schema": {"schema": hostile_schema(r)}}, {"type": "xml"}, "json",
        {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": "{}"}}])),
    lambda b, r: b.update(tools=FUZZ_TOOLS, tool_choice="required", response_format={"type": "json_object"}),
    lambda b, r: b["messages"].insert(-1, r.choice([
        {"role": "assistant", "content": None, "tool_calls": r.choice([[{"id": "c", "function": {
            "name": "get_weather", "arguments": r.choice(["{", "[]", "null", '{"city": 1}'])}}], "calls", [7]])},
        {"role": "tool", "tool_call_id": r.choice(["", "nope", 7]), "content": r.choice(["{}", None, 3])}])),
]


def speculative_fields(r: random.Random, body: dict[str, Any]) -> None:
    """llama.cpp's per-request speculation, taken on every generation route: n_max 0 (target-only) to 3, n_min up
    to it (within the servers' --max-draft-tokens of 8)."""
    if maybe(r, 0.2):
        body["speculative.n_max"] = most = r.choice([0, 1, 3])
        if maybe(r):
            body["speculative.n_min"] = r.randint(0, most)


def openai_fields(r: random.Random, body: dict[str, Any], chat: bool) -> None:
    body["max_tokens" if maybe(r) else "max_completion_tokens"] = r.randint(1, 4)
    for key, values in (("temperature", [0, 0.7, 1.0]), ("top_p", [0.5, 1.0]), ("seed", [0, 7, 2**31]),
                        ("stop", [".", ["\n\n", "return"]]), ("model", ["specrpc", "gpt-4o"])):
        if maybe(r, 0.3):
            body[key] = r.choice(values)
    if maybe(r, 0.4):
        body["stream"] = True
        if maybe(r):
            body["stream_options"] = {"include_usage": maybe(r)}
    for key, values in (("presence_penalty", [0, 1.5, -2]), ("frequency_penalty", [0.5, 2]), ("min_p", [0.1, 1]),
                        ("logit_bias", [{"5": 10}, {"11": -100, "12": 100}]), ("n", [1, 2]),
                        ("stop", [[13], [5, 7]]), ("repetition_penalty", [1.2]), ("min_tokens", [1])):
        if maybe(r, 0.1):
            body[key] = r.choice(values)
    if maybe(r, 0.2):
        body["logprobs"] = True if chat else r.randint(0, 3)
        if chat and maybe(r):
            body["top_logprobs"] = r.randint(0, 3)
    speculative_fields(r, body)
    if maybe(r, 0.25):
        content: Any = code(r)
        body["prediction"] = {"type": "content",
                              "content": content if maybe(r) else [{"type": "text", "text": content}]}


def llama_fields(r: random.Random, body: dict[str, Any]) -> None:
    body["n_predict"] = r.choice([0, 1, 2, 3, 4]) if maybe(r, 0.9) else -1
    for key, values in (("temperature", [0, 0.8]), ("top_k", [0, 40]), ("top_p", [0.95, 1.0]), ("seed", [-1, 3]),
                        ("n_indent", [0, 4]), ("t_max_predict_ms", [0, 250]), ("cache_prompt", [True]),
                        ("n_probs", [0, 2]), ("stop", [["\n\n"]]), ("samplers", [["top_k", "temperature"]]),
                        ("response_fields", [["content", "timings/prompt_n", "tokens_cached"]]),
                        ("repeat_penalty", [1.0, 1.1, 1.5]), ("repeat_last_n", [0, 64, -1]),
                        ("presence_penalty", [0.5]), ("frequency_penalty", [0.2]), ("min_p", [0.05]),
                        ("min_keep", [0, 2]), ("ignore_eos", [True, False])):
        if maybe(r, 0.3):
            body[key] = r.choice(values)
    if body["n_predict"] == 0:  # prefill only: the generation fields do not apply
        for key in ("n_probs", "t_max_predict_ms", "n_indent", "stop"):
            body.pop(key, None)
    speculative_fields(r, body)
    body["stream"] = maybe(r, 0.4)


def build_http(r: random.Random, t: Target, path: str) -> dict[str, Any]:
    body: dict[str, Any]
    if path == "/v1/chat/completions":
        body = {"messages": chat_messages(r)}
        openai_fields(r, body, chat=True)
        tool_fields(r, body)
    elif path == "/v1/completions":
        body = {"prompt": code(r) if maybe(r) else [code(r)]}
        if t.layouts and maybe(r, 0.3):
            body["suffix"] = code(r, 2)
        openai_fields(r, body, chat=False)
    elif path == "/v1/rewrite":
        text = code(r, 2)  # with an edit, at most 218 tokens of prompt: within the pair's context
        start, end, cursor = region(r, text)
        body = {"text": text, "path": "main.py", "region_start": start, "region_end": end, "cursor": cursor,
                "recent_edits": r.sample(EDITS, r.randint(0, 1)), "max_tokens": r.randint(1, 6),
                "stream": maybe(r, 0.4)}
        for key, values in (("temperature", [0, 0.7]), ("top_p", [0.9, 1.0]), ("seed", [0, 7])):
            if maybe(r, 0.3):
                body[key] = r.choice(values)
    elif path == "/infill":
        body = {"input_prefix": code(r), "input_suffix": code(r, 2), "prompt": r.choice(["", "    ret", "x = "]),
                "input_extra": [{"filename": "lib.py", "text": code(r, 2)} for _ in range(r.randint(0, 2))]}
        llama_fields(r, body)
    else:
        body = {"prompt": code(r)}
        llama_fields(r, body)
    if any(key in body for key in ("tools", "response_format", "json_schema", "grammar")):
        body.pop("min_tokens", None)  # a constraint decides where the reply ends
        body.pop("ignore_eos", None)
    if "tools" in body:
        body.pop("n", None)  # one choice with tools
    return body


# ---- mutations ----------------------------------------------------------------------------------------------------

BAD_FLOATS = [float("nan"), float("inf"), -1.0, 1e-40, 3.4e38, 1 - 1e-9]
PROTO_MUTATIONS: dict[str, Callable[[Any, random.Random, Target], None]] = {
    "temperature": lambda m, r, t: m.sampling.__setattr__("temperature", r.choice(BAD_FLOATS)),
    "top_p": lambda m, r, t: m.sampling.__setattr__("top_p", r.choice(BAD_FLOATS)),
    "top_k": lambda m, r, t: m.sampling.__setattr__("top_k", r.choice([-1, t.vocab + 1, 2**31 - 1])),
    "max_new_tokens": lambda m, r, t: m.__setattr__("max_new_tokens", r.choice([t.limits.max_new_tokens + 1,
                                                                                 2**32 - 1])),
    "stops": lambda m, r, t: m.stop.extend(["x" * (t.limits.max_stop_chars + 1)] * r.randint(1, 2)
                                           + ["."] * t.limits.max_stop_strings),
    "controls": lambda m, r, t: r.choice([
        lambda: m.sampling.__setattr__(r.choice(["presence_penalty", "frequency_penalty", "min_p",
                                                 "repetition_penalty"]), r.choice([*BAD_FLOATS, -3.0, 2.5])),
        lambda: m.sampling.logit_bias.update({r.choice([t.vocab, 2**32 - 1, 0]): r.choice([*BAD_FLOATS, 1e4])}),
        lambda: m.sampling.logit_bias.update({i: 1.0 for i in range(2000)}),
        lambda: m.sampling.__setattr__("penalty_last_n", r.choice([-2, -(2**31)])),
        lambda: m.sampling.__setattr__("min_tokens", r.choice([2**32 - 1, t.limits.max_new_tokens + 1])),
        lambda: m.sampling.__setattr__("min_keep", 2**32 - 1)])(),
    "num_draft": lambda m, r, t: m.speculation.__setattr__("num_draft_tokens", r.choice([2**31, 2**32 - 1])),
    "proposer": lambda m, r, t: m.speculation.__setattr__("proposer", r.choice([-1, 7, 99])),
    "session": lambda m, r, t: m.__setattr__("session_id", r.choice(["x" * 300, "bad\nid", "\x00"])),
}
REQUEST_MUTATIONS: dict[str, Callable[[Any, random.Random, Target], None]] = {
    "n_indent": lambda m, r, t: m.__setattr__("n_indent", r.choice([-1, 1025, 2**31 - 1])),
    "max_time_ms": lambda m, r, t: m.__setattr__("max_time_ms", r.choice([-5, 600_001])),
    "top_logprobs": lambda m, r, t: (m.__setattr__("logprobs", False), m.__setattr__("top_logprobs", 3)),
    "prefill_with_tokens": lambda m, r, t: (m.__setattr__("prefill_only", True),
                                            m.__setattr__("max_new_tokens", 3)),
    "huge_text": lambda m, r, t: m.__setattr__("prompt" if isinstance(m, pb.GenerateRequest) else "prefix",
                                               "x = 1\n" * 40_000),
}
PREDICTION_MUTATIONS: dict[str, Callable[[Any, random.Random, Target], None]] = {
    "huge_prediction": lambda m, r, t: m.__setattr__("prediction", r.choice(["word " * 2000, "é" * 60_000])),
}
REWRITE_MUTATIONS: dict[str, Callable[[Any, random.Random, Target], None]] = {
    "region_past_file": lambda m, r, t: m.__setattr__("region_end", len(m.text) + r.choice([1, 2**31])),
    "region_reversed": lambda m, r, t: (m.__setattr__("region_start", len(m.text)), m.__setattr__("region_end", 0)),
    "cursor_outside": lambda m, r, t: m.__setattr__("cursor", r.choice([m.region_end + 1, 2**32 - 1])),
    "huge_file": lambda m, r, t: m.__setattr__("text", "x = 1\n" * 40_000),
    "huge_edits": lambda m, r, t: m.recent_edits.extend(["-a\n+b\n" * 5000] * 4),
}
INFILL_MUTATIONS: dict[str, Callable[[Any, random.Random, Target], None]] = {
    "layout": lambda m, r, t: m.__setattr__("layout", r.choice([-1, 9] + [v for v in pb.FimLayout.values()
                                                                         if v not in t.layouts])),
    "extra_files": lambda m, r, t: [m.extra.add(path="f.py", text="x") for _ in range(t.limits.max_extra_files + 1)],
    "repo_name": lambda m, r, t: m.__setattr__("repo_name", "r" * 300),
    "no_truncate": lambda m, r, t: (m.__setattr__("truncate", False), m.__setattr__("prefix", "y = 2\n" * 2000)),
}
CONVERSE_MUTATIONS = ["role", "no_start", "second_start", "empty_action", "rewind_other", "rewind_first",
                      "system_huge", "turn_sampling", "tools"]
HTTP_MUTATIONS = ["drop_required", "wrong_type", "bad_number", "unknown_field_only", "garbage", "not_object",
                  "wrong_method", "content_type", "bad_role", "n", "header_mismatch", "bad_control", "unknown_path",
                  "tools", "prediction", "region", "speculative"]
HOSTILE_CONTROLS: list[tuple[str, Any]] = [
    ("presence_penalty", 2.5), ("frequency_penalty", -1e30), ("min_p", -0.1), ("min_p", "0.1"), ("min_keep", -4),
    ("repetition_penalty", 0), ("repeat_penalty", -1), ("repeat_last_n", -7), ("ignore_eos", "yes"),
    ("logit_bias", {"x": 1}), ("logit_bias", {"1" * 5000: 1}), ("logit_bias", {"3": float("inf")}),
    ("logit_bias", {"-1": 1}), ("logit_bias", {str(i): 1 for i in range(3000)}), ("logit_bias", [[1, 2]]),
    ("stop", [2**40]), ("stop", [1, "x"]), ("stop", [True]), ("min_tokens", 10**9), ("n", 0), ("best_of", 9)]
"""Values of the sampling controls an HTTP mutation sends (each refused with a 400 naming the field)."""


def mutate_proto(msg: Any, r: random.Random, t: Target) -> str:
    if isinstance(msg, pb.RewriteRequest):  # no stop strings
        table = {k: v for k, v in PROTO_MUTATIONS.items() if k != "stops"} | REWRITE_MUTATIONS
    else:
        table = dict(PROTO_MUTATIONS)
    if isinstance(msg, pb.GenerateRequest | pb.InfillRequest):
        table |= REQUEST_MUTATIONS | PREDICTION_MUTATIONS
    if isinstance(msg, pb.InfillRequest):
        table |= INFILL_MUTATIONS
    name = r.choice(sorted(table))
    table[name](msg, r, t)
    return name


def mutate_conversation(script: list[tuple[str, Any]], r: random.Random, t: Target) -> str:
    name = r.choice(CONVERSE_MUTATIONS)
    turns = [i for i, (kind, _) in enumerate(script) if kind == "turn"]
    if name == "role":
        script[r.choice(turns)][1].role = r.choice(["assistant", "bogus-role", "system", "tool"])
    elif name == "no_start":
        script.pop(0)
    elif name == "second_start":
        script.insert(r.randint(1, len(script)), ("start", pb.SessionStart(session_id="other")))
    elif name == "empty_action":
        script.insert(r.randint(1, len(script)), ("empty", None))
    elif name == "rewind_other":
        script.append(("rewind", pb.Rewind(spoken_chars=3, session_id="someone-else")))
    elif name == "rewind_first":
        script.insert(1, ("rewind", pb.Rewind(spoken_chars=3)))
    elif name == "system_huge":
        script[0][1].system = "s" * 2_000_000
    elif name == "tools":
        schema = hostile_schema(r)
        tool = pb.Tool(name=r.choice(["f", "", "bad name"]), parameters_json=json.dumps(schema)[:400_000])
        turn = script[r.choice(turns)][1]
        r.choice([lambda: turn.tools.append(tool), lambda: turn.tool_choice.__setattr__("function", "missing"),
                  lambda: turn.tool_choice.__setattr__("mode", pb.TOOL_CHOICE_MODE_REQUIRED),
                  lambda: (turn.tools.append(tool), turn.constraint.__setattr__("json_object", True))])()
    else:
        script[r.choice(turns)][1].sampling.CopyFrom(pb.SamplingParams(temperature=float("nan")))
    return name


def mutate_http(case: Case, r: random.Random) -> str:
    name = r.choice(HTTP_MUTATIONS)
    body: dict[str, Any] = case.payload
    if name == "drop_required":
        body.pop(next(iter(body)))
    elif name == "wrong_type":
        body[r.choice(sorted(body))] = r.choice([None, [], {}, 3, "x", True])
    elif name == "bad_number":
        key = "max_tokens" if case.kind.startswith("/v1/") else "n_predict"
        body[r.choice([key, "temperature", "top_p", "seed"])] = r.choice([-3, 10**30, 1e-40, "1", 2**64])
    elif name == "unknown_field_only":
        case.payload = {"unknown": 1}
    elif name == "garbage":
        case.http_raw = r.choice([b"", b"{", b"\xff\xfe\x00", b"[1, 2]", b'{"prompt": "\xed\xa0\x80"}',
                                  b"null", json.dumps(body).encode()[: r.randint(1, 20)]])
    elif name == "not_object":
        case.payload = r.choice([[body], "text", 5])
    elif name == "wrong_method":
        case.http_method = r.choice(["GET", "PUT", "DELETE"])
    elif name == "content_type":
        case.http_content_type = r.choice(["text/plain", "application/x-www-form-urlencoded", ""])
        case.http_raw = b"prompt=def+f("
    elif name == "bad_role":
        if "messages" in body:
            body["messages"][-1]["role"] = r.choice(["bogus", "assistant", 7, None])
        else:
            body["stream"] = "yes"
    elif name == "n":
        body["n" if case.kind.startswith("/v1/") else "n_probs"] = r.choice([2, 0, -1, 10**6])
    elif name == "bad_control":
        key, value = r.choice(HOSTILE_CONTROLS)
        body[key] = value
    elif name == "tools":
        if "messages" in body:
            r.choice(TOOL_MUTATIONS)(body, r)
        else:
            body["json_schema" if case.kind in ("/completion", "/infill") else "response_format"] = hostile_schema(r)
    elif name == "header_mismatch":
        body["user"] = "someone"
        case.session = case.session or "header-session"
    elif name == "prediction":
        body["prediction"] = r.choice([{"type": "text", "content": "x"}, {"type": "content"}, "x", 5, None,
                                       {"type": "content", "content": [{"type": "image_url"}]},
                                       {"type": "content", "content": "word " * 2000}])
    elif name == "speculative":
        body.update(r.choice([{"speculative.n_max": r.choice([-1, 9, 2**64, "3", 1.5, True, [3]])},
                              {"speculative.n_min": r.choice([-1, 9, "0", {}])},
                              {"speculative.n_max": 1, "speculative.n_min": 2}]))
    elif name == "region":
        body[r.choice(["region_start", "region_end", "cursor"])] = r.choice([-1, 10**9, 2**64, "3", 1.5, None])
    else:
        case.kind = r.choice(["/v1/embeddings", "/v2/completions", "/slots", "/v1"])
    return name


# ---- the generator ------------------------------------------------------------------------------------------------

HTTP_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/rewrite", "/infill", "/completion"]


def next_case(r: random.Random, t: Target, worker: int) -> Case:
    """One request for `t`: mostly valid (built so), MUTATE of them with one mutation; sessions from a small
    per-worker pool, so later requests reuse earlier ones' KV caches and Converse histories."""
    session = r.choice(["", f"{t.name}-w{worker}-a", f"{t.name}-w{worker}-b", f"{t.name}-w{worker}-c"])
    roll = r.random()
    mutate = maybe(r, MUTATE)
    if roll < 0.45 if t.templated else roll < 0.25:
        script = build_conversation(r, t, session)
        case = Case("Converse", t.name, script, session)
        if mutate:
            case.mutation = mutate_conversation(script, r, t)
        return case
    if roll < 0.55:
        pick = r.random()
        msg: Any = (build_rewrite(r, t, session) if pick < 0.3 else build_infill(r, t, session)
                    if t.layouts and pick < 0.6 else build_generate(r, t, session))
        case = Case(type(msg).__name__.removesuffix("Request"), t.name, msg, session, cancel=maybe(r, CANCEL))
        if mutate:
            case.mutation = mutate_proto(msg, r, t)
        return case
    if roll < 0.57:
        return Case(r.choice(["/v1/models", "/health"]), t.name, None, http_method="GET")
    path = "/v1/chat/completions" if t.templated and maybe(r, 0.7) else r.choice(HTTP_PATHS)
    if path in ("/infill",) and not t.layouts:
        path = "/completion"
    case = Case(path, t.name, build_http(r, t, path), session if maybe(r, 0.8) else "", cancel=maybe(r, CANCEL))
    if mutate:
        case.mutation = mutate_http(case, r)
    return case


# ---- sending ------------------------------------------------------------------------------------------------------

async def run_unary_stream(stub: pb_grpc.GeneratorStub, case: Case) -> tuple[grpc.StatusCode, str, bool]:
    method = {"Generate": stub.Generate, "Infill": stub.Infill, "Rewrite": stub.Rewrite}[case.kind]
    metadata = (("x-session-id", case.session),) if case.session and not case.mutation else ()
    call = method(case.payload, timeout=60, metadata=metadata)
    summary = False
    try:
        async for response in call:
            if case.cancel:
                call.cancel()
                break
            summary = response.WhichOneof("event") == "summary"
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or "", False
    if case.cancel:
        return grpc.StatusCode.CANCELLED, "", False
    return grpc.StatusCode.OK, "", summary


async def run_converse(stub: pb_grpc.GeneratorStub, case: Case) -> tuple[grpc.StatusCode, str, bool]:
    """Drive the script like a voice client: each turn's events are read before the next action; a barge-in
    cancels after the reply's first event; a rewind waits for its answer."""
    outbox: asyncio.Queue[pb.ConverseRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ConverseRequest]:
        while (item := await outbox.get()) is not None:
            yield item

    metadata = (("x-session-id", case.session),) if case.session and not case.mutation else ()
    call = stub.Converse(requests(), timeout=60, metadata=metadata)
    wanted = {"start": "started", "turn": "summary", "rewind": "rewound"}
    try:
        script = list(case.payload)
        for i, (kind, message) in enumerate(script):
            if kind == "empty":
                await outbox.put(pb.ConverseRequest())
            elif kind == "barge_in":
                continue  # sent while reading the turn before it
            else:
                await outbox.put(pb.ConverseRequest(**{kind: message}))
            barge = i + 1 < len(script) and script[i + 1][0] == "barge_in"
            until = wanted.get(kind)
            while until is not None:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                event = response.WhichOneof("event")
                if barge and event in ("chunk", "phrase"):
                    await outbox.put(pb.ConverseRequest(cancel=pb.Cancel()))
                    barge = False
                if event == until:
                    break
        await outbox.put(None)
        while await call.read() is not grpc.aio.EOF:
            pass
        code = await call.code()
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or "", False
    finally:
        outbox.put_nowait(None)
    return code, await call.details() or "", code == grpc.StatusCode.OK


async def run_http(client: httpx2.AsyncClient, case: Case) -> tuple[int, str, bool]:
    headers = {"content-type": case.http_content_type} if case.http_content_type else {}
    if case.session:
        headers["x-session-id"] = case.session
    content = case.http_raw if case.http_raw is not None else (
        json.dumps(case.payload).encode() if case.payload is not None else None)
    async with client.stream(case.http_method, case.kind, content=content, headers=headers) as response:
        if case.cancel and response.status_code == 200:
            async for _ in response.aiter_bytes():
                break  # drop the connection mid-stream
            return response.status_code, "", False
        text = (await response.aread()).decode(errors="replace")
    status = response.status_code
    if status != 200:
        return status, text, False
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
        # OpenAI ends with [DONE]; llama.cpp's last event has `stop: true`, or only the `response_fields` asked for
        done = bool(events) and (events[-1] == "[DONE]" or json.loads(events[-1]).get("stop", True) is True)
        # a failure mid-stream is an event with a top-level `error` (a generated token may read "error" itself)
        failed = any("error" in json.loads(e) for e in events if e != "[DONE]")
        return status, text if not done or failed else "", done and not failed
    json.loads(text)
    return status, "", True


async def worker(case_of: Callable[[int], Case], index: int, channels: dict[str, grpc.aio.Channel],
                 http: dict[str, httpx2.AsyncClient], stats: Stats, more: Callable[[], bool]) -> None:
    """Send `case_of(index)`'s requests one after another while `more()`."""
    while more():
        case = case_of(index)
        if case.kind in ("Generate", "Infill", "Rewrite", "Converse"):
            stub = pb_grpc.GeneratorStub(channels[case.server])
            run = run_converse if case.kind == "Converse" else run_unary_stream
            code, details, completed = await run(stub, case)
            problem = ""
            if (code, details) == CLIENT_WRITE_RACE and case.mutation:
                # the server ended a mutated stream (its status is in its own counter, checked at the end) while
                # the client was still writing: grpcio's client then loses that status
                stats.record(case, "client write race", False)
                continue
            if code not in GRPC_ALLOWED and not (code == grpc.StatusCode.CANCELLED and case.cancel):
                problem = f"status {code.name}: {details}"
            elif not case.mutation and code not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED) \
                    and not case.cancel:
                problem = f"built valid, got {code.name}: {details}"
            stats.record(case, code.name, completed, problem)
        else:
            status, text, completed = await run_http(http[case.server], case)
            problem = ""
            if not (200 <= status < 300 or 400 <= status < 500):
                problem = f"HTTP {status}: {text[:300]}"
            elif status >= 400:
                try:
                    error = json.loads(text)["error"]
                    assert {"message", "type", "code"} <= set(error)
                except (ValueError, KeyError, TypeError, AssertionError):
                    problem = f"HTTP {status} without a JSON error body: {text[:300]}"
                if not case.mutation and case.kind not in ("/health",) and status != 429 and not problem:
                    problem = f"built valid, got HTTP {status}: {text[:300]}"
            elif text:
                problem = f"HTTP {status} with an unfinished or failed stream: {text[-300:]}"
            stats.record(case, str(status), completed, problem)


# ---- servers ------------------------------------------------------------------------------------------------------

@pytest_asyncio.fixture(scope="module")
async def pair_server() -> AsyncIterator[Running]:
    """The shipped pair (draft and prompt lookup), small limits so that thousands of requests stay fast."""
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    base = make_config()
    config = replace(base, engine=replace(base.engine, max_context=256, max_sessions=6),
                     server=replace(base.server, metrics_port=0),
                     limits=Limits(max_message_bytes=1024 * 1024, max_new_tokens=8, default_max_new_tokens=3,
                                   max_stop_strings=4, max_stop_chars=24, max_extra_files=4,
                                   max_streams_per_client=16))
    running = await start_server(config)
    yield running
    await running.stop(0.5)


def target_of(name: str, server: Running) -> Target:
    rt = server.runtime
    layouts = []
    if rt.fim is not None:
        layouts.append(pb.FIM_LAYOUT_UNSPECIFIED)
        if "psm" in rt.fim.orders:
            layouts += [pb.FIM_LAYOUT_PSM, pb.FIM_LAYOUT_TYPED_LINE]
        if "spm" in rt.fim.orders:
            layouts.append(pb.FIM_LAYOUT_SPM)
    return Target(name, layouts, server.service.gateway.limits, templated=name == "chat", vocab=rt.vocab_size,
                  draft=rt.draft is not None)


async def settled(server: Running) -> None:
    service = server.service
    await wait_until(lambda: server.runtime.registry.in_use == 0 and not service.quota.open
                     and service.gateway.streams == 0, timeout=15, what="slots and stream quota released")
    registry = server.runtime.registry
    held = {s.slot.index for s in registry.sessions.values()}
    assert not (registry.free & held) and registry.free | held == set(range(registry.total)), "slot bookkeeping"


async def healthy(server: Running, channel: grpc.aio.Channel, http: httpx2.AsyncClient) -> None:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    summary = None
    async for event in pb_grpc.GeneratorStub(channel).Generate(
            pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=2), timeout=30):
        summary = event.summary if event.WhichOneof("event") == "summary" else summary
    assert summary is not None and summary.completion_tokens >= 1
    assert (await http.get("/health")).status_code == 200


async def test_deep_fuzz_both_edges(pair_server: Running, chat_server: Running) -> None:
    servers = {"pair": pair_server, "chat": chat_server}
    targets = {name: target_of(name, s) for name, s in servers.items()}
    # one generator per worker: each worker's sequence of requests is fixed by the seed, whatever the interleaving
    generators = {(name, w): random.Random(f"{SEED}-{name}-{w}") for name in servers
                  for w in range(WORKERS + CHAT_WORKERS)}
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for name, s in servers.items()}
    http = {name: httpx2.AsyncClient(base_url=f"http://127.0.0.1:{s.http_port}", timeout=60)
            for name, s in servers.items()}
    stats = Stats()
    started = time.monotonic()
    try:
        # every worker sends until the whole run has sent REQUESTS
        await asyncio.gather(
            *[worker(lambda w: next_case(generators["pair", w], targets["pair"], w), w, channels, http, stats,
                     lambda: stats.sent < REQUESTS) for w in range(WORKERS)],
            *[worker(lambda w: next_case(generators["chat", w], targets["chat"], w), w, channels, http, stats,
                     lambda: stats.sent < REQUESTS)
              for w in range(WORKERS, WORKERS + CHAT_WORKERS)])
        elapsed = time.monotonic() - started
        by_kind: Counter[str] = Counter()
        for (kind, _), n in stats.outcomes.items():
            by_kind[kind] += n
        print(f"\ndeep fuzz: {stats.sent} requests ({stats.chat_sent} to the templated model) in {elapsed:.0f}s, "
              f"{stats.completed} ran to completion, {stats.mutated} mutated; streams per kind {dict(by_kind)}")
        print("outcomes:", dict(sorted(stats.outcomes.items())))
        # the servers' own side first, so that a run with flagged requests still says whether it holds
        for name, server in servers.items():
            # what each server itself recorded, calls whose status the client lost included
            for metric in server.metrics.registry.collect():
                for sample in metric.samples:
                    if sample.name == "specrpc_requests_total":
                        assert sample.labels["code"] not in SERVER_FORBIDDEN or not sample.value, (name, sample)
            await settled(server)
            await healthy(server, channels[name], http[name])
            await settled(server)
        print("servers: no forbidden status in their counters, no slot or quota in use, both healthy")
        assert not stats.failures, "\n".join(stats.failures)
        assert stats.sent >= REQUESTS
        assert stats.chat_sent * 10 >= stats.sent, "the templated model should get a tenth of the requests or more"
        assert stats.completed * 2 >= stats.sent, f"only {stats.completed} of {stats.sent} ran to completion"
    finally:
        for channel in channels.values():
            await channel.close()
        for client in http.values():
            await client.aclose()
