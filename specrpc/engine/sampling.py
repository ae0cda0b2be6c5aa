"""Sampling: temperature / top-k / top-p → probabilities, and a per-request `torch.Generator`.

`logits_to_probs` is the one definition of "the distribution we sample from"; the draft and the target both go
through it with the same `SamplingParams`, which is what makes speculative verification exact.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; validated by the service, not here."""

    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # 0 or 1 => off
    top_k: int = 0  # 0 => off
    seed: int | None = None  # None => fresh OS entropy per request

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature <= 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator on `device` seeded from `params.seed`, or from OS entropy when unset; None for greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] → float32 probs [..., V]: temperature, then top-k, then top-p, renormalised.

    Greedy gives a one-hot at the argmax (ties → lowest index). Top-k keeps every token tied with the k-th
    largest; top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (≥ 1 token).
    """
    if params.greedy:
        top = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    scaled = logits.float() / params.temperature  # [..., V]
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [..., V]
    if 0.0 < params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V], [..., V]
        mass_before = sorted_probs.cumsum(dim=-1)[..., :-1]  # [..., V-1] mass ranked above tokens 1..V-1
        mass_before = F.pad(mass_before, (1, 0), value=-1.0)  # [..., V] -1: the best token always stays
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with -inf where `allowed` [..., V_m] (bool) is False: a grammar's mask, applied before
    temperature, top-k and top-p so that the draft and the target sample from the same masked distribution. Ids
    beyond the mask's vocabulary are forbidden; mask entries beyond the logits' are dropped."""
    vocab, masked = logits.shape[-1], allowed.shape[-1]
    if masked < vocab:
        allowed = F.pad(allowed, (0, vocab - masked), value=False)
    return logits.masked_fill(~allowed[..., :vocab].to(logits.device), float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Probs [N, V] (need not be normalised) → ids [N] int64, by the exponential race argmax(p / Exp(1)).

    No host sync. Noise is drawn on the generator's device (the probs' device when None) and moved to probs.
    """
    device = generator.device if generator is not None else probs.device
    noise = torch.empty(probs.shape, dtype=torch.float32, device=device)  # [N, V]
    noise.exponential_(1.0, generator=generator)
    noise = noise.to(probs.device).clamp_min_(torch.finfo(torch.float32).tiny)  # a draw of 0 would give 0/0 = NaN
    return (probs.float() / noise).argmax(dim=-1)  # [N]
