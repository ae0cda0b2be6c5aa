"""The speculative decoding loop: prefill → propose → score k+1 positions in one target forward → verify → commit.

The engine knows nothing of gRPC or asyncio. A `Generation` is a step-wise generator: the scheduler calls `step()`
until `finished`, and may simply stop calling it (cancellation between steps). KV invariant per slot: each model's
cache holds a prefix of `Slot.tokens`; the target holds all committed tokens but the last (whose logits the next step
needs), the draft at most as many. Rollback after a rejection is truncating the cache lengths.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specrpc.config import EngineConfig
from specrpc.engine.policy import AdaptivePolicy, BatchCosts, BatchGuard, BatchLoad, CostModel, host_kind
from specrpc.engine.proposers import (
    EMPTY,
    STEADY_CATCH_UP,
    DraftModelProposer,
    DraftRequest,
    PromptLookupProposer,
    Proposal,
    Proposer,
    feed,
)
from specrpc.engine.sampling import SamplingParams, logits_to_probs, make_generator, sample
from specrpc.engine.verify import VerifyResult, verify
from specrpc.models import BatchRow, CausalLM

Verifier = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, SamplingParams, torch.Generator | None], VerifyResult
]
"""(draft ids [k], draft probs [k, V] | None, target logits [k+1, V], params, generator) → accepted + tokens."""

FINISH_LENGTH = "length"
FINISH_STOP = "stop"

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities for (OpenAI's and vLLM's limit)."""

MAX_SUGGESTION_TOKENS = 64
"""Most tokens of the session's last suggestion verified in one step (it is a draft the editor already shows, so
it is drafted whole rather than in the policy's k)."""

PREFILL_STALL = 4.0
"""While streams decode, the prefill chunks mixed into their step make it at most this many times as long as their
plain step (by the measured batch costs): a long prompt delays each of them by a bounded factor, not by its whole
chunk, and is prefilled over more steps."""

MIN_PREFILL_SHARE = 16
"""Fewest prompt tokens a prefilling stream takes in a batched step, whatever the budget: every prompt moves on."""


@dataclass(frozen=True)
class Logprob:
    """A token and the target's log-probability of it at one position."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's raw logits (log-softmax, before temperature, top-k and
    top-p: what OpenAI and vLLM report) and the `top_logprobs` most likely tokens at that position, best first."""

    token_id: int
    logprob: float
    top: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate, in tokens."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    num_draft_tokens: int | None = None
    proposer: str | None = None
    stop_token_ids: frozenset[int] = frozenset()
    prefill_only: bool = False  # cache the prompt (target and draft) and generate nothing
    logprobs: bool = False  # report each emitted token's TokenLogprob
    top_logprobs: int = 0  # with logprobs: alternatives per token, 0..MAX_TOP_LOGPROBS
    suggestion: Proposer | None = None  # the session's last completion as a draft (proposers.SuggestionProposer)


@dataclass
class GenerationStats:
    """Per-request figures."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    last_k: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    tokens_cached: int = 0  # positions of the slot's context in the target's KV cache when the request ended
    suggestion_accepted: int = 0  # draft tokens accepted from the session's last suggestion

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step (accepted + recovered/bonus)."""
        return statistics.fmean(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ proposed."""
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True)
class StepResult:
    """Tokens committed by one step (prefill's first token, or one verify step's burst)."""

    token_ids: list[int]
    accepted: int
    proposed: int
    finish: str | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for logprobs


@dataclass
class Stall:
    """Test hook (`Engine.stall`): seconds slept in every speculative step, after drafting (`draft_s`) or after
    verifying (`verify_s`): inside the step's measured time but outside the cost model's draft, verify and host
    timings, like the stalls the realized-rate guard is there for (a first-seen shape, a catch-up)."""

    draft_s: float = 0.0
    verify_s: float = 0.0


@dataclass
class Slot:
    """One KV slot's state: the token context whose prefix both caches hold, and its session's policy."""

    index: int
    tokens: list[int]
    policy: AdaptivePolicy


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (list comparisons, halving the span where they differ)."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference, if any, lies in [lo, hi)
    if a[:n] == b[:n]:
        return n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Engine:
    """Target + optional draft resident on one device, with preallocated KV slots."""

    def __init__(self, target: CausalLM, draft: CausalLM | None, config: EngineConfig,
                 verifier: Verifier = verify) -> None:
        """`verifier`: the acceptance decision; `verify` (exact) except in benchmarks that simulate acceptance."""
        self.target = target
        self.draft = draft
        self.config = config
        self.verifier = verifier
        self.stall: Stall | None = None  # test hook, see Stall
        self.max_k = 0 if config.speculation == "off" else config.max_draft_tokens
        self.costs = CostModel()
        self.calibration_rounds = 0  # measured rounds of the last `calibrate`
        self.batch_costs = BatchCosts()  # batched steps' costs by total tokens, shared by every stream
        self.batch_guard = BatchGuard()  # whether speculating pays in fact, per batch width
        self.slots: dict[int, Slot] = {}  # each index's slot state (`new_slot`): where a prompt's prefix may be cached
        self.lookup = PromptLookupProposer()
        self.drafter = DraftModelProposer(draft, config.prefill_chunk) if draft is not None else None
        # "combined": each step, prompt lookup when it finds a match worth verifying, else the draft model
        self.proposers = frozenset({"lookup", "draft", "combined"} if draft is not None else {"lookup"})
        self.default_proposer = config.proposer if config.proposer in self.proposers else "lookup"
        self.vocab = max(target.vocab_size, draft.vocab_size if draft else 0)

    @property
    def capacity(self) -> int:
        """Context positions available to committed tokens per slot."""
        return self.config.max_context

    def new_slot(self, index: int, policy: AdaptivePolicy | None = None) -> Slot:
        """Fresh slot state with `policy`, by default a new one seeded from the device calibration."""
        self.target.truncate(index, 0)
        if self.draft is not None:
            self.draft.truncate(index, 0)
        slot = self.slots[index] = Slot(index, [], policy if policy is not None else self.new_policy())
        return slot

    def prefix_source(self, index: int, prompt: list[int]) -> tuple[Slot, int] | None:
        """The slot other than `index` whose target cache holds the longest prefix of `prompt`, and its length (its
        draft's may be shorter); None where no other slot holds any."""
        best: tuple[Slot, int] | None = None
        for other in self.slots.values():
            if other.index == index:
                continue
            held = min(common_prefix(other.tokens, prompt), self.target.length(other.index))
            if held > (best[1] if best is not None else 0):
                best = (other, held)
        return best

    def reset_slot(self, slot: Slot) -> None:
        """Forget a slot's cached context (after a failure mid-step its caches may be inconsistent)."""
        slot.tokens.clear()
        self.target.truncate(slot.index, 0)
        if self.draft is not None:
            self.draft.truncate(slot.index, 0)

    def new_policy(self) -> AdaptivePolicy:
        """Adaptive policy refined online from the shared calibration."""
        return AdaptivePolicy(max_k=self.max_k, costs=self.costs.copy())

    def calibrate(self, slot: int = 0, context: int = 256, repeats: int = 9, budget_s: float = 3.0,
                  max_repeats: int = 40, settle: float = 0.01) -> CostModel:
        """Measure one target decode step, verifying k+1 = 2..max_k+1 tokens and one draft decode step; this is also
        the warm-up (a first, unmeasured round meets every shape). At `context` positions (within the capacity): a
        verify's extra cost over a decode step grows with the context its k+1 queries attend to, and the costs of
        the k the policy does not use are never re-measured, so a short calibration context would leave long drafts
        looking cheaper than the ones measured online.

        The policy needs ratios (c, V(k)), and on a shared machine a slow spell stretches every time measured
        during it: so each round times the width-1 step before and after its verify and draft steps and keeps
        each step's ratio to their mean, and the costs are medians of those ratios over at least `repeats` rounds,
        more (up to `max_repeats`, within `budget_s`) until no median ratio moves by more than `settle` from one
        round to the next. The seconds are the median width-1 step times the median ratios."""
        context = max(1, min(context, self.capacity - self.max_k - 2))
        ids = [(i * 7919) % min(self.target.vocab_size, 256) for i in range(context + self.max_k + 2)]
        feed(self.target, slot, ids[:context], 0, self.config.prefill_chunk)
        if self.draft is not None:
            feed(self.draft, slot, ids[:context], 0, self.config.prefill_chunk)

        def timed(model: CausalLM, width: int) -> float:
            model.truncate(slot, context)
            batch = torch.tensor(ids[context : context + width], dtype=torch.long, device=model.device)  # [width]
            t0 = time.perf_counter()
            model.forward(batch, context, slot, num_logits=width).float().sum().item()
            return time.perf_counter() - t0

        units: list[float] = []
        ratios: dict[str, list[float]] = {}
        previous: dict[str, float] = {}
        t_start = time.perf_counter()
        for round_ in range(max_repeats + 1):
            before = timed(self.target, 1)
            times = {f"v{width}": timed(self.target, width) for width in range(2, self.max_k + 2)}
            if self.draft is not None:
                times["draft"] = timed(self.draft, 1)
            unit = (before + timed(self.target, 1)) / 2
            if round_ == 0:
                continue  # warm-up: first-time shapes
            units.append(unit)
            for name, seconds in times.items():
                ratios.setdefault(name, []).append(seconds / unit)
            medians = {name: statistics.median(values) for name, values in ratios.items()}
            settled = all(abs(m - previous.get(name, 0.0)) <= settle * m for name, m in medians.items())
            previous = medians
            if round_ >= repeats and (settled or time.perf_counter() - t_start > budget_s):
                break
        self.target.truncate(slot, 0)
        if self.draft is not None:
            self.draft.truncate(slot, 0)
        step = statistics.median(units)
        costs = CostModel(target_step_s=step)
        costs.verify_s[1] = step
        for width in range(2, self.max_k + 2):
            costs.verify_s[width] = step * previous[f"v{width}"]
        costs.draft_step_s = step * previous["draft"] if "draft" in previous else step
        if self.draft is not None:  # a catch-up's cost per token: the draft fed the context again (warm now)
            t0 = time.perf_counter()
            feed(self.draft, slot, ids[:context], 0, self.config.prefill_chunk)
            costs.draft_prefill_s = (time.perf_counter() - t0) / context
            self.draft.truncate(slot, 0)
        self.calibration_rounds = len(units)
        self.costs = costs
        return costs

    def calibrate_batches(self, slots: list[int], context: int = 64, repeats: int = 3) -> BatchCosts:
        """Measure batched target forwards over 1, 2, 4, … of `slots` (distinct, empty; left empty) with 1, k/2+1
        and k+1 tokens per row, and batched draft forwards of one token per row: the costs the policy starts from in
        a batched step (refined online from every one)."""
        widths = [w for w in (1, 2, 4, 8, 16, 32) if w <= len(slots)]
        per_row = sorted({1, self.max_k // 2 + 1, self.max_k + 1})
        ids = [(i * 7919) % min(self.target.vocab_size, 256) for i in range(context + self.max_k + 2)]
        costs = BatchCosts()
        models = [self.target] if self.draft is None else [self.target, self.draft]
        for model in models:
            for slot in slots[: widths[-1]]:
                model.truncate(slot, 0)
                feed(model, slot, ids[:context], 0, self.config.prefill_chunk)
        for width in widths:
            for tokens in per_row if self.max_k else [1]:
                times: list[float] = []
                for _ in range(repeats):
                    rows = [BatchRow(torch.tensor(ids[context : context + tokens], dtype=torch.long,
                                                  device=self.target.device), context, s, tokens)
                            for s in slots[:width]]
                    t0 = time.perf_counter()
                    out = self.target.forward_batch(rows)
                    out[-1].sum().item()
                    times.append(time.perf_counter() - t0)
                costs.target_s[width * tokens] = statistics.median(times)
            if self.draft is not None and self.max_k:
                times = []
                for _ in range(repeats):
                    rows = [BatchRow(torch.tensor(ids[context : context + 1], dtype=torch.long,
                                                  device=self.draft.device), context, s, 1) for s in slots[:width]]
                    t0 = time.perf_counter()
                    self.draft.forward_batch(rows)[-1].sum().item()
                    times.append(time.perf_counter() - t0)
                costs.draft_s[width] = statistics.median(times)
        for model in models:
            for slot in slots[: widths[-1]]:
                model.truncate(slot, 0)
        self.batch_costs = costs
        return costs

    def step_many(self, gens: list[Generation]) -> list[StepResult | Exception]:
        """One device step for several generations on distinct slots: each prefilling one takes a prefill chunk
        (together within `_prefill_budget` tokens, at least `MIN_PREFILL_SHARE` each), each decoding one plans its
        proposal with the batch's load in view, the draft model drafts for all that use it together, and the target
        runs every row (prefill chunks, verify k+1, plain decode 1) in one batched forward; then each verifies and
        commits alone.
        Returns per generation its StepResult or the exception that ended its step (the others go on; a failure
        of a shared forward fails every generation in it). One generation steps exactly as `Generation.step`."""
        if len(gens) == 1:
            try:
                return [gens[0].step()]
            except Exception as exc:  # the caller's to report, as for a batch
                return [exc]
        step_t0 = time.perf_counter()
        results: dict[int, StepResult | Exception] = {}
        live: list[int] = []
        for i, gen in enumerate(gens):
            try:
                if gen.finished:
                    raise RuntimeError("generation already finished")
                if not gen.started:
                    gen._reuse_prefix()
                live.append(i)
            except Exception as exc:
                results[i] = exc
        prefilling = [i for i in live if gens[i].prefilling]
        decoding = [i for i in live if not gens[i].prefilling]
        rows: dict[int, BatchRow] = {}
        if prefilling:  # the budget's search over the batch costs only where a prompt takes it
            share = max(MIN_PREFILL_SHARE, self._prefill_budget(len(decoding)) // len(prefilling))
            for i in prefilling:
                rows[i] = gens[i]._prefill_row(share)
            self._prefill_draft(gens, prefilling, rows, results)
        limit: int | None = None
        if prefilling and not self.batch_guard.drafting_on(len(gens)):
            limit = 0  # the guard judges steps without prompts; the prompts join the width they make next
        elif len(decoding) > 1:
            limit = self.batch_guard.plan(len(decoding))
        proposals, catch_up_s = self._plan_batch(gens, decoding, sum(r.ids.shape[0] for r in rows.values()), results,
                                                 limit)
        planned = [i for i in proposals if gens[i].fixed_k is None and proposals[i].source != "suggestion"]
        self.batch_guard.observe_share(len(gens), sum(proposals[i].source == "draft" for i in planned), len(planned))
        if self.stall is not None and any(len(p) for p in proposals.values()):
            time.sleep(self.stall.draft_s)
        for i, proposal in proposals.items():
            rows[i] = gens[i]._verify_row(proposal)
        order = sorted(rows)
        if order:
            t0 = time.perf_counter()
            try:
                outs = self.target.forward_batch([rows[i] for i in order])
            except Exception as exc:  # a shared forward: every row's slot may be half written
                results.update(dict.fromkeys(order, exc))
                outs = []
            if outs:
                self.batch_costs.observe_target(sum(rows[i].ids.shape[0] for i in order), time.perf_counter() - t0)
                if self.stall is not None and any(len(p) for p in proposals.values()):
                    time.sleep(self.stall.verify_s)
            for i, logits in zip(order, outs, strict=False):
                try:
                    gen = gens[i]
                    results[i] = (gen._verified(proposals[i], logits, t0, None) if i in proposals
                                  else gen._prefill_done(logits, rows[i]))
                except Exception as exc:
                    results[i] = exc
        if not prefilling and len(decoding) > 1 and all(isinstance(results[i], StepResult) for i in decoding):
            committed = sum(len(r.token_ids) for r in results.values() if isinstance(r, StepResult))
            policy_drafted = any(len(p) and gens[i].fixed_k is None and p.source != "suggestion"
                                 for i, p in proposals.items())  # what the guard decides on; the rest is given
            self.batch_guard.observe(len(decoding), policy_drafted, time.perf_counter() - step_t0 - catch_up_s,
                                     committed, catch_up_s)  # a catch-up is the price of the steps the drafts sat out
        return [results[i] for i in range(len(gens))]

    def _prefill_budget(self, decoding: int) -> int:
        """Prompt tokens a batched step takes in prefill chunks: `prefill_chunk` when no stream decodes in it, else
        the most that keep the target forward within `PREFILL_STALL` × the decoding streams' plain one."""
        chunk = self.config.prefill_chunk
        if not decoding:
            return chunk
        costs = self.batch_costs
        ceiling = PREFILL_STALL * costs.target(decoding)
        lo, hi = MIN_PREFILL_SHARE, chunk
        while lo < hi:  # the largest n with target(decoding + n) within the ceiling (at least the smallest share)
            mid = (lo + hi + 1) // 2
            if costs.target(decoding + mid) <= ceiling:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _prefill_draft(self, gens: list[Generation], prefilling: list[int], rows: dict[int, BatchRow],
                       results: dict[int, StepResult | Exception]) -> None:
        """The draft takes the same prefill chunks as the target (one batched draft forward), for the prompts that
        will draft and whose draft cache has reached the chunk: a request's own k always, the policy's where the
        guard has drafting on at this width and the policy has drafted there lately (elsewhere it would likely be
        spent for nothing; the draft catches up if drafting comes): otherwise the first batched draft after a
        prefill would catch up on whole prompts at once, in a step every stream waits for. A failure fails those
        rows."""
        if self.draft is None or self.max_k == 0:
            return
        guard, draft = self.batch_guard, self.draft
        policy = guard.drafting_on(len(gens)) and not guard.draft_idle(len(gens))
        chunks = [i for i in prefilling if gens[i].proposer != "lookup" and draft.length(rows[i].slot) == rows[i].start
                  and (policy if (k := gens[i].fixed_k) is None else k > 0)]
        if not chunks:
            return
        try:
            draft.forward_batch([rows[i] for i in chunks])
        except Exception as exc:  # a shared forward: every row's slot may be half written
            for i in chunks:
                results[i] = exc
                del rows[i]

    def _plan_batch(self, gens: list[Generation], decoding: list[int], prefill_tokens: int,
                    results: dict[int, StepResult | Exception], limit: int | None
                    ) -> tuple[dict[int, Proposal], float]:
        """Each decoding generation's proposal for this step (and the seconds its drafts spent catching up), k
        chosen with the rest of the batch in view (those planned before it at their k, those after it as plain
        decoding; policy k at most `limit`, the guard's); draft-model proposals drafted together. The policy's
        drafts catch up (beyond the steady `STEADY_CATCH_UP` tokens, after sitting out steps) within
        `prefill_chunk` tokens in all, the first always, the others in later steps once earlier ones caught up:
        speculation coming back at a wide batch does not stall every stream for whole prompts. A generation whose
        planning fails gets its exception in `results`."""
        tokens, committed, drafting = prefill_tokens + len(decoding), float(len(decoding)), 0
        catching_up = 0  # tokens the drafts planned so far must catch up on first
        plans: dict[int, Proposal | int] = {}
        for i in decoding:
            gen = gens[i]
            tokens, committed = tokens - 1, committed - 1
            gen.load = BatchLoad(self.batch_costs, tokens, committed, drafting, limit)
            try:
                plan = gen._plan()
            except Exception as exc:
                results[i] = exc
                continue
            finally:
                gen.load = None
            if isinstance(plan, int) and gen.fixed_k is None and self.draft is not None:
                lag = gen._draft_lag()  # what its draft must catch up on
                if lag > STEADY_CATCH_UP:
                    if catching_up and catching_up + lag > self.config.prefill_chunk:
                        plan = EMPTY  # it drafts in a later step: this step's catch-up budget is spent
                    else:
                        catching_up += lag
            k = plan if isinstance(plan, int) else len(plan)
            source = "draft" if isinstance(plan, int) else plan.estimate
            tokens += k + 1
            committed += gen.slot.policy.expected(source, k)
            drafting += isinstance(plan, int)
            plans[i] = plan
        proposals = {i: p for i, p in plans.items() if isinstance(p, Proposal)}
        wanted = {i: p for i, p in plans.items() if not isinstance(p, Proposal)}
        catch_up_s = 0.0
        if wanted:
            assert self.drafter is not None
            try:
                drafted, timings, catch_up_s = self.drafter.propose_batch(
                    [gens[i]._draft_request(k) for i, k in wanted.items()])
            except Exception as exc:  # a shared forward: every drafting stream's step fails
                results.update(dict.fromkeys(wanted, exc))
                drafted, timings = [], []
            proposals.update(zip(wanted, drafted, strict=False))
            for width, seconds in timings:
                self.batch_costs.observe_draft(width, seconds)
            # the first forward also drafts (the steady forward it extends): only what it took beyond one is catch-up
            catch_up_s = max(0.0, catch_up_s - self.batch_costs.draft(len(wanted))) if catch_up_s else 0.0
        return proposals, catch_up_s

    def start(self, slot: Slot, request: GenerationRequest) -> Generation:
        """A generation on `slot`, reusing the cached prefix shared with the prompt."""
        return Generation(self, slot, request)


class Generation:
    """One request's decoding, advanced one step per `step()` call."""

    def __init__(self, engine: Engine, slot: Slot, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(request.prompt_ids) >= engine.capacity:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in a context of "
                             f"{engine.capacity}")
        self.engine = engine
        self.slot = slot
        self.request = request
        self.params = request.sampling
        self.generator = make_generator(request.sampling, engine.target.device)
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        self.finish: str | None = None
        self.started = False
        self.prefill_pos = 0
        self.load: BatchLoad | None = None  # set by `Engine.step_many` while it plans a batched step
        name = request.proposer or engine.default_proposer
        if name not in engine.proposers:
            raise ValueError(f"proposer {name!r} is not available; loaded: {sorted(engine.proposers)}")
        self.proposer = name
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        # the server's `--speculation off` wins over a request's num_draft_tokens: the operator turned it off
        self.fixed_k = 0 if engine.max_k == 0 else request.num_draft_tokens
        if engine.config.speculation == "fixed" and self.fixed_k is None:
            self.fixed_k = engine.max_k

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish is not None

    @property
    def generated(self) -> int:
        """Tokens committed so far by this generation."""
        return self.stats.completion_tokens

    @property
    def prefilling(self) -> bool:
        """True until the prompt is fully in the target's cache and the first token is out."""
        return not self.started or self.prefill_pos < len(self.request.prompt_ids)

    def step(self) -> StepResult:
        """One prefill chunk (the last one emits the first token), or one speculative step.

        Long prompts take several steps so that other streams sharing the device keep their turn.
        """
        if self.finished:
            raise RuntimeError("generation already finished")
        if not self.started:
            self._reuse_prefix()
        if self.prefill_pos < len(self.request.prompt_ids):
            return self._prefill_chunk()
        return self._speculate()

    def _reuse_prefix(self) -> None:
        """Keep the cached prefix shared with the prompt, extended by a copy from another slot's cache where that
        one holds more of it (a prompt many clients send: a system prompt, a file several editors complete in); at
        least the last prompt token is recomputed."""
        engine, slot, prompt = self.engine, self.slot, self.request.prompt_ids
        shared = common_prefix(slot.tokens, prompt)
        keep = min(engine.target.length(slot.index), shared, len(prompt) - 1)
        engine.target.truncate(slot.index, keep)
        draft_keep = 0
        if engine.draft is not None:
            draft_keep = min(engine.draft.length(slot.index), shared)
            engine.draft.truncate(slot.index, draft_keep)
        source = engine.prefix_source(slot.index, prompt)
        if source is not None:
            other, held = source
            taken = min(held, len(prompt) - 1)
            if taken > keep and engine.target.copy_prefix(other.index, slot.index, taken, keep):
                keep = taken
            if engine.draft is not None:
                theirs = min(held, engine.draft.length(other.index))
                if theirs > draft_keep:
                    engine.draft.copy_prefix(other.index, slot.index, theirs, draft_keep)
        slot.tokens = list(prompt)
        self.stats.cached_prompt_tokens = keep
        self.prefill_pos = keep
        self.started = True

    def _prefill_chunk(self) -> StepResult:
        row = self._prefill_row(self.engine.config.prefill_chunk)
        return self._prefill_done(self.engine.target.forward(row.ids, row.start, row.slot, num_logits=1), row)

    def _prefill_row(self, budget: int) -> BatchRow:
        """The next prefill chunk, at most `budget` tokens, as a target row."""
        engine, prompt = self.engine, self.request.prompt_ids
        end = min(len(prompt), self.prefill_pos + budget)
        chunk = torch.tensor(prompt[self.prefill_pos : end], dtype=torch.long, device=engine.target.device)  # [T]
        return BatchRow(chunk, self.prefill_pos, self.slot.index, 1)

    def _prefill_done(self, logits: torch.Tensor, row: BatchRow) -> StepResult:
        """After the target ran prefill `row`: logits [1, V] of its last position (the first token after the last
        chunk)."""
        end = row.start + row.ids.shape[0]
        self.prefill_pos = end
        if end < len(self.request.prompt_ids):
            return StepResult([], 0, 0, None)
        if self.request.prefill_only:
            return self._prefilled()
        if self.params.greedy:
            token = int(logits[0].argmax())
        else:
            token = int(sample(logits_to_probs(logits, self.params), self.generator)[0])
        return self._commit([token], accepted=0, proposed=0, logits=logits)

    def _prefilled(self) -> StepResult:
        """End a prefill-only request: the whole prompt is in the target's cache (the next request on the slot
        recomputes from its last token on), and in the draft's too when speculation can use it."""
        engine, slot, prompt = self.engine, self.slot, self.request.prompt_ids
        if engine.draft is not None and engine.max_k > 0:
            start = engine.draft.length(slot.index)
            if start < len(prompt):
                feed(engine.draft, slot.index, prompt[start:], start, engine.config.prefill_chunk)
        self.stats.tokens_cached = engine.target.length(slot.index)
        self.finish = FINISH_LENGTH
        return StepResult([], 0, 0, self.finish)

    def _k(self, source: str) -> int:
        """Draft tokens for `source` this step: the request's fixed k or the policy's, within the room left."""
        if self.fixed_k is not None:
            k = self.fixed_k
        elif self.load is not None and self.load.k_limit == 0:
            k = 0  # the batch guard: speculating at this batch width is slower in fact
        else:
            k = self.slot.policy.choose(source, batch=self.load)
            if self.load is not None and self.load.k_limit is not None:
                k = min(k, self.load.k_limit)  # the guard is measuring what drafting costs at this width
        return max(0, min(k, self._room(), self.engine.max_k))

    def _room(self) -> int:
        """Draft tokens that fit this step: the bonus token must stay within max_new_tokens and the context."""
        return min(self.request.max_new_tokens - self.generated - 1, self.engine.capacity - len(self.slot.tokens))

    def _plan(self) -> Proposal | int:
        """The session's last suggestion while it still matches, then prompt lookup when allowed (free to draft),
        else the draft model's k (an int > 0: the caller drafts); EMPTY for plain decoding."""
        engine, slot = self.engine, self.slot
        suggestion = self.request.suggestion
        if suggestion is not None and engine.max_k > 0:
            asked = self.request.num_draft_tokens  # a request's own k bounds it; the policy's and `fixed` do not
            cap = MAX_SUGGESTION_TOKENS if asked is None else asked
            k = max(0, min(cap, self._room()))
            found = suggestion.propose(slot.tokens, slot.index, k, self.params, self.generator) if k else EMPTY
            if found.token_ids:
                return found
        if self.fixed_k is None and self.load is None and slot.policy.plain_due():
            return EMPTY  # a measured plain step now and then (`AdaptivePolicy.plain_due`)
        if self.fixed_k is None and self.load is not None and self.load.k_limit == 0:
            return EMPTY  # the batch guard has the policy's drafts off at this width, prompt lookup's too (`_k`)
        if self.proposer in ("lookup", "combined"):
            found = self._lookup()
            if self.proposer == "lookup" or (found.token_ids and not self._draft_pays_more(found)):
                return found
        if engine.drafter is None or not self._catch_up_pays():
            return EMPTY
        k = self._k("draft")
        return k if k > 0 else EMPTY

    def _draft_lag(self) -> int:
        """Tokens of the context the draft's cache has not seen."""
        assert self.engine.draft is not None
        return len(self.slot.tokens) - self.engine.draft.length(self.slot.index)

    def _catch_up_pays(self) -> bool:
        """Whether the policy's drafting is worth the draft's catch-up first (`AdaptivePolicy.catch_up_pays`):
        always for a request's own k and within the steady-state catch-up. In a batched step too, by what drafting
        would save alone (an upper bound: a batch gains less from it), so that a stream near its end does not catch
        its draft up on a whole context when drafting comes back as the batch narrows."""
        if self.fixed_k is not None or self.engine.draft is None:
            return True
        lag = self._draft_lag()
        remaining = self.request.max_new_tokens - self.generated
        return lag <= STEADY_CATCH_UP or self.slot.policy.catch_up_pays(lag, remaining)

    def _lookup(self) -> Proposal:
        """Prompt lookup's match, cut to the k the policy chooses for its kind (the match's n-gram size)."""
        engine, slot = self.engine, self.slot
        room = max(0, min(self._room(), engine.max_k if self.fixed_k is None else self.fixed_k))
        found = engine.lookup.propose(slot.tokens, slot.index, room, self.params, self.generator) if room else EMPTY
        if not found.token_ids:
            return EMPTY
        k = min(self._k(found.estimate), len(found))
        return found.first(k) if k else EMPTY

    def _draft_pays_more(self, found: Proposal) -> bool:
        """Whether the draft model's best k is expected to beat prompt lookup's `found` this step (combined): lookup
        costs nothing to draft but a short or unlikely match commits little; the draft costs c per token."""
        engine, policy = self.engine, self.slot.policy
        if engine.drafter is None or (self.load is not None and self.load.k_limit == 0) or not self._catch_up_pays():
            return False
        if self.fixed_k is None and policy.realized_speedup("draft") <= policy.min_speedup:
            return False  # the draft is off in fact (its probes still come through `_k`)
        cap = min(self._room(), engine.max_k if self.fixed_k is None else self.fixed_k)
        if self.load is not None and self.load.k_limit is not None:
            cap = min(cap, self.load.k_limit)
        if self.fixed_k is None:
            draft = max(policy.speedups("draft", cap, batch=self.load)[1:], default=0.0)
        else:
            draft = policy.speedup(cap, "draft", batch=self.load)
        return draft > policy.speedup(len(found), found.estimate, batch=self.load)

    def _draft_request(self, k: int) -> DraftRequest:
        return DraftRequest(self.slot.tokens, self.slot.index, k, self.params, self.generator)

    def _propose(self) -> Proposal:
        """What `_plan` chose, drafted alone when it is the draft model's turn."""
        plan = self._plan()
        if isinstance(plan, Proposal):
            return plan
        assert self.engine.drafter is not None
        lag = self._draft_lag()
        proposal = self.engine.drafter.propose(self.slot.tokens, self.slot.index, plan, self.params, self.generator)
        if proposal.step_s is not None:
            self.slot.policy.costs.observe_draft(proposal.step_s)
        if proposal.catch_up_s:
            self.slot.policy.costs.observe_catch_up(lag, proposal.catch_up_s)
        return proposal

    def _speculate(self) -> StepResult:
        engine = self.engine
        step_t0 = time.perf_counter()
        proposal = self._propose()
        propose_s = time.perf_counter() - step_t0
        if engine.stall is not None and len(proposal):
            time.sleep(engine.stall.draft_s)
        row = self._verify_row(proposal)
        t0 = time.perf_counter()
        logits = engine.target.forward(row.ids, row.start, row.slot, num_logits=row.num_logits)  # [k+1, V]
        forward_s = time.perf_counter() - t0
        step = self._verified(proposal, logits, step_t0, forward_s)
        if proposal.source != "suggestion":  # the host time around the forwards, for the policy's cost model
            kind = host_kind(proposal.estimate) if len(proposal) else "plain"
            stalled = engine.stall.draft_s + engine.stall.verify_s if engine.stall is not None and len(proposal) else 0
            host_s = time.perf_counter() - step_t0 - propose_s - forward_s - stalled
            self.slot.policy.costs.observe_host(kind, host_s)
        return step

    def _verify_row(self, proposal: Proposal) -> BatchRow:
        """The target row scoring `proposal`: the last committed token and the k drafts, k+1 logits."""
        n = len(self.slot.tokens)
        ids = torch.tensor([self.slot.tokens[-1], *proposal.token_ids], dtype=torch.long,
                           device=self.engine.target.device)  # [k+1]
        return BatchRow(ids, n - 1, self.slot.index, len(ids))

    def _verified(self, proposal: Proposal, logits: torch.Tensor, step_t0: float, forward_s: float | None
                  ) -> StepResult:
        """Verify `proposal` against the target's logits [k+1, V] and commit. `forward_s`: the target forward's
        seconds, for the cost model of a solo step; None in a batched step (its costs are the batch's)."""
        engine, slot = self.engine, self.slot
        result = engine.verifier(
            torch.tensor(proposal.token_ids, dtype=torch.long, device=logits.device),  # [k]
            self._pad_probs(proposal.probs),
            self._pad_logits(logits),
            self.params,
            self.generator,
        )
        if forward_s is not None:
            slot.policy.costs.observe_target(len(proposal) + 1, forward_s)
            # a solo step is a batch of one row: it refines the batch costs of its size too (the one-token entry
            # otherwise keeps its start-up calibration, and so does the bound every batched width is compared with)
            engine.batch_costs.observe_target(len(proposal) + 1, forward_s)
            if engine.stall is not None and len(proposal):
                time.sleep(engine.stall.verify_s)
        self.stats.verify_steps += 1
        self.stats.last_k = len(proposal)
        self.stats.accepted_lengths.append(result.accepted + 1)
        if proposal.source != "suggestion":  # not a proposer the policy chooses k for: keep its estimates clean
            if len(proposal):
                slot.policy.observe(proposal.estimate, len(proposal), result.accepted)
            if forward_s is not None:  # a batched step's time is every stream's: only solo steps are judged
                slot.policy.observe_step(proposal.estimate if len(proposal) else "plain",
                                         time.perf_counter() - step_t0, len(result.tokens), proposal.catch_up_s)
        step = self._commit(result.tokens, accepted=result.accepted, proposed=len(proposal), logits=logits)
        if proposal.source == "suggestion":
            self.stats.suggestion_accepted += step.accepted
        return step

    def _pad_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Target logits [k+1, V_t] → [k+1, V] with -inf on rows the target does not have."""
        missing = self.engine.vocab - logits.shape[-1]
        if missing <= 0:
            return logits
        return torch.nn.functional.pad(logits, (0, missing), value=float("-inf"))

    def _pad_probs(self, probs: torch.Tensor | None) -> torch.Tensor | None:
        """Draft probabilities [k, V_d] → [k, V] with zeros on rows the draft does not have."""
        if probs is None or probs.shape[-1] == self.engine.vocab:
            return probs
        return torch.nn.functional.pad(probs, (0, self.engine.vocab - probs.shape[-1]), value=0.0)

    def _logprobs(self, logits: torch.Tensor, tokens: list[int]) -> tuple[TokenLogprob, ...]:
        """TokenLogprob of each token from the target's raw logits [>= n, V_t] at its position (row i: token i)."""
        n = len(tokens)
        if not self.request.logprobs or n == 0:
            return ()
        logp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, V_t]
        ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)  # [n]
        chosen: list[float] = logp[torch.arange(n, device=logp.device), ids].tolist()  # [n]
        top_n = min(self.request.top_logprobs, logp.shape[-1])
        if top_n == 0:
            return tuple(TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True))
        values, top_ids = logp.topk(top_n, dim=-1)  # [n, N], [n, N]
        rows = zip(top_ids.tolist(), values.tolist(), strict=True)
        return tuple(TokenLogprob(t, lp, tuple(Logprob(i, v) for i, v in zip(r_ids, r_vals, strict=True)))
                     for t, lp, (r_ids, r_vals) in zip(tokens, chosen, rows, strict=True))

    def _commit(self, tokens: list[int], accepted: int, proposed: int, logits: torch.Tensor) -> StepResult:
        """Append tokens (cut at a stop token or the length limit) and roll the caches back to the new context.
        `logits` [>= len(tokens), V_t]: the target's raw logits the tokens were chosen from, row i for token i."""
        slot, engine = self.slot, self.engine
        n_before = len(slot.tokens)
        limit = min(self.request.max_new_tokens - self.generated, engine.capacity - n_before)
        kept: list[int] = []
        for token in tokens[: max(0, limit)]:
            kept.append(token)
            if token in self.request.stop_token_ids:
                self.finish = FINISH_STOP
                break
        slot.tokens.extend(kept)
        n = len(slot.tokens)
        engine.target.truncate(slot.index, min(engine.target.length(slot.index), n - 1))
        if engine.draft is not None:
            engine.draft.truncate(slot.index, min(engine.draft.length(slot.index), n - 1))
        self.stats.completion_tokens += len(kept)
        self.stats.proposed += proposed
        self.stats.accepted += min(accepted, len(kept))
        self.stats.tokens_cached = engine.target.length(slot.index)
        if self.finish is None and (self.generated >= self.request.max_new_tokens or n >= engine.capacity):
            self.finish = FINISH_LENGTH
        return StepResult(kept, min(accepted, len(kept)), proposed, self.finish, self._logprobs(logits, kept))
