"""What each decoding stream drafts this step: the request's prediction, the session's suggestion, prompt lookup or
the draft model, and how many tokens (k per stream from the policy, the batch's costs and the batch guard)."""

from __future__ import annotations

from dataclasses import dataclass

from specrpc.engine.generation import Generation
from specrpc.engine.policy import BatchCosts, BatchLoad
from specrpc.engine.proposers import (
    EMPTY,
    STEADY_CATCH_UP,
    DraftModelProposer,
    PromptLookupProposer,
    Proposal,
    Proposer,
)
from specrpc.engine.window import DraftWindow

MAX_SUGGESTION_TOKENS = 64
"""Most tokens of the session's last suggestion (drafted whole: the editor already shows it) or of a request's
prediction (as long as the policy expects it to pay) verified in one step."""

PREDICTION_PROBE = 2
"""Fewest tokens of an aligned prediction drafted, whatever the policy's estimate (`_prediction_k`)."""


@dataclass(frozen=True)
class Plan:
    """A stream's draft this step: a proposal in hand (suggestion, prompt lookup; EMPTY for a plain step), or
    `draft_k` > 0 tokens for the draft model to draw, with at most `draft_most` tokens in all where a grammar's
    forced runs ride along (they cost no draft forward; 0: draft_k)."""

    proposal: Proposal = EMPTY
    draft_k: int = 0
    draft_most: int = 0

    @property
    def k(self) -> int:
        """Tokens this plan puts before the target."""
        return self.draft_k or len(self.proposal)

    @property
    def source(self) -> str:
        """The policy's key for what this plan drafts with."""
        return "draft" if self.draft_k else self.proposal.estimate


PLAIN = Plan()


@dataclass(frozen=True)
class Drafting:
    """What planning needs of the engine: the largest k, the draft model (None without one) and the proposers."""

    max_k: int
    draft: DraftWindow | None
    drafter: DraftModelProposer | None
    lookup: PromptLookupProposer


def draft_lag(drafting: Drafting, gen: Generation) -> int:
    """Tokens of the stream's context the draft's catch-up would feed (at most its window)."""
    assert drafting.draft is not None
    return drafting.draft.lag(gen.slot.index, len(gen.slot.tokens))


def plan(drafting: Drafting, gen: Generation, load: BatchLoad | None) -> Plan:
    """`_plan`'s draft, or PLAIN where it is shorter than the request's `min_draft_tokens` (llama.cpp's
    speculative.n_min: a short draft is not verified, the step decodes one token)."""
    p = _plan(drafting, gen, load)
    return PLAIN if 0 < p.k < gen.request.min_draft_tokens else p


def _cap(drafting: Drafting, gen: Generation) -> int:
    """The most draft tokens the stream verifies in a step: the server's k max, within the request's own cap."""
    limit = gen.request.max_draft_tokens
    return drafting.max_k if limit is None else min(drafting.max_k, limit)


def _plan(drafting: Drafting, gen: Generation, load: BatchLoad | None) -> Plan:
    """The request's prediction while aligned with the output, unless what the policy would draft instead is
    expected to pay more (a prediction the output has left commits less than prompt lookup or the draft model); the
    session's last suggestion while it still matches; then prompt lookup (or the suffix source) when allowed (free
    to draft), else the draft model's k; PLAIN for plain decoding. `load`: the rest of a batched step (None: the
    stream is alone, and its policy judges its own steps)."""
    given = _given(drafting, gen, load)
    if given.source == "prediction" and gen.request.num_draft_tokens is None:
        rest = _policy_plan(drafting, gen, load)  # a prediction joins the choice by expected speed-up
        return rest if _expected_speedup(gen, rest, load) > _expected_speedup(gen, Plan(given), load) else Plan(given)
    if given.token_ids:
        return Plan(given)
    return _policy_plan(drafting, gen, load)


def _policy_plan(drafting: Drafting, gen: Generation, load: BatchLoad | None) -> Plan:
    """What the stream drafts without a given draft: prompt lookup (or the suffix source) when allowed, else the
    draft model's k; PLAIN for plain decoding."""
    guard_off = load is not None and load.k_limit == 0
    if gen.fixed_k is None and load is None and gen.slot.policy.plain_due():
        return PLAIN  # a measured plain step now and then (`AdaptivePolicy.plain_due`)
    if gen.fixed_k is None and guard_off:
        return PLAIN  # the batch guard has the policy's drafts off at this width, prompt lookup's too (`_k`)
    if gen.proposer in ("lookup", "combined"):
        found = _lookup(drafting, gen, load)
        if gen.proposer == "lookup" or (found.token_ids and not _draft_pays_more(drafting, gen, found, load)):
            return Plan(found)
    if drafting.drafter is None or not _catch_up_pays(drafting, gen):
        return PLAIN
    k = _k(drafting, gen, "draft", load)
    return Plan(draft_k=k, draft_most=_most(drafting, gen, k, load)) if k > 0 else PLAIN


def _most(drafting: Drafting, gen: Generation, k: int, load: BatchLoad | None) -> int:
    """Tokens in all a draft of k drawn tokens may verify with the grammar's forced runs: the policy's k counts
    what the draft guesses, each a draft forward; a forced token costs none and is the masked target's choice, so
    it rides along up to the stream's cap and room (the batch guard's limit in a batch). A request's own k is its
    verify's length."""
    if gen.fixed_k is not None or gen.constraint is None:
        return k
    return max(k, _longest(drafting, gen, load))


def _longest(drafting: Drafting, gen: Generation, load: BatchLoad | None) -> int:
    """The most draft tokens the stream may verify this step: its room, its request's k or the server's cap, and in
    a batch the guard's limit."""
    most = min(gen.room(), _cap(drafting, gen) if gen.fixed_k is None else gen.fixed_k)
    if load is not None and load.k_limit is not None:
        most = min(most, load.k_limit)
    return most


def _expected_speedup(gen: Generation, p: Plan, load: BatchLoad | None) -> float:
    """The policy's expected speed-up of plan `p` over plain decoding (1 for PLAIN)."""
    return gen.slot.policy.speedup(p.k, p.source, batch=load) if p.k else 1.0


def allowed(gen: Generation, found: Proposal) -> Proposal:
    """A point-mass draft (prediction, suggestion, prompt lookup, suffix source) cut at its first token the stream's
    grammar forbids: such a token could never be accepted, nor anything after it."""
    if gen.constraint is None or not found.token_ids:
        return found
    n = gen.constraint.valid_prefix(found.token_ids)
    return found.first(n) if n else EMPTY


def plan_batch(drafting: Drafting, costs: BatchCosts, gens: list[Generation], prefill_tokens: int,
               limit: int | None, catch_up_budget: int) -> dict[int, Plan | Exception]:
    """Each decoding stream's plan (by index into `gens`), k chosen with the rest of the batch in view (those planned
    before it at their k, those after it as plain decoding; policy k at most `limit`, the guard's). The policy's
    drafts catch up (beyond the steady `STEADY_CATCH_UP` tokens, after sitting out steps) within `catch_up_budget`
    tokens in all, the first always, the others in later steps once earlier ones caught up: speculation coming back
    at a wide batch does not stall every stream for whole prompts. A stream whose planning fails gets its
    exception."""
    tokens, committed = prefill_tokens + len(gens), float(len(gens))
    draft_rows: list[int] = []  # rows of each batched draft forward, from the streams planned so far
    catching_up = 0  # tokens the drafts planned so far must catch up on first
    plans: dict[int, Plan | Exception] = {}
    for i, gen in enumerate(gens):
        tokens, committed = tokens - 1, committed - 1
        try:
            p = plan(drafting, gen, BatchLoad(costs, tokens, committed, tuple(draft_rows), limit))
        except Exception as exc:
            plans[i] = exc
            continue
        if p.draft_k and gen.fixed_k is None and drafting.draft is not None:
            lag = draft_lag(drafting, gen)  # what its draft must catch up on
            if lag > STEADY_CATCH_UP:
                if catching_up and catching_up + lag > catch_up_budget:
                    p = PLAIN  # it drafts in a later step: this step's catch-up budget is spent
                else:
                    catching_up += lag
        tokens += p.k + 1
        committed += gen.slot.policy.expected(p.source, p.k)
        draft_rows.extend([0] * (p.draft_k - len(draft_rows)))
        for j in range(p.draft_k):  # its draws: the first p.draft_k forwards (forced tokens ride along)
            draft_rows[j] += 1
        plans[i] = p
    return plans


def _given(drafting: Drafting, gen: Generation, load: BatchLoad | None) -> Proposal:
    """A draft the request brings (EMPTY: none here): its prediction, cut where the policy expects the most of it
    (`_prediction_k`), else the session's suggestion whole. A request's own k or cap bounds either; the policy's, the
    batch guard's and `fixed` do not (they draft whatever plan chooses for the rest)."""
    asked, limit = gen.request.num_draft_tokens, gen.request.max_draft_tokens
    room = max(0, min(MAX_SUGGESTION_TOKENS if asked is None else asked, gen.room(),
                      MAX_SUGGESTION_TOKENS if limit is None else limit))
    if drafting.max_k == 0 or room == 0:
        return EMPTY
    prediction = gen.request.prediction
    if prediction is not None:
        found = allowed(gen, prediction.propose(gen.slot.tokens, gen.slot.index, room, gen.params, gen.generator))
        if found.token_ids:
            return found if asked is not None else _prediction_k(gen, found, load)
    suggestion = gen.request.suggestion
    if suggestion is not None:
        return allowed(gen, suggestion.propose(gen.slot.tokens, gen.slot.index, room, gen.params, gen.generator))
    return EMPTY


def _prediction_k(gen: Generation, found: Proposal, load: BatchLoad | None) -> Proposal:
    """The prediction's span cut where the policy's expected speed-up peaks: its acceptance is kept apart from the
    other sources' (a client's draft is right far more often), and the verify's cost over k decides how long a span
    pays. At least `PREDICTION_PROBE` tokens: it costs nothing to draft and is re-aligned every step, so a low
    estimate after a divergence recovers where the output copies again."""
    speedups = gen.slot.policy.speedups(found.estimate, len(found), batch=load)
    k = max(range(1, len(found) + 1), key=speedups.__getitem__)
    return found.first(max(k, min(PREDICTION_PROBE, len(found))))


def _k(drafting: Drafting, gen: Generation, source: str, load: BatchLoad | None) -> int:
    """Draft tokens for `source` this step: the request's fixed k or the policy's, within the room left."""
    if gen.fixed_k is not None:
        k = gen.fixed_k
    elif load is not None and load.k_limit == 0:
        k = 0  # the batch guard: speculating at this batch width is slower in fact
    else:
        k = gen.slot.policy.choose(source, batch=load, catch_up=_catch_up(drafting, gen) if source == "draft" else 0)
        if load is not None and load.k_limit is not None:
            k = min(k, load.k_limit)  # the guard is measuring what drafting costs at this width
    return max(0, min(k, gen.room(), _cap(drafting, gen)))


def _catch_up(drafting: Drafting, gen: Generation) -> int:
    """Tokens the draft would catch up on before drafting this step: 0 without a draft and within the steady-state
    `STEADY_CATCH_UP`."""
    if drafting.draft is None:
        return 0
    lag = draft_lag(drafting, gen)
    return lag if lag > STEADY_CATCH_UP else 0


def _catch_up_pays(drafting: Drafting, gen: Generation) -> bool:
    """Whether the policy's drafting is worth the draft's catch-up first (`AdaptivePolicy.catch_up_pays`): always
    for a request's own k and within the steady-state catch-up. In a batched step too, by what drafting would save
    alone (an upper bound: a batch gains less from it), so that a stream near its end does not catch its draft up on
    a whole context when drafting comes back as the batch narrows."""
    if gen.fixed_k is not None:
        return True
    lag = _catch_up(drafting, gen)
    return lag == 0 or gen.slot.policy.catch_up_pays(lag, gen.remaining)


def _lookup(drafting: Drafting, gen: Generation, load: BatchLoad | None) -> Proposal:
    """Prompt lookup's match, or the suffix source's where the request has one (earlier outputs of its scope), each
    cut to the k the policy chooses for its kind (the match's size): the one expected to yield the most per cost."""
    room = max(0, min(gen.room(), _cap(drafting, gen) if gen.fixed_k is None else gen.fixed_k))
    if not room:
        return EMPTY
    sources: list[Proposer] = [drafting.lookup]
    if gen.request.suffix is not None:
        sources.append(gen.request.suffix)
    best, best_speedup = EMPTY, 0.0
    for source in sources:
        found = allowed(gen, source.propose(gen.slot.tokens, gen.slot.index, room, gen.params, gen.generator))
        k = min(_k(drafting, gen, found.estimate, load), len(found)) if found.token_ids else 0
        speedup = gen.slot.policy.speedup(k, found.estimate, batch=load) if k else 0.0
        if speedup > best_speedup:
            best, best_speedup = found.first(k), speedup
    return best


def _draft_pays_more(drafting: Drafting, gen: Generation, found: Proposal, load: BatchLoad | None) -> bool:
    """Whether the draft model's best k is expected to beat prompt lookup's `found` this step (combined): lookup
    costs nothing to draft but a short or unlikely match commits little; the draft costs c per token."""
    policy = gen.slot.policy
    if drafting.drafter is None or (load is not None and load.k_limit == 0) or not _catch_up_pays(drafting, gen):
        return False
    if gen.fixed_k is None and policy.realized_speedup("draft") <= policy.min_speedup:
        return False  # the draft is off in fact (its probes still come through `_k`)
    most = _longest(drafting, gen, load)
    if gen.fixed_k is None:
        draft = max(policy.speedups("draft", most, batch=load)[1:], default=0.0)
    else:
        draft = policy.speedup(most, "draft", batch=load)
    return draft > policy.speedup(len(found), found.estimate, batch=load)
