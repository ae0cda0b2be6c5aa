"""Sampling: temperature / min-p / top-k / top-p → probabilities, and a per-request `torch.Generator`.

`logits_to_probs` is the one definition of "the distribution we sample from"; the draft and the target both go
through it with the same `SamplingParams`, which is what makes speculative verification exact. What depends on the
tokens before a position (penalties, banning end-of-text before `min_tokens`) and `logit_bias` are applied to the
logits first, by `logits_transform.LogitsTransform`, at every position alike.

The order, for every position of the draft's q and the target's p: grammar mask → logit_bias → repetition,
frequency and presence penalties → end-of-text bans (`min_tokens`, `ignore_eos`) → [greedy: argmax here] →
temperature → min_p → top-k → top-p.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrpc import native


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; validated by the service, not here."""

    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # 0 or 1 => off
    top_k: int = 0  # 0 => off
    seed: int | None = None  # None => fresh OS entropy per request
    min_p: float = 0.0  # 0 => off; else drop tokens below min_p × the most likely one's probability
    min_keep: int = 0  # min_p, top-k and top-p keep at least this many tokens (llama.cpp's min_keep); 0 or 1 => off
    repetition_penalty: float = 1.0  # 1 => off; a seen token's logit divided by it (multiplied when negative)
    presence_penalty: float = 0.0  # subtracted from a seen token's logit
    frequency_penalty: float = 0.0  # subtracted once per occurrence
    penalty_last_n: int = 0  # the penalties' window: 0 => the generated tokens; N => the context's last N; -1 => all
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    min_tokens: int = 0  # end-of-text (the request's stop tokens) banned until this many tokens are generated
    ignore_eos: bool = False  # end-of-text banned throughout (llama.cpp's ignore_eos)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty applies (they depend on the tokens before each position)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def transformed(self) -> bool:
        """The logits are changed before temperature (`logits_transform`); False keeps the plain path."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.ignore_eos


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator on `device` seeded from `params.seed`, or from OS entropy when unset; None for greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] → float32 probs [..., V]: temperature, then min-p, top-k, top-p, renormalised.

    Greedy gives a one-hot at the argmax (ties → lowest index). Min-p keeps the tokens whose probability is at
    least min_p × the largest; top-k keeps every token tied with the k-th largest; top-p keeps the smallest prefix
    of the sorted distribution whose mass reaches top_p (≥ 1 token). Each keeps at least `min_keep` tokens.
    """
    if params.greedy:
        top = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    scaled = logits.float() / params.temperature  # [..., V]
    vocab = scaled.shape[-1]
    keep = min(max(params.min_keep, 1), vocab)
    if params.min_p > 0.0:
        scaled = _min_p(scaled, params.min_p, keep)
    top_k = max(params.top_k, keep) if params.top_k > 0 else 0
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [..., V]
    if 0.0 < params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V], [..., V]
        mass_before = sorted_probs.cumsum(dim=-1)[..., :-1]  # [..., V-1] mass ranked above tokens 1..V-1
        mass_before = F.pad(mass_before, (1, 0), value=-1.0)  # [..., V] -1: the best token always stays
        if keep > 1:
            mass_before[..., :keep] = -1.0  # and the next best up to min_keep
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _min_p(scaled: torch.Tensor, min_p: float, keep: int) -> torch.Tensor:
    """Tempered logits [..., V] with -inf where the probability is below min_p × the largest (in log space:
    logit < max + log(min_p)), the `keep` best always kept. On the CPU one native pass does it in place (`scaled`
    is `logits_to_probs`' own tensor), the same bits as the torch ops below."""
    lib = native.library() if scaled.device.type == "cpu" and scaled.is_contiguous() else None
    if lib is not None:
        vocab = scaled.shape[-1]
        lib.specrpc_min_p(scaled.data_ptr(), scaled.numel() // vocab, vocab, math.log(min_p), keep)
        return scaled
    top = scaled.max(dim=-1, keepdim=True).values  # [..., 1]
    threshold = top + math.log(min_p)  # [..., 1]
    if keep > 1:
        threshold = torch.minimum(threshold, torch.topk(scaled, keep, dim=-1).values[..., -1:])  # [..., 1]
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of `logits` [R, V] (the first maximum on ties, NaN above all, as torch's), read back: through
    numpy for float32 on the CPU, whose argmax of a row of 8192 took 1.7 µs against torch's 8.8 on an AMD EPYC
    (3.7 against 23.7 for five rows), a share of every greedy step's host time."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    return logits.argmax(dim=-1).tolist()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with -inf where `allowed` [..., V_m] (bool) is False: a grammar's mask, applied before
    temperature, top-k and top-p so that the draft and the target sample from the same masked distribution. Ids
    beyond the mask's vocabulary are forbidden; mask entries beyond the logits' are dropped."""
    vocab, masked = logits.shape[-1], allowed.shape[-1]
    if masked < vocab:
        allowed = F.pad(allowed, (0, vocab - masked), value=False)
    return logits.masked_fill(~allowed[..., :vocab].to(logits.device), float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Probs [N, V] (need not be normalised) → ids [N] int64, by inverse transform: one uniform draw per row against
    the row's cumulative mass, summed in float64 so that every token keeps its share of the total to ~1e-16.

    One random number a row, not one per token: on a CPU a draw per vocabulary entry (an exponential race) costs
    more than a small model's decode step. No host sync. The draw is made on the generator's device (the probs' when
    None) and moved to the probs.
    """
    device = generator.device if generator is not None else probs.device
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [N, V]
    total = cdf[..., -1:].contiguous()  # [N, 1] (searchsorted copies a strided column with a warning)
    u = torch.rand(total.shape, dtype=torch.float64, device=device, generator=generator).to(probs.device)  # [N, 1]
    drawn = torch.searchsorted(cdf, u * total, right=True)  # [N, 1] the first token whose cumulative mass exceeds it
    last = torch.searchsorted(cdf, total)  # [N, 1] the last token with mass: u * total never rounds past it
    return torch.minimum(drawn, last).squeeze(-1)  # [N]
