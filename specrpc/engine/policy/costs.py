"""What steps cost, relative and in seconds: the figures the policy's speed-up model S(k) is made of.

D(k) (drafting k tokens in a speculative step ÷ one target step) and V(k) (verifying k+1 tokens ÷ one target
step) are the device's: one `CostModel`, measured at start-up (`calibration`) and refined by every lone step of every
session since, which every policy reads, so a session decodes from what the device's steps cost now, not from one
calibration a slow spell or a context unlike the traffic's can leave far off. Each step also spends host time around
its forwards (choosing k, verifying, committing) and before the next (its tokens handed on to the client, once a step
however many they are), measured per policy and kind of step (plain, drafted, looked up) as h (`HostTimes`: a
request's controls, grammar and edge set it, not the device). A draft that has not seen the prompt
must first catch up on it, at `draft_prefill_s` a token. A batched step's time is a function of the batch's total
tokens (`BatchCosts`, shared by every stream too), calibrated at start-up over a few batch widths and refined from
every batched step.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def host_kind(source: str) -> str:
    """The kind of step whose host time a source's steps share: the draft's, or prompt lookup's (every n-gram
    size)."""
    return "lookup" if source.startswith("lookup") else source


@dataclass
class Refined:
    """How a measured cost follows its measurements: the median of its last `window` ones (an EMA of them, from
    the value it started at, until `min_window` are in). A median settles where the measurements lie and one stall
    (a page fault, another process's burst) does not move it, where an EMA keeps wandering with every sample."""

    decay: float = 0.9
    window: int = 15
    min_window: int = 5
    _recent: dict[str, deque[float]] = field(default_factory=dict, repr=False, compare=False)

    def _refine(self, key: str, old: float | None, seconds: float) -> float:
        """The cost `key` after measuring `seconds`."""
        recent = self._recent.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        if len(recent) >= self.min_window:
            return statistics.median(recent)
        return seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds


def nearest(sizes: Iterable[int], size: int) -> int:
    """The size in `sizes` nearest `size`, the larger of two as near."""
    return min(sizes, key=lambda n: (abs(n - size), -n))


def nearest_in_order(sizes: list[int], size: int) -> int:
    """`nearest` for `sizes` in ascending order (not empty), by bisection: the cost model reads every stale size's
    estimate after each measurement."""
    at = bisect.bisect_left(sizes, size)  # sizes[at - 1] < size <= sizes[at]: the nearest is one of the two
    if at == len(sizes):
        return sizes[-1]
    return sizes[at] if at == 0 or sizes[at] - size <= size - sizes[at - 1] else sizes[at - 1]


@dataclass
class CostModel(Refined):
    """The device's step costs relative to one single-token target forward (seconds), each `Refined` from every
    lone step's measurement.

    A size the policy stops choosing is no longer measured, so what it last measured can stay wrong for good: drafts
    timed while other streams' work shares the cores (a draft's many short forwards suffer most) would keep a lone
    stream that follows at short drafts, the longer ones never timed again. A size not measured in the last
    `stale_after` measurements of its table (drafts, verifies) is therefore stale: it is read as the nearest fresh
    size's cost scaled by the two sizes' ratio in the costs as they stood before any step refined them (the start-up
    calibration's shape), and its first measurement after that starts its refinement afresh from that estimate."""

    target_step_s: float = 1e-3
    draft_step_s: float = 1e-4  # a drafted token's seconds, where `draft_s` has nothing measured
    verify_s: dict[int, float] = field(default_factory=dict)
    draft_prefill_s: float = 0.0  # seconds per token of a draft catching up on what it has not seen (a new prompt)
    draft_s: dict[int, float] = field(default_factory=dict)  # k → seconds of a speculative step's k drafted tokens
    stale_after: int = 64  # a table's measurements after which a size not measured since is stale
    _count: dict[str, int] = field(default_factory=lambda: {"v": 0, "d": 0}, repr=False, compare=False)  # by table
    _last: dict[str, dict[int, int]] = field(default_factory=lambda: {"v": {}, "d": {}}, repr=False,
                                             compare=False)  # by table, size → the table's count at its last
    _stale: dict[str, set[int]] = field(default_factory=lambda: {"v": set(), "d": set()}, repr=False,
                                        compare=False)  # by table, its stale sizes (kept by `_observe`)
    _shape: dict[str, dict[int, float]] | None = field(default=None, repr=False,
                                                      compare=False)  # by table, size → seconds before refining
    _ratios: tuple[tuple[Any, ...], list[float], list[float]] | None = field(
        default=None, repr=False, compare=False)  # `ratios`' last: the costs it was read from, D and V
    _plans: dict[str, tuple[tuple[Any, ...], list[tuple[int, int, float | None]]]] = field(
        default_factory=dict, repr=False, compare=False)  # by table, `_estimates`' last: what it held, and them

    def observe_target(self, tokens: int, seconds: float) -> None:
        """A target forward over `tokens` positions (1 = plain decode, k+1 = verify) took `seconds`."""
        value = self._observe(self.verify_s, tokens, "v", seconds)
        self.verify_s[tokens] = value
        if tokens == 1:
            self.target_step_s = value

    def observe_draft(self, k: int, seconds: float) -> None:
        """A speculative step's draft of k tokens took `seconds` (k forwards, the first over the last step's tokens
        right after the target's verify, when the target's weights have just passed through the caches: a draft of
        one token costs a third more than each of eight, a 2-core AMD EPYC at int8, so a cost per token taken from
        short drafts would price long ones too high, and from long ones short ones too low)."""
        self.draft_s[k] = self._observe(self.draft_s, k, "d", seconds)

    def _observe(self, table: dict[int, float], size: int, kind: str, seconds: float) -> float:
        """`table`'s cost of `size` after measuring `seconds` (a stale size starts afresh from its estimate); the
        table's stale sizes updated."""
        if self._shape is None:  # the costs as calibrated (or remembered): the shape stale sizes are read with
            self._shape = {"v": dict(self.verify_s), "d": dict(self.draft_s)}
        key, old = f"{kind}{size}", table.get(size)
        if old is not None and size in self._stale[kind]:
            old = self._current(table, kind)[size]
            self._recent.pop(key, None)
        count = self._count[kind] = self._count[kind] + 1
        last = self._last[kind]
        last[size] = count
        self._stale[kind] = {n for n in table if count - last.get(n, 0) >= self.stale_after}
        return self._refine(key, old, seconds)

    def _current(self, table: dict[int, float], kind: str) -> dict[int, float]:
        """`table`'s seconds as read now: each fresh size's own, each stale one's estimate (`_estimates`; `table`
        itself where none is stale)."""
        if not self._stale[kind]:
            return table
        current = dict(table)
        for n, near, factor in self._estimates(table, kind):
            current[n] = table[near] * factor if factor is not None else table[n]
        return current

    def _estimates(self, table: dict[int, float], kind: str) -> list[tuple[int, int, float | None]]:
        """How each stale size of `table` is read: (size, the nearest fresh size (the larger of two as near), the
        factor that one's seconds are scaled by: their ratio in the calibrated shape, by their sizes where the shape
        lacks either; None where no size is fresh: its own seconds). They change only where a size goes stale or
        fresh, or a new one is measured, so they are kept while the stale sizes and the table's sizes stay the same
        (a step's planning reads the tables afresh after every measurement: 27 µs a plan with speculation off, int8,
        2-core AMD EPYC Zen 4, each estimate worked out on every read, against 22 µs so)."""
        stale = self._stale[kind]
        key = (frozenset(stale), tuple(table))
        kept = self._plans.get(kind)
        if kept is not None and kept[0] == key:
            return kept[1]
        fresh = sorted(n for n in table if n not in stale)
        shape = self._shape[kind] if self._shape is not None else {}
        plan: list[tuple[int, int, float | None]] = []
        for n in table:
            if n not in stale:
                continue
            if not fresh:
                plan.append((n, n, None))
                continue
            near = nearest_in_order(fresh, n)
            mine, theirs = shape.get(n), shape.get(near)
            plan.append((n, near, mine / theirs if mine and theirs else n / near))
        self._plans[kind] = (key, plan)
        return plan

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft caught up on `tokens` tokens in `seconds`."""
        self.draft_prefill_s = self._refine("catch_up", self.draft_prefill_s, seconds / max(1, tokens))

    def entry(self) -> dict[str, Any]:
        """The measured costs as JSON (`from_entry` reads them back): what a start keeps for the next one."""
        return {"target_step_s": self.target_step_s, "draft_step_s": self.draft_step_s,
                "draft_prefill_s": self.draft_prefill_s, "verify_s": {str(n): s for n, s in self.verify_s.items()},
                "draft_s": {str(k): s for k, s in self.draft_s.items()}}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> CostModel:
        """The costs `entry()` gave (KeyError, TypeError, ValueError or AttributeError where `entry` holds no such
        figures)."""
        return cls(target_step_s=float(entry["target_step_s"]), draft_step_s=float(entry["draft_step_s"]),
                   draft_prefill_s=float(entry["draft_prefill_s"]),
                   verify_s={int(n): float(s) for n, s in entry["verify_s"].items()},
                   draft_s={int(k): float(s) for k, s in entry["draft_s"].items()})

    def d(self, k: int) -> float:
        """Drafting k tokens ÷ target step cost: measured, else scaled from the nearest k measured (the larger of
        two as near), else k `draft_step_s`."""
        return self._d(k, self._current(self.draft_s, "d"))

    def _d(self, k: int, drafts: dict[int, float]) -> float:
        """`d` from the draft table as read now (`_current`)."""
        if k in drafts:
            return drafts[k] / self.target_step_s
        if not drafts:
            return k * self.draft_step_s / self.target_step_s
        near = nearest(drafts, k)
        return drafts[near] * k / near / self.target_step_s

    def ratios(self, cap: int) -> tuple[list[float], list[float]]:
        """(D, V): `d(k)` and `v(k)` for k = 0 .. at least `cap`, kept while the costs stay as they were read (a
        step's planning weighs every k of a source two or three times between two measurements), each table's stale
        sizes estimated once for all k (searched for every k in turn, a measurement and the next read took 52 µs on
        a 2-core AMD EPYC, Zen 4, against 15 so)."""
        state = (self._count["v"], self._count["d"], self.target_step_s, self.draft_step_s,
                 tuple(self.verify_s.items()), tuple(self.draft_s.items()))
        kept = self._ratios
        if kept is None or kept[0] != state or len(kept[1]) <= cap:
            kept = self._ratios = (state, *self._read(cap))
        return kept[1], kept[2]

    def _read(self, cap: int) -> tuple[list[float], list[float]]:
        """`ratios`' D and V for k = 0 .. cap, read afresh: where each table holds every size (measured, or a stale
        one's estimate), each is its entry ÷ the target step, in one pass (as `d` and `v` read it)."""
        drafts, verifies = self._current(self.draft_s, "d"), self._current(self.verify_s, "v")
        step = self.target_step_s
        if all(k in drafts for k in range(1, cap + 1)) and all(n in verifies for n in range(1, cap + 2)):
            return ([0.0] + [drafts[k] / step for k in range(1, cap + 1)],
                    [verifies[n] / step for n in range(1, cap + 2)])
        known = sorted(verifies)
        return [self._d(k, drafts) for k in range(cap + 1)], [self._v(k, verifies, known) for k in range(cap + 1)]

    @property
    def c(self) -> float:
        """A drafted token's cost ÷ target step cost, at the longest draft measured (D(k) / k)."""
        k = max(self.draft_s, default=1)
        return self.d(k) / k

    def v(self, k: int) -> float:
        """Verify cost of k+1 positions ÷ target step cost (interpolated when not yet measured)."""
        return self._v(k, self._current(self.verify_s, "v"), sorted(self.verify_s))

    def _v(self, k: int, verifies: dict[int, float], known: list[int]) -> float:
        """`v` from the verify table as read now (`_current`) and its sizes in order."""
        if k + 1 in verifies:
            return verifies[k + 1] / self.target_step_s
        if not known:
            return 1.0
        below = max((n for n in known if n <= k + 1), default=known[0])
        above = min((n for n in known if n >= k + 1), default=known[-1])
        low, high = verifies[below], verifies[above]
        if below == above:
            per_extra = (low / self.target_step_s - 1.0) / max(1, below - 1)
            return 1.0 + per_extra * k
        w = (k + 1 - below) / (above - below)
        return ((1 - w) * low + w * high) / self.target_step_s


@dataclass
class HostTimes(Refined):
    """Seconds a lone step of each kind ("plain", or the source that drafted) spends outside the model forwards:
    choosing k, verifying, committing, and until the stream's next step starts, handing its tokens on
    (`Engine.between_s`). A policy's own: a request's controls, grammar and edge set them, not the device."""

    seconds: dict[str, float] = field(default_factory=dict)

    def observe(self, kind: str, seconds: float) -> None:
        """A whole step of `kind` spent `seconds` outside the model forwards."""
        self.seconds[kind] = self._refine(kind, self.seconds.get(kind), max(0.0, seconds))

    def of(self, kind: str) -> float:
        """Host seconds of a step of `kind`; until measured, a plain step's (a drafted step does all a plain one
        does and more: taking it as free would make drafting look best exactly when nothing is known of it, and
        start it with a catch-up on the whole prompt), 0 before that. For the same reason a plain step's is never
        read above a drafted kind's measured one: a plain time a stall inflated (its first steps, before a median
        forms) would make drafting look best, and while a stream drafts no plain step comes to correct it."""
        if kind == "plain":
            return min(self.seconds.values()) if "plain" in self.seconds else 0.0
        seconds = self.seconds.get(kind)
        return self.seconds.get("plain", 0.0) if seconds is None else seconds


def _interpolate(table: dict[int, float], x: int) -> float:
    """table (size → seconds) at x: linear between measured sizes, the smallest one's below them, extended above
    them along the slope from the largest size back to the largest at most half of it (else the smallest), never
    downwards; never below a nanosecond. The wide baseline keeps two noisy neighbouring entries (sizes a few tokens
    apart) from making the slope steep or flat far beyond what was measured: a prompt chunk's cost there sets the
    scheduler's prefill budget and the bench's bound."""
    measured = table.get(x)
    if measured is not None:  # the common case (a width's sizes recur), without sorting a table of every size seen
        return max(1e-9, measured)
    known = sorted(table)
    at = bisect.bisect_left(known, x)  # known[at - 1] < x < known[at]
    if at == 0:
        return max(1e-9, table[known[0]])
    if at < len(known):
        lo, hi = known[at - 1], known[at]
        return max(1e-9, table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo))
    last = table[known[-1]]
    if len(known) == 1:
        return max(1e-9, last * x / known[-1])
    base = max((n for n in known[:-1] if 2 * n <= known[-1]), default=known[0])
    slope = max(0.0, (last - table[base]) / (known[-1] - base))
    return max(1e-9, last + slope * (x - known[-1]))


@dataclass
class BatchCosts:
    """Seconds of one batched target forward by its total tokens, and of one batched draft forward by its rows, as
    EMAs of measured times (shared by every stream: the device is one)."""

    target_s: dict[int, float] = field(default_factory=dict)
    draft_s: dict[int, float] = field(default_factory=dict)
    decay: float = 0.9

    def observe_target(self, tokens: int, seconds: float) -> None:
        """A batched target forward over `tokens` tokens in all took `seconds`."""
        old = self.target_s.get(tokens)
        self.target_s[tokens] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def observe_draft(self, rows: int, seconds: float) -> None:
        """A batched draft forward over `rows` streams (one token each) took `seconds`."""
        old = self.draft_s.get(rows)
        self.draft_s[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def target(self, tokens: int) -> float:
        """Seconds of a target forward over `tokens` tokens (1 ms per token before anything was measured)."""
        return _interpolate(self.target_s, tokens) if self.target_s else 1e-3 * tokens

    def draft(self, rows: int) -> float:
        """Seconds of a draft forward over `rows` rows (0.1 ms per row before anything was measured)."""
        return _interpolate(self.draft_s, rows) if self.draft_s else 1e-4 * rows
