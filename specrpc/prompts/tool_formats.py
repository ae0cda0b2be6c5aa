"""How a model writes tool calls, as its chat template renders them: Hermes / Qwen2.5 `<tool_call>` tags, Llama 3.1's
JSON object with `"parameters"`, Mistral's `[TOOL_CALLS] [{…}, …]` list and its later `[TOOL_CALLS]name[ARGS]{…}` form,
and the plain format (Hermes' tags, described in the system prompt) for templates that do not speak of tools.
Recognised from the template text and the tokenizer's added tokens, or named by `--tool-format`. Pure text.

The grammar (tools.tool_grammar) and the streaming parser (tools.ToolCallParser) read a format's fields, so a format is
data, not code: a reply is text, then groups of calls; a group is `open`, one call (or several joined by `joiner`),
`close`; groups follow one another joined by `separator`."""

from __future__ import annotations

import hashlib
import json
import string
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

FORMAT_NAMES = ("auto", "hermes", "llama3", "mistral", "plain")
"""The values of `--tool-format` (auto: recognised from the chat template)."""

ALPHANUMERIC = string.ascii_letters + string.digits


class Call(Protocol):
    """A call as a format writes it (tools.ToolCall)."""

    @property
    def name(self) -> str:
        """The function's name."""
        ...

    @property
    def arguments(self) -> str:
        """Its arguments, JSON text."""
        ...


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes calls. A call is a JSON object `{"name": …, "<key>": {…}}`, or, with `name_args`, the bare
    name, `name_args` and the arguments object. `trigger`: the text that starts a group (empty: a call can only
    open the reply, as Llama 3's JSON calls do; `lead` may then precede it, a token the text never shows).
    `parallel`: whether one message may hold several calls (Llama 3.1's template renders one). `native`: the chat
    template renders tools, calls and results itself; otherwise the tools are described in the system prompt.
    `tokens`: the markers that are tokens of their own, with their ids (the grammar names them as tokens, since
    llguidance does not match a special token's text spelled as a string, and the reply's text shows them).
    `short_ids`: call ids of nine letters and digits, as Mistral's template requires."""

    name: str
    trigger: str = "<tool_call>"
    open: str = "<tool_call>\n"
    close: str = "\n</tool_call>"
    joiner: str = ""
    separator: str = "\n"
    key: str = "arguments"
    name_args: str = ""
    lead: str = ""
    parallel: bool = True
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")
    short_ids: bool = False
    native: bool = False
    tokens: tuple[tuple[str, int], ...] = ()

    @property
    def token_ids(self) -> dict[str, int]:
        """Marker text → its token id, for the markers that are tokens."""
        return dict(self.tokens)

    @property
    def shown(self) -> frozenset[int]:
        """Token ids the reply's text must show for the parser to find the calls (the markers but `lead`)."""
        return frozenset(i for text, i in self.tokens if text != self.lead)

    def call_text(self, call: Call) -> str:
        """One call as the model writes it."""
        if self.name_args:
            return f"{call.name}{self.name_args}{call.arguments}"
        return f'{{"name": {json.dumps(call.name)}, "{self.key}": {call.arguments}}}'

    def write(self, calls: Sequence[Call]) -> str:
        """A message's calls as the model writes them (for histories rendered without the template's help)."""
        if self.joiner:
            return self.open + self.joiner.join(self.call_text(c) for c in calls) + self.close
        return self.separator.join(self.open + self.call_text(c) + self.close for c in calls)

    def example(self) -> str:
        """How to call a function, for a system prompt."""
        if self.name_args:
            return f"{self.open}<function-name>{self.name_args}<args-json-object>{self.close}"
        return f'{self.open}{{"name": <function-name>, "{self.key}": <args-json-object>}}{self.close}'

    def new_id(self) -> str:
        """An id for a call the model wrote: OpenAI's `call_…` form, or nine letters and digits (Mistral)."""
        if self.short_ids:
            return "".join(ALPHANUMERIC[b % len(ALPHANUMERIC)] for b in uuid.uuid4().bytes[:9])
        return "call_" + uuid.uuid4().hex[:24]

    def history_id(self, call_id: str) -> str:
        """A client's call id as the template needs it: itself, or (with `short_ids`, when it is not nine letters
        and digits) nine derived from it, the same for a call and the tool result that answers it."""
        if not self.short_ids or (len(call_id) == 9 and call_id.isascii() and call_id.isalnum()):
            return call_id
        digest = hashlib.sha256(call_id.encode()).digest()
        return "".join(ALPHANUMERIC[b % len(ALPHANUMERIC)] for b in digest[:9])


HERMES = ToolFormat("hermes")
"""Hermes / Qwen2.5: `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one group per call."""

LLAMA3 = ToolFormat("llama3", trigger="", open="", close="", separator="; ", key="parameters", lead="<|python_tag|>",
                    parallel=False, markers=("<|python_tag|>",))
"""Llama 3.1 / 3.2 / 3.3 JSON calls: the reply is `{"name": …, "parameters": {…}}` (optionally after
`<|python_tag|>`), one call per message, as their templates render it; text that does not open with `{` is text."""

MISTRAL = ToolFormat("mistral", trigger="[TOOL_CALLS]", open="[TOOL_CALLS] [", close="]", joiner=", ", separator="",
                     markers=("[TOOL_CALLS]",), short_ids=True)
"""Mistral (tokenizer before v11, e.g. Mistral-7B-Instruct-v0.3): `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]`."""

MISTRAL_ARGS = ToolFormat("mistral", trigger="[TOOL_CALLS]", open="[TOOL_CALLS]", close="", separator="", key="",
                          name_args="[ARGS]", markers=("[TOOL_CALLS]", "[ARGS]"), short_ids=True)
"""Mistral (tokenizer v11 and later, whose vocabulary has `[ARGS]`): `[TOOL_CALLS]name[ARGS]{…}` for each call."""

PLAIN = replace(HERMES, name="plain")
"""The documented default for models whose chat template does not speak of tools (or that have none): Hermes' tags,
with the functions described in the system prompt (tools.tools_prompt)."""


def template_format(chat_template: str | None) -> str:
    """The format a chat template renders calls in: `[TOOL_CALLS]` is Mistral's, `<tool_call>` Hermes', an `ipython`
    role with `"parameters"` Llama 3's; plain when it renders none of them (or there is no template)."""
    if not chat_template or "tools" not in chat_template:
        return "plain"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "ipython" in chat_template and '"parameters"' in chat_template:
        return "llama3"
    return "plain"


def detect_format(chat_template: str | None, added_tokens: Mapping[str, int], name: str = "auto") -> ToolFormat:
    """The format to read and write calls in: `name` (a `--tool-format` value; auto: the template's own), native
    when the template renders tools, with the markers among the tokenizer's `added_tokens` as tokens. Mistral's
    two forms differ by the `[ARGS]` token (as vLLM tells them apart); its list opens as the template writes it
    (Mistral-Nemo's `[TOOL_CALLS][` has no space)."""
    chosen = template_format(chat_template) if name == "auto" else name
    template = chat_template or ""
    fmt = {"hermes": HERMES, "llama3": LLAMA3, "plain": PLAIN,
           "mistral": MISTRAL_ARGS if "[ARGS]" in added_tokens else
           replace(MISTRAL, open="[TOOL_CALLS][") if '"[TOOL_CALLS][' in template else MISTRAL}[chosen]
    native = chosen != "plain" and "tools" in template
    tokens = tuple((m, int(added_tokens[m])) for m in fmt.markers if m in added_tokens)
    return replace(fmt, native=native, tokens=tokens)
