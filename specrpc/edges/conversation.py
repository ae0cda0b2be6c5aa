"""Conversations, without a wire format: rendering a history to a prompt (the tokenizer's chat template, else plain
`Role: text` lines), the reply stops that go with it, and the Converse state machine (a session's turns, cancel /
barge-in, rewind to what was spoken, phrase events for TTS). gRPC Converse and the HTTP chat endpoint both use it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specrpc.edges.gateway import Gateway
from specrpc.edges.history import Message, bounded, check_role, fit
from specrpc.edges.validation import InvalidRequest, prompt_room
from specrpc.prompts.text import PhraseSegmenter
from specrpc.serving.runtime import DecodeParams, Runtime
from specrpc.serving.scheduler import Chunk, Done

ROLE_NAMES = {"user": "User", "assistant": "Assistant", "system": "System", "tool": "Tool"}
PLAIN_USER_STOP = "\nUser:"
"""Without a chat template a reply ends where the model starts the user's next line."""


def has_template(runtime: Runtime) -> bool:
    """Whether the tokenizer brings a chat template."""
    return bool(getattr(runtime.tokenizer, "chat_template", None))


def render(runtime: Runtime, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    """Prompt ids of a history: the tokenizer's chat template when it has one; else one `Role: text` line per
    message, a reply following `Assistant:` exactly as generated (its leading space included), so each turn's prompt
    extends the previous prompt and reply token for token and the session's KV cache is reused. An empty history (a
    conversation started without a system prompt) is the empty prompt: templates refuse to render one."""
    if not messages:
        return []
    tok = runtime.tokenizer
    if has_template(runtime):
        from jinja2.exceptions import TemplateError, TemplateSyntaxError  # transformers needs jinja2 for templates

        try:
            out: Any = tok.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                               add_generation_prompt=generation_prompt, tokenize=True)
        except TemplateSyntaxError:
            raise  # the model's template is broken: not the client's to fix
        except TemplateError as exc:  # the template's raise_exception: roles out of order, a role it lacks
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}; change their roles or "
                                 f"order") from None
        ids = out if isinstance(out, list) else out["input_ids"]
        return [int(i) for i in ids]
    text = "".join(f"Assistant:{t}\n" if r == "assistant" else f"{ROLE_NAMES.get(r, r.capitalize())}: {t}\n"
                   for r, t in messages)
    if generation_prompt:
        text += "Assistant:"
    return runtime.encode(text)


def reply_stops(runtime: Runtime) -> tuple[str, ...]:
    """Stop strings a reply needs besides the request's own (the plain format's next user line)."""
    return () if has_template(runtime) else (PLAIN_USER_STOP,)


def chat_prompt(gateway: Gateway, messages: Sequence[Message]) -> list[int]:
    """The prompt of a whole history given at once (the HTTP chat endpoint), its oldest messages dropped when it is
    too long (history.py: the system prompt stays)."""
    for i, (role, _text) in enumerate(messages):
        check_role(role, f"messages[{i}].role")
    return turn_prompt(gateway, messages, f"messages[{len(messages) - 1}].content")[1]


def turn_prompt(gateway: Gateway, messages: Sequence[Message], newest: str) -> tuple[list[Message], list[int]]:
    """The messages kept (within the history limits and the prompt's room) and their prompt, ending with the
    assistant's cue. `newest` names the newest message's field in errors."""
    rt = gateway.runtime
    kept, ids = fit(bounded(messages, gateway.limits, newest), lambda m: render(rt, m, True),
                    prompt_room(rt.context_limit, gateway.limits))
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
class TurnDone:
    """A reply has ended (finished, cancelled or stopped)."""

    turn_index: int
    done: Done
    time_to_first_phrase_ms: float
    reply_text: str


@dataclass(frozen=True)
class Rewound:
    """The last reply now keeps only what was spoken."""

    kept_chars: int
    kept_tokens: int
    history_tokens: int


Event = Started | Chunk | Phrase | TurnDone | Rewound


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

    def require_started(self, action: str) -> None:
        """Every action but `start` needs the session open."""
        if not self.session_id:
            raise InvalidRequest(f"the first Converse message must be `start`; got `{action}`")

    def abandon(self) -> None:
        """The client has gone: stop the reply in flight; start no other."""
        self.abandoned = True
        self.turn_cancel.set()

    async def start(self, wanted: str, system: str, phrase_mode: bool) -> None:
        """Open (or resume) session `wanted` ('' assigns one); `system` starts a new history."""
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
        state = session.conversation
        if resumed and state is not None:
            messages, self.turn_index, self.last_reply = state
            self.messages = list(messages)
        elif system:
            self.messages = [("system", system)]
        self.out.put_nowait(Started(session.id, resumed, len(render(self.runtime, self.messages, False))))

    async def turn(self, role: str, text: str, params: DecodeParams) -> None:
        """Start a reply to a new message (the reply in flight is cancelled first). `params` come from the edge,
        their stops including `reply_stops`."""
        self.require_started("turn")
        role = check_role(role or "user", "turn.role")
        await self.wait_turn(cancel=True)
        if self.abandoned:
            return
        self.turn_cancel = asyncio.Event()
        self.turn_task = asyncio.create_task(self._run_turn(role, text, params, self.turn_cancel))

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
        if not self.messages or self.messages[-1][0] != "assistant":
            raise InvalidRequest("rewind: nothing to rewind, there is no reply in this session yet")
        kept = self.last_reply[:spoken_chars]
        self.messages[-1] = ("assistant", kept)
        self.last_reply = kept
        self._save()
        kept_tokens = len(self.runtime.encode_plain(kept)) if kept else 0
        await self.out.put(Rewound(len(kept), kept_tokens, len(render(self.runtime, self.messages, False))))

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

    def _save(self) -> None:
        """Keep the history on the session (if it still holds a slot) for a later stream to resume."""
        session = self.runtime.registry.sessions.get(self.session_id)
        if session is not None:
            session.conversation = (list(self.messages), self.turn_index, self.last_reply)

    async def _run_turn(self, role: str, text: str, params: DecodeParams, cancel: asyncio.Event) -> None:
        try:
            await self._turn(role, text, params, cancel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.out.put(exc)

    async def _turn(self, role: str, text: str, params: DecodeParams, cancel: asyncio.Event) -> None:
        # the history changes only once its prompt is rendered: a turn the template refuses leaves it as it was
        self.messages, prompt = turn_prompt(self.gateway, [*self.messages, (role, text)], "turn.text")
        started = time.perf_counter()
        segmenter = PhraseSegmenter() if self.phrase_mode else None
        reply: list[str] = []
        first_phrase = 0.0
        offset = 0
        done: Done | None = None
        async for event in self.gateway.stream(prompt, params, self.session_id, "Converse", cancel):
            if isinstance(event, Chunk):
                reply.append(event.text)
                await self.out.put(event)
                for phrase in segmenter.feed(event.text) if segmenter else []:
                    first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                    await self.out.put(self._phrase(phrase, offset, started))
                    offset += len(phrase)
            else:
                done = event
        if segmenter is not None:
            rest = segmenter.flush()
            if rest:
                first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                await self.out.put(self._phrase(rest, offset, started))
        reply_text = "".join(reply)
        self.messages.append(("assistant", reply_text))
        self.last_reply = reply_text
        if done is not None:
            await self.out.put(TurnDone(self.turn_index, done, first_phrase, reply_text))
        self.turn_index += 1
        self._save()

    @staticmethod
    def _phrase(text: str, offset: int, started: float) -> Phrase:
        return Phrase(text, offset, offset + len(text), (time.perf_counter() - started) * 1e3)
