"""Simulated acceptance for benchmarks on random-weight models, whose drafts would never match the target: each
drafted token is accepted with probability α, independently, until the first rejection. Everything else (draft
forwards, the full verify forward, commit, rollback, KV bookkeeping) runs as usual, so the timings are real and only
the tokens are meaningless. Never a model result: tables label it "measured costs, simulated acceptance"."""

from __future__ import annotations

import random

import torch

from specrpc.engine.engine import Verifier
from specrpc.engine.sampling import SamplingParams
from specrpc.engine.verify import VerifyResult


def simulated_verifier(alpha: float, seed: int = 0, vocab: int | None = None) -> Verifier:
    """A verifier that accepts each draft with probability `alpha` until the first rejection, then emits the target's
    argmax at that position (the bonus when all k were accepted) among the first `vocab` ids (those both models
    embed: random weights put mass on a target's padded rows, which a draft with fewer rows cannot read)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    rng = random.Random(seed)

    def run(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
            params: SamplingParams, generator: torch.Generator | None) -> VerifyResult:
        k = draft_ids.shape[0]
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        token = target_logits[accepted, :vocab].argmax().view(1)  # [1]
        host = torch.cat([draft_ids[:accepted], token]).tolist()  # the one host sync
        return VerifyResult(accepted=accepted, tokens=host, bonus=accepted == k)

    return run
