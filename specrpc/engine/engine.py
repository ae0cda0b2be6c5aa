"""The engine: target + optional draft resident on one device with preallocated KV slots, and `Engine.step`, the one
device step for any number of generations: prefix reuse → prefill share → plan → propose → one target forward →
verify and commit per row → observe costs.

The engine knows nothing of gRPC or asyncio. A lone stream is width 1 of the same step: it drafts through the
proposer's fused fast path and its own policy judges its steps, where the batch guard judges a wider step."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specrpc.config import EngineConfig
from specrpc.engine.calibration import calibrate, calibrate_batches, warm_up
from specrpc.engine.generation import FINISH_LENGTH, Generation, GenerationRequest, Slot, StepResult
from specrpc.engine.plan import Drafting, Plan, draft_lag, plan, plan_batch
from specrpc.engine.policy import AdaptivePolicy, BatchCosts, BatchGuard, CostModel, SharedRates, host_kind
from specrpc.engine.prefix import reuse_prefix
from specrpc.engine.proposers import (
    GIVEN,
    DraftModelProposer,
    DraftRequest,
    PromptLookupProposer,
    Proposal,
    feed,
)
from specrpc.engine.sampling import SamplingParams
from specrpc.engine.verify import VerifyResult, accept_greedy, verify
from specrpc.engine.window import DraftWindow
from specrpc.models import BatchRow, CausalLM, Drift

Verifier = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, SamplingParams, torch.Generator | None], VerifyResult
]
"""(draft ids [k], draft probs [k, V] | None, target logits [k+1, V], params, generator) → accepted + tokens."""

Results = dict[int, StepResult | Exception]
"""Each generation's outcome of a step so far, by its index in the step."""

PREFILL_STALL = 4.0
"""While streams decode, the prefill chunks mixed into their step make it at most this many times as long as their
plain step (by the measured batch costs): a long prompt delays each of them by a bounded factor, not by its whole
chunk, and is prefilled over more steps."""

MIN_PREFILL_SHARE = 16
"""Fewest prompt tokens a prefilling stream takes in a batched step, whatever the budget: every prompt moves on."""


@dataclass
class Stall:
    """Test hook (`Engine.stall`): seconds slept in every speculative step, after drafting (`draft_s`) or after
    verifying (`verify_s`): inside the step's measured time but outside the cost model's draft, verify and host
    timings, like the stalls the realized-rate guard is there for (a first-seen shape, a catch-up)."""

    draft_s: float = 0.0
    verify_s: float = 0.0


@dataclass(frozen=True)
class Timing:
    """When a step started, what planning and drafting took, and what the target forward took (seconds); and the
    time since the stream's previous step ended (`Engine.between_s`)."""

    start: float
    propose_s: float
    forward_s: float
    between_s: float = 0.0


BETWEEN_STEPS_MOST = 0.05
"""Seconds between a lone stream's two steps beyond which the gap is not counted as the steps' cost (`between_s`):
a call the device thread ran between them, a pause of the process; per-step work (handing tokens over) is far less."""


class Engine:
    """Target + optional draft resident on one device, with preallocated KV slots."""

    def __init__(self, target: CausalLM, draft: CausalLM | None, config: EngineConfig,
                 verifier: Verifier = verify) -> None:
        """`verifier`: the acceptance decision; `verify` (exact) except in benchmarks that simulate acceptance."""
        self.target = target
        self.draft = DraftWindow(draft, config.draft_window) if draft is not None else None
        self.config = config
        self.verifier = verifier
        self.stall: Stall | None = None  # test hook, see Stall
        self.max_k = 0 if config.speculation == "off" else config.max_draft_tokens
        self.costs = CostModel()  # the device's step costs: every policy's, refined by every lone step
        self.rates = SharedRates()  # the device's realized rates: what a policy judges by before its own steps
        self.calibration_rounds = 0  # measured rounds of the last `calibrate`
        self.batch_costs = BatchCosts()  # batched steps' costs by total tokens, shared by every stream
        self.batch_guard = BatchGuard()  # whether speculating pays in fact, per batch width
        self.slots: dict[int, Slot] = {}  # each index's slot state (`new_slot`): where a prompt's prefix may be cached
        self.drafter = DraftModelProposer(self.draft, config.prefill_chunk) if self.draft is not None else None
        self.drafting = Drafting(self.max_k, self.draft, self.drafter, PromptLookupProposer())
        # "combined": each step, prompt lookup when it finds a match worth verifying, else the draft model
        self.proposers = frozenset({"lookup", "draft", "combined"} if draft is not None else {"lookup"})
        self.default_proposer = config.proposer if config.proposer in self.proposers else "lookup"
        self.vocab = max(target.vocab_size, draft.vocab_size if draft else 0)
        self._on_device: Callable[[], None] | None = None  # `step`'s hook, until called
        self._lone: tuple[Generation, float] | None = None  # the last lone step's generation and when it ended

    @property
    def capacity(self) -> int:
        """Context positions available to committed tokens per slot."""
        return self.config.max_context

    def new_slot(self, index: int, policy: AdaptivePolicy | None = None) -> Slot:
        """Fresh slot state with `policy`, by default a new one on the device's costs."""
        self.target.truncate(index, 0)
        if self.draft is not None:
            self.draft.truncate(index, 0)
        slot = self.slots[index] = Slot(index, [], policy if policy is not None else self.new_policy())
        return slot

    def reset_slot(self, slot: Slot) -> None:
        """Forget a slot's cached context (after a failure mid-step its caches may be inconsistent)."""
        slot.tokens.clear()
        self.target.truncate(slot.index, 0)
        if self.draft is not None:
            self.draft.truncate(slot.index, 0)

    def new_policy(self, shared: bool = True) -> AdaptivePolicy:
        """An adaptive policy on the device's costs (`costs`, shared: every policy's lone steps refine them) and,
        where `shared`, its realized rates (`rates`): a session's first steps are judged by what every other
        session's steps realized (a server's slots, each taking new requests). Unshared: its own steps alone (a
        bench contender's one policy for all its requests)."""
        return AdaptivePolicy(max_k=self.max_k, costs=self.costs, shared=self.rates if shared else None)

    def calibrate(self, slot: int = 0, context: int = 256, repeats: int = 9, budget_s: float = 3.0,
                  max_repeats: int = 40, settle: float = 0.01) -> CostModel:
        """Measure the one-stream step costs (`calibration.calibrate`), also the warm-up: the device's costs that
        policies made from now on share (`new_policy`)."""
        self.costs, self.calibration_rounds = calibrate(self.target, self.draft, self.max_k, self.config.prefill_chunk,
                                                        self.capacity, slot, context, repeats, budget_s, max_repeats,
                                                        settle)
        return self.costs

    def recall_costs(self, entry: Mapping[str, Any], slot: int = 0, context: int = 256) -> CostModel | None:
        """Take the step costs an earlier start measured (`CostModel.entry`) where, after a warm-up of every shape
        `calibrate` measures, the one-token step times within `Drift`'s tolerance of its time then (`warm_up`, as
        `calibrate` times it); None, nothing taken, otherwise (then `calibrate`)."""
        try:
            costs = CostModel.from_entry(entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        then, drift = costs.target_step_s, Drift()
        if then <= 0.0 or any(width not in costs.verify_s for width in range(1, self.max_k + 2)):
            return None
        now = warm_up(self.target, self.draft, self.max_k, self.config.prefill_chunk, self.capacity,
                      lambda seconds: drift.within(seconds, then) or seconds < then, slot, context)
        if not drift.within(now, then):
            return None
        self.costs, self.calibration_rounds = costs, 0
        return costs

    def calibrate_batches(self, slots: list[int], context: int = 64, repeats: int = 3) -> BatchCosts:
        """Measure batched forwards by width over `slots` (`calibration.calibrate_batches`)."""
        self.batch_costs = calibrate_batches(self.target, self.draft, self.max_k, self.config.prefill_chunk, slots,
                                             context, repeats)
        return self.batch_costs

    def start(self, slot: Slot, request: GenerationRequest) -> Generation:
        """A generation on `slot`; its first step reuses the cached prefix shared with the prompt."""
        name = request.proposer or self.default_proposer
        if name not in self.proposers:
            raise ValueError(f"proposer {name!r} is not available; loaded: {sorted(self.proposers)}")
        # the server's `--speculation off` wins over a request's num_draft_tokens: the operator turned it off
        # and a request's cap of 0 (llama.cpp's `speculative.n_max: 0`) is target-only, as num_draft_tokens 0 is
        fixed_k = 0 if self.max_k == 0 or request.max_draft_tokens == 0 else request.num_draft_tokens
        if self.config.speculation == "fixed" and fixed_k is None:
            fixed_k = self.max_k if request.max_draft_tokens is None else min(self.max_k, request.max_draft_tokens)
        return Generation(slot, request, proposer=name, fixed_k=fixed_k, capacity=self.capacity,
                          device=self.target.device)

    def step_one(self, gen: Generation) -> StepResult:
        """`step` for one generation, raising what ended its step."""
        result = self.step([gen])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def step(self, gens: list[Generation], on_device: Callable[[], None] | None = None
             ) -> list[StepResult | Exception]:
        """One device step for generations on distinct slots: each prefilling one takes a prompt chunk (together
        within `prefill_budget`), each decoding one plans its draft with the batch in view and the draft model
        drafts for all that use it together, the target runs every row (prompt chunks, verifies of k+1, plain
        decodes of 1) in one forward, then each row is verified and committed. Returns per generation its
        StepResult or the exception that ended its step (the others go on; a failed shared forward fails every
        generation in it). `on_device`: called once, as the step's first model forward starts (the device thread lets
        go of the interpreter there: another thread's Python work runs beside the forward, not in the device thread's
        way), or at the step's end without one."""
        self._on_device = on_device
        try:
            return self._step(gens)
        finally:
            self._went_to_device()
            self._lone = (gens[0], time.perf_counter()) if len(gens) == 1 else None

    def between_s(self, gen: Generation, now: float) -> float:
        """Seconds since `gen`'s previous step ended where that step was lone and the last one (0 otherwise, and
        beyond `BETWEEN_STEPS_MOST`): what the caller spent between them, handing the step's tokens on (detokenizing,
        stop checks, streaming them to the client) and taking the next step up. Each step costs it once whatever its
        tokens, so a lone stream's policy counts it with the step's host time: a step that commits several tokens
        pays it once for all of them."""
        lone = self._lone
        if lone is None or lone[0] is not gen:
            return 0.0
        gap = now - lone[1]
        return gap if 0.0 <= gap <= BETWEEN_STEPS_MOST else 0.0

    def _step(self, gens: list[Generation]) -> list[StepResult | Exception]:
        """`step`'s phases."""
        solo = len(gens) == 1
        t_start = time.perf_counter()
        between_s = self.between_s(gens[0], t_start) if solo else 0.0
        results: Results = {}
        live = self._begin(gens, results)
        prefilling = [i for i in live if gens[i].prefilling]
        decoding = [i for i in live if not gens[i].prefilling]
        rows = self._prefill_rows(gens, prefilling, len(decoding), solo, results)
        plans = self._plan(gens, prefilling, decoding, rows, solo, results)
        proposals, catch_up_s = self._propose(gens, plans, solo, results)
        timing_propose = time.perf_counter() - t_start
        if not solo:
            self._observe_share(gens, proposals)
        if self.stall is not None and any(len(p) for p in proposals.values()):
            time.sleep(self.stall.draft_s)
        for i, proposal in proposals.items():
            ids = gens[i].verify_ids(proposal)
            rows[i] = BatchRow(torch.tensor(ids, dtype=torch.long, device=self.target.device),  # [k+1]
                               len(gens[i].slot.tokens) - 1, gens[i].slot.index, len(ids))
        outs, forward_s = self._forward(rows, proposals, solo, results)
        timing = Timing(t_start, timing_propose, forward_s, between_s)
        for i, logits in outs.items():
            try:
                if i in proposals:
                    results[i] = self._accept(gens[i], proposals[i], logits, timing if solo else None)
                else:
                    results[i] = self._prefilled(gens[i], rows[i], logits)
            except Exception as exc:
                results[i] = exc
        if not solo and not prefilling and len(decoding) > 1:
            self._observe_guard(gens, decoding, proposals, results, time.perf_counter() - t_start, catch_up_s)
        return [results[i] for i in range(len(gens))]

    def prefill_budget(self, decoding: int) -> int:
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

    def _went_to_device(self) -> None:
        """Call the step's `on_device` hook, once."""
        hook, self._on_device = self._on_device, None
        if hook is not None:
            hook()

    # ---- the step's phases, in order --------------------------------------------------------------------------

    def _begin(self, gens: list[Generation], results: Results) -> list[int]:
        """The generations that step now; a new one first keeps what the caches hold of its prompt."""
        live: list[int] = []
        for i, gen in enumerate(gens):
            try:
                if gen.finished:
                    raise RuntimeError("generation already finished")
                if not gen.started:
                    gen.begin(reuse_prefix(self.target, self.draft, self.slots.values(), gen.slot,
                                           gen.request.prompt_ids))
                live.append(i)
            except Exception as exc:
                results[i] = exc
        return live

    def _prefill_rows(self, gens: list[Generation], prefilling: list[int], decoding: int, solo: bool,
                      results: Results) -> dict[int, BatchRow]:
        """Each prefilling generation's next prompt chunk as a target row: a lone prompt takes `prefill_chunk`,
        prompts beside decoding streams share `prefill_budget` (at least `MIN_PREFILL_SHARE` each). In a batch the
        draft takes the same chunks where it will draft (`_prefill_draft`)."""
        if not prefilling:
            return {}
        budget = self.prefill_budget(decoding)
        share = budget if solo else max(MIN_PREFILL_SHARE, budget // len(prefilling))
        rows: dict[int, BatchRow] = {}
        for i in prefilling:
            ids, start = gens[i].prefill_chunk(share)
            rows[i] = BatchRow(torch.tensor(ids, dtype=torch.long, device=self.target.device), start,  # [T]
                               gens[i].slot.index, 1)
        if not solo:
            self._prefill_draft(gens, rows, results)
        return rows

    def _prefill_draft(self, gens: list[Generation], rows: dict[int, BatchRow], results: Results) -> None:
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
        chunks = [i for i in rows if gens[i].proposer != "lookup"
                  and (policy if (k := gens[i].fixed_k) is None else k > 0)
                  and draft.takes_chunk(rows[i].slot, rows[i].start, rows[i].ids.shape[0],
                                        len(gens[i].request.prompt_ids))]
        if not chunks:
            return
        batch = [rows[i] for i in chunks]
        self._went_to_device()
        try:
            draft.forward_batch(batch)
        except Exception as exc:  # a shared forward: every row's slot may be half written
            for i in chunks:
                results[i] = exc
                del rows[i]

    def _plan(self, gens: list[Generation], prefilling: list[int], decoding: list[int], rows: dict[int, BatchRow],
              solo: bool, results: Results) -> dict[int, Plan]:
        """Each decoding generation's plan: alone by its own policy; in a batch with the others' load in view and
        policy k within the batch guard's limit (none while prompts join the width they make next, unless drafting
        is on there)."""
        if solo:
            plans: dict[int, Plan | Exception] = {}
            for i in decoding:
                try:
                    plans[i] = plan(self.drafting, gens[i], None)
                except Exception as exc:
                    plans[i] = exc
        else:
            limit: int | None = None
            if prefilling and not self.batch_guard.drafting_on(len(gens)):
                limit = 0  # the guard judges steps without prompts; the prompts join the width they make next
            elif len(decoding) > 1:
                limit = self.batch_guard.plan(len(decoding))
            prefill_tokens = sum(row.ids.shape[0] for row in rows.values())
            planned = plan_batch(self.drafting, self.batch_costs, [gens[i] for i in decoding], prefill_tokens, limit,
                                 self.config.prefill_chunk)
            plans = {decoding[j]: p for j, p in planned.items()}
        good: dict[int, Plan] = {}
        for i, p in plans.items():
            if isinstance(p, Exception):
                results[i] = p
            else:
                good[i] = p
        return good

    def _propose(self, gens: list[Generation], plans: dict[int, Plan], solo: bool, results: Results
                 ) -> tuple[dict[int, Proposal], float]:
        """Each plan's proposal, the draft model drafting for all that use it in one batched loop (alone: its fused
        fast path). Returns the proposals and the seconds a batch's drafts spent catching up beyond one steady
        forward (the price of steps they sat out, not what drafting costs)."""
        proposals = {i: p.proposal for i, p in plans.items() if not p.draft_k}
        wanted = {i: p for i, p in plans.items() if p.draft_k}  # the draft model's plans
        if not wanted:
            return proposals, 0.0
        assert self.drafter is not None
        catch_up_s = 0.0
        self._went_to_device()
        try:
            if solo:
                (i, p), = wanted.items()
                proposals[i] = self._draft_alone(gens[i], p.draft_k, p.draft_most)
            else:
                drafted, timings, catch_up_s = self.drafter.propose_batch(
                    [DraftRequest(gens[i].slot.tokens, gens[i].slot.index, p.draft_k, gens[i].params,
                                  gens[i].generator, gens[i].constraint, gens[i].transform, p.draft_most)
                     for i, p in wanted.items()])
                proposals.update(zip(wanted, drafted, strict=True))
                for width, seconds in timings:
                    self.batch_costs.observe_draft(width, seconds)
                # the first forward also drafts (the steady forward it extends): only what it took beyond is catch-up
                catch_up_s = max(0.0, catch_up_s - self.batch_costs.draft(len(wanted))) if catch_up_s else 0.0
        except Exception as exc:  # a shared forward: every drafting stream's step fails
            results.update(dict.fromkeys(wanted, exc))
        return proposals, catch_up_s

    def _draft_alone(self, gen: Generation, k: int, most: int) -> Proposal:
        """A lone stream's k draft-model tokens (at most `most` with the grammar's forced ones, at least k: 0 is
        k); its policy learns the draft step's and catch-up's costs."""
        assert self.drafter is not None
        lag = draft_lag(self.drafting, gen)
        proposal = self.drafter.propose(gen.slot.tokens, gen.slot.index, k, gen.params, gen.generator, gen.constraint,
                                        gen.transform, most)
        if proposal.draft_s is not None and proposal.drawn:
            gen.slot.policy.costs.observe_draft(proposal.drawn, proposal.draft_s)
        if proposal.catch_up_s:
            gen.slot.policy.costs.observe_catch_up(lag, proposal.catch_up_s)
        return proposal

    def _forward(self, rows: dict[int, BatchRow], proposals: dict[int, Proposal], solo: bool, results: Results
                 ) -> tuple[dict[int, torch.Tensor], float]:
        """Every row through the target in one forward → per row logits [num_logits, V], and its seconds; a batch's
        costs learn them here (a lone stream's in `_accept`)."""
        order = sorted(rows)
        if not order:
            return {}, 0.0
        batch = [rows[i] for i in order]
        self._went_to_device()
        t0 = time.perf_counter()
        try:
            outs = self.target.forward_batch(batch)
        except Exception as exc:  # a shared forward: every row's slot may be half written
            results.update(dict.fromkeys(order, exc))
            return {}, 0.0
        seconds = time.perf_counter() - t0
        if not solo:
            self.batch_costs.observe_target(sum(rows[i].ids.shape[0] for i in order), seconds)
        if self.stall is not None and any(len(p) for p in proposals.values()):
            time.sleep(self.stall.verify_s)
        return dict(zip(order, outs, strict=True)), seconds

    def _accept(self, gen: Generation, proposal: Proposal, logits: torch.Tensor, timing: Timing | None
                ) -> StepResult:
        """Verify `proposal` against the target's logits [k+1, V] and commit; the caches roll back to the context.
        `timing`: a lone stream's step, which its policy judges (None in a batch, which the guard judges). Greedy
        rows are verified on the host (`accept_greedy` on the argmax of each row as shaped, `Generation.greedy_ids`,
        the first maximum on ties, as `verify` reads it): right after a forward, the draft ids' tensor, the
        verifier's other ops and torch's argmax were a quarter to a third of a greedy step's verify and commit at int8
        weights, and at 8 streams a verify per row took a twentieth of a step."""
        policy = gen.slot.policy
        if timing is not None:  # a lone verify is a batch of one row: it refines its size's batch cost too
            policy.costs.observe_target(len(proposal) + 1, timing.forward_s)
            self.batch_costs.observe_target(len(proposal) + 1, timing.forward_s)
        padded = self._pad_logits(logits)  # [k+1, V]
        if gen.params.greedy and self.verifier is verify:
            result = accept_greedy(proposal.token_ids, gen.greedy_ids(padded, proposal))
        else:
            result = self.verifier(
                torch.tensor(proposal.token_ids, dtype=torch.long, device=logits.device),  # [k]
                self._pad_probs(proposal.probs),  # a draft's probabilities are masked and transformed already
                gen.shaped(padded, proposal),  # [k+1, V] mask and transform along the draft (as is without either)
                gen.params, gen.generator)
        tokens = gen.as_the_parser_allows(result.tokens, padded, proposal)
        gen.count_verify(proposal, result.accepted + 1)
        if proposal.source != "suggestion":  # not a proposer the policy chooses k for: keep its estimates clean
            if len(proposal):
                policy.observe(proposal.estimate, *proposal.drawn_outcome(result.accepted))
            if timing is not None:
                policy.observe_step(proposal.estimate if len(proposal) else "plain",
                                    time.perf_counter() - timing.start + timing.between_s, len(result.tokens),
                                    proposal.catch_up_s,
                                    share=gen.fixed_k is None,
                                    drafts=0 if proposal.forced else len(proposal))  # (forced: counted as drawn)
        step = gen.commit(tokens, accepted=result.accepted, proposed=len(proposal), logits=logits)
        self._roll_back(gen)
        if proposal.source == "suggestion":
            gen.stats.suggestion_accepted += step.accepted
        elif timing is not None:  # the host time around the forwards, for the policy's cost model
            kind = host_kind(proposal.estimate) if len(proposal) else "plain"
            stalled = self.stall.draft_s + self.stall.verify_s if self.stall is not None and len(proposal) else 0.0
            host_s = time.perf_counter() - timing.start - timing.propose_s - timing.forward_s - stalled
            policy.host.observe(kind, host_s + timing.between_s)
        return step

    def _prefilled(self, gen: Generation, row: BatchRow, logits: torch.Tensor) -> StepResult:
        """After the target ran prompt chunk `row` (logits [1, V] of its last position). A prefill-only request ends
        with the whole prompt in the target's cache (the next request on the slot recomputes from its last token
        on), and in the draft's too when speculation can use it."""
        result = gen.prefilled(row.start + row.ids.shape[0], logits)
        if gen.request.prefill_only and result.finish == FINISH_LENGTH:
            prompt, slot = gen.request.prompt_ids, gen.slot.index
            if self.draft is not None and self.max_k > 0:
                start = self.draft.catch_up_from(slot, len(prompt))
                if start < len(prompt):
                    feed(self.draft, slot, prompt[start:], start, self.config.prefill_chunk)
            gen.stats.tokens_cached = self.target.length(slot)
        elif result.token_ids:
            self._roll_back(gen)
        return result

    def _roll_back(self, gen: Generation) -> None:
        """Cut both caches to the committed context but its last token (rejected drafts go with the length)."""
        n, slot = len(gen.slot.tokens), gen.slot.index
        self.target.truncate(slot, min(self.target.length(slot), n - 1))
        if self.draft is not None:
            self.draft.truncate(slot, min(self.draft.length(slot), n - 1))
        gen.stats.tokens_cached = self.target.length(slot)

    def _observe_share(self, gens: list[Generation], proposals: dict[int, Proposal]) -> None:
        """The guard learns how many of the streams the policy planned for drafted with the draft model."""
        planned = [i for i, p in proposals.items() if gens[i].fixed_k is None and p.source not in GIVEN]
        self.batch_guard.observe_share(len(gens), sum(proposals[i].source == "draft" for i in planned), len(planned))

    def _observe_guard(self, gens: list[Generation], decoding: list[int], proposals: dict[int, Proposal],
                       results: Results, seconds: float, catch_up_s: float) -> None:
        """The guard judges a batched decoding step that every stream completed: whether the policy drafted in it,
        its time less its drafts' catch-up (the price of the steps they sat out) and the tokens it committed."""
        if not all(isinstance(results[i], StepResult) for i in decoding):
            return
        committed = sum(len(r.token_ids) for r in results.values() if isinstance(r, StepResult))
        policy_drafted = any(len(p) and gens[i].fixed_k is None and p.source not in GIVEN
                             for i, p in proposals.items())  # what the guard decides on; the rest is given
        self.batch_guard.observe(len(decoding), policy_drafted, seconds - catch_up_s, committed, catch_up_s)

    def _pad_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Target logits [k+1, V_t] → [k+1, V] with -inf on rows the target does not have."""
        missing = self.vocab - logits.shape[-1]
        if missing <= 0:
            return logits
        return torch.nn.functional.pad(logits, (0, missing), value=float("-inf"))

    def _pad_probs(self, probs: torch.Tensor | None) -> torch.Tensor | None:
        """Draft probabilities [k, V_d] → [k, V] with zeros on rows the draft does not have."""
        if probs is None or probs.shape[-1] == self.vocab:
            return probs
        return torch.nn.functional.pad(probs, (0, self.vocab - probs.shape[-1]), value=0.0)
