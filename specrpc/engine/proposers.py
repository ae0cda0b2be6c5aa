"""Proposers draft tokens for the target to verify: the draft model, prompt lookup and the session's last
suggestion (the engine combines them)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specrpc import native
from specrpc.engine.constraint import MAX_REFUSED, Constraint
from specrpc.engine.logits_transform import Cursor, LogitsTransform
from specrpc.engine.sampling import SamplingParams, logits_to_probs, sample
from specrpc.engine.window import DraftWindow
from specrpc.models import BatchRow, CausalLM


@dataclass(frozen=True)
class Proposal:
    """k proposed tokens; `probs` [k, V] is the proposer's distribution (None: a point mass at each token);
    `draft_s`: a draft model's measured seconds for its drawn tokens in the steady state (a forward each, the first
    over the last step's tokens; a grammar's forced tokens ride along in one; None: not measured, a catch-up came
    first); `catch_up_s`: seconds a draft model spent catching up on more than the last step's tokens first (after
    sitting out, or a new prompt); `forced`: the positions of tokens a grammar forced (drafted without drawing: not
    the proposer's guesses, so the policy's acceptance leaves them out)."""

    token_ids: list[int]
    probs: torch.Tensor | None
    source: str
    draft_s: float | None = None
    catch_up_s: float = 0.0
    kind: str = ""  # what the policy judges it as (acceptance, realized rate): `source` unless a proposer splits it
    forced: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def estimate(self) -> str:
        """The policy's key for this proposal's acceptance and realized rate."""
        return self.kind or self.source

    def first(self, k: int) -> Proposal:
        """The first k tokens (k <= len)."""
        return dataclasses.replace(self, token_ids=self.token_ids[:k],
                                   probs=None if self.probs is None else self.probs[:k],
                                   forced=frozenset(i for i in self.forced if i < k))

    @property
    def drawn(self) -> int:
        """Tokens the proposer guessed (all but the grammar's forced ones)."""
        return len(self.token_ids) - len(self.forced)

    def drawn_outcome(self, accepted: int) -> tuple[int, int]:
        """A verify's outcome (`accepted` of the tokens, then the first rejection if any) on the drawn tokens alone,
        as (tested, accepted): the ones up to the first rejection, and those accepted. A forced token is no guess of
        the proposer's: the policy's acceptance of its drafts counts the drawn ones."""
        tested = range(min(accepted + 1, len(self.token_ids)))
        drawn = [i for i in tested if i not in self.forced]
        return len(drawn), sum(i < accepted for i in drawn)


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
    most: int | None = None  # tokens in all with the grammar's forced ones (None: k)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
          constraint: Constraint | None, cursor: Cursor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token [1] from logits [1, V] under the grammar's mask (which then takes it) and the logits
    transform at this position (which then counts it), and its distribution [V] (None when greedy: verify ignores
    draft probabilities then). Greedy, the argmax is checked first and the mask filled only when the grammar
    forbids it (an allowed argmax is the masked one; the transform keeps -inf, so it commutes with the mask)."""
    raw = logits  # [1, V]
    for _ in range(MAX_REFUSED + 1):
        logits = raw
        if constraint is not None and not params.greedy:
            logits = constraint.mask_next(raw)  # [1, V]
        if cursor is not None:
            logits = cursor.apply(logits)  # [1, V]
        if params.greedy:
            token, probs = logits[0].argmax().view(1), None  # [1]
            if constraint is not None and not constraint.take(int(token)):
                token = constraint.mask_next(logits)[0].argmax().view(1)  # [1]
                if not constraint.take(int(token)):  # a token the mask admits and the parser refuses
                    constraint.refuse(int(token))
                    continue
        else:
            p = logits_to_probs(logits, params)  # [1, V]
            token, probs = sample(p, generator), p[0]  # [1], [V]
            if constraint is not None and not constraint.take(int(token)):
                constraint.refuse(int(token))  # drawn again without it: q is the mask's without it, exactly
                continue
        break
    else:
        assert constraint is not None
        constraint.advance(int(token))  # the parser's own error, where it refuses what its mask keeps offering
    if cursor is not None:
        cursor.advance(token)
    return token, probs


class _Stream:
    """One stream's drafting in progress: k tokens to draw, at most `most` in all with the grammar's forced runs
    (they cost no draft forward), its tokens so far ([1] drawn or [F] forced each, on the device), their
    distributions ([1, V] or [F, V] each; none when greedy) and those not yet in the draft's cache."""

    def __init__(self, k: int, most: int, params: SamplingParams, generator: torch.Generator | None,
                 constraint: Constraint | None, cursor: Cursor | None, vocab: int, device: torch.device) -> None:
        self.k = k
        self.most = max(k, most)
        self.params = params
        self.generator = generator
        self.constraint = constraint
        self.cursor = cursor
        self.vocab = vocab
        self.device = device
        self.n = 0  # tokens drafted
        self.drawn = 0  # of them drawn from the draft's logits
        self._forced: list[int] = []  # the positions of the forced ones
        self._drafted: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []
        self._unfed: list[torch.Tensor] = []

    @classmethod
    def start(cls, model: CausalLM, tokens: list[int], k: int, most: int | None, params: SamplingParams,
              generator: torch.Generator | None, constraint: Constraint | None,
              transform: LogitsTransform | None) -> _Stream:
        """A stream drawing k tokens after `tokens` with `model`, at most `most` in all (None: k) with forced ones
        (its transform's cursor made here)."""
        cursor = None if transform is None else transform.cursor(tokens, model.vocab_size, model.device)
        return cls(k, k if most is None else most, params, generator, constraint, cursor, model.vocab_size,
                   model.device)

    def lead(self) -> list[int]:
        """The run the grammar forces at the start, to go into the draft's cache with the catch-up (counted as fed
        from now on); none where there is none or drafting ends with it (no forward follows then)."""
        ahead = self.force()
        if ahead and self.more:
            self.unfed()
            return ahead
        return []

    @property
    def more(self) -> bool:
        """Whether it draws on: fewer than k drawn and `most` in all, and the grammar not ended (the bonus position
        is its end)."""
        return (self.drawn < self.k and self.n < self.most
                and not (self.constraint is not None and self.constraint.done))

    def force(self) -> list[int]:
        """Take the tokens the grammar forces next, up to `most` in all (returned), where a draw follows them:
        drafts that cost no draft forward (jump-forward decoding under speculation; the target verifies them like
        any draft), a point mass each, going into the draft's cache with the token before them. Not after the last
        draw: the draft's cache would then lag more than a steady step's catch-up behind the next step."""
        if self.constraint is None or not self.more:
            return []
        forced = self.constraint.forced()[: self.most - self.n]
        if forced:
            self.constraint.advance_all(forced)
            tokens = torch.tensor(forced, dtype=torch.long, device=self.device)  # [F]
            if self.cursor is not None:
                for token in tokens:
                    self.cursor.advance(token.view(1))
            self._forced.extend(range(self.n, self.n + len(forced)))
            self._add(tokens, None if self.params.greedy else F.one_hot(tokens, self.vocab).to(torch.float32))
        return forced

    def draw(self, logits: torch.Tensor) -> None:
        """Draw a token from the draft's logits [1, V] (`_draw`), then take what the grammar forces after it."""
        token, probs = _draw(logits, self.params, self.generator, self.constraint, self.cursor)  # [1], [V]
        self._add(token, None if probs is None else probs.unsqueeze(0))
        self.drawn += 1
        self.force()

    def unfed(self) -> tuple[torch.Tensor, int]:
        """The drafted tokens the draft's cache lacks [T] (they go in with one forward) and the index of the first
        among the drafts; counted as fed from now on."""
        fresh = torch.cat(self._unfed)  # [T]
        self._unfed = []
        return fresh, self.n - fresh.shape[0]

    def proposal(self, name: str) -> Proposal:
        """The drafts as a proposal (the one host sync), the grammar rewound to where drafting started."""
        ids: list[int] = torch.cat(self._drafted).tolist() if self._drafted else []  # [n]
        if self.constraint is not None:
            self.constraint.rewind(len(ids))
        probs = None if self.params.greedy or not ids else torch.cat(self._probs)  # [n, V]
        return Proposal(ids, probs, name, forced=frozenset(self._forced))

    def _add(self, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        self._drafted.append(tokens)
        self._unfed.append(tokens)
        if probs is not None:
            self._probs.append(probs)
        self.n += tokens.shape[0]


class DraftModelProposer:
    """Autoregressive drafting with a small model that shares the target's tokenizer and KV-slot layout."""

    name = "draft"

    def __init__(self, model: DraftWindow, prefill_chunk: int) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None,
        constraint: Constraint | None = None, transform: LogitsTransform | None = None, most: int | None = None,
    ) -> Proposal:
        """Catch the draft cache up to `tokens` (chunked: it may hold only a prefix), then sample k tokens (under
        `constraint`'s mask, its matcher advancing through them and rewound after: fewer when the grammar ends;
        and under `transform` at each position). Tokens the grammar forces are drafted without drawing
        (`_Stream.force`) and go into the draft's cache with the token before them, in one forward."""
        if k == 0:
            return EMPTY
        start = self.model.catch_up_from(slot, len(tokens))
        t0 = time.perf_counter()
        steady = len(tokens) - start <= STEADY_CATCH_UP
        plain = params.greedy and constraint is None and transform is None  # the fused greedy paths may serve
        shaped = (transform.greedy_draft(tokens, self.model.vocab_size, k)
                  if params.greedy and constraint is None and transform is not None else None)
        fused = self._feed_greedy(tokens, start, slot, k, shaped) if plain or shaped is not None else None
        if fused is not None:  # the catch-up and the k drafts in one call: k forwards, the first over the catch-up
            ids: list[int] = fused.tolist()  # [k]
            # a catch-up of a few more tokens (after a prompt lookup step, or a plain one) is a few more rows in the
            # first forward, part of this step's cost: timed as a draft step only in the steady state
            return Proposal(ids, None, self.name, time.perf_counter() - t0 if steady else None)
        model = self.model
        stream = _Stream.start(model, tokens, k, most, params, generator, constraint, transform)
        ahead = stream.lead()
        logits = feed(model, slot, tokens[start:] + ahead, start, self.prefill_chunk)  # [1, V]
        # Steady state: one forward over the last accepted draft token and the target's token. A longer catch-up
        # (the draft sat out steps, or a new prompt) is prefill, not drafting: its time apart, the draft's untimed.
        catch_up_s = 0.0 if steady else time.perf_counter() - t0
        position = len(tokens)
        looped = self._greedy_loop(logits, position, slot, k) if plain else None
        if looped is not None:
            proposal = Proposal(looped.tolist(), None, self.name)  # [k]
        else:
            while stream.more:  # tokens stay on the device: on a GPU the steps queue unsynced (a grammar syncs each)
                stream.draw(logits)
                if stream.more:  # the token drawn and the forced run after it: one forward
                    fresh, at = stream.unfed()
                    logits = model.forward(fresh, position + at, slot, num_logits=1)  # [1, V]
            proposal = stream.proposal(self.name)
        draft_s = time.perf_counter() - t0 if steady else None  # a forward each, the first over the catch-up
        return dataclasses.replace(proposal, draft_s=draft_s, catch_up_s=catch_up_s)

    def propose_batch(self, requests: list[DraftRequest]
                      ) -> tuple[list[Proposal], list[tuple[int, float]], float]:
        """`propose` for several streams (distinct slots, each k >= 1) with one batched draft forward per draft
        position: the first also catches each slot up on its new tokens (a catch-up beyond a prefill chunk is fed
        alone first), the next ones carry each stream still drafting's last token (and the run its grammar forces
        after it, which costs no forward of its own: the batch cost model counts rows). Each stream samples from its own
        logits with its own generator, in its own order, as alone. Returns the proposals, per batched drafting
        forward (rows, seconds) for the batch cost model, and the seconds spent catching up beyond the steady
        state (the first forward then, and any feed before it): the price of steps the drafts sat out, not what
        drafting costs, so neither the cost model nor the batch guard should count it."""
        model = self.model
        rows: list[BatchRow] = []
        streams: list[_Stream] = []
        steady = True
        t_catch = time.perf_counter()
        for r in requests:
            start = model.catch_up_from(r.slot, len(r.tokens))
            rest = r.tokens[start:]
            if len(rest) > self.prefill_chunk:
                skip = len(rest) - self.prefill_chunk
                feed(model, r.slot, rest[:skip], start, self.prefill_chunk)
                start, rest = start + skip, rest[skip:]
            steady = steady and len(rest) <= STEADY_CATCH_UP
            stream = _Stream.start(model, r.tokens, r.k, r.most, r.params, r.generator, r.constraint, r.transform)
            ahead = stream.lead()
            streams.append(stream)
            rows.append(BatchRow(torch.tensor(rest + ahead, dtype=torch.long, device=model.device), start, r.slot,
                                 1))
        timings: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        logits = model.forward_batch(rows)  # per stream [1, V]
        if steady:
            timings.append((len(rows), time.perf_counter() - t0))
        catch_up_s = 0.0 if steady else time.perf_counter() - t_catch
        active = list(range(len(requests)))  # the streams `logits` holds a row for, in order
        while True:
            step: list[BatchRow] = []
            drafting: list[int] = []
            for j, row_logits in zip(active, logits, strict=True):
                stream = streams[j]
                if not stream.more:
                    continue
                stream.draw(row_logits)
                if stream.more:  # the token drawn and the forced run after it: one row
                    fresh, at = stream.unfed()
                    step.append(BatchRow(fresh, len(requests[j].tokens) + at, requests[j].slot, 1))
                    drafting.append(j)
            if not step:
                break
            t0 = time.perf_counter()
            logits = model.forward_batch(step)  # per stream still drafting [1, V]
            timings.append((len(step), time.perf_counter() - t0))
            active = drafting
        return [stream.proposal(self.name) for stream in streams], timings, catch_up_s

    def _feed_greedy(self, tokens: list[int], start: int, slot: int, k: int,
                     transform: native.DraftTransform | None) -> torch.Tensor | None:
        """The catch-up on tokens[start:] and k greedy drafts [k] in one call of the model's (a lean model's native
        step on CPU), each the argmax of the logits as `transform` leaves them where given, or None where it has
        none."""
        ids = torch.tensor(tokens[start:], dtype=torch.long, device=self.model.device)  # [F]
        return self.model.feed_greedy(ids, start, slot, k, transform)

    def _greedy_loop(self, logits: torch.Tensor, position: int, slot: int, k: int) -> torch.Tensor | None:
        """k greedy tokens [k] from one replay of the model's captured k-step loop (a lean model on CUDA), or None
        where the model has none (then the caller drafts step by step)."""
        return self.model.greedy_draft(logits, position, slot, k)


@dataclass
class NgramIndex:
    """One slot's context as prompt lookup indexes it: `tokens` (a copy) and, per n-gram size s (list index s-1),
    each n-gram → its most recent start i among those ending before the last token (i + s <= len(tokens) - 1);
    `source`: the context list it was last brought up to."""

    tokens: list[int]
    last: list[dict[tuple[int, ...], int]]
    source: list[int] | None = None


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
        """`slot`'s index brought up to `tokens`. A request's context is one list that only grows
        (`Generation.commit` extends it): the same list again extends what was indexed, and only another one
        (a new request, which may share the prompt's start) is compared token by token."""
        index = self._index.get(slot)
        grown = index is not None and index.source is tokens and len(tokens) >= len(index.tokens)
        if index is None or not (grown or tokens[: len(index.tokens)] == index.tokens):
            index = self._index[slot] = NgramIndex([], [{} for _ in range(self.max_ngram)])
        index.source = tokens
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
