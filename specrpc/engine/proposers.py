"""Proposers draft tokens for the target to verify: the draft model, prompt lookup and the session's last
suggestion (the engine combines them)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from specrpc.engine.constraint import Constraint
from specrpc.engine.logits_transform import Cursor, LogitsTransform
from specrpc.engine.sampling import SamplingParams, logits_to_probs, mask_logits, sample
from specrpc.models import BatchRow, CausalLM


@dataclass(frozen=True)
class Proposal:
    """k proposed tokens; `probs` [k, V] is the proposer's distribution (None: a point mass at each token);
    `step_s`: a draft model's measured seconds per forward step (None: nothing measured); `catch_up_s`: seconds a
    draft model spent catching up on more than the last step's tokens first (after sitting out, or a new prompt)."""

    token_ids: list[int]
    probs: torch.Tensor | None
    source: str
    step_s: float | None = None
    catch_up_s: float = 0.0
    kind: str = ""  # what the policy judges it as (acceptance, realized rate): `source` unless a proposer splits it

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def estimate(self) -> str:
        """The policy's key for this proposal's acceptance and realized rate."""
        return self.kind or self.source

    def first(self, k: int) -> Proposal:
        """The first k tokens (k <= len)."""
        return dataclasses.replace(self, token_ids=self.token_ids[:k],
                                   probs=None if self.probs is None else self.probs[:k])


EMPTY = Proposal([], None, "none")

GIVEN = frozenset({"suggestion", "prediction"})
"""Sources of drafts a request brings (the session's suggestion, the client's prediction): drafted whatever the
batch guard decides, so it judges steps by the policy's own drafts alone."""

STEADY_CATCH_UP = 2
"""Tokens a drafting stream's draft feeds at the start of a step in steady state (the last draft token and the
target's); more is a catch-up after sitting out steps or on a new prompt (timed apart here, budgeted per batched
step by `Engine._plan_batch`)."""


class Proposer(Protocol):
    """Drafting behind one protocol (HF CandidateGenerator / vLLM SpeculativeProposer)."""

    name: str

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens continuing `tokens` (the committed context of `slot`)."""
        ...


def feed(model: CausalLM, slot: int, ids: list[int], start: int, chunk: int, num_logits: int = 1) -> torch.Tensor:
    """Run `ids` at positions start.. through `model` in chunks; returns logits [num_logits, V] of the last chunk."""
    assert ids, "feed needs at least one token"
    device = model.device
    logits = torch.empty(0)
    for lo in range(0, len(ids), chunk):
        part = ids[lo : lo + chunk]
        last = lo + chunk >= len(ids)
        tensor = torch.tensor(part, dtype=torch.long, device=device)  # [T]
        logits = model.forward(tensor, start + lo, slot, num_logits=num_logits if last else 1)
    return logits


@dataclass(frozen=True)
class DraftRequest:
    """One stream's share of a batched draft: `propose`'s arguments."""

    tokens: list[int]
    slot: int
    k: int
    params: SamplingParams
    generator: torch.Generator | None
    constraint: Constraint | None = None
    transform: LogitsTransform | None = None


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
          constraint: Constraint | None, cursor: Cursor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token [1] from logits [1, V] under the grammar's mask (which then takes it) and the logits
    transform at this position (which then counts it), and its distribution [V] (None when greedy: verify ignores
    draft probabilities then)."""
    if constraint is not None:
        logits = mask_logits(logits, constraint.allowed())  # [1, V]
    if cursor is not None:
        logits = cursor.apply(logits)  # [1, V]
    if params.greedy:
        token, probs = logits[0].argmax().view(1), None  # [1]
    else:
        p = logits_to_probs(logits, params)  # [1, V]
        token, probs = sample(p, generator), p[0]  # [1], [V]
    if constraint is not None:
        constraint.advance(int(token))
    if cursor is not None:
        cursor.advance(token)
    return token, probs


class DraftModelProposer:
    """Autoregressive drafting with a small model that shares the target's tokenizer and KV-slot layout."""

    name = "draft"

    def __init__(self, model: CausalLM, prefill_chunk: int) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None,
        constraint: Constraint | None = None, transform: LogitsTransform | None = None,
    ) -> Proposal:
        """Catch the draft cache up to `tokens` (chunked: it may hold only a prefix), then sample k tokens (under
        `constraint`'s mask, its matcher advancing through them and rewound after: fewer when the grammar ends;
        and under `transform` at each position)."""
        if k == 0:
            return EMPTY
        start = self.model.length(slot)
        t0 = time.perf_counter()
        steady = len(tokens) - start <= STEADY_CATCH_UP
        plain = params.greedy and constraint is None and transform is None  # the fused greedy paths may serve
        fused = self._feed_greedy(tokens, start, slot, k) if plain else None
        if fused is not None:  # the catch-up and the k drafts in one call: k forwards, the first over the catch-up
            ids: list[int] = fused.tolist()  # [k]
            # a catch-up of a few more tokens (after a prompt lookup step, or a plain one) is a few more rows in the
            # first forward, part of this step's cost: timed as a draft step only in the steady state
            return Proposal(ids, None, self.name, (time.perf_counter() - t0) / k if steady else None)
        logits = feed(self.model, slot, tokens[start:], start, self.prefill_chunk)  # [1, V]
        # Steady state: one forward over the last accepted draft token and the target's token. A longer catch-up
        # (the draft sat out steps, or a new prompt) is prefill, not drafting: leave it out of the step time.
        catch_up_s = 0.0
        if not steady:
            catch_up_s = time.perf_counter() - t0
            t0 += catch_up_s
        position = len(tokens)
        looped = self._greedy_loop(logits, position, slot, k) if plain else None
        drafted: list[torch.Tensor] = [] if looped is None else [looped]
        rows: list[torch.Tensor] = []
        cursor = None if transform is None else transform.cursor(tokens, logits.shape[-1], logits.device)
        for i in range(k if looped is None else 0):  # tokens stay on the device: on a GPU the steps queue unsynced
            token, probs = _draw(logits, params, generator, constraint, cursor)  # a grammar syncs each token
            drafted.append(token)
            if probs is not None:
                rows.append(probs)
            if constraint is not None and constraint.done:
                break  # nothing may follow: the verify's bonus position is the grammar's end
            if i + 1 < k:
                logits = self.model.forward(token, position + i, slot, num_logits=1)  # [1, V]
        ids = torch.cat(drafted).tolist()  # [k]: the one host sync of the proposal
        if constraint is not None:
            constraint.rewind(len(ids))
        probs_out = None if params.greedy else torch.stack(rows)  # [k, V]
        forwards = len(ids) if steady else len(ids) - 1
        step_s = (time.perf_counter() - t0) / forwards if forwards else None
        return Proposal(ids, probs_out, self.name, step_s, catch_up_s)


    def propose_batch(self, requests: list[DraftRequest]
                      ) -> tuple[list[Proposal], list[tuple[int, float]], float]:
        """`propose` for several streams (distinct slots, each k >= 1) with one batched draft forward per draft
        position: the first also catches each slot up on its new tokens (a catch-up beyond a prefill chunk is fed
        alone first), the next ones carry one token per stream still drafting. Each stream samples from its own
        logits with its own generator, in its own order, as alone. Returns the proposals, per batched drafting
        forward (rows, seconds) for the batch cost model, and the seconds spent catching up beyond the steady
        state (the first forward then, and any feed before it): the price of steps the drafts sat out, not what
        drafting costs, so neither the cost model nor the batch guard should count it."""
        model = self.model
        rows: list[BatchRow] = []
        t_catch = time.perf_counter()
        for r in requests:
            start = model.length(r.slot)
            rest = r.tokens[start:]
            if len(rest) > self.prefill_chunk:
                skip = len(rest) - self.prefill_chunk
                feed(model, r.slot, rest[:skip], start, self.prefill_chunk)
                start, rest = start + skip, rest[skip:]
            rows.append(BatchRow(torch.tensor(rest, dtype=torch.long, device=model.device), start, r.slot, 1))
        steady = all(row.ids.shape[0] <= STEADY_CATCH_UP for row in rows)
        timings: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        logits = model.forward_batch(rows)  # per stream [1, V]
        if steady:
            timings.append((len(rows), time.perf_counter() - t0))
        catch_up_s = 0.0 if steady else time.perf_counter() - t_catch
        drafted: list[list[torch.Tensor]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        ks = [r.k for r in requests]  # each stream's k, cut where its grammar ends
        cursors = [None if r.transform is None else r.transform.cursor(r.tokens, out.shape[-1], out.device)
                   for r, out in zip(requests, logits, strict=True)]
        for i in range(max(ks)):
            active = [j for j, k in enumerate(ks) if k > i]
            step: list[BatchRow] = []
            for j, row_logits in zip(active, logits, strict=True):
                r = requests[j]
                token, p = _draw(row_logits, r.params, r.generator, r.constraint, cursors[j])
                if p is not None:
                    probs[j].append(p)
                drafted[j].append(token)
                if r.constraint is not None and r.constraint.done:
                    ks[j] = i + 1
                if i + 1 < ks[j]:
                    step.append(BatchRow(token, len(r.tokens) + i, r.slot, 1))
            if not step:
                break
            t0 = time.perf_counter()
            logits = model.forward_batch(step)  # per stream still drafting [1, V]
            timings.append((len(step), time.perf_counter() - t0))
        proposals = []
        for r, tokens, rows_p in zip(requests, drafted, probs, strict=True):
            ids: list[int] = torch.cat(tokens).tolist()  # [k]
            if r.constraint is not None:
                r.constraint.rewind(len(ids))
            proposals.append(Proposal(ids, None if r.params.greedy else torch.stack(rows_p), self.name))
        return proposals, timings, catch_up_s

    def _feed_greedy(self, tokens: list[int], start: int, slot: int, k: int) -> torch.Tensor | None:
        """The catch-up on tokens[start:] and k greedy drafts [k] in one call of the model's (a lean model's native
        step on CPU), or None where it has none."""
        fused = getattr(self.model, "feed_greedy", None)  # optional: not part of the CausalLM protocol
        if fused is None:
            return None
        ids = torch.tensor(tokens[start:], dtype=torch.long, device=self.model.device)  # [F]
        drafted: torch.Tensor | None = fused(ids, start, slot, k)
        return drafted

    def _greedy_loop(self, logits: torch.Tensor, position: int, slot: int, k: int) -> torch.Tensor | None:
        """k greedy tokens [k] from one replay of the model's captured k-step loop (a lean model on CUDA), or None
        where the model has none (then the caller drafts step by step)."""
        loop = getattr(self.model, "greedy_draft", None)  # optional: not part of the CausalLM protocol
        if loop is None:
            return None
        tokens: torch.Tensor | None = loop(logits, position, slot, k)
        return tokens


@dataclass
class NgramIndex:
    """One slot's context as prompt lookup indexes it: `tokens` (a copy) and, per n-gram size s (list index s-1),
    each n-gram → its most recent start i among those ending before the last token (i + s <= len(tokens) - 1)."""

    tokens: list[int]
    last: list[dict[tuple[int, ...], int]]


def lookup_kind(size: int) -> str:
    """The policy's key for prompt lookup proposals from a match of `size` tokens."""
    return f"lookup{size}"


class PromptLookupProposer:
    """Copy what followed the most recent earlier occurrence of the context's last n-gram (n = max_ngram..1).

    Free to run and strong on code edits, repeated identifiers and quoted text; proposals are point masses. Each
    slot's n-grams are indexed as its context grows (a step adds the n-grams of its new tokens, a dict lookup per
    size finds the match), so a step costs the same at any context length; the index is rebuilt when the context
    is not the indexed one extended (a new prompt, a reset slot).
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._index: dict[int, NgramIndex] = {}

    def _indexed(self, tokens: list[int], slot: int) -> NgramIndex:
        """`slot`'s index brought up to `tokens`."""
        index = self._index.get(slot)
        if index is None or len(index.tokens) > len(tokens) or tokens[: len(index.tokens)] != index.tokens:
            index = self._index[slot] = NgramIndex([], [{} for _ in range(self.max_ngram)])
        m, n = len(index.tokens), len(tokens)
        for size in range(1, self.max_ngram + 1):
            last = index.last[size - 1]
            for i in range(max(0, m - size), n - size):  # the starts whose n-gram now ends before the last token
                last[tuple(tokens[i : i + size])] = i
        index.tokens.extend(tokens[m:])
        return index

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """The longest suffix n-gram with an earlier match wins; the most recent match among equals. The match's
        size is the proposal's `kind` (`lookup_kind`): a one-token match is right far less often than a three-token
        one, so the policy keeps their acceptance apart."""
        if k == 0 or len(tokens) < 2:
            return EMPTY
        index = self._indexed(tokens, slot)
        n = len(tokens)
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            start = index.last[size - 1].get(tuple(tokens[n - size :]))
            if start is not None:
                ids = tokens[start + size : start + size + k]
                if ids:
                    return Proposal(ids, None, self.name, kind=lookup_kind(size))
        return EMPTY


SUGGESTION_SLACK = 4
"""Tokens at the end of the previous prompt that the new prompt may tokenize differently (typed characters merge
with the token before them) and still follow the previous completion."""

REPLACEMENT = "\ufffd"


class SuggestionProposer:
    """The session's last completion as a draft, for an editor's next keystroke: when the characters typed since
    follow that completion (which the editor still shows), its remainder is proposed whole, a point mass like
    prompt lookup, so the target accepts it in one or two verify steps. The target decides; nothing is assumed.

    Alignment is by text, since typing inside a token retokenizes it: the characters typed past the common token
    prefix plus the text generated so far must be a prefix of the previous text past it, and ending where one of
    its tokens ends; then the tokens after that one are proposed. Once the text departs from the suggestion it is
    dropped for the rest of the request.
    """

    name = "suggestion"

    def __init__(self, rest: list[int], rest_text: str, typed: str, prompt_len: int,
                 decode: Callable[[list[int]], str]) -> None:
        self.rest = rest  # the previous prompt's tail and completion past the common prefix
        self.rest_text = rest_text  # decode(rest)
        self.typed = typed  # the new prompt's text past the common prefix (the typed characters)
        self.prompt_len = prompt_len
        self.alive = True
        self._decode = decode
        self._ends = TokenEnds(rest, rest_text, decode)

    @classmethod
    def follow(cls, previous: list[int], previous_prompt_len: int, prompt: list[int],
               decode: Callable[[list[int]], str], special_ids: Collection[int]) -> SuggestionProposer | None:
        """A proposer for `prompt` when it continues `previous` (the last prompt, then its completion from
        `previous_prompt_len` on) along the completion's text, else None.

        Special tokens that end both prompts alike (a FIM middle token after suffix-first prefix text) are set
        aside: the typed characters come before them in the new prompt, the completion after them in the old."""
        old_prompt = previous[:previous_prompt_len]
        tail = 0
        while (tail < min(SUGGESTION_SLACK, len(old_prompt) - 1, len(prompt) - 1)
               and old_prompt[-1 - tail] in special_ids and prompt[-1 - tail] == old_prompt[-1 - tail]):
            tail += 1
        old = old_prompt[: len(old_prompt) - tail] + previous[previous_prompt_len:]
        body = prompt[: len(prompt) - tail]
        shared = 0
        for a, b in zip(body, old, strict=False):
            if a != b:
                break
            shared += 1
        if shared == 0 or shared < len(old_prompt) - tail - SUGGESTION_SLACK:
            return None
        typed = decode(body[shared:])
        rest = old[shared:]
        rest_text = decode(rest)
        if len(rest_text) <= len(typed) or not rest_text.startswith(typed) or REPLACEMENT in typed:
            return None
        return cls(rest, rest_text, typed, len(prompt), decode)

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens of the suggestion after the text typed and generated so far (EMPTY when that text ends
        inside one of its tokens, or has left it)."""
        if not self.alive or k == 0:
            return EMPTY
        done = self.typed
        if len(tokens) > self.prompt_len:
            done += self._decode(tokens[self.prompt_len :]).rstrip(REPLACEMENT)  # an unfinished character waits
        if not self.rest_text.startswith(done):
            self.alive = False
            return EMPTY
        at = self._ends.tokens_at(len(done))
        ids = self.rest[at : at + k] if at is not None else []
        return Proposal(ids, None, self.name) if ids else EMPTY


class TokenEnds:
    """Where the tokens of `ids` end in their text `text` (= decode(ids)): typing or generating inside a token
    retokenizes it, so drafts given as text are aligned by characters and proposed from a token that ends there.

    Found lazily, only as far as asked, in linear time: each token's text is the difference of two short decodes
    from a boundary a few tokens back (the context a SentencePiece decoder needs to keep a leading space), not a
    decode of the whole prefix each time."""

    def __init__(self, ids: list[int], text: str, decode: Callable[[list[int]], str]) -> None:
        self.ids = ids
        self.text = text
        self._decode = decode
        self._ends: dict[int, int] = {0: 0}  # characters of text → tokens of ids whose text ends exactly there
        self._bounds: list[tuple[int, int]] = [(0, 0)]  # (tokens, characters) of each boundary found, in order
        self._scanned = 0  # tokens of ids looked at so far

    def tokens_at(self, chars: int) -> int | None:
        """How many tokens of `ids` decode to exactly the first `chars` characters of `text`, None if no token
        ends there."""
        while self._scanned < len(self.ids) and self._bounds[-1][1] < chars:
            self._scanned += 1
            (base, _), (last, last_chars) = self._bounds[max(0, len(self._bounds) - 3)], self._bounds[-1]
            context = self._decode(self.ids[base:last]) if last > base else ""
            grown = self._decode(self.ids[base : self._scanned])
            if grown.endswith(REPLACEMENT) or not grown.startswith(context):
                continue  # an unfinished character: its token ends no text
            end = last_chars + len(grown) - len(context)
            if self.text.startswith(grown[len(context) :], last_chars) and end > last_chars:
                self._ends.setdefault(end, self._scanned)
                self._bounds.append((self._scanned, end))
        return self._ends.get(chars)
