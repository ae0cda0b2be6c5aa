"""One request's decoding state: what it asked for, its slot, how far it got, its figures, and how tokens are
committed to its context. A `Generation` touches no model: the engine's step runs the forwards and hands it logits.

KV invariant per slot: each model's cache holds a prefix of `Slot.tokens`; the target holds all committed tokens but
the last (whose logits the next step needs), the draft at most as many. Rollback after a rejection is truncating the
cache lengths (`engine.step.roll_back`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from specrpc.engine.constraint import MAX_REFUSED, Constraint, Grammar
from specrpc.engine.logits_transform import Cursor, LogitsTransform
from specrpc.engine.policy import AdaptivePolicy
from specrpc.engine.prediction import PredictionProposer
from specrpc.engine.proposers import EMPTY, Proposal, Proposer
from specrpc.engine.sampling import SamplingParams, argmax_ids, logits_to_probs, make_generator, sample
from specrpc.engine.suffix import SuffixProposer

FINISH_LENGTH = "length"
FINISH_STOP = "stop"

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities for (OpenAI's and vLLM's limit)."""


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
    max_draft_tokens: int | None = None  # the most draft tokens any step verifies (None: the server's; 0: none)
    min_draft_tokens: int = 0  # a step whose draft would be shorter decodes plainly (llama.cpp's speculative.n_min)
    prefill_only: bool = False  # cache the prompt (target and draft) and generate nothing
    logprobs: bool = False  # report each emitted token's TokenLogprob
    top_logprobs: int = 0  # with logprobs: alternatives per token, 0..MAX_TOP_LOGPROBS
    suggestion: Proposer | None = None  # the session's last completion as a draft (proposers.SuggestionProposer)
    prediction: PredictionProposer | None = None  # the client's predicted output as a draft
    suffix: SuffixProposer | None = None  # drafts from earlier outputs of the request's scope
    grammar: Grammar | None = None  # what the output must match (constraint.py); it ends (stop) when complete


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
    accepted_prediction_tokens: int = 0  # prediction tokens that appear in the completion (`count_prediction`)
    rejected_prediction_tokens: int = 0  # prediction tokens that do not

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


NOTHING = StepResult([], 0, 0, None)
"""A step that committed nothing (a prefill chunk before the last)."""


@dataclass
class Slot:
    """One KV slot's state: the token context whose prefix both caches hold, and its session's policy."""

    index: int
    tokens: list[int]
    policy: AdaptivePolicy


class Generation:
    """One request's decoding on `slot`, advanced by the engine's step until `finished` (a caller may simply stop
    stepping it: cancellation between steps)."""

    def __init__(self, slot: Slot, request: GenerationRequest, *, proposer: str, fixed_k: int | None, capacity: int,
                 device: torch.device) -> None:
        """`proposer`: the drafting source by name; `fixed_k`: the request's own k (0: no drafting), None for the
        policy's; `capacity`: context positions of the slot."""
        if not request.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(request.prompt_ids) >= capacity:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in a context of {capacity}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        self.slot = slot
        self.request = request
        self.params = request.sampling
        self.generator = make_generator(request.sampling, device)
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        self.proposer = proposer
        self.constraint: Constraint | None = request.grammar.start() if request.grammar is not None else None
        self.transform = (LogitsTransform(request.sampling, request.stop_token_ids, len(request.prompt_ids))
                          if request.sampling.transformed else None)
        self.fixed_k = fixed_k
        self.capacity = capacity
        self.finish: str | None = None
        self.started = False
        self.prefill_pos = 0

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

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.request.max_new_tokens - self.generated

    def room(self) -> int:
        """Draft tokens that fit this step: the bonus token must stay within max_new_tokens and the context."""
        return min(self.remaining - 1, self.capacity - len(self.slot.tokens))

    def begin(self, cached: int) -> None:
        """Start on the prompt with its first `cached` tokens already in the target's cache."""
        self.slot.tokens = list(self.request.prompt_ids)
        self.stats.cached_prompt_tokens = cached
        self.prefill_pos = cached
        self.started = True

    def prefill_chunk(self, budget: int) -> tuple[list[int], int]:
        """The next prompt chunk of at most `budget` tokens and its start position."""
        end = min(len(self.request.prompt_ids), self.prefill_pos + budget)
        return self.request.prompt_ids[self.prefill_pos : end], self.prefill_pos

    def prefilled(self, end: int, logits: torch.Tensor) -> StepResult:
        """After the target ran the prompt up to `end`: logits [1, V] of its last position. The last chunk emits the
        first token (or ends a prefill-only request)."""
        self.prefill_pos = end
        if end < len(self.request.prompt_ids):
            return NOTHING
        if self.request.prefill_only:
            self.finish = FINISH_LENGTH
            return StepResult([], 0, 0, self.finish)
        chosen = self.shaped(logits, EMPTY)  # [1, V]
        if self.params.greedy:
            token = int(chosen[0].argmax())
        else:
            token = int(sample(logits_to_probs(chosen, self.params), self.generator)[0])
        tokens = self.as_the_parser_allows([token], logits, EMPTY)
        return self.commit(tokens, accepted=0, proposed=0, logits=logits)

    def as_the_parser_allows(self, tokens: list[int], logits: torch.Tensor, proposal: Proposal) -> list[int]:
        """A verify's `tokens` (drafts the grammar took, then the token drawn at row len(tokens) - 1 of `logits`
        [k+1, V] as `shaped` makes it), the last one drawn again, from its row with it cleared from the mask, while
        the grammar's parser refuses a token its mask admitted (`Constraint.refuse`; guidance-ai/llguidance#366). A
        draw from the row with the refused token, redrawn without it when it comes up, is an exact draw from the row
        without it."""
        c = self.constraint
        n = len(tokens) - 1
        for _ in range(MAX_REFUSED):
            if c is None or c.takes(tokens):
                break
            c.refuse(tokens[-1], proposal.token_ids[:n])
            if self.params.greedy:
                token = self.greedy_ids(logits, proposal)[n]
            else:
                row = self.shaped(logits, proposal)[n : n + 1]  # [1, V]
                token = int(sample(logits_to_probs(row, self.params), self.generator)[0])
            tokens = [*tokens[:-1], token]
        return tokens

    def verify_ids(self, proposal: Proposal) -> list[int]:
        """The tokens the target scores for `proposal`: the last committed token and the k drafts."""
        return [self.slot.tokens[-1], *proposal.token_ids]

    def shaped(self, logits: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """A verify's target logits [k+1, V] as the request samples from them at each position along the draft:
        what the grammar forbids at -inf, then the logits transform with that position's counts (unchanged
        without either). Greedy, the mask goes only on the rows whose argmax the verify reads and the grammar
        forbids (`Constraint.greedy_rows`): every row read has its masked argmax, at a mask's cost only where the
        grammar overrules the target; the engine's own greedy verify reads only those argmaxes (`greedy_ids`)."""
        if self.constraint is not None and not self.params.greedy:
            logits = self.constraint.mask_rows(logits, proposal.token_ids)  # [k+1, V]
        if self.transform is not None:
            logits = self.transform.along(logits, self.slot.tokens, proposal.token_ids)  # [k+1, V]
        if self.constraint is not None and self.params.greedy:
            logits = self.constraint.greedy_rows(logits, proposal.token_ids)  # [k+1, V]
        return logits

    def greedy_ids(self, logits: torch.Tensor, proposal: Proposal) -> list[int]:
        """Each row's argmax of a greedy verify's logits [k+1, V] as `shaped` makes them (the first maximum on ties,
        as `verify` reads it), without shaping the rows: the transform along the draft, then the grammar's mask
        only where it overrules a row the verify reads (`Constraint.greedy_ids`)."""
        if self.transform is not None:
            logits = self.transform.along(logits, self.slot.tokens, proposal.token_ids)  # [k+1, V]
        if self.constraint is not None:
            return self.constraint.greedy_ids(logits, proposal.token_ids)
        return argmax_ids(logits)

    def cursor(self, vocab: int, device: torch.device) -> Cursor | None:
        """The logits transform for drafting after the committed context (None without one)."""
        return None if self.transform is None else self.transform.cursor(self.slot.tokens, vocab, device)

    def commit(self, tokens: list[int], accepted: int, proposed: int, logits: torch.Tensor) -> StepResult:
        """Append tokens, cut at a stop token, the end of the grammar or the length limit. `logits`
        [>= len(tokens), V_t]: the target's raw logits the tokens were chosen from, row i for token i (log-probs
        are reported from them, before any grammar mask). The caller rolls the caches back to the context."""
        n_before = len(self.slot.tokens)
        limit = min(self.remaining, self.capacity - n_before)
        kept: list[int] = []
        for token in tokens[: max(0, limit)]:
            kept.append(token)
            if self.constraint is not None and self.constraint.commit(token):
                self.finish = FINISH_STOP
                break
            if token in self.request.stop_token_ids:
                self.finish = FINISH_STOP
                break
        self.slot.tokens.extend(kept)
        self.stats.completion_tokens += len(kept)
        self.stats.proposed += proposed
        self.stats.accepted += min(accepted, len(kept))
        if self.finish is None and (self.remaining <= 0 or len(self.slot.tokens) >= self.capacity):
            self.finish = FINISH_LENGTH
        return StepResult(kept, min(accepted, len(kept)), proposed, self.finish, self._logprobs(logits, kept))

    def count_verify(self, proposal: Proposal, committed: int) -> None:
        """A verify step's figures: its k and the tokens it committed (accepted + recovered/bonus)."""
        self.stats.verify_steps += 1
        self.stats.last_k = len(proposal)
        self.stats.accepted_lengths.append(committed)

    def count_prediction(self) -> None:
        """The prediction's accepted and rejected tokens against the completion so far, as OpenAI counts them
        (`PredictionProposer.count`): once, when the request ends, whatever ended it."""
        prediction = self.request.prediction
        if prediction is None:
            return
        start = len(self.request.prompt_ids)
        completion = self.slot.tokens[start : start + self.stats.completion_tokens] if self.started else []
        self.stats.accepted_prediction_tokens, self.stats.rejected_prediction_tokens = prediction.count(completion)

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
