"""RoPE tables (default / linear / dynamic / llama3, as transformers computes them), built once per model for every
position of its KV cache; the forward rotates q and k with them (`forward._decoder`)."""

from __future__ import annotations

import math

import torch

from specrpc.models.llama.config import LlamaArgs


def rope_inv_freq(args: LlamaArgs, capacity: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, as transformers' rope init functions compute them.

    `dynamic` is static NTK here: the base is scaled once for `capacity` positions. That equals transformers while
    capacity <= max_position_embeddings; beyond it transformers rescales per step (and keeps stale keys), we don't.
    """
    p, dim = args.rope, args.head_dim
    base = float(p["rope_theta"])
    if p["rope_type"] == "dynamic":
        factor, max_pos = float(p["factor"]), args.max_position_embeddings
        seq_len = max(capacity, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))  # [D/2]
    if p["rope_type"] == "linear":
        return inv_freq / float(p["factor"])
    if p["rope_type"] != "llama3":
        return inv_freq
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = int(p["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    args: LlamaArgs, capacity: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [C, D] and sign-folded sin [C, D] so that rope(x) = x·cos + roll(x, D/2)·sin."""
    inv_freq = rope_inv_freq(args, capacity)  # [D/2]
    freqs = torch.arange(capacity, dtype=torch.int64).float()[:, None] * inv_freq  # [C, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [C, D]
    sin = emb.sin()
    half = args.head_dim // 2
    sin[:, :half].neg_()  # rotate_half(x) = cat(-x2, x1) = roll(x, D/2) · [-1…, +1…]
    return emb.cos().to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

