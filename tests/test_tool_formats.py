"""Tool-call formats (prompts/tool_formats.py, and the grammar and parser of prompts/tools.py in each): recognised from
published chat templates or named by --tool-format; Llama 3 JSON and Mistral `[TOOL_CALLS]` calls parsed whole and
streamed in pieces; grammars that force each format's calls; histories with calls and results rendered through the
templates; `tool_choice: required` at T = 1 over HTTP from random-weight checkpoints (`llama3_tool_server`,
`mistral_tool_server`), every call valid."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import ALTERNATING_TEMPLATE, LLAMA3_TOOLS_TEMPLATE, MISTRAL_TEMPLATE, QWEN_TEMPLATE
from service_helpers import base_url

from specrpc.config import build_config
from specrpc.edges.conversation import render, tool_format
from specrpc.edges.history import Message
from specrpc.edges.server import Running
from specrpc.engine.constraint import ConstraintSpec, GrammarCompiler
from specrpc.prompts.tool_formats import LLAMA3, MISTRAL, MISTRAL_ARGS, ToolFormat, detect_format
from specrpc.prompts.tools import (
    ArgumentsPart,
    CallStarted,
    TextPart,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    grammar_text,
    tool_grammar,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}}
                    for n, s in SCHEMAS.items()]
DECLARED = [Tool(n, "", json.dumps(s)) for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def template(path: Path) -> str:
    return str(json.loads(path.read_text())["chat_template"])


# ---- recognition -----------------------------------------------------------------------------------------------------


def test_formats_are_recognised_from_published_templates_and_their_tokens() -> None:
    hermes = detect_format(template(QWEN_TEMPLATE), {"<tool_call>": 7, "</tool_call>": 8})
    assert (hermes.name, hermes.native, hermes.tokens) == ("hermes", True, (("<tool_call>", 7), ("</tool_call>", 8)))
    mistral = detect_format(template(MISTRAL_TEMPLATE), {"[TOOL_CALLS]": 5})
    assert mistral == replace(MISTRAL, native=True, tokens=(("[TOOL_CALLS]", 5),))
    assert detect_format(template(MISTRAL_TEMPLATE), {"[TOOL_CALLS]": 5, "[ARGS]": 32}).name_args == "[ARGS]"
    llama = detect_format(LLAMA3_TOOLS_TEMPLATE, {"<|python_tag|>": 9})
    assert (llama.name, llama.native, llama.key, llama.shown) == ("llama3", True, "parameters", frozenset())
    for no_tools in (ALTERNATING_TEMPLATE, None):  # a template that does not speak of tools, or none
        assert (detect_format(no_tools, {}).name, detect_format(no_tools, {}).native) == ("plain", False)


def test_the_flag_overrides_the_template() -> None:
    assert detect_format(template(QWEN_TEMPLATE), {}, "llama3").key == "parameters"
    forced = detect_format(template(QWEN_TEMPLATE), {}, "plain")
    assert (forced.name, forced.native) == ("plain", False)
    assert build_config(None, env={"SPECRPC_TOOL_FORMAT": "mistral"}).engine.tool_format == "mistral"
    with pytest.raises(ValueError, match="--tool-format must be one of auto, hermes, llama3, mistral, plain"):
        build_config(None, env={"SPECRPC_TOOL_FORMAT": "chatml"})


# ---- the parser ------------------------------------------------------------------------------------------------------


ARGS = '{"city": "Pa}r\\"is", "n": [1, {"a": 2}]}'
READS: list[tuple[ToolFormat, str, str, list[tuple[str, str]]]] = [
    (LLAMA3, '{"name": "get_weather", "parameters": ' + ARGS + "}", "", [("get_weather", ARGS)]),
    (LLAMA3, 'Sure: {"name": "get_weather"} is a call.', 'Sure: {"name": "get_weather"} is a call.', []),
    (MISTRAL, 'Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + ARGS
     + '}, {"name": "get_time", "arguments": {}}]', "Let me look.", [("get_weather", ARGS), ("get_time", "{}")]),
    (MISTRAL, "A [TOOL list] is no call.", "A [TOOL list] is no call.", []),
    (MISTRAL_ARGS, "[TOOL_CALLS]get_weather[ARGS]" + ARGS + "[TOOL_CALLS]get_time[ARGS]{}", "",
     [("get_weather", ARGS), ("get_time", "{}")]),
]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("fmt", "reply", "text", "calls"), READS,
                         ids=["llama3-call", "llama3-text", "mistral-list", "mistral-text", "mistral-args"])
def test_calls_are_read_in_each_format_from_a_reply_split_anywhere(
        fmt: ToolFormat, reply: str, text: str, calls: list[tuple[str, str]], seed: int) -> None:
    rng = random.Random(seed)
    parser, parts, i = ToolCallParser(fmt), [], 0
    while i < len(reply):
        n = rng.randint(1, 9) if seed else len(reply)  # seed 0: the whole reply at once
        parts += parser.feed(reply[i:i + n])
        i += n
    parts += parser.finish()
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == text
    args: dict[int, str] = {}
    for p in parts:
        if isinstance(p, ArgumentsPart):
            args[p.index] = args.get(p.index, "") + p.text
    assert [(c.name, c.arguments) for c in parser.calls] == calls == [(c.name, args[n])
                                                                       for n, c in enumerate(parser.calls)]
    starts = [p for p in parts if isinstance(p, CallStarted)]
    assert [s.id for s in starts] == [c.id for c in parser.calls]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parser.calls) if fmt.short_ids else True


# ---- grammars and histories, with each family's tokens ---------------------------------------------------------------


def constrained(rt: Any, choice: ToolChoice, parallel: bool) -> Any:
    fmt = tool_format(rt)
    grammar = grammar_text(tool_grammar(DECLARED, choice, parallel, fmt) or [])
    return rt.grammars.compile(ConstraintSpec("grammar", grammar)).start()


def test_llama3_grammars_force_one_json_call_or_text(llama3_tool_server: Running) -> None:
    rt = llama3_tool_server.runtime
    good = rt.encode_plain('{"name": "get_time", "parameters": {"zone": "UTC"}}')
    required = constrained(rt, ToolChoice("required"), True)
    assert required.valid_prefix(good) == len(good)
    tagged = rt.encode_plain("<|python_tag|>") + good
    assert len(tagged) == len(good) + 1 and required.valid_prefix(tagged) == len(tagged)
    for bad in ('{"name": "get_time", "arguments": {"zone": "UTC"}}', "Hello"):
        assert required.valid_prefix(rt.encode_plain(bad)) < len(rt.encode_plain(bad))
    two = rt.encode_plain('{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": '
                          '{"zone": "CET"}}')
    assert required.valid_prefix(two) < len(two)  # one call per message, as the template renders them
    auto = constrained(rt, ToolChoice("auto"), True)
    text = rt.encode_plain("It is sunny.")
    assert auto.valid_prefix(text) == len(text) and auto.valid_prefix(good) == len(good)
    not_a_call = rt.encode_plain('{"city": "Paris"}')
    assert auto.valid_prefix(not_a_call) < len(not_a_call)  # a reply that opens with `{` is a call
    spaced = rt.encode_plain('\n {"name": "undeclared", "parameters": {}}')
    assert auto.valid_prefix(spaced) < len(spaced)  # so is one that opens with whitespace, then `{`
    spaced_text = rt.encode_plain("\n It is sunny.")
    assert auto.valid_prefix(spaced_text) == len(spaced_text)


def test_mistral_grammars_force_a_call_list_after_the_marker_token(mistral_tool_server: Running) -> None:
    rt = mistral_tool_server.runtime
    fmt = tool_format(rt)
    assert fmt.native and fmt.joiner == ", " and fmt.shown == {rt.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")}
    one = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    good, two = (rt.encode_plain(f"[TOOL_CALLS] [{calls}]") for calls in (one, f"{one}, {one}"))
    required = constrained(rt, ToolChoice("required"), True)
    assert required.valid_prefix(good) == len(good) and required.valid_prefix(two) == len(two)
    assert constrained(rt, ToolChoice("required"), False).valid_prefix(two) < len(two)
    wrong = rt.encode_plain('[TOOL_CALLS] [{"name": "get_date", "arguments": {}}]')
    assert required.valid_prefix(wrong) < len(wrong)
    auto = constrained(rt, ToolChoice("auto"), True)
    text = rt.encode_plain("One moment. ")
    assert auto.valid_prefix(text + good) == len(text + good)
    assert auto.valid_prefix(text + wrong) < len(text + wrong)


def test_mistral_v11_grammars_force_name_args_calls(mistral_tool_server: Running) -> None:
    """With `[ARGS]` in the vocabulary (Mistral's tokenizer v11 and later) calls are `[TOOL_CALLS]name[ARGS]{…}`, one
    after another."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(mistral_tool_server.runtime.config.engine.target) / "tokenizer.json"))
    tok.add_special_tokens(["[ARGS]"])
    ids = {m: tok.token_to_id(m) for m in ("[TOOL_CALLS]", "[ARGS]")}
    fmt = detect_format(template(MISTRAL_TEMPLATE), ids)
    assert fmt.name_args == "[ARGS]" and fmt.shown == set(ids.values())
    compiler = GrammarCompiler.from_tokenizer_json(tok.to_str(), {tok.token_to_id("</s>")}, tok.get_vocab_size())

    def start(choice: ToolChoice) -> Any:
        grammar = grammar_text(tool_grammar(DECLARED, choice, True, fmt) or [])
        return compiler.compile(ConstraintSpec("grammar", grammar)).start()

    one = '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    two, wrong = tok.encode(one + one).ids, tok.encode('[TOOL_CALLS]get_date[ARGS]{}').ids
    assert start(ToolChoice("required")).valid_prefix(two) == len(two)
    assert start(ToolChoice("required")).valid_prefix(wrong) < len(wrong)
    text = tok.encode("One moment. " + one).ids
    assert start(ToolChoice("auto")).valid_prefix(text) == len(text)


def test_histories_with_calls_and_results_render_through_each_template(
        llama3_tool_server: Running, mistral_tool_server: Running) -> None:
    """Calls and results reach the templates in OpenAI's shape; Mistral's, which refuses call ids other than nine
    letters and digits, gets ids derived from the client's, the same for a call and its result."""
    tools = [Tool("get_weather", "Weather in a city", json.dumps(WEATHER))]
    call = ToolCall("call_0123456789abcdef", "get_weather", '{"city": "Paris", "unit": "celsius"}')
    history = [Message("user", "Weather in Paris?"), Message("assistant", "", (call,)),
               Message("tool", '{"temperature": 21}', tool_call_id=call.id)]
    rt = llama3_tool_server.runtime
    text = rt.tokenizer.decode(render(rt, history, True, tools))
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": '
            '"Paris", "unit": "celsius"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": '
            '21}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n') in text
    rt = mistral_tool_server.runtime
    text = rt.tokenizer.decode(render(rt, history, True, tools))
    short = tool_format(rt).history_id(call.id)
    assert len(short) == 9 and short.isalnum()
    assert (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris", "unit": "celsius"}}, "id": '
            f'"{short}"}}]</s>[TOOL_RESULTS] {{"content": {{"temperature": 21}}, "call_id": "{short}"}}'
            f"[/TOOL_RESULTS]") in text
    assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"' in text


# ---- HTTP ------------------------------------------------------------------------------------------------------------


async def stream_calls(client: openai.AsyncOpenAI, seed: int, parallel: bool) -> dict[str, list[str]]:
    """One streamed `required` reply at T = 1: its calls' names and arguments, from OpenAI's deltas."""
    stream = await client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
        parallel_tool_calls=parallel, max_tokens=300, stream=True)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: list[str] = []
    finish = None
    async for chunk in stream:
        choice = chunk.choices[0]
        assert not choice.delta.content, choice.delta
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.function and call.function.name and call.index not in names
                names[call.index] = call.function.name
                ids.append(call.id)
            else:
                assert call.function is not None
                args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and names
    return {"names": [names[i] for i in sorted(names)], "args": [args[i] for i in sorted(names)], "ids": ids}


@pytest.fixture(params=["llama3", "mistral"])
def family_server(request: pytest.FixtureRequest) -> Running:
    """The llama3 and the mistral tool server in turn (set up outside the test's event loop)."""
    running: Running = request.getfixturevalue(f"{request.param}_tool_server")
    return running


async def test_required_calls_at_t1_stream_valid_in_the_models_format(family_server: Running) -> None:
    """Random weights write noise; the grammar makes every call in the family's format parse and validate, and the
    reply goes back into the history as the assistant's calls and a tool result."""
    running = family_server
    family = tool_format(running.runtime).name
    short = tool_format(running.runtime).short_ids
    async with openai.AsyncOpenAI(base_url=base_url(running) + "/v1", api_key="unused", max_retries=0) as client:
        for seed in range(6):
            got = await stream_calls(client, seed, parallel=seed % 2 == 1)
            for name, arguments in zip(got["names"], got["args"], strict=True):
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            assert all(len(i) == 9 and i.isalnum() for i in got["ids"]) if short else True
            assert len(got["names"]) == 1 if family == "llama3" else True
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                 for i, n, a in zip(got["ids"], got["names"], got["args"], strict=True)]
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
                   {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 21}'}]
        reply = await client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none",
                                                     max_tokens=4)
        assert reply.choices[0].message.tool_calls is None
