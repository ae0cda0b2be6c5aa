"""How many tokens to draft: maximise the expected speed-up S(k) (below), switch off at S ≤ 1.

α (acceptance per draft token) is estimated per session from decayed counts; c (one draft step ÷ one target step)
and V(k) (verifying k+1 tokens ÷ one target step) start from the device calibration and are refined online from
measured step times. Each step also spends host time around its forwards (choosing k, verifying, committing), measured
online per kind of step (plain, drafted, looked up) as h: S(k) = E(α, k) (1 + h_plain) / (k·c + V(k) + h_source).
Where a target step is short (int8 weights, a small model, a GPU) that time is a large part of a step, and a
speculative step spends more of it than a plain one. A draft that has not seen the prompt must first catch up on it:
that costs once per request, and it is paid only where the request's remaining tokens are expected to save more
(`catch_up_pays`). While speculation is off, a probe every `probe_every` steps re-measures α so that a session whose
text became predictable comes back.

The model can miss costs it does not see (a draft catching up after sitting out, a GPU stalling on a shape met for
the first time, host work between kernels), so the policy also keeps the realized seconds per committed token of
each proposer's whole steps and switches a proposer off when it is not faster than plain decoding in fact. While a
proposer is off, what was measured before is stale: each probe restarts its realized rate from the probe's own step,
so a proposer comes back at the first good probe once the stall is gone, and stays off while probes are slow.

In a batched step (several streams in one target forward, `BatchLoad`), a stream's k is chosen for the whole batch's
throughput: the step's time is V as a function of the batch's total tokens (`BatchCosts`, calibrated at start-up
over a few batch widths and refined from every batched step), and k maximises (others' expected tokens + E(α, k)) ÷
(batch time with this stream's k + 1 tokens + its draft steps). Alone, that is S(k); as the batch grows, the tokens a
stream adds cost every stream's step while adding only its own E, so k shrinks and turns off when plain batched
decoding is faster. As alone, the model can miss costs (ragged rows, draft catch-ups, host work per stream), so a
`BatchGuard` keeps the realized seconds per committed token of whole batched steps per width, with and without
drafts, and turns the policy's speculation off at a width where it is not faster in fact (probing back).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field


def host_kind(source: str) -> str:
    """The kind of step whose host time a source's steps share: the draft's, or prompt lookup's (every n-gram
    size)."""
    return "lookup" if source.startswith("lookup") else source


def expected_tokens(alpha: float, k: int) -> float:
    """E = (1 − α^(k+1)) / (1 − α): tokens committed per verify step with k drafts (k + 1 at α = 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    """Step costs relative to one single-token target forward (seconds). Online, each cost is the median of its
    last `window` measurements (an EMA of them, from the calibrated value, until `min_window` are in): a median
    settles where the measurements lie and one stall (a page fault, another process's burst) does not move it,
    where an EMA keeps wandering with every sample."""

    target_step_s: float = 1e-3
    draft_step_s: float = 1e-4
    verify_s: dict[int, float] = field(default_factory=dict)
    decay: float = 0.9
    window: int = 15
    min_window: int = 5
    host_s: dict[str, float] = field(default_factory=dict)  # per kind of step ("plain", a source): host seconds
    draft_prefill_s: float = 0.0  # seconds per token of a draft catching up on what it has not seen (a new prompt)
    _recent: dict[str, deque[float]] = field(default_factory=dict, repr=False, compare=False)

    def _ema(self, old: float, new: float) -> float:
        return self.decay * old + (1.0 - self.decay) * new

    def _refine(self, key: str, old: float | None, seconds: float) -> float:
        """The cost `key` after measuring `seconds`."""
        recent = self._recent.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        if len(recent) >= self.min_window:
            return statistics.median(recent)
        return seconds if old is None else self._ema(old, seconds)

    def observe_target(self, tokens: int, seconds: float) -> None:
        """A target forward over `tokens` positions (1 = plain decode, k+1 = verify) took `seconds`."""
        value = self._refine(f"v{tokens}", self.verify_s.get(tokens), seconds)
        self.verify_s[tokens] = value
        if tokens == 1:
            self.target_step_s = value

    def observe_draft(self, seconds_per_token: float) -> None:
        """One draft decode step took `seconds_per_token`."""
        self.draft_step_s = self._refine("draft", self.draft_step_s, seconds_per_token)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft caught up on `tokens` tokens in `seconds`."""
        self.draft_prefill_s = self._refine("catch_up", self.draft_prefill_s, seconds / max(1, tokens))

    def observe_host(self, kind: str, seconds: float) -> None:
        """A whole step of `kind` ("plain", or the source that drafted) spent `seconds` outside the model forwards:
        choosing k, verifying, committing, handing tokens over."""
        self.host_s[kind] = self._refine(f"host:{kind}", self.host_s.get(kind), max(0.0, seconds))

    def host(self, kind: str) -> float:
        """Host time of a step of `kind` ÷ target step cost (0 until measured)."""
        return self.host_s.get(kind, 0.0) / self.target_step_s

    @property
    def c(self) -> float:
        """Draft step cost ÷ target step cost."""
        return self.draft_step_s / self.target_step_s

    def v(self, k: int) -> float:
        """Verify cost of k+1 positions ÷ target step cost (interpolated when not yet measured)."""
        if k + 1 in self.verify_s:
            return self.verify_s[k + 1] / self.target_step_s
        known = sorted(self.verify_s)
        if not known:
            return 1.0
        below = max((n for n in known if n <= k + 1), default=known[0])
        above = min((n for n in known if n >= k + 1), default=known[-1])
        if below == above:
            per_extra = (self.verify_s[below] / self.target_step_s - 1.0) / max(1, below - 1)
            return 1.0 + per_extra * k
        w = (k + 1 - below) / (above - below)
        return ((1 - w) * self.verify_s[below] + w * self.verify_s[above]) / self.target_step_s

    def copy(self) -> CostModel:
        """An independent copy (per-session refinement of the shared calibration)."""
        return CostModel(self.target_step_s, self.draft_step_s, dict(self.verify_s), self.decay, self.window,
                         self.min_window, dict(self.host_s), self.draft_prefill_s,
                         {key: deque(values, maxlen=self.window) for key, values in self._recent.items()})


def _interpolate(table: dict[int, float], x: int) -> float:
    """table (size → seconds) at x: linear between measured sizes, the smallest one's below them, extended along
    the last two (never downwards) above them; never below a nanosecond."""
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
    slope = max(0.0, (last - table[known[-2]]) / (known[-1] - known[-2]))
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


@dataclass(frozen=True)
class BatchLoad:
    """What the other streams of this step bring: the tokens they put in the target forward, the tokens they are
    expected to commit, and how many of them draft with the draft model."""

    costs: BatchCosts
    tokens: int
    committed: float
    drafting: int
    k_limit: int | None = None  # the batch guard's cap on policy k at this width (0: drafting was slower there)


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted and rejected draft tokens: α = accepted / trials."""

    accepted: float = 3.0
    trials: float = 4.0
    decay: float = 0.95

    def observe(self, proposed: int, accepted: int) -> None:
        """Drafts are tested in order until the first rejection: `accepted` successes, one failure if any left."""
        if proposed == 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + trials

    @property
    def alpha(self) -> float:
        """Current estimate, clamped below 1 so E stays finite-looking."""
        return min(0.999, self.accepted / max(self.trials, 1e-9))


@dataclass
class RealizedRate:
    """Decayed seconds per committed token over whole steps (proposing, verifying, committing)."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    decay: float = 0.8

    def observe(self, seconds: float, tokens: int) -> None:
        """One step took `seconds` and committed `tokens`."""
        self.seconds = self.decay * self.seconds + seconds
        self.tokens = self.decay * self.tokens + tokens
        self.steps += 1

    @property
    def per_token(self) -> float:
        """Seconds per committed token (inf before any token)."""
        return self.seconds / self.tokens if self.tokens > 0 else float("inf")


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


def default_acceptance() -> dict[str, AcceptanceEstimate]:
    """Optimistic priors, so a new session tries speculating: the draft at α 0.75; each kind of prompt lookup match
    at 0.5 when first met (`AdaptivePolicy._alpha`)."""
    return {"draft": AcceptanceEstimate()}


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


@dataclass
class AdaptivePolicy:
    """Per-session choice of k for each proposer: argmax over k of S(k); 0 while S ≤ `min_speedup`, with periodic
    probes to come back. Prompt lookup drafts for free (c = 0); the draft model costs c per token. Sources are the
    proposals' `estimate` keys: "draft", and prompt lookup per n-gram size of its match ("lookup1".."lookup3")."""

    max_k: int
    costs: CostModel
    acceptance: dict[str, AcceptanceEstimate] = field(default_factory=default_acceptance)
    min_speedup: float = 1.05
    probe_every: int = 16
    probe_k: int = 2
    min_realized_steps: int = 4  # whole steps of a proposer before its realized rate can switch it off
    plain_every: int = 32  # speculative solo steps between two plain ones, which keep plain decoding's rate measured
    realized: dict[str, RealizedRate] = field(default_factory=dict)  # per proposer, and "plain" for k = 0
    _steps_off: dict[str, int] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)  # proposers whose next step is a probe
    _since_plain: int = 0  # solo steps with drafts since the last plain one

    def _alpha(self, source: str) -> AcceptanceEstimate:
        """The estimate for `source`; a kind not seen yet starts from the draft's prior, or prompt lookup's."""
        estimate = self.acceptance.get(source)
        if estimate is None:
            prior = AcceptanceEstimate() if source == "draft" else AcceptanceEstimate(accepted=1.0, trials=2.0)
            estimate = self.acceptance[source] = prior
        return estimate

    def speedups(self, source: str, cap: int, batch: BatchLoad | None = None) -> list[float]:
        """`speedup` for k = 0 .. cap, the terms every k shares computed once (a step weighs them all)."""
        a = self._alpha(source).alpha
        if batch is not None:
            plain = self._batch_rate(0, source, a, batch)
            return [1.0] + [self._batch_rate(k, source, a, batch) / plain for k in range(1, cap + 1)]
        c, plain, host = self._solo_terms(source)
        return [1.0] + [expected_tokens(a, k) * plain / (k * c + self.costs.v(k) + host) for k in range(1, cap + 1)]

    def _solo_terms(self, source: str) -> tuple[float, float, float]:
        """What a solo step's S(k) takes besides α and V(k): c (0 for prompt lookup, free to draft), 1 + the plain
        step's host time and the source's host time, in target steps."""
        c = self.costs.c if source == "draft" else 0.0
        return c, 1.0 + self.costs.host("plain"), self.costs.host(host_kind(source))

    def speedup(self, k: int, source: str = "draft", alpha: float | None = None, batch: BatchLoad | None = None
                ) -> float:
        """Expected speed-up over target-only decoding with k drafts from `source`; in a batch (`batch`), of the
        whole batch's tokens per second over this stream decoding plainly in it."""
        a = self._alpha(source).alpha if alpha is None else alpha
        if k == 0:
            return 1.0
        if batch is not None:
            return self._batch_rate(k, source, a, batch) / self._batch_rate(0, source, a, batch)
        c, plain, host = self._solo_terms(source)
        return expected_tokens(a, k) * plain / (k * c + self.costs.v(k) + host)

    @staticmethod
    def _batch_rate(k: int, source: str, alpha: float, batch: BatchLoad) -> float:
        """Expected tokens per second of the whole batch with this stream drafting k from `source`."""
        seconds = batch.costs.target(batch.tokens + k + 1)
        if source == "draft" and k:
            seconds += k * batch.costs.draft(batch.drafting + 1)
        return (batch.committed + expected_tokens(alpha, k)) / seconds

    def catch_up_pays(self, lag: int, remaining: int) -> bool:
        """Whether drafting is worth a catch-up of the draft on `lag` tokens it has not seen (a new prompt, turns it
        sat out) with at most `remaining` tokens left to generate: the time the draft's best k is expected to save
        over them against the catch-up's (`CostModel.draft_prefill_s`). A short request on a long new prompt, or a
        draft that barely pays, is better decoded without it (prompt lookup needs no catch-up)."""
        best = max(self.speedups("draft", self.max_k)[1:], default=1.0)
        if best <= 1.0:
            return False
        plain_step_s = self.costs.target_step_s * (1.0 + self.costs.host("plain"))
        return remaining * plain_step_s * (1.0 - 1.0 / best) > lag * self.costs.draft_prefill_s

    def expected(self, source: str, k: int) -> float:
        """Tokens a step with k drafts from `source` is expected to commit."""
        return expected_tokens(self._alpha(source).alpha, k) if k else 1.0

    def choose(self, source: str = "draft", load: int = 1, batch: BatchLoad | None = None) -> int:
        """k for the next step with `source`. `load` = streams sharing the device: the probe rate drops with it
        (probes cost every stream). `batch`: the step is shared with other streams (see the module docstring);
        the realized-rate guard judges only solo steps, whose times are this stream's own."""
        if self.max_k == 0:
            return 0
        speedups = self.speedups(source, self.max_k, batch)
        best_k = max(range(self.max_k + 1), key=speedups.__getitem__)  # the first of equal maxima
        realized = self.realized_speedup(source) if batch is None else float("inf")
        if speedups[best_k] <= self.min_speedup or realized <= self.min_speedup:
            off = self._steps_off.get(source, 0) + 1
            if off >= self.probe_every * max(1, load):
                self._steps_off[source] = 0
                self._probing.add(source)
                return min(self.probe_k, self.max_k)
            self._steps_off[source] = off
            self._probing.discard(source)
            return 0
        self._steps_off[source] = 0
        self._probing.discard(source)
        return best_k

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        """Record a verify step's outcome for the proposer that drafted."""
        self._alpha(source).observe(proposed, accepted)

    def observe_step(self, source: str, seconds: float, tokens: int, catch_up_s: float = 0.0) -> None:
        """A whole step with `source`'s drafts ("plain": none) took `seconds` and committed `tokens`, `catch_up_s` of
        it a draft catching up on tokens, which is left out: it is the price of the steps that did not run the draft
        (plain ones, prompt lookup's, a probe's sitting out), paid once, not what drafting costs from here on. A
        probe's step alone decides the rate (counted as judged: `min_realized_steps` - 1 earlier steps, with no
        weight)."""
        seconds -= catch_up_s
        self._since_plain = 0 if source == "plain" else self._since_plain + 1
        if source in self._probing:
            self._probing.discard(source)
            self.realized[source] = RealizedRate(steps=self.min_realized_steps - 1)
        self.realized.setdefault(source, RealizedRate()).observe(seconds, tokens)

    def plain_due(self) -> bool:
        """Whether the next solo step should decode plainly: one step in `plain_every` + 1 while speculating, so
        that the realized-rate guard compares each proposer with plain decoding as measured now, not with the
        start-up calibration (which a noisy start, or costs the model does not see, can leave far off)."""
        return self.max_k > 0 and self._since_plain >= self.plain_every

    def realized_speedup(self, source: str) -> float:
        """Measured speed-up of `source`'s steps over plain decoding (over one calibrated target step while no
        plain step was measured, which flatters plain decoding); inf until `min_realized_steps` steps were seen."""
        rate = self.realized.get(source)
        if rate is None or rate.steps < self.min_realized_steps:
            return float("inf")
        plain = self.realized.get("plain")
        plain_s = plain.per_token if plain is not None else self.costs.target_step_s
        return plain_s / rate.per_token
