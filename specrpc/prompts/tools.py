"""Tool calls, without a wire format: the declared functions, the grammar that makes a reply's calls follow their
functions' JSON schemas in the model's own format (tool_formats.py: Hermes / Qwen2.5 tags, Llama 3 JSON, Mistral's
`[TOOL_CALLS]`, or the plain format described in the system prompt), and the parser that turns the streamed reply
into text and calls.

Both edges use it: HTTP chat completions (`tools`, `tool_choice`) and gRPC Converse (tool declarations, tool-call
events). Pure text: no torch, no grpc.

`tool_choice: auto` uses a lazy grammar (llguidance's lazy lexeme, its documented pattern for tool calling), not a
grammar alternation that decides at the first token: the model writes free text, and once that text reaches the
call marker the rest is forced to a valid call. An alternation would have to choose "text or call" before the marker
is written, which either forbids text that merely starts like a call or lets a call's JSON run unconstrained. Where
the marker is a token of its own, the text is any text that does not spell it, followed by the marker token; where
calls open the reply (Llama 3), the reply is text that does not open with `{` (past any whitespace), or a call."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from specrpc.prompts.json_layout import json_layout
from specrpc.prompts.tool_formats import ToolFormat

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
"""A function name as OpenAI accepts it: letters, digits, `_`, `.` and `-`, at most 64."""

MAX_TOOLS = 128
"""Most functions one request declares (OpenAI's limit)."""

NO_PARAMETERS = '{"type": "object", "properties": {}, "additionalProperties": false}'
"""The parameters of a function declared without any: an empty parameter list, so its call's arguments are `{}`
(as OpenAI reads an omitted `parameters`)."""

ChoiceMode = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and parameters (a JSON Schema object, as JSON text so
    the declaration is hashable and compiles to the same cached grammar). `strict`: the schema compiles strictly
    (unsupported keywords refused); otherwise leniently, as OpenAI treats tools without `strict`."""

    name: str
    description: str = ""
    parameters: str = NO_PARAMETERS
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
        if parameters.get("type", "object") != "object":
            raise InvalidTools(f"{field_name}[{i}].function.parameters must describe a JSON object (type \"object\"): "
                               f"a call's arguments are an object; got type {parameters['type']!r:.80}")
    if choice.mode in ("required", "function") and not tools:
        raise InvalidTools(f"tool_choice {choice.mode!r} needs {field_name}: declare at least one function")
    if choice.mode == "function" and choice.name not in seen:
        raise InvalidTools(f"tool_choice names {choice.name[:80]!r}, which is not among {field_name}; name a "
                           f"declared function")


def tools_prompt(tools: Sequence[Tool], fmt: ToolFormat) -> str:
    """The functions and how to call them, for a system prompt (a template that does not render tools)."""
    lines = "\n".join(json.dumps(tool.openai()) for tool in tools)
    how = ("write a JSON object with its name and arguments within tags" if fmt.trigger.startswith("<")
           else "write its name and arguments in this form")
    return (f"# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>\n{lines}\n</tools>\n\n"
            f"To call a function, {how}:\n{fmt.example()}")


# ---- the grammar -----------------------------------------------------------------------------------------------------


def lark_string(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text)


def lark_text(text: str, fmt: ToolFormat) -> str:
    """`text` as a Lark sequence: its markers that are tokens as `<[id]>` token references, the rest as strings
    (nothing for no text)."""
    parts: list[str] = []
    ids = fmt.token_ids
    while text:
        at, marker = min(((text.find(m), m) for m in ids if m in text), default=(-1, ""))
        if at < 0:
            parts.append(lark_string(text))
            break
        if at:
            parts.append(lark_string(text[:at]))
        parts.append(f"<[{ids[marker]}]>")
        text = text[at + len(marker):]
    return " ".join(parts)


def guided(schema: dict[str, Any], tool: Tool) -> dict[str, Any]:
    """`schema` with llguidance's options: the JSON layout of every grammar (json_layout.py), lenient unless the tool
    is strict."""
    return {**schema, "x-guidance": json_layout(lenient=not tool.strict)}


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema of a call's arguments: the function's parameters, an object even where they leave the type
    out (`{}`), so a call's arguments always parse as the object OpenAI's `arguments` holds."""
    return {"type": "object", **json.loads(tool.parameters)}


def call_schema(tool: Tool, key: str = "arguments") -> dict[str, Any]:
    """The JSON Schema of one call's object: the function's name, then its arguments under `key` (llguidance keeps
    the order of `properties`, so the name is written first and a stream can announce the call before its
    arguments). The parameters' `$defs` and `definitions` move to the root, where their `#/$defs/…` references
    point."""
    parameters = arguments_schema(tool)
    hoisted: dict[str, Any] = {k: parameters.pop(k) for k in ("$defs", "definitions") if k in parameters}
    return guided({
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
        **hoisted,
    }, tool)


def call_rules(i: int, tool: Tool, fmt: ToolFormat) -> list[str]:
    """The Lark rules of a call of `tool` (`fn_<i>`) in the format's shape: a JSON object, or the name, the
    format's `name_args` and the arguments object."""
    if fmt.name_args:
        arguments = guided(arguments_schema(tool), tool)
        return [f"fn_{i}: {lark_string(tool.name)} {lark_text(fmt.name_args, fmt)} args_{i}",
                f"args_{i}: %json {json.dumps(arguments)}"]
    return [f"fn_{i}: %json {json.dumps(call_schema(tool, fmt.key))}"]


def chosen_tools(tools: Sequence[Tool], choice: ToolChoice) -> list[Tool]:
    """The functions a reply may call: the named one, or all."""
    return [t for t in tools if t.name == choice.name] if choice.mode == "function" else list(tools)


GrammarLines = list[tuple[str, int | None]]
"""A grammar's lines, each with the index of the declared function whose call's rule it is (None for the rest)."""


def grammar_text(lines: GrammarLines) -> str:
    """The grammar `tool_grammar`'s lines spell."""
    return "\n".join(line for line, _ in lines)


def tool_grammar(tools: Sequence[Tool], choice: ToolChoice, parallel: bool, fmt: ToolFormat) -> GrammarLines | None:
    """The lines of the Lark grammar (llguidance's dialect) a reply must match, each with the index in `tools` of the
    function whose call's rule it is (None for the rest: a schema that does not compile is reported against that
    function's parameters, ConstraintSpec.lines), or None for free text (`none`, or no tools). `required`: calls
    only; a named function: exactly one call of it (OpenAI's forced function); `auto`: any text, and once it reaches
    the call marker, calls (for a format whose calls open the reply, Llama 3's: text that does not open with `{`, or
    a call). With `parallel` (and a format that allows it), calls may follow one another; else one call."""
    if choice.mode == "none" or not tools:
        return None
    chosen = chosen_tools(tools, choice)
    index = {t.name: i for i, t in enumerate(tools)}
    rules = [(rule, index[tool.name]) for i, tool in enumerate(chosen) for rule in call_rules(i, tool, fmt)]
    many = parallel and fmt.parallel and choice.mode != "function"
    calls = f"body ({lark_text(fmt.joiner, fmt)} body)*" if many and fmt.joiner else "body"
    more = f" ({lark_text(fmt.separator, fmt)} group)*" if many and not fmt.joiner else ""
    rest = [f"rest: {lark_text(fmt.open[len(fmt.trigger):], fmt)} {calls} {lark_text(fmt.close, fmt)}"]
    lead = f"{lark_text(fmt.lead, fmt)}? " if fmt.lead in fmt.token_ids else ""
    group = [f"group: {lead}{lark_text(fmt.trigger, fmt)} rest"]
    if choice.mode != "auto":
        start = [f"start: group{more}"]
    elif not fmt.trigger:  # calls open the reply: text is what does not open with `{`, whitespace before it too
        start = ["start: TEXT | group", r"TEXT: /\s*([^{\s](?s:.*))?/"]  # as the parser reads it
    elif fmt.trigger in fmt.token_ids:  # the marker is a token: text is any text that does not spell it
        start = [f"start: TEXT | TEXT group{more}",
                 f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(fmt.trigger)}(?s:.*)/"]
    else:  # the marker is text: a lazy lexeme ends the free text at the first marker
        start = [f"start: TEXT | head rest{more}", f"head[lazy]: TEXT {lark_string(fmt.trigger)}",
                 r"TEXT: /(.|\n)*/"]
    body = " | ".join(f"fn_{i}" for i in range(len(chosen)))
    plain = ["%llguidance {}", *start, *group, *rest, f"body: {body}"]
    return [*((line, None) for line in plain), *rules, ("", None)]


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


def loose(text: str) -> str:
    """A regex for `text` after optional whitespace, any whitespace in it matching any whitespace (or none)."""
    return r"\s*" + r"\s*".join(re.escape(part) for part in text.split())


def call_head(fmt: ToolFormat) -> str:
    """A regex for a call up to its arguments, capturing the name: `{"name": "…", "<key>": ` or `name[ARGS]`."""
    if fmt.name_args:
        return r"\s*([A-Za-z0-9_.\-]{1,64})" + loose(fmt.name_args) + r"\s*"
    return r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*' + json.dumps(fmt.key) + r"\s*:\s*"


@dataclass
class ToolCallParser:
    """Splits a reply streamed in pieces into text and calls, as soon as each part is known: a call is announced
    once its name is complete, its arguments streamed as they arrive, and it ends where the format ends it. Text
    that may be the start of a call marker is held until it is known not to be; whitespace between calls is
    dropped. A format whose calls open the reply (Llama 3) reads a reply whose first character past whitespace is
    `{` as a call, any other as text. Fed in order by one stream; pieces may split anywhere (several tokens of one
    speculative step, or half a marker)."""

    fmt: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _state: Literal["text", "head", "next", "arguments", "tail"] = "text"
    _opened: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _started: bool = False
    _id: str = ""
    _name: str = ""
    _args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        head = call_head(self.fmt)
        self._first = re.compile(loose(self.fmt.open[len(self.fmt.trigger):]) + head)
        self._next = re.compile(head)  # after a joiner (`_more` reads it)
        end = r"\s*\}" if not self.fmt.name_args else ""
        self._end = re.compile(end + loose(self.fmt.close))
        self._more = re.compile(end + loose(self.fmt.joiner)) if self.fmt.joiner else None

    @property
    def text(self) -> bool:
        """Whether the parser is outside a call (what it holds is text)."""
        return self._state == "text"

    @property
    def pending(self) -> ToolCall | None:
        """The call announced and not ended, with its arguments so far: what a reply cut short (`max_tokens`) leaves
        of its last call, as it was streamed."""
        if self._state not in ("arguments", "tail"):
            return None
        return ToolCall(self._id, self._name, "".join(self._args))

    @property
    def written(self) -> list[ToolCall]:
        """The calls as the reply wrote them: every ended one, then the one cut short (`pending`) if any."""
        pending = self.pending
        return [*self.calls, *([pending] if pending else [])]

    def feed(self, piece: str) -> list[ReplyPart]:
        """The parts `piece` completes."""
        self._buffer += piece
        parts: list[ReplyPart] = []
        while self._buffer or self._state == "tail":  # a call may end with its arguments (Llama 3, `[ARGS]`)
            before = (self._state, len(self._buffer))
            handler = {"text": self._text, "head": self._head, "next": self._head, "arguments": self._arguments,
                       "tail": self._tail}
            parts += handler[self._state]()
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return parts

    def finish(self) -> list[ReplyPart]:
        """The rest at the end of the reply: held text (a call cut short stays as streamed so far; a reply that
        opened with `{` but is no call is text)."""
        parts: list[ReplyPart] = []
        unread = self._state == "head" and not self.fmt.trigger
        if (self._state == "text" or unread) and self._buffer and (self._buffer.strip() or not self.calls):
            parts.append(TextPart(self._buffer))
        self._buffer = ""
        return parts

    def _text(self) -> list[ReplyPart]:
        if not self.fmt.trigger and not self._opened:  # the reply's opening decides: a call or text
            if not self._buffer.strip():
                return []
            self._opened = True
            if self._buffer.lstrip().startswith("{"):
                self._state = "head"
                return []
        trigger = self.fmt.trigger
        at = self._buffer.find(trigger) if trigger else -1
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
        match = (self._first if self._state == "head" else self._next).match(self._buffer)
        if match is None:
            return []
        name = match.group(1)
        self._name = json.loads(name) if name.startswith('"') else name
        self._id = self.fmt.new_id()
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
        more = self._more.match(self._buffer) if self._more is not None else None
        match = more or self._end.match(self._buffer)
        if match is None:
            return []
        self._buffer = self._buffer[match.end():]
        call = ToolCall(self._id, self._name, "".join(self._args))
        self.calls.append(call)
        self._state = "next" if more else "text"
        return [CallEnded(len(self.calls) - 1, call)]
