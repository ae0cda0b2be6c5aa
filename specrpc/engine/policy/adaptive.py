"""How many tokens to draft per stream: maximise the expected speed-up S(k) (below), switch off at S ≤ 1.

α (acceptance per draft token) is estimated per session from decayed counts; D(k) and V(k) are the device's
`CostModel` (every policy's, refined by every session's lone steps), the host times h the policy's own
(`HostTimes`): S(k) = E(α, k) (1 + h_plain) / (D(k) + V(k) + h_source). Where a target step is short (int8 weights,
a small model, a GPU) host time is a large part of a step, and a speculative step spends more of it than a plain
one. A draft's catch-up on a prompt it has not seen costs once per request, and it is paid only where the request's
remaining tokens are expected to save more (`catch_up_pays`). While speculation is off, a probe every `probe_every`
steps re-measures α so that a session whose text became predictable comes back; a probe of the draft waits longer
where it would first catch up on a prompt it never saw, until that costs at most `probe_share` of the time off.

The model can miss costs it does not see (a draft catching up after sitting out, a GPU stalling on a shape met for
the first time, host work between kernels, a draft evicting the target's weights from a cache), so the policy also
keeps the realized seconds per token of each proposer's whole steps and switches a proposer off when it is not
faster than plain decoding in fact. A drafted step's tokens are counted at their expectation E(α, k) at the
acceptance estimated so far, not as drawn: the rate judges what the steps cost, over a few steps, and α judges the
draws, over many (counted as drawn, a few unlucky drafts in a row switched off a draft 1.3× faster than plain
decoding at α 0.8, for a fifth to a quarter of the steps, and each probe that drew badly kept it off for
`probe_every` more). While a proposer is off, what was measured before is stale: each probe restarts its realized
rate from the probe's own step, so a proposer comes back at the first good probe once the stall is gone, and stays
off while probes are slow. Until a session has steps of its own, it judges by the device's (`SharedRates`: every
session's solo steps), so a server whose draft does not pay in fact does not pay again for learning it on every new
request (a draft's catch-up on each new prompt, a few slow steps).

In a batched step (several streams in one target forward, `BatchLoad`), a stream's k is chosen for the whole batch's
throughput: k maximises (others' expected tokens + E(α, k)) ÷ (batch time with this stream's k + 1 tokens + the
step's batched draft forwards, its k drafts among them). Alone, that is S(k); as the batch grows, the tokens a stream
adds cost every stream's step while adding only its own E, so k shrinks and turns off when plain batched decoding is
faster; a stream that joins draft forwards others already run adds only its rows to them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from specrpc.engine.policy.costs import BatchCosts, CostModel, HostTimes, host_kind


def expected_tokens(alpha: float, k: int) -> float:
    """E = (1 − α^(k+1)) / (1 − α): tokens committed per verify step with k drafts (k + 1 at α = 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class BatchLoad:
    """What the other streams of this step bring: the tokens they put in the target forward, the tokens they are
    expected to commit, and the rows they put in each of the step's batched draft forwards."""

    costs: BatchCosts
    tokens: int
    committed: float
    draft_rows: tuple[int, ...] = ()  # forward j: the streams drafting more than j tokens with the draft model
    k_limit: int | None = None  # the batch guard's cap on policy k at this width (0: drafting was slower there)

    def draft_seconds(self, k: int) -> float:
        """Seconds of the step's batched draft forwards with this stream drafting k tokens besides the others: it
        joins the first k of them. A batched draft forward costs about as much for one row as for several (the
        draft's weights are read once: 0.21 ms for 1 row, 0.28 for 4, float32 on a 2-core AMD EPYC Zen 4), so a
        stream that joins the others' forwards adds little, and one that drafts alone pays whole forwards."""
        others, joined, alone = self._draft_terms
        n = len(self.draft_rows)
        return others + joined[min(k, n)] + max(0, k - n) * alone

    @functools.cached_property
    def _draft_terms(self) -> tuple[float, list[float], float]:
        """For `draft_seconds` (read for every k of every stream's choice): the others' draft forwards' seconds, what
        joining the first j of them adds (j = 0 .. their count), and a draft forward of one row."""
        draft = self.costs.draft
        others, joined = 0.0, [0.0]
        for n in self.draft_rows:
            theirs = draft(n) if n else 0.0
            others += theirs
            joined.append(joined[-1] + draft(n + 1) - theirs)
        return others, joined, draft(1)


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
    """Decayed seconds per token over whole steps (proposing, verifying, committing): committed, or a drafted step's
    expected (`AdaptivePolicy.observe_step`)."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    decay: float = 0.8

    def observe(self, seconds: float, tokens: float) -> None:
        """One step took `seconds` and committed `tokens` (or is expected to: `AdaptivePolicy.observe_step`)."""
        self.seconds = self.decay * self.seconds + seconds
        self.tokens = self.decay * self.tokens + tokens
        self.steps += 1

    @property
    def per_token(self) -> float:
        """Seconds per committed token (inf before any token)."""
        return self.seconds / self.tokens if self.tokens > 0 else float("inf")


@dataclass
class SharedRates:
    """Realized rates of every session's solo steps on one device, per proposer and for plain decoding: what a
    session judges by until it has steps of its own (`AdaptivePolicy.realized_speedup`)."""

    rates: dict[str, RealizedRate] = field(default_factory=dict)

    def observe(self, source: str, seconds: float, tokens: float) -> None:
        """A session's solo step with `source`'s drafts ("plain": none)."""
        self.rates.setdefault(source, RealizedRate()).observe(seconds, tokens)


PRIORS = {"draft": (3.0, 4.0), "prediction": (9.0, 10.0)}
"""(accepted, trials) a source's acceptance starts from: the draft at 0.75, a client's prediction at 0.9 (where it is
aligned with the output it is mostly right; a long first span is what it is sent for), prompt lookup's kinds at
0.5."""


def default_acceptance() -> dict[str, AcceptanceEstimate]:
    """Optimistic priors, so a new session tries speculating: the draft at α 0.75; each kind of prompt lookup match
    at 0.5 when first met (`AdaptivePolicy._alpha`)."""
    return {"draft": AcceptanceEstimate()}


@dataclass
class AdaptivePolicy:
    """Per-session choice of k for each proposer: argmax over k of S(k); 0 while S ≤ `min_speedup`, with periodic
    probes to come back. Prompt lookup drafts for free; the draft model costs D(k) for k tokens. Sources are the
    proposals' `estimate` keys: "draft", and prompt lookup per n-gram size of its match ("lookup1".."lookup3")."""

    max_k: int
    costs: CostModel  # the device's, shared with every other policy
    acceptance: dict[str, AcceptanceEstimate] = field(default_factory=default_acceptance)
    host: HostTimes = field(default_factory=HostTimes)  # this policy's steps' own
    min_speedup: float = 1.05
    probe_every: int = 16
    probe_k: int = 2
    probe_share: float = 0.05  # most of the time spent off that a probe's catch-up on a prompt may cost (`choose`)
    min_realized_steps: int = 4  # whole steps of a proposer before its realized rate can switch it off
    plain_every: int = 32  # speculative solo steps between two plain ones, which keep plain decoding's rate measured
    realized: dict[str, RealizedRate] = field(default_factory=dict)  # per proposer, and "plain" for k = 0
    shared: SharedRates | None = None  # the device's, every session's (None: this session's steps alone)
    _steps_off: dict[str, int] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)  # proposers whose next step is a probe
    _since_plain: int = 0  # solo steps with drafts since the last plain one

    def _alpha(self, source: str) -> AcceptanceEstimate:
        """The estimate for `source`; a kind not seen yet starts from its prior (`PRIORS`), else prompt lookup's."""
        estimate = self.acceptance.get(source)
        if estimate is None:
            accepted, trials = PRIORS.get(source, (1.0, 2.0))
            prior = AcceptanceEstimate(accepted=accepted, trials=trials)
            estimate = self.acceptance[source] = prior
        return estimate

    def speedups(self, source: str, cap: int, batch: BatchLoad | None = None) -> list[float]:
        """`speedup` for k = 0 .. cap, the terms every k shares computed once (a step weighs them all)."""
        a = self._alpha(source).alpha
        if batch is not None:
            plain = self._batch_rate(0, source, a, batch)
            return [1.0] + [self._batch_rate(k, source, a, batch) / plain for k in range(1, cap + 1)]
        return self._solo(source, a, cap)

    def _solo(self, source: str, alpha: float, cap: int) -> list[float]:
        """A lone step's S(k) for k = 0 .. cap: E(α, k) (1 + h_plain) / (D(k) + V(k) + h_source), 1 at k = 0; D(k)
        for the draft model, nothing for prompt lookup."""
        plain, host = 1.0 + self._host("plain"), self._host(host_kind(source))
        drafts, verifies = self.costs.ratios(max(cap, self.max_k))
        drafted = source == "draft"
        return [1.0] + [expected_tokens(alpha, k) * plain / ((drafts[k] if drafted else 0.0) + verifies[k] + host)
                        for k in range(1, cap + 1)]

    def _host(self, kind: str) -> float:
        """Host time of a step of `kind` (`HostTimes.of`) ÷ the target step's."""
        return self.host.of(kind) / self.costs.target_step_s

    def speedup(self, k: int, source: str = "draft", alpha: float | None = None, batch: BatchLoad | None = None
                ) -> float:
        """Expected speed-up over target-only decoding with k drafts from `source`; in a batch (`batch`), of the
        whole batch's tokens per second over this stream decoding plainly in it."""
        a = self._alpha(source).alpha if alpha is None else alpha
        if k == 0:
            return 1.0
        if batch is not None:
            return self._batch_rate(k, source, a, batch) / self._batch_rate(0, source, a, batch)
        return self._solo(source, a, k)[k]

    @staticmethod
    def _batch_rate(k: int, source: str, alpha: float, batch: BatchLoad) -> float:
        """Expected tokens per second of the whole batch with this stream drafting k from `source`: the target's
        forward over every stream's tokens and the step's draft forwards, this stream's drafts among them where it
        drafts with the draft model (the others' are paid whatever it does)."""
        seconds = batch.costs.target(batch.tokens + k + 1) + batch.draft_seconds(k if source == "draft" else 0)
        return (batch.committed + expected_tokens(alpha, k)) / seconds

    def catch_up_pays(self, lag: int, remaining: int) -> bool:
        """Whether drafting is worth a catch-up of the draft on `lag` tokens it has not seen (a new prompt, turns it
        sat out) with at most `remaining` tokens left to generate: the time the draft's best k is expected to save
        over them against the catch-up's (`CostModel.draft_prefill_s`). A short request on a long new prompt, or a
        draft that barely pays, is better decoded without it (prompt lookup needs no catch-up)."""
        best = max(self.speedups("draft", self.max_k)[1:], default=1.0)
        if best <= 1.0:
            return False
        return remaining * self._plain_step_s() * (1.0 - 1.0 / best) > lag * self.costs.draft_prefill_s

    def _plain_step_s(self) -> float:
        """Seconds of a plain step: the target's forward and the host's work around it."""
        return self.costs.target_step_s + self.host.of("plain")

    def expected(self, source: str, k: int) -> float:
        """Tokens a step with k drafts from `source` is expected to commit."""
        return expected_tokens(self._alpha(source).alpha, k) if k else 1.0

    def choose(self, source: str = "draft", load: int = 1, batch: BatchLoad | None = None, catch_up: int = 0) -> int:
        """k for the next step with `source`. `load` = streams sharing the device: the probe rate drops with it
        (probes cost every stream). `batch`: the step is shared with other streams (see the module docstring);
        the realized-rate guard judges only solo steps, whose times are this stream's own. `catch_up`: the tokens a
        step drafting with `source` would first catch the draft up on (the steps it sat out, a prompt it never
        saw): while off, a probe waits until what it catches up on beyond the steps off is at most
        `probe_share` of their time, so that probing a draft that does not pay costs a bounded share of the time
        however long the prompts are (while off the draft sees no prompt: each probe catches it up on a whole
        one)."""
        if self.max_k == 0:
            return 0
        speedups = self.speedups(source, self.max_k, batch)
        best_k = max(range(self.max_k + 1), key=speedups.__getitem__)  # the first of equal maxima
        realized = self.realized_speedup(source) if batch is None else float("inf")
        if speedups[best_k] <= self.min_speedup or realized <= self.min_speedup:
            off = self._steps_off.get(source, 0) + 1
            beyond_s = (catch_up - off) * self.costs.draft_prefill_s  # catching up on more than the steps off
            if off >= self.probe_every * max(1, load) and beyond_s <= self.probe_share * off * self._plain_step_s():
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

    def observe_step(self, source: str, seconds: float, tokens: float, catch_up_s: float = 0.0,
                     share: bool = True, drafts: int = 0) -> None:
        """A whole step with `source`'s drafts ("plain": none) took `seconds` and committed `tokens`, `catch_up_s` of
        it a draft catching up on tokens, which is left out: it is the price of the steps that did not run the draft
        (plain ones, prompt lookup's, a probe's sitting out), paid once, not what drafting costs from here on. A
        probe's step alone decides the rate (counted as judged: `min_realized_steps` - 1 earlier steps, with no
        weight). `share`: also into the device's rates (not a request's own k, which the policy did not choose).
        `drafts`: the step's k (after `observe` took its outcome), its tokens then counted at `expected` instead."""
        if drafts:
            tokens = self.expected(source, drafts)
        seconds -= catch_up_s
        self._since_plain = 0 if source == "plain" else self._since_plain + 1
        if source in self._probing:
            self._probing.discard(source)
            self.realized[source] = RealizedRate(steps=self.min_realized_steps - 1)
        self.realized.setdefault(source, RealizedRate()).observe(seconds, tokens)
        if self.shared is not None and share:
            self.shared.observe(source, seconds, tokens)

    def plain_due(self) -> bool:
        """Whether the next solo step should decode plainly: one step in `plain_every` + 1 while speculating, so
        that the realized-rate guard compares each proposer with plain decoding as measured now, not with the
        start-up calibration (which a noisy start, or costs the model does not see, can leave far off)."""
        return self.max_k > 0 and self._since_plain >= self.plain_every

    def realized_speedup(self, source: str) -> float:
        """Measured speed-up of `source`'s steps over plain decoding: this session's, else (fewer than
        `min_realized_steps` of its own) the device's (`shared`); plain decoding's likewise, else one calibrated
        target step (which flatters plain decoding); inf until `min_realized_steps` steps were seen."""
        rate = self._measured(source)
        if rate is None:
            return float("inf")
        plain = self.realized.get("plain") or self._measured("plain")
        plain_s = plain.per_token if plain is not None else self.costs.target_step_s
        return plain_s / rate.per_token

    def _measured(self, source: str) -> RealizedRate | None:
        """`source`'s realized rate with at least `min_realized_steps` steps: this session's, else the device's."""
        for rates in (self.realized, self.shared.rates if self.shared is not None else {}):
            rate = rates.get(source)
            if rate is not None and rate.steps >= self.min_realized_steps:
                return rate
        return None
