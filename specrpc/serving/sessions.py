"""Sessions and KV-slot admission: which slot a request runs in, prefix reuse, cancel-previous, idle eviction."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specrpc.engine.engine import Engine
from specrpc.engine.generation import Slot
from specrpc.engine.prefix import common_prefix
from specrpc.serving.scheduler import Job

RELEASE_WAIT_S = 2.0
"""Longest wait for the slot of a cancelled stream that the device thread has not let go of yet (within one
engine step, normally milliseconds) before a request is refused with RESOURCE_EXHAUSTED."""

MIN_REUSE = 32
"""Prompt tokens (or half the prompt, if less) a free slot's cache must share with an anonymous request's prompt to
be taken for it ahead of the slot taken longest ago."""


class SlotsExhausted(Exception):
    """Every KV slot has a stream in flight."""


class UnknownSession(Exception):
    """A request named a session that does not exist (or was evicted)."""


class Superseded(Exception):
    """A newer request arrived on the session while this one waited for it (cancel-previous): it never ran."""


@dataclass(frozen=True)
class LastCompletion:
    """A session's last completion, kept as a draft for its next request: the prompt, then the completion."""

    tokens: list[int]
    prompt_len: int


@dataclass
class Session:
    """A named conversation/editor buffer that keeps its KV slot between requests until idle for the TTL."""

    id: str
    slot: Slot
    last_used: float = field(default_factory=time.monotonic)
    job: Job | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conversation: tuple[list[tuple[Any, ...]], int, str] | None = None  # the edges' messages, turns, last reply
    latest: int = 0  # ticket of the newest request on this session (cancel-previous also skips waiting ones)
    last_completion: LastCompletion | None = None  # what the editor shows now (proposers.SuggestionProposer)


@dataclass
class Lease:
    """A slot held for one request; `session` is None for anonymous requests; `job` once submitted."""

    slot: Slot
    session: Session | None
    job: Job | None = None


class SessionRegistry:
    """Owns the slot pool. Anonymous requests borrow a free slot: the one sharing the longest prefix with their
    prompt, so repeated prompts still hit the cache, unless that prefix is too short to be worth another prompt's
    cache (under `MIN_REUSE` tokens and half the prompt); then the free slot whose cached prompt other slots hold
    too, else the one taken longest ago (never-taken ones first), so that prompts taking turns keep their caches (as
    llama.cpp's slot similarity threshold does). Named sessions keep theirs until idle past the TTL, and idle
    sessions are evicted least-recently-used first when a new request needs a slot."""

    def __init__(self, engine: Engine, num_slots: int, ttl_s: float) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.slots = [engine.new_slot(i) for i in range(num_slots)]
        self.free: set[int] = set(range(num_slots))
        self._taken: dict[int, int] = {}  # slot → when an anonymous request last took it (`_clock`)
        self._prompts: dict[int, list[int]] = {}  # slot → the prompt it was last taken for
        self._clock = 0
        self.sessions: dict[str, Session] = {}
        self.busy: set[int] = set()
        self.leases: dict[int, Lease] = {}
        self._released = asyncio.Event()

    @property
    def in_use(self) -> int:
        """Slots with a stream in flight."""
        return len(self.busy)

    @property
    def total(self) -> int:
        """Slots preallocated."""
        return len(self.slots)

    def get(self, session_id: str) -> Session:
        """An existing session, or UnknownSession."""
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"session {session_id!r} does not exist (never opened, or evicted after "
                                 f"{self.ttl_s:.0f}s idle); open it again")
        return session

    def _take_slot(self, prompt: list[int]) -> Slot:
        if not self.free:
            self._evict_lru_idle()
        if not self.free:
            raise SlotsExhausted(
                f"all {self.total} KV slots have a stream in flight; retry later, or start the server with a "
                f"larger --max-sessions"
            )
        shared = {i: common_prefix(self.slots[i].tokens, prompt) for i in self.free}
        best = max(self.free, key=lambda i: (shared[i], -i))
        if shared[best] < min(MIN_REUSE, len(prompt) // 2):
            best = self._victim()
        self._clock += 1
        self._taken[best] = self._clock
        self._prompts[best] = prompt
        self.free.discard(best)
        return self.slots[best]

    def _victim(self) -> int:
        """The free slot whose cache a prompt that no free slot shares overwrites: the one whose cached prompt most
        other slots hold too (free ones in their caches, anonymous ones in flight in their prompts: they come back
        with it), so that nothing is lost, then the one taken longest ago (never-taken ones first). With LRU alone,
        prompts taking turns over just enough slots lose their last free copy to a miss, and the next request for
        it misses in turn."""
        held = {i: self._cached_prompt(i) for i in self.free}
        held.update({i: self._prompts[i] for i, lease in self.leases.items()
                     if lease.session is None and i in self._prompts})

        def copies(i: int) -> int:
            mine = held[i]
            if not mine:
                return len(self.slots)  # an empty slot loses nothing
            n = len(mine)
            return sum(j != i and other[:n] == mine for j, other in held.items())

        return max(self.free, key=lambda i: (copies(i), -self._taken.get(i, -1), -i))

    def _cached_prompt(self, index: int) -> list[int]:
        """The prompt a free slot was last taken for, while its cache still starts with it; else its whole cache."""
        tokens = self.slots[index].tokens
        prompt = self._prompts.get(index)
        return prompt if prompt is not None and tokens[: len(prompt)] == prompt else tokens

    def _evict_lru_idle(self) -> None:
        idle = [s for s in self.sessions.values() if s.slot.index not in self.busy]
        if idle:
            self._drop(min(idle, key=lambda s: s.last_used))

    def _drop(self, session: Session) -> None:
        del self.sessions[session.id]
        if session.slot.index not in self.busy:
            self.free.add(session.slot.index)

    def evict_expired(self, now: float | None = None) -> int:
        """Drop sessions idle for longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [s for s in self.sessions.values()
                   if s.slot.index not in self.busy and now - s.last_used > self.ttl_s]
        for session in expired:
            self._drop(session)
        return len(expired)

    def open(self, session_id: str = "", prompt: list[int] | None = None) -> Session:
        """The named session, created with a slot if new ('' assigns an id)."""
        if session_id and session_id in self.sessions:
            return self.sessions[session_id]
        slot = self._take_slot(prompt or [])
        session = Session(session_id or uuid.uuid4().hex, slot)
        self.sessions[session.id] = session
        return session

    def close(self, session_id: str) -> None:
        """Forget a session now (its slot becomes free once idle)."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._drop(session)

    def _releasing(self) -> bool:
        """Some slot is held only by a stream that was cancelled: the device thread lets go of it within a step."""
        return any(lease.job is not None and lease.job.cancelled.is_set() for lease in self.leases.values())

    async def wait_for_release(self, session_id: str = "") -> None:
        """Before taking a slot for a new session or an anonymous request: when no slot is free or evictable but a
        cancelled stream still holds one, wait (at most RELEASE_WAIT_S) for it, so that a client that cancels and
        asks again at once (an editor on each keystroke, a barge-in) is served instead of refused."""
        if session_id in self.sessions:
            return
        deadline = time.monotonic() + RELEASE_WAIT_S
        while len(self.busy) == self.total and self._releasing():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), remaining)
            except TimeoutError:
                return

    def _hold(self, slot: Slot, session: Session | None) -> Lease:
        lease = Lease(slot, session)
        self.busy.add(slot.index)
        self.leases[slot.index] = lease
        return lease

    async def acquire(self, session_id: str, prompt: list[int]) -> Lease:
        """Hold a slot for one request. On a named session, first cancel the request still in flight there
        (cancel-previous) and wait until the device thread has let go of the slot; a request still waiting when a
        newer one arrives on the session raises Superseded (on each keystroke only the latest counts). Pair with
        `release`."""
        await self.wait_for_release(session_id)
        if not session_id:
            return self._hold(self._take_slot(prompt), None)
        session = self.open(session_id, prompt)
        session.latest += 1
        ticket = session.latest
        if session.job is not None:
            session.job.cancel()
        await session.lock.acquire()
        if session.latest != ticket:
            session.lock.release()
            raise Superseded(f"a newer request on session {session.id!r} replaced this one before it started")
        if self.sessions.get(session.id) is not session:  # evicted while waiting: start it again, cold
            session.lock.release()
            return await self.acquire(session_id, prompt)
        return self._hold(session.slot, session)

    def release(self, lease: Lease) -> None:
        """Give the slot back (called once the device thread is done with it)."""
        self.busy.discard(lease.slot.index)
        self.leases.pop(lease.slot.index, None)
        self._released.set()
        session = lease.session
        if session is None:
            self.free.add(lease.slot.index)
            return
        session.last_used = time.monotonic()
        session.job = None
        if self.sessions.get(session.id) is not session:
            self.free.add(session.slot.index)
        session.lock.release()
