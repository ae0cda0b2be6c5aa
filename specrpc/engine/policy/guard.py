"""Whether speculating pays in fact at a batch width: the realized rates of whole batched steps (`BatchGuard`).

The policy's cost model can miss costs (ragged rows, draft catch-ups, host work per stream), so the guard keeps the
realized seconds per committed token of whole batched steps per width, with and without drafts, and turns the
policy's speculation off at a width where it is not faster in fact (probing back).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


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
    rates: dict[tuple[int, bool], RecentRate] = field(default_factory=dict)  # (width bucket, drafted) → rate
    _off: dict[int, int] = field(default_factory=dict)  # width → plain steps since it was judged off or probed
    _every: dict[int, int] = field(default_factory=dict)  # width → plain steps between probes now
    _probing: set[int] = field(default_factory=set)  # a probe was allowed, its drafted step not yet seen
    _judging: set[int] = field(default_factory=set)  # a probe's step was seen, not yet judged
    probe_share: float = 0.01  # the most of plain decoding's time that failed probes may cost at a width
    # width → the measurement under way (first, or a probe): its drafts' catch-up seconds, its drafted steps' tokens
    _probe_cost: dict[int, tuple[float, int]] = field(default_factory=dict)
    _wait_s: dict[int, float] = field(default_factory=dict)  # width → plain seconds before the next probe
    _off_s: dict[int, float] = field(default_factory=dict)  # width → plain seconds since it was judged off or probed
    plain_every: int = 32  # drafted steps at a width between two plain ones, which keep plain's rate measured
    window: int = 8  # steps each rate is the median of (tokens swing with acceptance, times with the host)
    idle_share: float = 0.1  # below this share of streams drafting with the draft model, its prefill is idle work
    draft_share: dict[int, float] = field(default_factory=dict)  # width → decayed share of streams that drafted
    _since_plain: dict[int, int] = field(default_factory=dict)  # width → drafted steps since its last plain one

    @staticmethod
    def bucket(width: int) -> int:
        """Widths judged together: 1, 2, 3-4, 5-8, 9-16, … (a batch's width moves as streams come and go, and each
        bucket's judgement costs steps of both kinds first)."""
        return 1 << max(0, width - 1).bit_length()

    def limit(self, width: int) -> int | None:
        """The most policy k may be in the next batched step of `width` decoding streams: None (no limit: drafting
        was faster), 0 (it was not), or, while drafting is being measured (first, and in each probe), `probe_k` and
        0 in turn, so that finding out costs little and drift hits both rates alike."""
        width = self.bucket(width)
        drafted, plain = self.rates.get((width, True)), self.rates.get((width, False))
        measured = (drafted.steps if drafted else 0, plain.steps if plain else 0)
        if min(measured) < self.min_steps:  # drafted and plain steps in turn, so that the host's drift hits both
            return self.probe_k if measured[0] <= measured[1] else 0
        probed = width in self._judging
        self._judging.discard(width)
        # while off, only a probe's own steps judge it again: the drafted rate is the last probe's, and plain steps
        # that the host slowed since would turn a losing speculation on
        if (probed or width not in self._off) and not self._judged_off(width):
            if probed:  # back on: the next probes come sooner, but a width where it flaps keeps most of its wait
                self._every[width] = max(self.probe_every, self._every.get(width, self.probe_every) // 2)
            self._off.pop(width, None)
            self._off_s.pop(width, None)
            self._wait_s.pop(width, None)
            self._probe_cost.pop(width, None)
            since = self._since_plain.get(width, 0) + 1
            self._since_plain[width] = 0 if since > self.plain_every else since
            return 0 if since > self.plain_every else None
        if probed:  # the probe failed: wait twice as long for the next one
            self._every[width] = min(self.max_probe_every, 2 * self._every.get(width, self.probe_every))
        if probed or width not in self._off:  # and long enough for what it (or the first measurement) cost
            catch_up_s, tokens = self._probe_cost.pop(width, (0.0, 0))
            loss = self.rates[(width, True)].per_token - self.rates[(width, False)].per_token  # medians: no stall
            self._wait_s[width] = (catch_up_s + tokens * max(0.0, loss)) / self.probe_share
        off = self._off.get(width, 0) + 1
        waited = self._off_s.get(width, 0.0) >= self._wait_s.get(width, 0.0)
        if off >= self._every.get(width, self.probe_every) and waited:
            self._off[width] = 0
            self._off_s[width] = 0.0
            self._probing.add(width)
            return self.probe_k
        self._off[width] = off
        return 0

    def _judged_off(self, width: int) -> bool:
        """Whether drafting is off at bucket `width` now (both rates measured): slower than plain by the margin of
        the state it is in (`min_speedup` to stay on, `resume_speedup` to come back)."""
        drafted, plain = self.rates[(width, True)], self.rates[(width, False)]
        margin = self.resume_speedup if width in self._off else self.min_speedup
        return plain.per_token <= margin * drafted.per_token

    def drafting_on(self, width: int) -> bool:
        """Whether drafting was found faster at `width` and is not being probed or first measured there (without
        counting a step towards a probe)."""
        width = self.bucket(width)
        drafted, plain = self.rates.get((width, True)), self.rates.get((width, False))
        return (drafted is not None and plain is not None and min(drafted.steps, plain.steps) >= self.min_steps
                and width not in self._probing and width not in self._judging and width not in self._off
                and not self._judged_off(width))

    def observe_share(self, width: int, drafting: int, streams: int) -> None:
        """In a batched step of `width` streams, `drafting` of the `streams` the policy planned for drafted with
        the draft model (with or without prefill chunks in the step)."""
        if streams:
            width = self.bucket(width)
            old = self.draft_share.get(width)
            share = drafting / streams
            self.draft_share[width] = share if old is None else 0.9 * old + 0.1 * share

    def draft_idle(self, width: int) -> bool:
        """Whether the draft model has hardly drafted at `width` lately (the policy chose k = 0 for nearly every
        stream there), so a prompt's draft prefill would be spent for nothing: it catches up if drafting
        returns."""
        share = self.draft_share.get(self.bucket(width))
        return share is not None and share < self.idle_share

    def observe(self, width: int, drafted: bool, seconds: float, tokens: int, catch_up_s: float = 0.0) -> None:
        """A batched step of `width` decoding streams (no prefill in it), with drafts or without, took `seconds`
        and committed `tokens`, besides `catch_up_s` its drafts spent catching up on what they had not seen (the
        price of the steps they sat out: not judged, but a probe's cost)."""
        width = self.bucket(width)
        if drafted and width in self._probing:
            self._probing.discard(width)
            self._judging.add(width)
            for kind in (True, False):  # judged again after min_steps of each, measured now
                self.rates[(width, kind)] = RecentRate(self.window)
            self._probe_cost.pop(width, None)
        measured = self.rates.get((width, True))
        if drafted and (width in self._judging or measured is None or measured.steps < self.min_steps):
            cost = self._probe_cost.get(width, (0.0, 0))
            self._probe_cost[width] = (cost[0] + catch_up_s, cost[1] + tokens)
        elif not drafted and width in self._off:
            self._off_s[width] = self._off_s.get(width, 0.0) + seconds
        self.rates.setdefault((width, drafted), RecentRate(self.window)).observe(seconds, tokens)

    def speedup(self, width: int) -> float | None:
        """Realized speed-up of drafted over plain steps at `width` (None until both were measured)."""
        width = self.bucket(width)
        drafted, plain = self.rates.get((width, True)), self.rates.get((width, False))
        if drafted is None or plain is None or not drafted.recent or not plain.recent:
            return None
        return plain.per_token / drafted.per_token
