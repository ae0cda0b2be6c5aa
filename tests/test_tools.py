"""Tool calls (prompts/tools.py and both edges): the streaming parser, the grammars, histories with calls and results
through Qwen2.5's chat template, the official openai SDK streaming calls from a random-weight Qwen2 checkpoint
(`tool_server`), the plain format on the shipped pair, gRPC Converse tool declarations and events, bad and hostile
declarations refused with 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx2
import jsonschema
import openai
import pytest
from service_helpers import Conversation, base_url

from specrpc.edges import validation
from specrpc.edges.conversation import render, tool_format
from specrpc.edges.history import Message
from specrpc.edges.server import Running
from specrpc.edges.validation import prompt_room
from specrpc.engine.constraint import ConstraintSpec, InvalidConstraint
from specrpc.prompts.tool_formats import HERMES, MISTRAL, MISTRAL_ARGS, ToolFormat
from specrpc.prompts.tools import (
    NO_PARAMETERS,
    ArgumentsPart,
    CallEnded,
    CallStarted,
    TextPart,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    call_schema,
    grammar_text,
    tool_grammar,
)
from specrpc.serving.runtime import Runtime
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- the parser and the grammar ----------------------------------------------------------------------------------


REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "n": [1, {"a": 2}]}}'
         '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("seed", range(20))
def test_the_parser_reads_calls_from_a_reply_split_anywhere(seed: int) -> None:
    rng = random.Random(seed)
    parser, parts, i = ToolCallParser(HERMES), [], 0
    while i < len(REPLY):
        n = rng.randint(1, 9)
        parts += parser.feed(REPLY[i:i + n])
        i += n
    parts += parser.finish()
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == "Let me look.\n"
    args: dict[int, str] = {}
    for p in parts:
        if isinstance(p, ArgumentsPart):
            args[p.index] = args.get(p.index, "") + p.text
    assert args == {0: '{"city": "Pa}r\\"is", "n": [1, {"a": 2}]}', 1: "{}"}
    starts = [p for p in parts if isinstance(p, CallStarted)]
    assert [p.name for p in starts] == ["get_weather", "get_time"]
    ends = [p for p in parts if isinstance(p, CallEnded)]
    assert [e.call for e in ends] == parser.calls and [c.id for c in parser.calls] == [s.id for s in starts]
    # a call is announced before its arguments, and its arguments before it ends
    order = [type(p).__name__ for p in parts if not isinstance(p, TextPart)]
    assert order.index("CallStarted") < order.index("ArgumentsPart") < order.index("CallEnded")


def test_text_that_only_looks_like_a_marker_is_text() -> None:
    parser = ToolCallParser(HERMES)
    parts = parser.feed("a <tool") + parser.feed("box> b <tool_c") + parser.finish()
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == "a <toolbox> b <tool_c"
    assert parser.calls == []


def test_a_call_cut_short_is_pending_with_its_arguments_so_far() -> None:
    parser = ToolCallParser(HERMES)
    parser.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": "U')
    pending = parser.pending
    assert pending is not None and (pending.name, pending.arguments) == ("get_time", '{"zone": "U')
    parser.feed('TC"}}\n</tool_call>')
    assert parser.pending is None and parser.calls[0].id == pending.id


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL_ARGS])
def test_a_calls_arguments_are_an_object_whatever_its_parameters_leave_out(server: Running, fmt: ToolFormat) -> None:
    """Parameters `{}` (a schema any JSON meets) still give arguments that are an object, which OpenAI's
    `arguments` are and the parser reads; a function declared without parameters (an empty parameter list, as
    OpenAI reads it) is called with `{}` only."""
    rt = server.runtime

    def accepts(parameters: str, arguments: str) -> bool:
        grammar = grammar_text(tool_grammar([Tool("f", "", parameters)], ToolChoice("required"), False, fmt) or [])
        ids = rt.encode_plain(fmt.write([ToolCall("", "f", arguments)]))
        return rt.grammars.compile(ConstraintSpec("grammar", grammar)).start().valid_prefix(ids) == len(ids)

    assert accepts("{}", '{"a": [1]}') and not accepts("{}", '"a"') and not accepts("{}", "7")
    assert accepts(NO_PARAMETERS, "{}") and not accepts(NO_PARAMETERS, '{"a": 1}')


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL])
def test_a_named_function_is_called_exactly_once_even_with_parallel_calls(server: Running, fmt: ToolFormat) -> None:
    """OpenAI's forced function (`tool_choice` naming one) is exactly one call of it; `required` may make several."""
    rt = server.runtime
    tools = [Tool("get_time", "", json.dumps(TIME))]
    call = ToolCall("", "get_time", '{"zone": "UTC"}')
    one, two = (rt.encode_plain(fmt.write(calls)) for calls in ([call], [call, call]))

    def start(choice: ToolChoice) -> Any:
        grammar = grammar_text(tool_grammar(tools, choice, True, fmt) or [])
        return rt.grammars.compile(ConstraintSpec("grammar", grammar)).start()

    named = start(ToolChoice("function", "get_time"))
    assert named.valid_prefix(one) == len(one) and named.valid_prefix(two) < len(two)
    assert start(ToolChoice("required")).valid_prefix(two) == len(two)


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL_ARGS])
def test_a_schema_that_does_not_compile_is_named_by_its_field(server: Running, fmt: ToolFormat) -> None:
    """The error names the function's parameters as the request wrote them, not a line of the generated grammar."""
    tools = [Tool("good", "", json.dumps(TIME)), Tool("bad", "", '{"properties": {"a": {"type": 7}}}')]
    for choice in (ToolChoice("required"), ToolChoice("auto"), ToolChoice("function", "bad")):
        spec = validation.tool_constraint(tools, choice, True, fmt, "turn.tools")
        assert spec is not None
        with pytest.raises(InvalidConstraint, match=r"^turn\.tools\[1\]\.function\.parameters: failed to compile"):
            server.runtime.grammars.compile(spec)


def test_grammars_force_valid_calls(tool_server: Running) -> None:
    """Required: only a call can start the reply, and a wrong name is refused; auto: text until the marker, then
    the call is forced; none: no grammar."""
    rt = tool_server.runtime
    fmt = tool_format(rt)
    assert fmt.native and fmt.name == "hermes" and {m for m, _ in fmt.tokens} == {"<tool_call>", "</tool_call>"}
    tools = [Tool("get_weather", "", json.dumps(WEATHER)), Tool("get_time", "", json.dumps(TIME))]
    encode = rt.encode_plain
    good = encode('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    wrong = encode('<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>')
    required = rt.grammars.compile(ConstraintSpec("grammar", grammar_text(
        tool_grammar(tools, ToolChoice("required"), True, fmt) or []))).start()
    assert required.valid_prefix(good) == len(good)
    assert required.valid_prefix(wrong) < len(wrong)
    for padded in ('{"name": "get_time", "arguments": {"zone":"UTC"}}', '{"name": "get_time" , "arguments": {}}',
                   '{"name": "get_time", "arguments": {\n"zone": "UTC"}}'):  # the layout's separators only
        ids = encode(f"<tool_call>\n{padded}\n</tool_call>")
        assert required.valid_prefix(ids) < len(ids), padded
    assert required.valid_prefix(encode("Hello")) == 0
    named = rt.grammars.compile(ConstraintSpec("grammar", grammar_text(
        tool_grammar(tools, ToolChoice("function", "get_weather"), False, fmt) or []))).start()
    assert named.valid_prefix(good) < len(good)  # only get_weather
    auto = rt.grammars.compile(ConstraintSpec("grammar", grammar_text(
        tool_grammar(tools, ToolChoice("auto"), True, fmt) or []))).start()
    text = encode("Sure, one moment. ")
    assert auto.valid_prefix(text + good) == len(text + good)
    assert auto.valid_prefix(text + wrong) < len(text + wrong)
    assert tool_grammar(tools, ToolChoice("none"), True, fmt) is None


def test_a_history_with_calls_and_results_renders_through_the_template(tool_server: Running) -> None:
    rt = tool_server.runtime
    tools = [Tool("get_weather", "Weather in a city", json.dumps(WEATHER))]
    history = [Message("user", "Weather in Paris?"),
               Message("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),)),
               Message("tool", '{"temperature": 21}', tool_call_id="call_1")]
    text = rt.tokenizer.decode(render(rt, history, True, tools))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    assert '"name": "get_weather", "description": "Weather in a city"' in text  # the tools in the system prompt


# ---- HTTP ------------------------------------------------------------------------------------------------------------


def sdk(running: Running) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(running) + "/v1", api_key="unused", max_retries=0)


async def test_sdk_streams_100_of_100_valid_calls_with_tool_choice_required(tool_server: Running) -> None:
    """The issue's bar: `tools` + `tool_choice: required` at T = 1 from a random-weight model with Qwen2.5's
    template; every streamed call parses and validates against its function's schema. One request in ten allows
    parallel calls (a random model chains them about one time in two, so most requests make one call and none
    runs out of tokens)."""
    calls = 0
    async with sdk(tool_server) as client:
        for seed in range(100):
            stream = await client.chat.completions.create(
                model="m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                parallel_tool_calls=seed % 10 == 0, max_tokens=400, stream=True)
            names: dict[int, str] = {}
            args: dict[int, str] = {}
            finish = None
            async for chunk in stream:
                choice = chunk.choices[0]
                assert not choice.delta.content, choice.delta
                for call in choice.delta.tool_calls or []:
                    if call.id is not None:  # a call's first delta: index, id, type, name, empty arguments
                        assert call.type == "function" and call.function and call.function.name
                        assert call.function.arguments == "" and call.index not in names
                        names[call.index] = call.function.name
                    else:
                        assert call.function and call.function.name is None and call.index in names
                        args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
                finish = choice.finish_reason or finish
            assert finish == "tool_calls" and names
            for index, name in names.items():
                jsonschema.validate(json.loads(args[index]), SCHEMAS[name])
                calls += 1
    assert calls >= 100


async def test_a_named_function_not_streamed(tool_server: Running) -> None:
    async with sdk(tool_server) as client:
        reply = await client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, temperature=1.0, seed=3, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


async def test_a_call_cut_by_max_tokens_is_in_the_whole_reply_as_it_streamed(tool_server: Running) -> None:
    """A reply cut inside its call ends with `length`; not streamed, its message still carries the call as far as
    it was written (id, name, arguments so far), as the stream gave it."""
    request: dict[str, Any] = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                               "temperature": 1.0, "seed": 2, "max_tokens": 18}
    async with sdk(tool_server) as client:
        whole = await client.chat.completions.create(**request)
        name, arguments, finish = None, "", None
        async for chunk in await client.chat.completions.create(**request, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or []:
                assert delta.function is not None and delta.index == 0
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    choice = whole.choices[0]
    assert choice.finish_reason == finish == "length" and choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and (call.function.name, call.function.arguments) == (name, arguments)
    assert arguments.startswith("{") and not arguments.endswith("}")  # cut inside its arguments


async def test_auto_and_none_write_text_and_a_tool_result_turn_is_accepted(tool_server: Running) -> None:
    async with sdk(tool_server) as client:
        for choice in ("auto", "none"):
            reply = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                         temperature=0, max_tokens=20)
            first = reply.choices[0]
            if first.message.tool_calls:  # auto may call: then the call is valid
                assert choice == "auto" and first.finish_reason == "tool_calls"
                for call in first.message.tool_calls:
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            else:
                assert first.finish_reason in ("stop", "length") and first.message.content
        history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": '{"temperature": 21}'}]
        reply = await client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none",
                                                     temperature=0, max_tokens=8)
        assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")


async def test_the_plain_format_on_the_shipped_pair(client: openai.AsyncOpenAI) -> None:
    """A model without a chat template gets the tools described in its prompt and the same tags, constrained."""
    for seed in range(3):
        reply = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                     temperature=1.0, seed=seed, max_tokens=200,
                                                     parallel_tool_calls=False)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "declared twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     'tools[0].function.parameters must describe a JSON object (type "object")'),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "properties": {
                                                      "a": {"type": "strange"}}}}}]},
     "tools[0].function.parameters: failed to compile JSON schema"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strange"}}}}}]}, "tools[2].function.parameters: failed to compile JSON schema: Invalid type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "exclusive"),
])
async def test_bad_tools_are_400_naming_the_field(http: httpx2.AsyncClient, body: dict[str, Any], param: str) -> None:
    response = await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]


def hostile_schemas() -> dict[str, dict[str, Any]]:
    """The hostile schemas `tools/hostile_latency.py` measures a stream beside (one list for the test and the tool)."""
    spec = importlib.util.spec_from_file_location("specrpc_hostile_latency",
                                                  Path(__file__).parents[1] / "tools" / "hostile_latency.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.HOSTILE)


HOSTILE = hostile_schemas()


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_tool_schemas_are_served_or_refused(http: httpx2.AsyncClient, name: str) -> None:
    """Served (a call that validates) or refused with 400 naming the problem; never a 500, never a hang. The server
    enforces the one-second budget itself (COMPILE_BUDGET_S); the bound here only catches a hang on a loaded box."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": HOSTILE[name]}}]
    started = time.perf_counter()
    response = await http.post("/v1/chat/completions", json={
        "model": "m", "messages": ASK, "tools": tools, "tool_choice": "required", "max_tokens": 64}, timeout=60)
    assert time.perf_counter() - started < 30
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["code"] in ("invalid_schema", "invalid_value") and error["message"]
    if name == "huge enum":  # its declaration is longer than the context: refused, never cut
        assert response.status_code == 400 and response.json()["error"]["message"].startswith("tools: ")


def enum_tool(values: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"e": {"enum": [f"value-{i}" for i in range(values)]}}}}}]


def prompt_tokens(rt: Runtime, text: str, tools: list[dict[str, Any]]) -> int:
    """Tokens of the chat prompt the edge builds for one user message and `tools` (parsed as chat_tools does)."""
    declared = [Tool("f", "", json.dumps(t["function"]["parameters"])) for t in tools]
    return len(render(rt, [Message("user", text)], True, declared))


async def test_a_declaration_just_within_the_context_is_served_and_one_just_over_is_refused(
        http: httpx2.AsyncClient, server: Running) -> None:
    """The prompt's room exactly is served; one token more is refused naming `tools` (counted by tokenizing: the
    floor is far below the count there)."""
    rt = server.runtime
    room = prompt_room(rt.context_limit, rt.config.limits)
    low, high = 1, 2000  # the most enum values whose prompt fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if prompt_tokens(rt, "Weather?", enum_tool(mid)) <= room else (low, mid - 1)
    tools, text = enum_tool(low), "Weather?"
    while prompt_tokens(rt, text + " ok", tools) <= room:
        text += " ok"
    assert prompt_tokens(rt, text, tools) == room < prompt_tokens(rt, text + " ok", tools)
    for message, status in ((text, 200), (text + " ok", 400)):
        response = await http.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": message}], "tools": tools, "max_tokens": 1})
        assert response.status_code == status, response.text
    assert response.json()["error"]["message"].startswith(f"tools: the declarations with the system prompt and the "
                                                          f"newest message take {room + 1} prompt tokens")


@pytest.fixture
def tokenized(server: Running, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every text the served runtime tokenizes from now on."""
    rt, seen = server.runtime, []

    def counting(tokenize: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
        def counted(text: str) -> list[int]:
            seen.append(len(text))
            return tokenize(text)
        return counted

    monkeypatch.setattr(rt, "encode", counting(rt.encode))
    monkeypatch.setattr(rt, "encode_plain", counting(rt.encode_plain))
    return seen


async def test_a_declaration_far_over_the_context_is_refused_without_tokenizing_it(
        http: httpx2.AsyncClient, stub: pb_grpc.GeneratorStub, tokenized: list[int]) -> None:
    """The 20,000-value enum renders to 290 KB, 131,000 tokens: refused on its floor alone, over HTTP and over
    Converse (declared on a turn, or at start with a system prompt), with nothing of it tokenized."""
    response = await http.post("/v1/chat/completions", json={
        "model": "m", "messages": ASK, "tools": enum_tool(20_000), "tool_choice": "required", "max_tokens": 1})
    assert response.status_code == 400 and re.match(r"tools: .* take at least \d+ prompt tokens",
                                                    response.json()["error"]["message"])
    enum = pb.Tool(name="f", parameters_json=json.dumps(enum_tool(20_000)[0]["function"]["parameters"]))
    conversation = Conversation(stub)
    await conversation.start(system="Be brief.", max_new_tokens=1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await conversation.turn_events("What is the weather in Paris?", tools=[enum])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("tools: ")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await Conversation(stub).start(system="Be brief.", tools=[enum])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("start.tools: ")
    assert max(tokenized, default=0) < 10_000


async def test_a_schema_nested_past_any_parser_is_400(http: httpx2.AsyncClient) -> None:
    body = ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": '
            '[{"type": "function", "function": {"name": "f", "parameters": ' + '{"properties": {"a": ' * 5000 + "{}"
            + "}}" * 5000 + "}}]}")
    response = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text


# ---- gRPC ------------------------------------------------------------------------------------------------------------


def grpc_tools() -> list[pb.Tool]:
    return [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                    parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS]


async def test_converse_declares_tools_streams_call_events_and_takes_results(tool_server: Running) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tool_server.port}") as channel:
        conversation = Conversation(pb_grpc.GeneratorStub(channel))
        await conversation.start(tools=grpc_tools(), tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
                                 max_new_tokens=300)
        events = await conversation.turn_events("What is the weather in Paris?",
                                                sampling=pb.SamplingParams(temperature=1.0, seed=5))
        calls = [e.tool_call for e in events if e.WhichOneof("event") == "tool_call"]
        summary = events[-1].summary
        assert calls and list(summary.tool_calls) == calls
        assert all(e.chunk.text == "" for e in events if e.WhichOneof("event") == "chunk")  # calls are not text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
        events = await conversation.turn_events('{"temperature": 21}', role="tool", tool_call_id=calls[0].id,
                                                tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
                                                max_new_tokens=6)
        assert not [e for e in events if e.WhichOneof("event") == "tool_call"]
        assert events[-1].summary.reply_text
        await conversation.close()


async def test_a_converse_call_cut_by_the_token_limit_stays_in_the_summary_and_the_history(tool_server: Running
                                                                                            ) -> None:
    """A reply whose call the token limit cuts short: the summary's last call is that call as far as it was written
    (its arguments not yet JSON), with no tool_call event, and the history keeps it as the model wrote it, as HTTP's
    message does, rather than an empty reply."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tool_server.port}") as channel:
        for limit in (12, 16, 20, 28):  # the first limit that ends inside the arguments (the name written)
            conversation = Conversation(pb_grpc.GeneratorStub(channel))
            started = await conversation.start(tools=grpc_tools(), max_new_tokens=limit,
                                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))
            events = await conversation.turn_events("What is the weather in Paris?")
            summary = events[-1].summary
            announced = [e.tool_call for e in events if e.WhichOneof("event") == "tool_call"]
            if len(summary.tool_calls) > len(announced):
                break
            await conversation.close()
        else:
            pytest.fail("no limit cut a call inside its arguments")
        # the conversation goes on over the cut call (its arguments rendered as the text they are)
        after = await conversation.turn_events("Never mind.", max_new_tokens=4,
                                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))
        assert after[-1].summary.turn_index == 1 and after[-1].summary.generation.completion_tokens
        await conversation.close()
    assert summary.generation.finish_reason == pb.FINISH_REASON_LENGTH
    cut = summary.tool_calls[-1]
    assert list(summary.tool_calls[:-1]) == announced and cut.name in SCHEMAS and cut.id
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.arguments_json)
    state = tool_server.runtime.registry.sessions[started.session_id].conversation
    assert state is not None
    reply = Message(*state[0][-3])  # the cut reply, before "Never mind." and its answer
    assert reply.role == "assistant" and [(c.id, c.name, c.arguments) for c in reply.tool_calls][-1] == (
        cut.id, cut.name, cut.arguments_json)


async def test_converse_refuses_bad_tools(stub: pb_grpc.GeneratorStub) -> None:
    conversation = Conversation(stub)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await conversation.start(tools=[pb.Tool(name="f", parameters_json="[]")])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "start.tools[0].function.parameters" in (caught.value.details() or "")


def test_a_recursive_schema_keeps_its_definitions() -> None:
    """`$defs` move to the call's root, where the parameters' `#/$defs/…` references find them."""
    tool = Tool("f", "", json.dumps(HOSTILE["recursive ref"]))
    schema = call_schema(tool)
    assert schema["$defs"] == HOSTILE["recursive ref"]["$defs"] and "$defs" not in schema["properties"]["arguments"]


async def test_converse_takes_the_results_of_parallel_calls_in_one_turn(tool_server: Running) -> None:
    """A reply's two calls answered in one turn: both results enter the history in order (one `<tool_response>`
    each in the template's tool block) and one reply follows (the stream then ends without another)."""
    rt, tools = tool_server.runtime, grpc_tools()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tool_server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for seed in range(12):  # a random model makes several calls about one reply in two
            conversation = Conversation(stub)
            started = await conversation.start(tools=tools, max_new_tokens=300,
                                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))
            events = await conversation.turn_events("What is the weather in Paris, and the time there?",
                                                    sampling=pb.SamplingParams(temperature=1.0, seed=seed))
            calls = list(events[-1].summary.tool_calls)
            if len(calls) >= 2:
                break
            await conversation.close()
        assert len(calls) >= 2, "no reply made several calls"
        results = [pb.ToolResult(tool_call_id=c.id, text=json.dumps({"result": i})) for i, c in enumerate(calls)]
        events = await conversation.turn_events("", tool_results=results, max_new_tokens=6,
                                                tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))
        assert events[-1].summary.turn_index == 1 and events[-1].summary.reply_text
        await conversation.close()  # reads EOF: no second reply
    state = rt.registry.sessions[started.session_id].conversation
    assert state is not None
    history = [Message(*m) for m in state[0]]
    assert [(m.role, m.tool_call_id) for m in history[2:2 + len(calls)]] == [("tool", c.id) for c in calls]
    text = rt.tokenizer.decode(render(rt, history[:2 + len(calls)], True,
                                      [Tool(t.name, t.description, t.parameters_json) for t in tools]))
    block = "\n".join(f'<tool_response>\n{{"result": {i}}}\n</tool_response>' for i in range(len(calls)))
    assert f"</tool_call><|im_end|>\n<|im_start|>user\n{block}<|im_end|>\n<|im_start|>assistant\n" in text


@pytest.mark.parametrize(("turn", "field"), [
    (pb.Turn(tool_results=[pb.ToolResult(tool_call_id="call_1", text="1"), pb.ToolResult(text="2")]),
     "turn.tool_results[1].tool_call_id"),
    (pb.Turn(role="user", tool_results=[pb.ToolResult(tool_call_id="call_1", text="1")]), "turn.role"),
    (pb.Turn(text="hi", tool_results=[pb.ToolResult(tool_call_id="call_1", text="1")]), "turn.text"),
    (pb.Turn(tool_call_id="call_1", tool_results=[pb.ToolResult(tool_call_id="call_1", text="1")]),
     "turn.tool_call_id"),
    (pb.Turn(tool_results=[pb.ToolResult(tool_call_id=f"call_{i}", text="1") for i in range(256)]),
     "turn.tool_results and the system prompt are 257 messages"),
    (pb.Turn(tool_results=[pb.ToolResult(tool_call_id=f"call_{i}", text="x" * 600_000) for i in range(2)]),
     "turn.tool_results and the system prompt have"),
], ids=["no call id", "user role", "text", "tool_call_id", "too many", "too large"])
async def test_converse_refuses_bad_tool_results_naming_the_field(stub: pb_grpc.GeneratorStub, turn: pb.Turn,
                                                                  field: str) -> None:
    conversation = Conversation(stub)
    await conversation.start(system="Be brief.")
    await conversation.send(turn=turn)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await conversation.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (caught.value.details() or ""), caught.value.details()
