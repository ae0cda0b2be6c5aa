"""How many tokens to draft: maximise the expected speed-up S(k) = E(α, k) / (k·c + V(k)), switch off at S ≤ 1.

α (acceptance per draft token) is estimated per session from decayed counts; c (one draft step ÷ one target step)
and V(k) (verifying k+1 tokens ÷ one target step) start from the device calibration and are refined online from
measured step times. While speculation is off, a probe every `probe_every` steps re-measures α so that a session
whose text became predictable comes back.

The model can miss costs it does not see (a draft catching up after sitting out, a GPU stalling on a shape met for
the first time, host work between kernels), so the policy also keeps the realized seconds per committed token of
each proposer's whole steps and switches a proposer off when it is not faster than plain decoding in fact. While a
proposer is off, what was measured before is stale: each probe restarts its realized rate from the probe's own step,
so a proposer comes back at the first good probe once the stall is gone, and stays off while probes are slow.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


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
                         self.min_window, {key: deque(values, maxlen=self.window)
                                           for key, values in self._recent.items()})


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


def default_acceptance() -> dict[str, AcceptanceEstimate]:
    """Optimistic priors, so a new session tries speculating: the draft at α 0.75, prompt lookup at 0.5."""
    return {"draft": AcceptanceEstimate(), "lookup": AcceptanceEstimate(accepted=1.0, trials=2.0)}


@dataclass
class AdaptivePolicy:
    """Per-session choice of k for each proposer: argmax over k of S(k); 0 while S ≤ `min_speedup`, with periodic
    probes to come back. Prompt lookup drafts for free (c = 0); the draft model costs c per token."""

    max_k: int
    costs: CostModel
    acceptance: dict[str, AcceptanceEstimate] = field(default_factory=default_acceptance)
    min_speedup: float = 1.05
    probe_every: int = 16
    probe_k: int = 2
    min_realized_steps: int = 4  # whole steps of a proposer before its realized rate can switch it off
    realized: dict[str, RealizedRate] = field(default_factory=dict)  # per proposer, and "plain" for k = 0
    _steps_off: dict[str, int] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)  # proposers whose next step is a probe

    def _alpha(self, source: str) -> AcceptanceEstimate:
        return self.acceptance.setdefault(source, AcceptanceEstimate())

    def speedup(self, k: int, source: str = "draft", alpha: float | None = None) -> float:
        """Expected speed-up over target-only decoding with k drafts from `source`."""
        a = self._alpha(source).alpha if alpha is None else alpha
        c = 0.0 if source == "lookup" else self.costs.c
        if k == 0:
            return 1.0
        return expected_tokens(a, k) / (k * c + self.costs.v(k))

    def choose(self, source: str = "draft", load: int = 1) -> int:
        """k for the next step with `source`. `load` = streams sharing the device: steps are interleaved, not
        batched, so each stream's S is unchanged by load; only the probe rate drops (probes cost every stream)."""
        if self.max_k == 0:
            return 0
        best_k = max(range(self.max_k + 1), key=lambda k: self.speedup(k, source))
        if self.speedup(best_k, source) <= self.min_speedup or self.realized_speedup(source) <= self.min_speedup:
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
        it a draft catching up on tokens. A probe's step alone decides the rate (counted as judged:
        `min_realized_steps` - 1 earlier steps, with no weight), without its catch-up: that is the one-off price of
        having sat out, not what speculating costs from here on."""
        if source in self._probing:
            self._probing.discard(source)
            self.realized[source] = RealizedRate(steps=self.min_realized_steps - 1)
            seconds -= catch_up_s
        self.realized.setdefault(source, RealizedRate()).observe(seconds, tokens)

    def realized_speedup(self, source: str) -> float:
        """Measured speed-up of `source`'s steps over plain decoding (over one calibrated target step while no
        plain step was measured, which flatters plain decoding); inf until `min_realized_steps` steps were seen."""
        rate = self.realized.get(source)
        if rate is None or rate.steps < self.min_realized_steps:
            return float("inf")
        plain = self.realized.get("plain")
        plain_s = plain.per_token if plain is not None else self.costs.target_step_s
        return plain_s / rate.per_token
