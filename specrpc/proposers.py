"""Proposers draft tokens for the target to verify: the draft model and prompt lookup (the engine combines them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specrpc.models import CausalLM
from specrpc.sampling import SamplingParams, logits_to_probs, sample


@dataclass(frozen=True)
class Proposal:
    """k proposed tokens; `probs` [k, V] is the proposer's distribution (None: a point mass at each token)."""

    token_ids: list[int]
    probs: torch.Tensor | None
    source: str

    def __len__(self) -> int:
        return len(self.token_ids)


EMPTY = Proposal([], None, "none")


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


class DraftModelProposer:
    """Autoregressive drafting with a small model that shares the target's tokenizer and KV-slot layout."""

    name = "draft"

    def __init__(self, model: CausalLM, prefill_chunk: int) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.last_step_s = 0.0

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Catch the draft cache up to `tokens` (chunked: it may hold only a prefix), then sample k tokens."""
        if k == 0:
            return EMPTY
        start = self.model.length(slot)
        logits = feed(self.model, slot, tokens[start:], start, self.prefill_chunk)  # [1, V]
        position = len(tokens)
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:  # verify ignores draft probabilities when greedy
                token = int(logits[0].argmax())
            else:
                probs = logits_to_probs(logits, params)  # [1, V]
                token = int(sample(probs, generator)[0])
                rows.append(probs[0])
            ids.append(token)
            if i + 1 < k:
                step = torch.tensor([token], dtype=torch.long, device=self.model.device)  # [1]
                logits = self.model.forward(step, position + i, slot, num_logits=1)  # [1, V]
        probs_out = None if params.greedy else torch.stack(rows)  # [k, V]
        return Proposal(ids, probs_out, self.name)


class PromptLookupProposer:
    """Copy what followed the most recent earlier occurrence of the context's last n-gram (n = max_ngram..1).

    Free to run and strong on code edits, repeated identifiers and quoted text; proposals are point masses.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """The longest suffix n-gram with an earlier match wins; the most recent match among equals."""
        if k == 0 or len(tokens) < 2:
            return EMPTY
        context = torch.tensor(tokens, dtype=torch.long)  # [n]
        n = len(tokens)
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            windows = context[: n - 1].unfold(0, size, 1)  # [n-size, size], excludes the suffix itself
            hits = (windows == context[n - size :]).all(dim=1).nonzero().flatten()  # [m]
            if hits.numel():
                follow = int(hits[-1]) + size
                ids = tokens[follow : follow + k]
                if ids:
                    return Proposal(ids, None, self.name)
        return EMPTY
