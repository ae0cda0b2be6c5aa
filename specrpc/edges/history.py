"""Chat histories kept within bounds by whole messages, for gRPC Converse and the HTTP chat endpoint alike: the
oldest user, assistant and tool messages go first, in steps of STEP messages, and the system prompt stays first, so
the prompt's cached prefix (the system prompt and the messages kept) survives a trim; the newest message always
stays. Steps counted from the history's start make the cut the same for a few turns of a growing history, so an
HTTP client resending its whole history reuses the KV cache between trims as a Converse session does. A Converse turn
that adds several messages at once (the results of several tool calls) keeps all of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import NamedTuple

from specrpc.config import Limits
from specrpc.edges.validation import InvalidRequest
from specrpc.prompts.tools import ToolCall

ROLES = ("system", "user", "assistant", "tool")
STEP = 8
"""Messages dropped at a time (four turns): a trim makes room for several turns before the next one."""



class Message(NamedTuple):
    """One message of a history: its role and text; an assistant's tool calls, or the call a tool's result answers."""

    role: str
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    @property
    def size(self) -> int:
        """Bytes the history limits count: the text and the calls' names and arguments."""
        return len(self.text.encode()) + sum(len(c.name) + len(c.arguments.encode()) for c in self.tool_calls)

Render = Callable[[Sequence[Message]], list[int]]  # messages → prompt ids
Floor = Callable[[Sequence[Message]], int]  # messages → how few tokens their prompt can have, known untokenized


def check_role(role: str, name: str) -> str:
    """`role` if it is one of ROLES, else InvalidRequest naming the field `name`."""
    if role not in ROLES:
        raise InvalidRequest(f"{name} {role[:32]!r} is not supported; use one of {', '.join(ROLES)}")
    return role


def newest_results(messages: Sequence[Message]) -> int:
    """How many tool results end `messages` (at least 1: the newest message is always kept): a reply's several calls
    answered together (OpenAI's history, a Converse turn's `tool_results`) stay together."""
    n = 0
    while n < len(messages) and messages[-1 - n].role == "tool":
        n += 1
    return max(1, n)


class Trim:
    """The ways to drop the oldest messages of one history, with their sizes counted once."""

    def __init__(self, messages: Sequence[Message], keep: int = 1) -> None:
        self.messages = list(messages)
        self.keep = keep  # the newest messages, never dropped
        self.head = 1 if messages and messages[0].role == "system" else 0
        sizes = [m.size for m in reversed(messages)]
        self.tail_bytes = [*reversed(list(accumulate(sizes, initial=0)))]  # [len + 1] text bytes from message i on

    def start(self, n: int) -> int:
        """Where the kept messages resume after dropping the `n` oldest after the system prompt (never the `keep`
        newest): at a user message, as the templates that make roles alternate (Mistral's, Gemma's) require."""
        newest = len(self.messages) - self.keep
        i = min(self.head + n, max(newest, self.head))
        while i < newest and self.messages[i].role != "user":
            i += 1
        return i

    def kept(self, n: int) -> list[Message]:
        """The history less its `n` oldest messages (see `start`)."""
        return self.messages[:self.head] + self.messages[self.start(n):]

    def bytes(self, n: int) -> int:
        """Text bytes of `kept(n)`."""
        return self.tail_bytes[0] - self.tail_bytes[self.head] + self.tail_bytes[self.start(n)]

    def count(self, n: int) -> int:
        """Messages in `kept(n)`."""
        return self.head + len(self.messages) - self.start(n)


def bounded(messages: Sequence[Message], limits: Limits, newest: str, keep: int = 1) -> list[Message]:
    """`messages` within --max-history-messages and --max-history-bytes, the oldest dropped STEP at a time;
    InvalidRequest naming `newest` (the field of the `keep` newest messages) when the system prompt and they alone
    are over."""
    trim, n, most = Trim(messages, keep), 0, max(limits.max_history_messages, 2)
    while trim.count(n) > most or trim.bytes(n) > limits.max_history_bytes:
        if trim.start(n + STEP) == trim.start(n):
            if trim.count(n) > most:
                raise InvalidRequest(f"{newest} and the system prompt are {trim.count(n)} messages, over the {most} "
                                     f"a conversation keeps (server --max-history-messages); send fewer")
            raise InvalidRequest(f"{newest} and the system prompt have {trim.bytes(n)} bytes, over the "
                                 f"{limits.max_history_bytes} a conversation keeps (server --max-history-bytes); "
                                 f"send a shorter message")
        n += STEP
    return trim.kept(n)


def fit(messages: Sequence[Message], render: Render, cap: int, tools: bool = False, floor: Floor | None = None,
        keep: int = 1) -> tuple[list[Message], list[int]]:
    """The messages to keep and their prompt: all of them when their prompt has at most `cap` tokens, else with the
    oldest dropped STEP at a time until it has (how many steps is guessed from the tokens per byte of the last render,
    then checked by rendering). When the system prompt and the `keep` newest messages alone are over `cap`, their
    prompt's last `cap` tokens (the system prompt is cut from this prompt only) — unless the prompt declares `tools`:
    cutting would drop declarations, so that is InvalidRequest naming `tools`, decided by `floor` without tokenizing
    that prompt when even its floor is over `cap` (a 20,000-value enum: 290 KB, a second to tokenize)."""
    trim, n, kept = Trim(messages, keep), 0, list(messages)
    while True:
        last = trim.start(n + STEP) == trim.start(n)  # nothing more to drop
        if last and tools and floor is not None and (least := floor(kept)) > cap:
            raise too_long(f"at least {least}", cap)
        ids = render(kept)
        if len(ids) <= cap:
            return trim.kept(n), ids
        if last:
            if tools:
                raise too_long(str(len(ids)), cap)
            return trim.kept(n), ids[-cap:]
        # guess the steps from this render's tokens per byte, so a long history is rendered about twice, not per step
        excess = (len(ids) - cap) * trim.bytes(n) / len(ids)
        step = n + STEP
        while trim.bytes(n) - trim.bytes(step) < excess and trim.start(step + STEP) != trim.start(step):
            step += STEP
        n = step
        kept = trim.kept(n)


def too_long(tokens: str, cap: int, name: str = "tools", beside: str = "the system prompt and the newest message"
             ) -> InvalidRequest:
    """The refusal of tool declarations (the field `name`) that with `beside` alone are over `cap` tokens."""
    return InvalidRequest(f"{name}: the declarations with {beside} take {tokens} prompt tokens, over the {cap} the "
                          f"context leaves; declare fewer or smaller tools (a long enum is a long declaration), or "
                          f"send a shorter message")
