"""Conversations, without a wire format: rendering a history to a prompt (the tokenizer's chat template, else plain
`Role: text` lines), the reply stops that go with it, and the Converse state machine (a session's turns, cancel /
barge-in, rewind to what was spoken, phrase events for TTS). gRPC Converse and the HTTP chat endpoint both use it."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specrpc.edges.gateway import Gateway
from specrpc.edges.history import Message, bounded, check_role, fit, newest_results, too_long
from specrpc.edges.offload import prepared
from specrpc.edges.validation import InvalidRequest, prompt_room
from specrpc.prompts.text import PhraseSegmenter
from specrpc.prompts.tool_formats import ToolFormat, detect_format
from specrpc.prompts.tools import CallEnded, TextPart, Tool, ToolCall, ToolCallParser, ToolChoice, tools_prompt
from specrpc.serving.runtime import DecodeParams, Runtime
from specrpc.serving.scheduler import Chunk, Done

ROLE_NAMES = {"user": "User", "assistant": "Assistant", "system": "System", "tool": "Tool"}
PLAIN_USER_STOP = "\nUser:"
"""Without a chat template a reply ends where the model starts the user's next line."""


def has_template(runtime: Runtime) -> bool:
    """Whether the tokenizer brings a chat template."""
    return bool(getattr(runtime.tokenizer, "chat_template", None))


def tool_format(runtime: Runtime) -> ToolFormat:
    """How the model writes tool calls: `--tool-format`, or (auto) its chat template's (prompts/tool_formats.py)."""
    template = getattr(runtime.tokenizer, "chat_template", None)
    return detect_format(template if isinstance(template, str) else None, runtime.tokenizer.get_added_vocab(),
                         runtime.config.engine.tool_format)


def template_message(m: Message, fmt: ToolFormat) -> dict[str, Any]:
    """A message as chat templates read it (OpenAI's shape; a call's arguments as an object, which templates
    render with `tojson`, when they parse; call ids as the format's template needs them)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.tool_calls:
        out["tool_calls"] = [{"id": fmt.history_id(c.id), "type": "function",
                              "function": {"name": c.name, "arguments": arguments_value(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = fmt.history_id(m.tool_call_id)
    return out


def arguments_value(arguments: str) -> Any:
    """A call's arguments parsed (the text itself when it is not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def without_tools(messages: Sequence[Message], tools: Sequence[Tool], fmt: ToolFormat, templated: bool
                  ) -> list[Message]:
    """A history for a renderer that does not speak of tools: the functions described in the system prompt, calls
    written into the assistant's text in the format's own shape, results as `<tool_response>` messages (from the
    user where a template renders the roles, as the `tool` role there is often refused)."""
    out = [Message(m.role, m.text + ("\n" if m.text else "") + fmt.write(m.tool_calls)) if m.tool_calls else m
           for m in messages]
    out = [Message("user" if templated else "tool", f"<tool_response>\n{m.text}\n</tool_response>")
           if m.role == "tool" else m for m in out]
    if tools:
        described = tools_prompt(tools, fmt)
        if out and out[0].role == "system":
            out[0] = Message("system", f"{out[0].text}\n\n{described}")
        else:
            out.insert(0, Message("system", described))
    return out


def render(runtime: Runtime, messages: Sequence[Message], generation_prompt: bool, tools: Sequence[Tool] = ()
           ) -> list[int]:
    """Prompt ids of a history (`prompt_text` tokenized; the empty prompt for an empty history, a conversation
    started without a system prompt: templates refuse to render one)."""
    return prompt_ids(runtime, prompt_text(runtime, messages, generation_prompt, tools)) if messages else []


def prompt_text(runtime: Runtime, messages: Sequence[Message], generation_prompt: bool, tools: Sequence[Tool] = ()
                ) -> str:
    """A history's prompt text: the tokenizer's chat template when it has one (given the `tools` when it renders
    them); else one `Role: text` line per message, a reply following `Assistant:` exactly as generated (its leading
    space included), so each turn's prompt extends the previous prompt and reply token for token and the session's
    KV cache is reused. Tools, calls and results reach a renderer that does not speak of them as `without_tools`
    writes them."""
    templated = has_template(runtime)
    fmt = tool_format(runtime)
    if not fmt.native and (tools or any(m.tool_calls or m.role == "tool" for m in messages)):
        messages = without_tools(messages, tools, fmt, templated)
    if templated:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError  # transformers needs jinja2 for templates

        try:
            return str(runtime.tokenizer.apply_chat_template(
                [template_message(m, fmt) for m in messages],
                tools=[t.openai() for t in tools] if tools and fmt.native else None,
                add_generation_prompt=generation_prompt, tokenize=False))
        except TemplateSyntaxError:
            raise  # the model's template is broken: not the client's to fix
        except TemplateError as exc:  # the template's raise_exception: roles out of order, a role it lacks
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}; change their roles or "
                                 f"order") from None
    text = "".join(f"Assistant:{m.text}\n" if m.role == "assistant" else
                   f"{ROLE_NAMES.get(m.role, m.role.capitalize())}: {m.text}\n" for m in messages)
    return text + "Assistant:" if generation_prompt else text


def prompt_ids(runtime: Runtime, text: str) -> list[int]:
    """A prompt text's ids: as `apply_chat_template(tokenize=True)` tokenizes a template's text (no special tokens
    added: the template writes them), else as the tokenizer encodes plain text."""
    return runtime.encode_plain(text) if has_template(runtime) else runtime.encode(text)


def reply_stops(runtime: Runtime) -> tuple[str, ...]:
    """Stop strings a reply needs besides the request's own (the plain format's next user line)."""
    return () if has_template(runtime) else (PLAIN_USER_STOP,)


def chat_prompt(gateway: Gateway, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
    """The prompt of a whole history given at once (the HTTP chat endpoint), its oldest messages dropped when it is
    too long (history.py: the system prompt stays)."""
    for i, m in enumerate(messages):
        check_role(m.role, f"messages[{i}].role")
    keep = newest_results(messages)  # a reply's results stay together, as a Converse turn's `tool_results` do
    newest = f"messages[{len(messages) - 1}].content" if keep == 1 else f"messages[{len(messages) - keep}:]"
    return turn_prompt(gateway, messages, newest, tools, keep)[1]


def turn_prompt(gateway: Gateway, messages: Sequence[Message], newest: str, tools: Sequence[Tool] = (), keep: int = 1
                ) -> tuple[list[Message], list[int]]:
    """The messages kept (within the history limits and the prompt's room, the `keep` newest always) and their
    prompt, ending with the assistant's cue. `newest` names the newest messages' field in errors. A prompt declaring
    tools whose text alone is certainly over the room (runtime.token_floor) is refused without tokenizing it."""
    rt = gateway.runtime
    text = functools.lru_cache(maxsize=1)(lambda kept: prompt_text(rt, kept, True, tools))  # the floor's, reused
    floor = rt.token_floor
    kept, ids = fit(bounded(messages, gateway.limits, newest, keep), lambda m: prompt_ids(rt, text(tuple(m))),
                    prompt_room(rt.context_limit, gateway.limits), tools=bool(tools),
                    floor=None if floor is None else lambda m: floor.tokens(text(tuple(m))), keep=keep)
    if not ids:
        raise InvalidRequest("the chat template renders these messages as an empty prompt; send a message with text")
    return kept, ids


# ---- the events a conversation produces ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """A session is open for this conversation."""

    session_id: str
    resumed: bool
    history_tokens: int


@dataclass(frozen=True)
class Phrase:
    """A phrase of the reply, complete enough to speak."""

    text: str
    start_char: int
    end_char: int
    time_ms: float


@dataclass(frozen=True)
class ToolCalled:
    """The reply has written a complete tool call (its `index`-th)."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class TurnDone:
    """A reply has ended (finished, cancelled or stopped); `reply_text` is its text outside tool calls."""

    turn_index: int
    done: Done
    time_to_first_phrase_ms: float
    reply_text: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Rewound:
    """The last reply now keeps only what was spoken."""

    kept_chars: int
    kept_tokens: int
    history_tokens: int


Event = Started | Chunk | Phrase | ToolCalled | TurnDone | Rewound


@dataclass(frozen=True)
class TurnInput:
    """A Converse turn's new message: who speaks, the text, and for a tool's result the call it answers; or the
    results of several calls of the last reply, (call id, text) in order, one tool message each."""

    role: str
    text: str
    tool_call_id: str = ""
    tools: tuple[Tool, ...] = field(default=())
    choice: ToolChoice | None = None  # None: the session's
    results: tuple[tuple[str, str], ...] = ()

    def checked(self) -> TurnInput:
        """This turn with its role (empty: user, or tool with results), or InvalidRequest naming the wrong field:
        a role not in history.ROLES, results beside a role other than tool or beside the turn's own text or call
        id, a result without its call's id."""
        role = check_role(self.role or ("tool" if self.results else "user"), "turn.role")
        if self.results:
            if role != "tool":
                raise InvalidRequest(f"turn.role is {role!r}, but turn.tool_results are tool messages; leave "
                                     f"turn.role empty or set it to tool")
            if self.text or self.tool_call_id:
                raise InvalidRequest("turn.text and turn.tool_call_id must be empty with turn.tool_results (each "
                                     "result carries its own); send a single result in text and tool_call_id, or "
                                     "every result in tool_results")
            for i, (call_id, _text) in enumerate(self.results):
                if not call_id:
                    raise InvalidRequest(f"turn.tool_results[{i}].tool_call_id is empty; set it to the id of the "
                                         f"call (ToolCall.id) this result answers")
        return replace(self, role=role)

    def messages(self) -> list[Message]:
        """The messages this turn adds to the history, in order."""
        if self.results:
            return [Message("tool", text, tool_call_id=call_id) for call_id, text in self.results]
        return [Message(self.role, self.text, tool_call_id=self.tool_call_id)]


class Conversation:
    """One conversation stream: a session's turns, cancel (barge-in) and rewind. Actions come in through `start`,
    `turn`, `cancel`, `rewind`; events (and errors) go out through `out`, ending with None after `finish`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.runtime = gateway.runtime
        self.out: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()
        self.session_id = ""
        self.phrase_mode = False
        self.messages: list[Message] = []
        self.turn_task: asyncio.Task[None] | None = None
        self.turn_cancel = asyncio.Event()
        self.turn_index = 0
        self.last_reply = ""
        self.abandoned = False
        self.tools: tuple[Tool, ...] = ()
        self.choice = ToolChoice("none")
        self.parallel = True  # whether a reply may make several calls

    def require_started(self, action: str) -> None:
        """Every action but `start` needs the session open."""
        if not self.session_id:
            raise InvalidRequest(f"the first Converse message must be `start`; got `{action}`")

    def abandon(self) -> None:
        """The client has gone: stop the reply in flight; start no other."""
        self.abandoned = True
        self.turn_cancel.set()

    async def start(self, wanted: str, system: str, phrase_mode: bool, tools: Sequence[Tool] = (),
                    choice: ToolChoice | None = None) -> None:
        """Open (or resume) session `wanted` ('' assigns one); `system` starts a new history. `tools` (checked by the
        edge) are the functions this stream's replies may call, as `choice` says (default: auto with tools)."""
        await self.runtime.registry.wait_for_release(wanted)
        if self.session_id:
            raise InvalidRequest("start: this Converse stream already has a session; open a new stream for another")
        limit = self.gateway.limits.max_history_bytes
        if len(system.encode()) > limit:
            raise InvalidRequest(f"start.system has {len(system.encode())} bytes, over the {limit} a conversation "
                                 f"keeps (server --max-history-bytes); send a shorter system prompt")
        registry = self.runtime.registry
        resumed = bool(wanted) and wanted in registry.sessions
        session = registry.open(wanted)
        self.session_id = session.id
        self.phrase_mode = phrase_mode
        self.tools = tuple(tools)
        self.choice = choice or ToolChoice("auto" if tools else "none")
        state = session.conversation
        if resumed and state is not None:
            messages, self.turn_index, self.last_reply = state
            self.messages = [Message(*m) for m in messages]
        elif system:
            self.messages = [Message("system", system)]
        self.out.put_nowait(Started(session.id, resumed, self._history_tokens()))

    async def turn(self, message: TurnInput, params: DecodeParams) -> None:
        """Start a reply to a new message (the reply in flight is cancelled first). `params` come from the edge,
        their stops including `reply_stops` and their constraint the tools' grammar (`turn_tools`)."""
        self.require_started("turn")
        message = message.checked()
        await self.wait_turn(cancel=True)
        if self.abandoned:
            return
        self.turn_cancel = asyncio.Event()
        self.turn_task = asyncio.create_task(self._run_turn(message, params, self.turn_cancel))

    def turn_tools(self, message: TurnInput) -> tuple[tuple[Tool, ...], ToolChoice]:
        """The tools a turn's reply may call and how: the turn's own, else the stream's."""
        tools = message.tools or self.tools
        return tools, message.choice or (self.choice if not message.tools else ToolChoice("auto"))

    def cancel(self) -> None:
        """Barge-in: stop the reply in flight (it ends with its TurnDone, finish `cancelled`)."""
        self.require_started("cancel")
        self.turn_cancel.set()

    async def rewind(self, session_id: str, spoken_chars: int) -> None:
        """Keep only the first `spoken_chars` characters of the last reply (what the user heard)."""
        self.require_started("rewind")
        if session_id and session_id != self.session_id:
            raise InvalidRequest(f"rewind.session_id is {session_id!r}, but this stream's session is "
                                 f"{self.session_id!r}; leave it empty or send this session's id")
        await self.wait_turn(cancel=True)
        if not self.messages or self.messages[-1].role != "assistant":
            raise InvalidRequest("rewind: nothing to rewind, there is no reply in this session yet")
        kept = self.last_reply[:spoken_chars]
        self.messages[-1] = self.messages[-1]._replace(text=kept)
        self.last_reply = kept
        self._save()
        kept_tokens = len(self.runtime.encode_plain(kept)) if kept else 0
        await self.out.put(Rewound(len(kept), kept_tokens, len(render(self.runtime, self.messages, False,
                                                                      self.tools))))

    async def finish(self) -> None:
        """No more actions: let the reply in flight end, then end the event stream."""
        await self.wait_turn(cancel=False)
        await self.out.put(None)

    async def close(self) -> None:
        """Cancel a reply still in flight and wait until it has let go of the session."""
        await self.wait_turn(cancel=True)

    async def wait_turn(self, cancel: bool) -> None:
        """Wait for the reply in flight (cancelled first when `cancel`). asyncio.wait, unlike gather, leaves the
        turn running if this waiter is itself cancelled, so the turn always ends through its own cancel path."""
        if self.turn_task is not None and not self.turn_task.done():
            if cancel:
                self.turn_cancel.set()
            await asyncio.wait({self.turn_task})

    def _history_tokens(self) -> int:
        """The prompt tokens of the history with the stream's tools, as `start` reports them; InvalidRequest naming
        `start.tools` when the system prompt with them is certainly over the prompt's room (runtime.token_floor),
        decided without tokenizing."""
        if not self.messages:
            return 0
        text = prompt_text(self.runtime, self.messages, False, self.tools)
        floor, room = self.runtime.token_floor, prompt_room(self.runtime.context_limit, self.gateway.limits)
        if self.tools and floor is not None and self.messages[0].role == "system":
            head = text if len(self.messages) == 1 else prompt_text(self.runtime, self.messages[:1], False, self.tools)
            if (least := floor.tokens(head)) > room:
                raise too_long(f"at least {least}", room, "start.tools", "the system prompt")
        return len(prompt_ids(self.runtime, text))

    def _save(self) -> None:
        """Keep the history on the session (if it still holds a slot) for a later stream to resume."""
        session = self.runtime.registry.sessions.get(self.session_id)
        if session is not None:
            session.conversation = (list(self.messages), self.turn_index, self.last_reply)

    async def _run_turn(self, message: TurnInput, params: DecodeParams, cancel: asyncio.Event) -> None:
        try:
            await self._turn(message, params, cancel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.out.put(exc)

    async def _turn(self, message: TurnInput, params: DecodeParams, cancel: asyncio.Event) -> None:
        # the history changes only once its prompt is rendered: a turn the template refuses leaves it as it was
        tools, choice = self.turn_tools(message)
        newest = message.messages()
        history = [*self.messages, *newest]
        field_name = "turn.tool_results" if message.results else "turn.text"
        self.messages, prompt = await prepared(
            lambda: turn_prompt(self.gateway, history, field_name, tools, len(newest)),
            sum(m.size for m in history) + sum(len(t.parameters) for t in tools))
        started = time.perf_counter()
        segmenter = PhraseSegmenter() if self.phrase_mode else None
        parser = ToolCallParser(tool_format(self.runtime)) if tools and choice.mode != "none" else None
        reply: list[str] = []
        first_phrase = 0.0
        offset = 0
        done: Done | None = None
        async for event in self.gateway.stream(prompt, params, self.session_id, "Converse", cancel):
            if isinstance(event, Chunk):
                text = event.text
                if parser is not None:  # the calls' text goes out as ToolCalled events, not as reply text
                    parts = parser.feed(event.text)
                    text = "".join(p.text for p in parts if isinstance(p, TextPart))
                    event = replace(event, text=text)
                reply.append(text)
                await self.out.put(event)
                for part in parts if parser is not None else []:
                    if isinstance(part, CallEnded):
                        await self.out.put(ToolCalled(part.index, part.call))
                for phrase in segmenter.feed(text) if segmenter else []:
                    first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                    await self.out.put(self._phrase(phrase, offset, started))
                    offset += len(phrase)
            else:
                done = event
        held = "".join(p.text for p in parser.finish() if isinstance(p, TextPart)) if parser is not None else ""
        if held:  # text the parser held as a possible call marker, which the reply ended without
            reply.append(held)
            await self.out.put(Chunk(held, [], 0, time.perf_counter()))
        if segmenter is not None:
            for phrase in segmenter.feed(held):
                first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                await self.out.put(self._phrase(phrase, offset, started))
                offset += len(phrase)
            rest = segmenter.flush()
            if rest:
                first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                await self.out.put(self._phrase(rest, offset, started))
        reply_text = "".join(reply)
        # a call cut short (the token limit, a stop) stays as far as it was written, as HTTP's message gives it: the
        # history then holds what the model wrote, and the summary shows the client why the reply ended
        calls = tuple(parser.written) if parser is not None else ()
        self.messages.append(Message("assistant", reply_text, calls))
        self.last_reply = reply_text
        if done is not None:
            await self.out.put(TurnDone(self.turn_index, done, first_phrase, reply_text, calls))
        self.turn_index += 1
        self._save()

    @staticmethod
    def _phrase(text: str, offset: int, started: float) -> Phrase:
        return Phrase(text, offset, offset + len(text), (time.perf_counter() - started) * 1e3)
