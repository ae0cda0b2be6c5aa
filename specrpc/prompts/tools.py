"""Tool calls, without a wire format: the declared functions, how a model writes a call (the Hermes / Qwen2.5
`<tool_call>{"name": …, "arguments": …}</tool_call>` format, recognised from the chat template, or the same tags
described in the system prompt for models whose template does not speak of tools), the grammar that makes a call's
arguments follow its function's JSON schema, and the parser that turns the streamed reply into text and calls.

Both edges use it: HTTP chat completions (`tools`, `tool_choice`) and gRPC Converse (tool declarations, tool-call
events). Pure text: no torch, no grpc.

`tool_choice: auto` uses a lazy grammar (llguidance's lazy lexeme, its documented pattern for tool calling), not a
grammar alternation that decides at the first token: the model writes free text, and once that text reaches the
call marker the rest is forced to a valid call. An alternation would have to choose "text or call" before the marker
is written, which either forbids text that merely starts like a call or lets a call's JSON run unconstrained."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,4}"
"""Whitespace a call's JSON may have between tokens: bounded, as for response_format (engine/constraint.py)."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
"""A function name as OpenAI accepts it: letters, digits, `_`, `.` and `-`, at most 64."""

MAX_TOOLS = 128
"""Most functions one request declares (OpenAI's limit)."""

ChoiceMode = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and parameters (a JSON Schema object, as JSON text so
    the declaration is hashable and compiles to the same cached grammar). `strict`: the schema compiles strictly
    (unsupported keywords refused); otherwise leniently, as OpenAI treats tools without `strict`."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """OpenAI's declaration shape, which chat templates render (`apply_chat_template(tools=…)`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`auto` (text or calls), `none` (text only), `required` (at least one call) or `function` (a call of
    `name`)."""

    mode: ChoiceMode = "auto"
    name: str = ""


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote (or, in a history, one it wrote before): its id, function and arguments (JSON text)."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """An id for a call, in OpenAI's `call_…` form."""
    return "call_" + uuid.uuid4().hex[:24]


class InvalidTools(ValueError):
    """A tool declaration or choice the client must change (INVALID_ARGUMENT / 400)."""


def check_tools(tools: Sequence[Tool], choice: ToolChoice, field_name: str = "tools") -> None:
    """Names well formed and distinct, parameters a JSON object, a named choice among the tools, a choice other than
    `none` only with tools."""
    if len(tools) > MAX_TOOLS:
        raise InvalidTools(f"{field_name}: at most {MAX_TOOLS} functions; got {len(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not NAME_PATTERN.fullmatch(tool.name):
            raise InvalidTools(f"{field_name}[{i}].function.name {tool.name[:80]!r} must be 1 to 64 letters, digits, "
                               f"'_', '.' or '-'")
        if tool.name in seen:
            raise InvalidTools(f"{field_name}[{i}].function.name {tool.name!r} is declared twice; names must differ")
        seen.add(tool.name)
        try:
            parameters = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise InvalidTools(f"{field_name}[{i}].function.parameters is not JSON: {exc}") from None
        if not isinstance(parameters, dict):
            raise InvalidTools(f"{field_name}[{i}].function.parameters must be a JSON Schema object")
    if choice.mode in ("required", "function") and not tools:
        raise InvalidTools(f"tool_choice {choice.mode!r} needs {field_name}: declare at least one function")
    if choice.mode == "function" and choice.name not in seen:
        raise InvalidTools(f"tool_choice names {choice.name[:80]!r}, which is not among {field_name}; name a "
                           f"declared function")


# ---- formats ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes calls: each call is `open` + `{"name": …, "arguments": …}` + `close`, several calls
    joined by `separator`. `native`: the chat template renders tools, calls and results itself; otherwise the
    tools are described in the system prompt (`tools_prompt`), calls are written into the assistant's text and tool
    results become user messages wrapped in `<tool_response>` tags. `marker_tokens`: the tokenizer has the
    markers (`<tool_call>`, `</tool_call>`) as tokens of their own, as Qwen2.5's has; the grammar then names them as
    tokens (llguidance treats added `<…>` tokens as special, so their text spelled as a string would not match)."""

    name: str
    open: str = "<tool_call>\n"
    close: str = "\n</tool_call>"
    separator: str = "\n"
    native: bool = False
    marker_tokens: bool = False

    @property
    def trigger(self) -> str:
        """The text that starts a call (what the lazy grammar waits for)."""
        return self.open.strip()

    @property
    def closer(self) -> str:
        """The text that ends a call."""
        return self.close.strip()

    def write(self, call: ToolCall) -> str:
        """A call as the model writes it (for histories rendered without the template's help)."""
        return f'{self.open}{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}{self.close}'


HERMES = ToolFormat("hermes", native=True)
"""Hermes / Qwen2.5: `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, rendered by the template."""

PLAIN = ToolFormat("plain")
"""The documented default for models whose chat template does not speak of tools (or that have none): the same
tags, with the functions described in the system prompt by `tools_prompt`."""


def detect_format(chat_template: str | None, added_tokens: Collection[str] = ()) -> ToolFormat:
    """The format a chat template uses: Hermes when it writes `<tool_call>` tags and renders `tools`, else PLAIN;
    with `marker_tokens` when the markers are among the tokenizer's `added_tokens`."""
    fmt = HERMES if chat_template and "<tool_call>" in chat_template and "tools" in chat_template else PLAIN
    return replace(fmt, marker_tokens=fmt.trigger in added_tokens and fmt.closer in added_tokens)


def tools_prompt(tools: Sequence[Tool], fmt: ToolFormat) -> str:
    """The functions and how to call them, for a system prompt (PLAIN format)."""
    lines = "\n".join(json.dumps(tool.openai()) for tool in tools)
    return (f"# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>\n{lines}\n</tools>\n\n"
            f"To call a function, write a JSON object with its name and arguments within tags:\n"
            f'{fmt.open}{{"name": <function-name>, "arguments": <args-json-object>}}{fmt.close}')


# ---- the grammar -----------------------------------------------------------------------------------------------------


def lark_string(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text)


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema of one call's object: the function's name, then its arguments (llguidance keeps the order of
    `properties`, so the name is written first and a stream can announce the call before its arguments). The
    parameters' `$defs` and `definitions` move to the root, where their `#/$defs/…` references point."""
    parameters = json.loads(tool.parameters)
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, "lenient": not tool.strict},
    }


def tool_grammar(tools: Sequence[Tool], choice: ToolChoice, parallel: bool, fmt: ToolFormat) -> str | None:
    """The Lark grammar (llguidance's dialect) a reply must match, or None for free text (`none`, or no tools).
    `required` and a named function: calls only; `auto`: any text, and once it reaches the call marker, calls. With
    `parallel`, calls may follow one another (joined by the format's separator); else one call."""
    if choice.mode == "none" or not tools:
        return None
    chosen = [t for t in tools if t.name == choice.name] if choice.mode == "function" else list(tools)
    rules = [f"fn_{i}: %json {json.dumps(call_schema(tool))}" for i, tool in enumerate(chosen)]
    body = " | ".join(f"fn_{i}" for i in range(len(chosen)))
    more = f" ({lark_string(fmt.separator)} call)*" if parallel else ""
    inner = f"{lark_string(fmt.open[len(fmt.trigger):])} body {lark_string(fmt.close[:-len(fmt.closer)])}"
    if fmt.marker_tokens:  # the markers are tokens: text is any text that does not spell the marker
        call = [f"call: {fmt.trigger} {inner} {fmt.closer}"]
        auto = [f"start: TEXT | TEXT call{more}",
                f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(fmt.trigger)}(?s:.*)/"]
    else:  # the markers are text: a lazy lexeme ends the free text at the first marker
        call = [f"call: {lark_string(fmt.trigger)} rest", f"rest: {inner} {lark_string(fmt.closer)}"]
        auto = [f"start: TEXT | head rest{more}", f"head[lazy]: TEXT {lark_string(fmt.trigger)}",
                r"TEXT: /(.|\n)*/"]
    start = auto if choice.mode == "auto" else [f"start: call{more}"]
    return "\n".join(["%llguidance {}", *start, *call, f"body: {body}", *rules, ""])


# ---- reading the reply -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextPart:
    """Reply text outside calls."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    """A call's name is known (OpenAI's first tool_calls delta)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPart:
    """More of a call's arguments JSON."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnded:
    """A call is complete (gRPC's tool-call event)."""

    index: int
    call: ToolCall


ReplyPart = TextPart | CallStarted | ArgumentsPart | CallEnded

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallParser:
    """Splits a reply streamed in pieces into text and calls, as soon as each part is known: a call is announced
    once its name is complete, its arguments streamed as they arrive, and it ends at the close marker. Text that may
    be the start of a call marker is held until it is known not to be; whitespace between calls is dropped. Fed in
    order by one stream; pieces may split anywhere (several tokens of one speculative step, or half a marker)."""

    fmt: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _state: Literal["text", "head", "arguments", "tail"] = "text"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _started: bool = False
    _id: str = ""
    _name: str = ""
    _args: list[str] = field(default_factory=list)

    @property
    def text(self) -> bool:
        """Whether the parser is outside a call (what it holds is text)."""
        return self._state == "text"

    def feed(self, piece: str) -> list[ReplyPart]:
        """The parts `piece` completes."""
        self._buffer += piece
        parts: list[ReplyPart] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            handler = {"text": self._text, "head": self._head, "arguments": self._arguments, "tail": self._tail}
            parts += handler[self._state]()
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return parts

    def finish(self) -> list[ReplyPart]:
        """The rest at the end of the reply: held text (a call cut short stays as streamed so far)."""
        parts: list[ReplyPart] = []
        if self._state == "text" and self._buffer and (self._buffer.strip() or not self.calls):
            parts.append(TextPart(self._buffer))
        self._buffer = ""
        return parts

    def _text(self) -> list[ReplyPart]:
        trigger = self.fmt.trigger
        at = self._buffer.find(trigger)
        if at >= 0:
            text, self._buffer = self._buffer[:at], self._buffer[at + len(trigger):]
            self._state = "head"
            return [TextPart(text)] if text and (text.strip() or not self.calls) else []
        keep = next((n for n in range(min(len(trigger) - 1, len(self._buffer)), 0, -1)
                     if trigger.startswith(self._buffer[-n:])), 0)
        text = self._buffer[:len(self._buffer) - keep]
        if self.calls and not text.strip():
            return []  # whitespace after a call: dropped unless text follows (kept in the buffer until then)
        self._buffer = self._buffer[len(text):]
        return [TextPart(text)] if text else []

    def _head(self) -> list[ReplyPart]:
        match = _HEAD.match(self._buffer)
        if match is None:
            return []
        self._name = json.loads(match.group(1))
        self._id = new_call_id()
        self._buffer = self._buffer[match.end():]
        self._state, self._depth, self._in_string, self._escaped, self._started = "arguments", 0, False, False, False
        self._args = []
        return [CallStarted(len(self.calls), self._id, self._name)]

    def _scan(self) -> tuple[str, bool]:
        """The leading part of the buffer that belongs to the arguments value, and whether the value is complete."""
        for i, ch in enumerate(self._buffer):
            if not self._started:
                if ch.isspace():
                    continue
                self._started = True
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._buffer[:i + 1], True
        return self._buffer, False

    def _arguments(self) -> list[ReplyPart]:
        taken, complete = self._scan()
        self._buffer = self._buffer[len(taken):]
        taken = taken.lstrip() if not "".join(self._args) else taken
        parts: list[ReplyPart] = [ArgumentsPart(len(self.calls), taken)] if taken else []
        self._args.append(taken)
        if complete:
            self._state = "tail"
        return parts

    def _tail(self) -> list[ReplyPart]:
        close = self.fmt.closer
        at = self._buffer.find(close)
        if at < 0:
            return []
        self._buffer = self._buffer[at + len(close):]
        call = ToolCall(self._id, self._name, "".join(self._args))
        self.calls.append(call)
        self._state = "text"
        return [CallEnded(len(self.calls) - 1, call)]
