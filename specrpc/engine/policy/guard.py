"""Whether speculating pays in fact at a batch width: a state machine per width over the realized rates of whole
batched steps (`BatchGuard`).

The policy's cost model can miss costs (ragged rows, draft catch-ups, host work per stream), so the guard keeps the
realized seconds per committed token of whole batched steps per width, with policy drafts and without, and caps the
policy's k at a width where drafting is not faster in fact. Each width bucket moves through these phases:

    MEASURING ──plan, both measured: faster by min_speedup──▶ ON ──plan: not faster by min_speedup──▶ OFF
        └──────plan, both measured: not──────────────────────────────────────────────────────────▶ OFF
    OFF ──plan: `every` plain steps and `wait_s` plain seconds──▶ PROBE_ALLOWED (plan gives probe_k; counts as OFF)
    PROBE_ALLOWED ──observe: a drafted step──▶ PROBING (both rates restart)
    PROBING ──plan, both measured: faster by resume_speedup──▶ ON   (every halved)
            └─plan, both measured: not──▶ OFF   (every doubled; wait_s = what the probe cost ÷ probe_share)

`plan` advances a width (it judges, counts, allows probes); `observe` records a step's rate; the rest are queries.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum


@dataclass
class RecentRate:
    """Seconds per committed token of one kind of batched step: the median of its last `window` steps' own rates.
    A step the host stalled moves it no more than any other step; a decayed sum kept such a step in the rate for as
    many steps of its kind as the decay took (at 8 streams one 17 ms plain step among 4.5 ms ones kept drafting on
    for hundreds of steps: drafting on, plain steps are measured one step in 33)."""

    window: int = 8
    steps: int = 0
    recent: deque[float] = field(default_factory=deque)

    def observe(self, seconds: float, tokens: int) -> None:
        """One step took `seconds` and committed `tokens` (steps that committed nothing are not rated)."""
        if tokens <= 0:
            return
        self.recent.append(seconds / tokens)
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.steps += 1

    @property
    def per_token(self) -> float:
        """Seconds per committed token (inf before any step)."""
        return statistics.median(self.recent) if self.recent else float("inf")


class Phase(Enum):
    """Where a width bucket stands."""

    MEASURING = "measuring"  # both rates measured the first time, drafted and plain steps in turn; judged at a plan
    ON = "on"  # drafting was faster: no cap, but for a plain step one in `plain_every` + 1
    OFF = "off"  # drafting was slower: k 0, plain steps and seconds counted towards the next probe
    PROBE_ALLOWED = "probe allowed"  # a plan gave probe_k, no drafted step seen since: still off
    PROBING = "probing"  # the probe's first drafted step restarted both rates: measured in turn, then judged


@dataclass
class WidthState:
    """One width bucket's phase and what it measured."""

    every: int  # plain steps between probes now
    drafted: RecentRate  # steps with policy drafts
    plain: RecentRate  # steps without
    phase: Phase = Phase.MEASURING
    plain_steps: int = 0  # plans while off since drafting was last on or a probe allowed
    plain_s: float = 0.0  # plain steps' seconds while off since then
    wait_s: float = 0.0  # plain seconds the next probe waits for
    catch_up_s: float = 0.0  # the measurement under way (first, or a probe): its drafts' catch-up seconds
    drafted_tokens: int = 0  # and its drafted steps' tokens
    since_plain: int = 0  # plans while on since the last plain step
    draft_share: float | None = None  # decayed share of planned streams that drafted with the draft model

    def measured(self, min_steps: int) -> bool:
        """Whether both rates have `min_steps` steps."""
        return min(self.drafted.steps, self.plain.steps) >= min_steps

    def faster(self, margin: float) -> bool:
        """Whether drafted steps are `margin` times faster per token than plain ones."""
        return self.plain.per_token > margin * self.drafted.per_token

    def measurement_step(self, probe_k: int) -> int:
        """The cap for the next step of a measurement: drafted (probe_k) and plain (0) in turn, so that the host's
        drift hits both rates alike."""
        return probe_k if self.drafted.steps <= self.plain.steps else 0

    def measurement_cost(self) -> float:
        """Seconds the measurement under way cost: its catch-ups, and its drafted tokens' time beyond plain
        decoding's rate (medians: one stalled step does not set it)."""
        loss = max(0.0, self.drafted.per_token - self.plain.per_token)
        return self.catch_up_s + self.drafted_tokens * loss


@dataclass
class BatchGuard:
    """Realized seconds per committed token of whole batched steps by width (decoding streams, in `bucket`s), with
    drafts the policy chose and without (requests' own k and suggestions draft either way): at a width where steps
    with policy drafts are not `min_speedup` faster per token than steps without (a margin too: where drafting and
    plain decoding are about even, the rates' noise would keep a slightly losing speculation on), policy k is 0.
    Both rates are first measured over `min_steps` steps each, drafted (at most `probe_k`) and plain in turn, so
    that the host's drift hits both: one step's committed tokens vary too much with acceptance to judge a width by.
    While off, only a probe judges again (the drafted rate is the last probe's, and plain steps the host slowed
    since would turn a losing speculation on): it measures both rates afresh, in turn, and speculation comes back
    only when drafting is `resume_speedup` faster (a margin, so that a lucky probe on a noisy machine does not turn
    on a losing speculation for the steps it then takes to judge it again). Each probe that fails doubles the plain
    steps before the next one (`probe_every` up to `max_probe_every`), each that succeeds halves them; and after a
    failed probe (or first measurement) the next waits until the plain steps since took 1 / `probe_share` times
    what it cost: its drafts' catch-ups on contexts they had not seen, and its drafted tokens' time beyond plain
    decoding's rate. At a wide batch on a CPU one probe catches every stream's draft up on its whole context,
    hundreds of milliseconds that a count of steps alone would spend every few seconds. While drafting is on, one
    step in `plain_every` + 1 is plain, so that it is judged against plain decoding as it runs now, not as it ran
    when last measured."""

    min_speedup: float = 1.05
    resume_speedup: float = 1.15
    min_steps: int = 4
    probe_every: int = 32
    max_probe_every: int = 512
    probe_k: int = 2
    probe_share: float = 0.01  # the most of plain decoding's time that failed probes may cost at a width
    plain_every: int = 32  # drafted steps at a width between two plain ones, which keep plain's rate measured
    window: int = 8  # steps each rate is the median of (tokens swing with acceptance, times with the host)
    idle_share: float = 0.1  # below this share of streams drafting with the draft model, its prefill is idle work
    widths: dict[int, WidthState] = field(default_factory=dict)  # width bucket → its state

    @staticmethod
    def bucket(width: int) -> int:
        """Widths judged together: 1, 2, 3-4, 5-8, 9-16, … (a batch's width moves as streams come and go, and each
        bucket's judgement costs steps of both kinds first)."""
        return 1 << max(0, width - 1).bit_length()

    def _state(self, width: int) -> WidthState:
        """The state of `width`'s bucket, measuring from nothing when first met."""
        bucket = self.bucket(width)
        state = self.widths.get(bucket)
        if state is None:
            state = self.widths[bucket] = WidthState(self.probe_every, RecentRate(self.window), RecentRate(self.window))
        return state

    def plan(self, width: int) -> int | None:
        """Advance `width`'s state by the next batched step of `width` decoding streams and return the most policy
        k may be in it: None (no cap), 0, or `probe_k`. A measurement alternates `probe_k` and 0; a finished one is
        judged; while on or off, the step counts towards the next plain step or probe."""
        state = self._state(width)
        phase = state.phase
        if phase in (Phase.MEASURING, Phase.PROBING) and not state.measured(self.min_steps):
            return state.measurement_step(self.probe_k)
        if phase is Phase.PROBING:
            if state.faster(self.resume_speedup):
                self._resume(state)
                return self._on_step(state)
            self._fail_probe(state)
        elif phase in (Phase.MEASURING, Phase.ON):
            if state.faster(self.min_speedup):
                if phase is Phase.MEASURING:
                    self._turn_on(state)
                return self._on_step(state)
            self._turn_off(state)
        return self._off_step(state)

    def _resume(self, state: WidthState) -> None:
        """A probe found drafting `resume_speedup` faster: on, the next probes sooner (halved, so that a width where
        it flaps keeps most of its wait)."""
        state.every = max(self.probe_every, state.every // 2)
        self._turn_on(state)

    def _fail_probe(self, state: WidthState) -> None:
        """A probe did not: off again, the next probe twice as many plain steps off (up to `max_probe_every`)."""
        state.every = min(self.max_probe_every, 2 * state.every)
        self._turn_off(state)

    def _turn_on(self, state: WidthState) -> None:
        """Drafting was found faster: what counted towards a probe, and the measurement's cost, are dropped."""
        state.phase = Phase.ON
        state.plain_steps, state.plain_s, state.wait_s = 0, 0.0, 0.0
        state.catch_up_s, state.drafted_tokens = 0.0, 0

    def _turn_off(self, state: WidthState) -> None:
        """Drafting was found slower: the next probe waits until plain decoding took 1 / `probe_share` times what
        the measurement cost."""
        state.phase = Phase.OFF
        state.wait_s = state.measurement_cost() / self.probe_share
        state.catch_up_s, state.drafted_tokens = 0.0, 0

    def _on_step(self, state: WidthState) -> int | None:
        """A step while on: unlimited, but for a plain one after every `plain_every`."""
        state.since_plain += 1
        if state.since_plain > self.plain_every:
            state.since_plain = 0
            return 0
        return None

    def _off_step(self, state: WidthState) -> int:
        """A step while off: plain, or a probe once `every` steps and `wait_s` plain seconds passed."""
        state.plain_steps += 1
        if state.plain_steps >= state.every and state.plain_s >= state.wait_s:
            return self._allow_probe(state)
        return 0

    def _allow_probe(self, state: WidthState) -> int:
        """Let the next step draft `probe_k`; counting towards the probe after it starts again."""
        state.phase = Phase.PROBE_ALLOWED
        state.plain_steps, state.plain_s = 0, 0.0
        return self.probe_k

    def _start_probe(self, state: WidthState) -> None:
        """The allowed probe's first drafted step: both rates are measured afresh from it (the old ones are stale)."""
        state.phase = Phase.PROBING
        state.drafted, state.plain = RecentRate(self.window), RecentRate(self.window)
        state.catch_up_s, state.drafted_tokens = 0.0, 0

    def observe(self, width: int, drafted: bool, seconds: float, tokens: int, catch_up_s: float = 0.0) -> None:
        """A batched step of `width` decoding streams (no prefill in it), with drafts or without, took `seconds`
        and committed `tokens`, besides `catch_up_s` its drafts spent catching up on what they had not seen (the
        price of the steps they sat out: not judged, but a probe's cost)."""
        state = self._state(width)
        if drafted and state.phase is Phase.PROBE_ALLOWED:
            self._start_probe(state)
        if drafted and (state.phase is Phase.PROBING or state.drafted.steps < self.min_steps):
            state.catch_up_s += catch_up_s  # charged to the measurement under way
            state.drafted_tokens += tokens
        elif not drafted and state.phase in (Phase.OFF, Phase.PROBE_ALLOWED, Phase.PROBING):
            state.plain_s += seconds
        (state.drafted if drafted else state.plain).observe(seconds, tokens)

    def drafting_on(self, width: int) -> bool:
        """Whether drafting is faster at `width` by `min_speedup`, on or first measured there and judged so now."""
        state = self.widths.get(self.bucket(width))
        return (state is not None and state.phase in (Phase.MEASURING, Phase.ON) and state.measured(self.min_steps)
                and state.faster(self.min_speedup))

    def observe_share(self, width: int, drafting: int, streams: int) -> None:
        """In a batched step of `width` streams, `drafting` of the `streams` the policy planned for drafted with
        the draft model (with or without prefill chunks in the step)."""
        if streams:
            state = self._state(width)
            share = drafting / streams
            state.draft_share = share if state.draft_share is None else 0.9 * state.draft_share + 0.1 * share

    def draft_idle(self, width: int) -> bool:
        """Whether the draft model has hardly drafted at `width` lately (the policy chose k = 0 for nearly every
        stream there), so a prompt's draft prefill would be spent for nothing: it catches up if drafting
        returns."""
        state = self.widths.get(self.bucket(width))
        return state is not None and state.draft_share is not None and state.draft_share < self.idle_share

    def speedup(self, width: int) -> float | None:
        """Realized speed-up of drafted over plain steps at `width` (None until both were measured)."""
        state = self.widths.get(self.bucket(width))
        if state is None or not state.drafted.recent or not state.plain.recent:
            return None
        return state.plain.per_token / state.drafted.per_token
