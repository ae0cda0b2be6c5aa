"""Pure rejection sampler for speculative decoding (greedy and stochastic): no model, no I/O.

Vocabulary as in vLLM: draft tokens are *accepted* up to the first rejection, where one *recovered* token is
sampled from the residual norm(max(0, p - q)); when all k are accepted a *bonus* token is sampled from p[k].
The emitted tokens are distributed exactly as sampling from the target one token at a time (Leviathan et al.
2023; Chen et al. 2023). The caller pads or truncates draft and target to one common vocabulary width V first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrpc.engine.sampling import SamplingParams, argmax_ids, logits_to_probs, sample


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verify step."""

    accepted: int  # draft tokens accepted, 0..k
    tokens: list[int]  # accepted draft tokens + one recovered or bonus token; len == accepted + 1
    bonus: bool  # all k accepted and tokens[-1] sampled from p[k] (True for k == 0)


def verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Accept a prefix of `draft_ids` against the target and emit one more token; one host sync.

    draft_ids [k] int64; draft_probs [k, V] float32 from `logits_to_probs` with the same params, or None for a
    point-mass proposer (q(x) = 1 at the proposed token); target_logits [k+1, V] raw logits over (last committed
    token + k drafts). Draft and target must share V. Greedy ignores draft_probs and generator.
    """
    k = draft_ids.shape[0]
    vocab = target_logits.shape[-1]
    assert draft_ids.dim() == 1, "draft_ids must be [k]"
    assert target_logits.shape == (k + 1, vocab), "target_logits must be [k+1, V]"
    assert draft_probs is None or draft_probs.shape == (k, vocab), "draft_probs must be [k, V] with the target's V"
    if params.greedy and k == 0:  # plain greedy decoding: the argmax, without the acceptance machinery
        return VerifyResult(accepted=0, tokens=argmax_ids(target_logits), bonus=True)  # as below, ties too
    draft_ids = draft_ids.to(target_logits.device)  # [k]
    if params.greedy:
        return _verify_greedy(draft_ids, target_logits)
    return _verify_stochastic(draft_ids, draft_probs, target_logits, params, generator)


def _first_rejection(rejected: torch.Tensor) -> torch.Tensor:
    """Rejected [k] bool → index of the first True, or k when none; a 0-dim int64 tensor, no host sync."""
    sentinel = torch.ones(1, dtype=torch.uint8, device=rejected.device)  # [1]
    return torch.cat([rejected.to(torch.uint8), sentinel]).argmax()  # argmax returns the first maximum


def _verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept while the draft equals the target's argmax; the target's argmax at the first mismatch follows. The
    comparison runs on the host: k + 1 integers, after the one sync the tokens need anyway (fewer ops than comparing
    on the device, each of which costs more than the comparison right after a forward has flushed the caches)."""
    k = draft_ids.shape[0]
    host = torch.cat([draft_ids, target_logits.argmax(dim=-1)]).tolist()  # [2k+1]: drafts, target ids; one sync
    return accept_greedy(host[:k], host[k:])


def accept_greedy(drafts: list[int], target_ids: list[int]) -> VerifyResult:
    """Greedy verification on the host: `drafts` [k] accepted while each equals the target's argmax at its position
    (`target_ids` [k+1], the first maximum on ties), then the target's argmax at the first mismatch (or the bonus)."""
    k = len(drafts)
    n = next((i for i in range(k) if drafts[i] != target_ids[i]), k)
    return VerifyResult(accepted=n, tokens=target_ids[: n + 1], bonus=n == k)  # accepted drafts == target ids


def _verify_stochastic(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); resample the first rejection from the residual."""
    k, vocab = draft_ids.shape[0], target_logits.shape[-1]
    device = target_logits.device
    p = logits_to_probs(target_logits, params)  # [k+1, V]
    if draft_probs is None:
        q = F.one_hot(draft_ids, vocab).to(torch.float32)  # [k, V] point mass at each proposal
    else:
        q = draft_probs.to(device=device, dtype=torch.float32)  # [k, V]
    rows = torch.arange(k, device=device)  # [k]
    p_x = p[rows, draft_ids]  # [k]
    q_x = q[rows, draft_ids]  # [k]
    noise_device = generator.device if generator is not None else device
    u = torch.rand(k, generator=generator, device=noise_device).to(device)  # [k]
    accepted = _first_rejection(~(u < p_x / q_x))  # []  (p_x = 0 → never accepted; q_x = 0 < p_x → accepted)
    q_pad = torch.cat([q, q.new_zeros(1, vocab)])  # [k+1, V] zero row at k: the bonus residual is p[k]
    p_row = p.index_select(0, accepted.view(1))  # [1, V]
    residual = (p_row - q_pad.index_select(0, accepted.view(1))).clamp_min_(0.0)  # [1, V]
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_row)  # all-zero residual → p
    extra = sample(residual, generator)  # [1]
    host = torch.cat([accepted.view(1), extra, draft_ids]).tolist()  # the one host sync
    n = host[0]
    return VerifyResult(accepted=n, tokens=[*host[2 : n + 2], host[1]], bonus=n == k)
