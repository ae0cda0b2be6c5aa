"""Lean forward for Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3, StarCoder2), weights read straight from
safetensors.

RoPE (default / linear / dynamic / llama3, as transformers computes them), grouped-query attention against a
preallocated per-slot KV cache, optional biases on every projection, tied or untied embeddings, per-layer sliding
windows. What differs between the families is data on the weights, not branches in the forward: the norm (`Norm`:
RMSNorm, or LayerNorm with a bias for StarCoder2), the MLP (`LlamaArgs.gated`: SwiGLU's gate·up, or StarCoder2's
c_fc → GELU(tanh) → c_proj), and Qwen3's per-head q/k RMSNorm before RoPE (`Layer.qk_norm`). q/k/v and gate/up are
fused into one weight each. `llama_forward` is a plain function of tensors; `llama_forward_static` is its
fixed-shape twin that `cuda_graphs.GraphedForward` captures on CUDA.

Matrix products (`_linear`): weights are kept transposed, `wt` [K, N]. On CPU in float32 `wt` is contiguous (MKL
gemv for one row) and a second, oneDNN-blocked copy `packed` serves every product with more than one row (verify,
prefill), at twice the weight memory; one-row products take whichever of the two `LlamaLM.tune_decode` finds faster
at load. Measured on the 2-core AVX-512 dev box, one thread, summed over the five product
shapes of one d=384 layer + the 8192-row head: M=1: `x @ wt` 0.60 ms, F.linear 1.36, oneDNN 1.11; M=5: oneDNN 0.97,
`x @ wt` 2.26, F.linear 2.58. Whole d=384/8-layer step: decode 6.0 ms, 5-token verify 7.2 ms (F.linear only:
7.9 / 13.8). Elsewhere (CUDA) `wt` is the transposed view of the row-major weight, so `x @ wt` is exactly `F.linear`.
With int8 weights (`--weights int8`, CPU) a projection keeps only `q8` and its scales (`int8_linear`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from specrpc.models import native_step
from specrpc.models.batch import BatchRow, check_rows
from specrpc.models.kv_cache import KVCache
from specrpc.models.native_step import NativeStep

if TYPE_CHECKING:
    from specrpc.models.cuda_graphs import GraphedDraftLoop, GraphedForward

log = logging.getLogger(__name__)

LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "starcoder2"})
LAYER_NORM_TYPES = frozenset({"starcoder2"})  # LayerNorm with bias, plain MLP; the rest: RMSNorm, SwiGLU
ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3"})
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint needs something the lean forward does not implement; load it with the transformers fallback."""


@dataclass(frozen=True)
class LlamaArgs:
    """Dimensions and options read from config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    act: str
    layer_norm: bool  # LayerNorm with bias (StarCoder2), else RMSNorm
    gated: bool  # MLP down(act(gate(x)) · up(x)) (SwiGLU), else down(act(up(x))) (StarCoder2's c_fc / c_proj)
    qk_norm: bool  # RMSNorm per head on q and k before RoPE (Qwen3)
    tie_embeddings: bool
    max_position_embeddings: int
    rope: dict[str, Any]  # rope_type, rope_theta and the type's parameters
    windows: tuple[int | None, ...]  # sliding window per layer, None = full attention

    @staticmethod
    def from_config(cfg: dict[str, Any]) -> LlamaArgs:
        """Parse a Llama / Mistral / Qwen2 / Qwen3 / StarCoder2 config.json dict; raise UnsupportedModelError for
        anything else."""
        model_type = cfg.get("model_type")
        if model_type not in LEAN_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}")
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        layer_norm = model_type in LAYER_NORM_TYPES
        act = cfg.get("hidden_act", "gelu_pytorch_tanh" if layer_norm else "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act!r} is not one of {sorted(ACTIVATIONS)}")
        return LlamaArgs(
            hidden=int(cfg["hidden_size"]),
            layers=layers,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            ffn=int(cfg["intermediate_size"]),
            eps=float(cfg.get("norm_epsilon", 1e-5) if layer_norm else cfg.get("rms_norm_eps", 1e-6)),
            act=act,
            layer_norm=layer_norm,
            gated=not layer_norm,
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope_parameters(cfg),
            windows=_sliding_windows(cfg, layers),
        )


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older configs)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type RoPE parameters")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {params['rope_type']!r} is not one of {sorted(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial}")
    if params["rope_type"] == "llama3":
        if "original_max_position_embeddings" in cfg:  # transformers gives the top-level value priority
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return params


def _sliding_windows(cfg: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window: Mistral and StarCoder2 use it on every layer, Qwen2 and Qwen3 only with
    use_sliding_window on late layers."""
    window = cfg.get("sliding_window")
    if cfg["model_type"] == "llama" or window is None:
        return (None,) * layers
    if cfg["model_type"] in ("mistral", "starcoder2"):
        return (int(window),) * layers
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    max_window_layers = cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


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


@dataclass(frozen=True)
class Linear:
    """One projection y = x W^T + b, stored as `wt` [K, N], optional oneDNN-blocked copy, optional bias [N], and
    optionally an int8 copy for products of at most `INT8_MAX_ROWS` rows (`q8` [N, K], per-row `q8_scale` [N])."""

    wt: torch.Tensor | None  # None once `packed` serves every product (see `LlamaLM.tune_decode`)
    packed: torch.Tensor | None
    bias: torch.Tensor | None
    q8: torch.Tensor | None = None
    q8_scale: torch.Tensor | None = None
    packed_rows: int = 2  # products of at least this many rows take `packed` (1: decode too, see `with_packed_decode`)
    q8_rows: int = 8  # products of at most this many rows take `q8` (INT8_MAX_ROWS; INT8_WEIGHT_ROWS: int8 weights)
    bf16_only: bool = False  # `packed` is the bf16 weight alone, fed bf16 activations (`bf16_linear`)


INT8_MAX_ROWS = 8
"""Row counts up to which the int8 copy serves a product. Measured on the dev box (one thread, a 1536×256 weight):
int8 26/34/74 µs for 1/2/5 rows against fp32 29/56/110, but 817 against 565 at 64 rows; cache-cold, the
8192×256 head takes 188 µs against 447, since decoding is bound by reading weights."""


INT8_WEIGHT_ROWS = 80
"""With int8 weights (`int8_linear`, no float copy), products of up to this many rows go through the int8
kernel: every decode step and every verify (k + 1 <= 33, a suggestion's 65), so that a token's logits take the same
kernel whether it is decoded alone or verified; longer products (prefill chunks) dequantize the weight block by block
into a float32 product, where the int8 kernel falls behind."""

DEQUANT_BLOCK = 4096
"""Output rows dequantized at once by a long product on int8 weights (bounds the float32 temporary)."""


def int8_available(device: torch.device) -> bool:
    """Whether torch has a CPU int8 weight-only kernel (`_weight_int8pack_mm`) to serve int8 decode."""
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → symmetric per-output-row int8 [N, K] and bf16 scales [N] (the kernel's activation type)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()  # [N, K]
    return q, scale.to(torch.bfloat16)


INT8_KERNEL_COLS = 16
"""torch's int8 kernel (`_weight_int8pack_mm`) takes inputs whose width is a multiple of this: it crashes the
process on others (seen with 72 columns and 4 rows or more); such a projection's products take the other paths."""


def _int8_rows(cols: int, rows: int) -> int:
    """The rows up to which a product of `cols` input columns may take the int8 kernel (0: never)."""
    return rows if cols % INT8_KERNEL_COLS == 0 else 0


def quantize_int8(p: Linear) -> Linear:
    """`p` plus a symmetric per-output-row int8 copy of its weight (bf16 scales, the kernel's activation type)."""
    assert p.wt is not None
    q, scale = _quantize(p.wt.t())
    return Linear(p.wt, p.packed, p.bias, q, scale, q8_rows=_int8_rows(q.shape[1], INT8_MAX_ROWS))


def int8_linear(w: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """w [N, K] as int8 alone (no float copy): `INT8_WEIGHT_ROWS` rows or fewer through the int8 kernel, more
    dequantized per product (`_dequantized_product`)."""
    q, scale = _quantize(w)
    return Linear(wt=None, packed=None, bias=bias, q8=q, q8_scale=scale,
                  q8_rows=_int8_rows(q.shape[1], INT8_WEIGHT_ROWS))


def with_int8_decode(w: LlamaWeights) -> LlamaWeights:
    """Every projection and the head get an int8 copy for decode-sized products (a draft's proposals: any
    distribution is a valid draft, and verification keeps the output the target's)."""
    return _map_linears(w, quantize_int8)


def _map_linears(w: LlamaWeights, fn: Callable[[Linear], Linear]) -> LlamaWeights:
    """`w` with `fn` applied to every projection and the head."""
    layers = tuple(
        dataclasses.replace(layer, qkv=fn(layer.qkv), o=fn(layer.o), up=fn(layer.up), down=fn(layer.down))
        for layer in w.layers
    )
    return dataclasses.replace(w, layers=layers, head=fn(w.head))


def with_packed_decode(w: LlamaWeights, on: bool = True) -> LlamaWeights:
    """One-row products through the oneDNN-blocked copy too (`on`), or through MKL's gemv on `wt` (not `on`).
    Which is faster depends on the CPU and the thread count: on the dev box, one decode step of the shipped target
    took 7.7 ms with gemv and 9.2 with oneDNN on one thread, but 8.0 against 6.7 on two."""
    return _map_linears(w, lambda p: dataclasses.replace(p, packed_rows=1 if on else 2))


@dataclass(frozen=True)
class Norm:
    """RMSNorm (no bias) or LayerNorm (`layer`, with an optional bias) over the last dimension."""

    weight: torch.Tensor  # [d]
    bias: torch.Tensor | None  # [d]
    layer: bool
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] normalised."""
        shape = (x.shape[-1],)
        if self.layer:
            return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
        return F.rms_norm(x, shape, self.weight, self.eps)


@dataclass(frozen=True)
class Layer:
    """One decoder layer."""

    attn_norm: Norm
    qkv: Linear  # K=d, N=(heads + 2·kv_heads)·head_dim
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: Qwen3's q_norm per query head, k_norm per KV head
    o: Linear  # K=heads·head_dim, N=d
    mlp_norm: Norm
    up: Linear  # K=d, N=2·ffn (gate and up fused, gated MLP) or ffn (plain MLP)
    down: Linear  # K=ffn, N=d
    window: int | None  # sliding window, None = full causal attention


@dataclass(frozen=True)
class LlamaWeights:
    """Everything the forward reads: weights, RoPE tables, a position ramp."""

    args: LlamaArgs
    embed: torch.Tensor  # [V, d]
    layers: tuple[Layer, ...]
    norm: Norm
    head: Linear  # K=d, N=V
    cos: torch.Tensor  # [C, D]
    sin: torch.Tensor  # [C, D], sign folded
    positions: torch.Tensor  # [C] int64 ramp 0..C-1
    act: Callable[[torch.Tensor], torch.Tensor]

    def linears(self) -> list[Linear]:
        """Every projection and the head."""
        return [p for layer in self.layers for p in (layer.qkv, layer.o, layer.up, layer.down)] + [self.head]


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-blocked copy of w [N, K] for products of more than one row, or None where oneDNN can't do it."""
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed


def bf16_available(device: torch.device) -> bool:
    """Whether oneDNN computes bf16 products on this CPU (`bf16_linear`)."""
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_linear(w: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """w [N, K] as a oneDNN-blocked bf16 weight alone: every product, whatever its rows, rounds its activations to
    bf16 and runs the same kernel (whose rows do not depend on each other), so a token's logits are the same
    decoded alone or verified; the result and the bias stay in the activations' dtype."""
    packed = _onednn_pack(w.to(torch.bfloat16).contiguous())
    if packed is None:
        raise ValueError("--weights bf16 needs oneDNN's bf16 products on this CPU")
    return Linear(wt=None, packed=packed, bias=bias, bf16_only=True)


def _make_linear(w: torch.Tensor, b: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 int8: bool = False, bf16: bool = False) -> Linear:
    """Store w [N, K] (checkpoint layout) for `_linear` on `device`; `int8`: as int8 alone (CPU, `int8_linear`);
    `bf16`: as bf16 alone (CPU, `bf16_linear`)."""
    bias = None if b is None else b.to(device=device, dtype=dtype)
    if int8:
        return int8_linear(w.to(device=device), bias)
    if bf16:
        return bf16_linear(w.to(device=device), bias)
    w = w.to(device=device, dtype=dtype).contiguous()
    if device.type != "cpu":
        return Linear(wt=w.t(), packed=None, bias=bias)
    bf16 = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed = _onednn_pack(w) if dtype == torch.float32 or bf16 else None
    return Linear(wt=w.t().contiguous(), packed=packed, bias=bias)


def _int8_product(x: torch.Tensor, p: Linear) -> torch.Tensor:
    """x [M, K] W^T through the int8 copy (activations in bf16), back in x's dtype."""
    assert p.q8 is not None and p.q8_scale is not None
    out: torch.Tensor = torch._weight_int8pack_mm(x.to(torch.bfloat16), p.q8, p.q8_scale).to(x.dtype)  # [M, N]
    return out if p.bias is None else out.add_(p.bias)


def _dequantized_product(x: torch.Tensor, p: Linear) -> torch.Tensor:
    """x [M, K] W^T (+ b) on int8 weights without a float copy: W dequantized `DEQUANT_BLOCK` output rows at a
    time into x's dtype."""
    assert p.q8 is not None and p.q8_scale is not None
    out = x.new_empty(x.shape[0], p.q8.shape[0])  # [M, N]
    for n0 in range(0, p.q8.shape[0], DEQUANT_BLOCK):
        block = p.q8[n0 : n0 + DEQUANT_BLOCK].to(x.dtype) * p.q8_scale[n0 : n0 + DEQUANT_BLOCK, None].to(x.dtype)
        torch.mm(x, block.t(), out=out[:, n0 : n0 + block.shape[0]])
    return out if p.bias is None else out.add_(p.bias)


def _bf16_product(x: torch.Tensor, p: Linear) -> torch.Tensor:
    """x [M, K] W^T (+ b) through the bf16 weight alone, back in x's dtype."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), p.packed, None, "none", [], "")
    out = out.to(x.dtype)  # [M, N]
    return out if p.bias is None else out.add_(p.bias)


def _linear(x: torch.Tensor, p: Linear) -> torch.Tensor:
    """x [M, K] → [M, N]."""
    if p.bf16_only:
        return _bf16_product(x, p)
    if p.q8 is not None and x.shape[0] <= p.q8_rows:
        return _int8_product(x, p)
    if p.q8 is not None and p.wt is None and p.packed is None:
        return _dequantized_product(x, p)
    if p.packed is not None and x.shape[0] >= p.packed_rows:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, p.packed, p.bias, "none", [], "")
        return out
    assert p.wt is not None
    if p.bias is None:
        return x @ p.wt
    return torch.addmm(p.bias, x, p.wt)


def _linear_add(x: torch.Tensor, p: Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual [M, N] + x [M, K] W^T (+ b), the residual add fused into the product."""
    if p.bf16_only:
        return _bf16_product(x, p).add_(residual)
    if p.q8 is not None and x.shape[0] <= p.q8_rows:
        return _int8_product(x, p).add_(residual)
    if p.q8 is not None and p.wt is None and p.packed is None:
        return _dequantized_product(x, p).add_(residual)
    if p.packed is not None and x.shape[0] >= p.packed_rows:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, p.packed, p.bias, "add")
        return out
    assert p.wt is not None
    out = torch.addmm(residual, x, p.wt)
    return out if p.bias is None else out.add_(p.bias)


def _attention_spans(
    w: LlamaWeights, start: int, end: int
) -> dict[int | None, tuple[int, torch.Tensor | None]]:
    """Per distinct window: first key position and bool mask [rep·T, end-lo] (None when every key is visible)."""
    a = w.args
    rep, count = a.heads // a.kv_heads, end - start
    spans: dict[int | None, tuple[int, torch.Tensor | None]] = {}
    for window in {layer.window for layer in w.layers}:
        if count == 1:
            spans[window] = (0 if window is None else max(0, end - window), None)
            continue
        lo = 0 if window is None else max(0, start - window + 1)
        q_pos = w.positions[start:end].repeat(rep)[:, None]  # [rep·T, 1], rows ordered (rep, t)
        k_pos = w.positions[lo:end]  # [S]
        mask = k_pos <= q_pos  # [rep·T, S]
        if window is not None:
            mask &= k_pos > q_pos - window
        spans[window] = (lo, mask)
    return spans


Attention = Callable[[int, int | None, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer index, window, q [T, hq, D], k_new [hkv, T, D], v_new [hkv, T, D]) → attention output [T, hq·D]: stores
the new K/V and attends to what each query may see."""


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [T, hq, D] against k, v [1, hkv, S, D] under mask [rep·T, S] (None: all visible) → [T, hq·D]. Query heads
    are grouped by their KV head ([1, hkv, rep·T, D]) so GQA needs no repeated K/V."""
    count, hq, dh = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    q = q.reshape(count, hkv, rep, dh).permute(1, 2, 0, 3).reshape(1, hkv, rep * count, dh)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [1, hkv, rep·T, D] (4-D: fused CPU kernel)
    return o.view(hkv, rep, count, dh).permute(2, 0, 1, 3).reshape(count, hq * dh)  # [T, hq·D]


def _decoder(
    w: LlamaWeights,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: Attention,
    logit_rows: slice | torch.Tensor,
) -> torch.Tensor:
    """The layers over ids [T] with RoPE rows cos, sin [T, D] → float32 logits [R, V] of the rows `logit_rows`
    selects (R of them). `attention` (see `Attention`) is all that differs between one slot, a fixed-shape graph
    and a batch of slots: the matrix products run once over all T tokens."""
    a = w.args
    count = ids.shape[0]
    hq, hkv, dh = a.heads, a.kv_heads, a.head_dim
    nqk = (hq + hkv) * dh
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    x = F.embedding(ids, w.embed)  # [T, d]
    for i, layer in enumerate(w.layers):
        h = layer.attn_norm(x)  # [T, d]
        qkv = _linear(h, layer.qkv)  # [T, (hq + 2·hkv)·D]
        qk = qkv[:, :nqk].view(count, hq + hkv, dh)  # [T, hq + hkv, D]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (dh,), None, a.eps).mul_(layer.qk_norm)  # per head, [T, hq + hkv, D]
        qk = torch.addcmul(qk * cos, qk.roll(dh // 2, -1), sin)  # rotary, [T, hq + hkv, D]
        o = attention(i, layer.window, qk[:, :hq], qk[:, hq:].transpose(0, 1),  # [T, hq, D], [hkv, T, D]
                      qkv[:, nqk:].view(count, hkv, dh).transpose(0, 1))  # [hkv, T, D] → o [T, hq·D]
        x = _linear_add(o, layer.o, x)  # [T, d]
        up = _linear(layer.mlp_norm(x), layer.up)  # [T, 2·ffn] gated, [T, ffn] plain
        hidden = w.act(up[:, : a.ffn]).mul_(up[:, a.ffn :]) if a.gated else w.act(up)  # [T, ffn]
        x = _linear_add(hidden, layer.down, x)  # [T, d]
    x = w.norm(x[logit_rows])  # [R, d]
    return _linear(x, w.head).float()  # [R, V]


def _slot_attention(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, end: int
) -> Attention:
    """Attention of positions start..end-1 of one slot (k_cache, v_cache [L, H_kv, C, D]): writes their K/V, reads
    only the span a layer can see, so the cost grows with the context, not the capacity."""
    spans = _attention_spans(w, start, end)

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        k_cache[i, :, start:end] = k_new
        v_cache[i, :, start:end] = v_new
        lo, mask = spans[window]
        return _grouped_sdpa(q, k_cache[i, None, :, lo:end], v_cache[i, None, :, lo:end], mask)  # [T, hq·D]

    return attention


def llama_forward(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor, start: int, num_logits: int,
    valid: int | None = None,
) -> torch.Tensor:
    """ids [T] at positions start..start+T-1 → logits [num_logits, V] (float32) for the last positions (of the first
    `valid` ids, when the rest is padding: its K/V lie past the slot's length, where nothing reads them).

    k_cache, v_cache: one slot's [L, H_kv, C, D]; positions start..start+T-1 are written, [0, start) are read.
    """
    end = start + ids.shape[0]
    last = ids.shape[0] if valid is None else valid
    return _decoder(w, ids, w.cos[start:end], w.sin[start:end], _slot_attention(w, k_cache, v_cache, start, end),
                    slice(last - num_logits, last))


def _rows_attention(w: LlamaWeights, k_all: torch.Tensor, v_all: torch.Tensor, rows: list[BatchRow]) -> Attention:
    """Attention of several rows of T tokens each (decode steps, verify steps of one k) as one SDPA per layer, not
    one per row: the queries go in a [slots, hkv, rep·T, D] batch over the slots from the lowest to the highest of
    theirs, the keys are the cache itself ([L, S, H_kv, C, D], a strided view, no copy) up to the furthest row's
    last position, each row masked to its own positions (a slot in the range with no row attends to its key 0, and
    is dropped)."""
    a = w.args
    hkv, rep, dh = a.kv_heads, a.heads // a.kv_heads, a.head_dim
    count, tokens = len(rows), rows[0].ids.shape[0]
    slots = [r.slot for r in rows]
    low = min(slots)
    width = max(slots) + 1 - low
    device = k_all.device
    at = torch.tensor([s - low for s in slots], device=device)  # [n]: each row's place in the batch
    steps = w.positions[:tokens]  # [T]
    pos = torch.tensor([r.start for r in rows], device=device)[:, None] + steps  # [n, T]
    slot_ids = (at + low)[:, None].expand(count, tokens)  # [n, T]
    span = max(r.start for r in rows) + tokens
    q_pos = torch.zeros(width, tokens, dtype=torch.long, device=device).index_copy_(0, at, pos)  # [B, T]
    q_pos = q_pos.repeat(1, rep)[:, :, None]  # [B, rep·T, 1], rows ordered (rep, t)
    k_pos = w.positions[:span]  # [S]
    masks: dict[int | None, torch.Tensor] = {}
    for window in {layer.window for layer in w.layers}:
        mask = k_pos <= q_pos  # [B, rep·T, S]
        if window is not None:
            mask &= k_pos > q_pos - window
        masks[window] = mask[:, None]  # [B, 1, rep·T, S]

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        k_all[i, slot_ids, :, pos] = k_new.reshape(hkv, count, tokens, dh).permute(1, 2, 0, 3)  # [n, T, hkv, D]
        v_all[i, slot_ids, :, pos] = v_new.reshape(hkv, count, tokens, dh).permute(1, 2, 0, 3)
        q = q.reshape(count, tokens, hkv, rep, dh).permute(0, 2, 3, 1, 4).reshape(count, hkv, rep * tokens, dh)
        grouped = q.new_zeros(width, hkv, rep * tokens, dh).index_copy_(0, at, q)  # [B, hkv, rep·T, D]
        o = F.scaled_dot_product_attention(grouped, k_all[i, low : low + width, :, :span],
                                           v_all[i, low : low + width, :, :span], attn_mask=masks[window])
        o = o[at].view(count, hkv, rep, tokens, dh).permute(0, 3, 1, 2, 4)  # [n, T, hkv, rep, D]
        return o.reshape(count * tokens, a.heads * dh)  # [n·T, hq·D]

    return attention


def llama_forward_batch(
    w: LlamaWeights, k_all: torch.Tensor, v_all: torch.Tensor, rows: list[BatchRow]
) -> list[torch.Tensor]:
    """Several slots in one forward, each row with its own tokens at its own positions (ragged): the rows' tokens
    are concatenated [N] for every matrix product, and split for attention, where each row attends to its own
    slot's cache up to its position (rows of equal length together, `_rows_attention`; a row of a length no other
    row has, alone). k_all, v_all: the whole cache [L, S, H_kv, C, D]. → per row float32 logits [num_logits, V], as
    `llama_forward` of that row alone computes them (up to the rounding of a product over more rows)."""
    order = sorted(range(len(rows)), key=lambda j: rows[j].ids.shape[0])  # rows of one length side by side
    rows = [rows[j] for j in order]
    lengths = [r.ids.shape[0] for r in rows]
    groups: list[tuple[int, int, Attention]] = []  # token range in the concatenation, and its attention
    end = 0
    for length, members in itertools.groupby(rows, key=lambda r: r.ids.shape[0]):
        same = list(members)
        if len(same) > 1:
            groups.append((end, end + length * len(same), _rows_attention(w, k_all, v_all, same)))
        else:
            r = same[0]
            groups.append((end, end + length, _slot_attention(w, k_all[:, r.slot], v_all[:, r.slot], r.start,
                                                              r.start + length)))
        end += length * len(same)

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        parts = [part(i, window, q[lo:hi], k_new[:, lo:hi], v_new[:, lo:hi]) for lo, hi, part in groups]
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # [N, hq·D]

    ids = torch.cat([r.ids for r in rows])  # [N]
    positions = torch.cat([w.positions[r.start : r.start + r.ids.shape[0]] for r in rows])  # [N]
    ends = list(itertools.accumulate(lengths))
    # the rows' last tokens in the concatenation (which may be longer than the position table: not from it)
    picks = torch.tensor([i for r, e in zip(rows, ends, strict=True) for i in range(e - r.num_logits, e)],
                         device=ids.device)  # [R]
    logits = _decoder(w, ids, w.cos[positions], w.sin[positions], attention, picks)  # [R, V]
    sizes = [r.num_logits for r in rows]
    out = [logits[e - n : e] for n, e in zip(sizes, itertools.accumulate(sizes), strict=True)]
    result: list[torch.Tensor] = [out[0]] * len(out)
    for place, j in enumerate(order):
        result[j] = out[place]
    return result


def llama_forward_static(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
    num_logits: int
) -> torch.Tensor:
    """`llama_forward` with the positions as a tensor pos [T] (consecutive) and attention over the slot's whole
    capacity under a causal mask, so that every shape depends on T alone: a CUDA graph captured once per T replays
    at any position. Positions past pos[-1] hold stale or zero K/V and are masked out."""
    a = w.args
    q_pos = pos.repeat(a.heads // a.kv_heads)[:, None]  # [rep·T, 1], rows ordered (rep, t)
    k_pos = w.positions  # [C]
    causal = k_pos <= q_pos  # [rep·T, C]
    masks = {window: causal if window is None else causal & (k_pos > q_pos - window)
             for window in {layer.window for layer in w.layers}}

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        k_cache[i].index_copy_(1, pos, k_new)  # [hkv, C, D]
        v_cache[i].index_copy_(1, pos, v_new)
        return _grouped_sdpa(q, k_cache[i, None], v_cache[i, None], masks[window])  # [T, hq·D]

    count = ids.shape[0]
    return _decoder(w, ids, w.cos[pos], w.sin[pos], attention, slice(count - num_logits, count))


def greedy_draft_static(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, first: torch.Tensor, base: torch.Tensor, steps: int
) -> torch.Tensor:
    """A greedy draft's loop with no host sync: `first` [1] (the token drafted from the catch-up's logits) at
    position `base` [1], then `steps` forwards, each feeding the previous argmax → tokens [steps + 1]. Shapes depend
    on `steps` alone, so `cuda_graphs.GraphedDraftLoop` captures it once per (slot, steps)."""
    tokens = [first]
    for i in range(steps):
        logits = llama_forward_static(w, k_cache, v_cache, tokens[-1], base + i, 1)  # [1, V]
        tokens.append(logits[0].argmax().view(1))
    return torch.cat(tokens)  # [steps + 1]


def bucket_sizes(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from the first one >= `smallest` up to `largest`, and `largest` itself: the token counts eager
    forwards are padded to, so that every shape a request can meet was met at load."""
    if largest < smallest:
        return ()
    sizes = [1 << max(0, smallest - 1).bit_length()]
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    return tuple(sorted({*(s for s in sizes if s < largest), largest}))


def bucket_for(count: int, sizes: tuple[int, ...], room: int) -> int:
    """The smallest size >= `count` that fits in `room` positions; `count` itself when none does."""
    return next((s for s in sizes if count <= s <= room), count)


def _effective_window(window: int | None, capacity: int) -> int | None:
    """A window at least as long as the cache never hides anything."""
    return window if window is not None and window < capacity else None


def _tensor_reader(path: Path, stack: ExitStack) -> Callable[[str], torch.Tensor | None]:
    """name → tensor (CPU) over all safetensors shards of `path`, None when absent."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    handles = [stack.enter_context(safe_open(str(path / f), framework="pt", device="cpu")) for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (safe_open has no __iter__)

    def get(name: str) -> torch.Tensor | None:
        h = where.get(name)
        return None if h is None else h.get_tensor(name)

    return get


TensorSource = Callable[[str], torch.Tensor | None]
"""Checkpoint tensor name → tensor (in the checkpoint's [N, K] layout), None when the checkpoint has no such tensor."""


def _mlp_names(args: LlamaArgs) -> tuple[list[str], str]:
    """The MLP's input projections (fused in this order) and its output projection."""
    return (["gate_proj", "up_proj"], "down_proj") if args.gated else (["c_fc"], "c_proj")


def checkpoint_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a transformers checkpoint of this config holds, by name, with its shape (the biases and norms
    its family's config switches on; no lm_head when the embeddings are tied)."""
    a = LlamaArgs.from_config(cfg)
    d, q, kv = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    model_type = cfg["model_type"]
    attn_bias = bool(cfg.get("use_bias", True) if a.layer_norm else cfg.get("attention_bias", False))
    qkv_bias = attn_bias or model_type == "qwen2"  # Qwen2 always has q/k/v biases, never an o bias
    mlp_bias = bool(cfg.get("use_bias", True)) if a.layer_norm else bool(cfg.get("mlp_bias", False))
    ins, out = _mlp_names(a)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (int(cfg["vocab_size"]), d)}
    for i in range(a.layers):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{p}.{norm}.weight"] = (d,)
            if a.layer_norm:
                shapes[f"{p}.{norm}.bias"] = (d,)
        for name, n, k, bias in (("q_proj", q, d, qkv_bias), ("k_proj", kv, d, qkv_bias), ("v_proj", kv, d, qkv_bias),
                                 ("o_proj", d, q, attn_bias)):
            shapes[f"{p}.self_attn.{name}.weight"] = (n, k)
            if bias:
                shapes[f"{p}.self_attn.{name}.bias"] = (n,)
        if a.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = shapes[f"{p}.self_attn.k_norm.weight"] = (a.head_dim,)
        for name, n, k in [*((m, a.ffn, d) for m in ins), (out, d, a.ffn)]:
            shapes[f"{p}.mlp.{name}.weight"] = (n, k)
            if mlp_bias:
                shapes[f"{p}.mlp.{name}.bias"] = (n,)
    shapes["model.norm.weight"] = (d,)
    if a.layer_norm:
        shapes["model.norm.bias"] = (d,)
    if not a.tie_embeddings:
        shapes["lm_head.weight"] = (int(cfg["vocab_size"]), d)
    return shapes


def build_llama_weights(
    get: TensorSource, args: LlamaArgs, *, capacity: int, device: torch.device, dtype: torch.dtype, where: str,
    int8: bool = False, bf16: bool = False,
) -> LlamaWeights:
    """Fuse and lay out the weights `get` returns (`where` names their origin in errors); `int8`: every projection
    and the head as int8 alone (`int8_linear`; CPU), the rest (embedding, norms, KV cache) at `dtype`; `bf16`: the
    same as bf16 alone (`bf16_linear`)."""

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise UnsupportedModelError(f"{where}: tensor {name!r} missing from the checkpoint")
        return t

    def fused(names: list[str], prefix: str) -> Linear:
        ws = [need(f"{prefix}.{n}.weight") for n in names]  # each [N_i, K]
        bs = [get(f"{prefix}.{n}.bias") for n in names]
        bias = None
        if any(b is not None for b in bs):
            bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.to(w) for w, b in zip(ws, bs, strict=True)])
        return _make_linear(torch.cat(ws) if len(ws) > 1 else ws[0], bias, device, dtype, int8, bf16)

    def vec(name: str) -> torch.Tensor:
        return need(name).to(device=device, dtype=dtype)

    def norm(prefix: str) -> Norm:
        bias = get(f"{prefix}.bias") if args.layer_norm else None
        return Norm(vec(f"{prefix}.weight"), None if bias is None else bias.to(device=device, dtype=dtype),
                    args.layer_norm, args.eps)

    def qk_norm(prefix: str) -> torch.Tensor | None:
        if not args.qk_norm:
            return None
        q, k = vec(f"{prefix}.q_norm.weight"), vec(f"{prefix}.k_norm.weight")  # [D] each
        return torch.cat([q.expand(args.heads, -1), k.expand(args.kv_heads, -1)])  # [hq + hkv, D]

    mlp_in, mlp_out = _mlp_names(args)
    layers = tuple(
        Layer(
            attn_norm=norm(f"model.layers.{i}.input_layernorm"),
            qkv=fused(["q_proj", "k_proj", "v_proj"], f"model.layers.{i}.self_attn"),
            qk_norm=qk_norm(f"model.layers.{i}.self_attn"),
            o=fused(["o_proj"], f"model.layers.{i}.self_attn"),
            mlp_norm=norm(f"model.layers.{i}.post_attention_layernorm"),
            up=fused(mlp_in, f"model.layers.{i}.mlp"),
            down=fused([mlp_out], f"model.layers.{i}.mlp"),
            window=_effective_window(args.windows[i], capacity),
        )
        for i in range(args.layers)
    )
    embed = need("model.embed_tokens.weight")
    head = get("lm_head.weight")
    if args.tie_embeddings or head is None:
        head = embed
    cos, sin = rope_tables(args, capacity, device, dtype)
    return LlamaWeights(
        args=args,
        embed=embed.to(device=device, dtype=dtype),
        layers=layers,
        norm=norm("model.norm"),
        head=_make_linear(head, None, device, dtype, int8, bf16),
        cos=cos,
        sin=sin,
        positions=torch.arange(capacity, device=device),
        act=ACTIVATIONS[args.act],
    )


def load_llama_weights(
    path: Path, args: LlamaArgs, *, capacity: int, device: torch.device, dtype: torch.dtype, int8: bool = False,
    bf16: bool = False,
) -> LlamaWeights:
    """Read, fuse and lay out the weights of a Llama-family checkpoint directory (`int8`: see
    `build_llama_weights`)."""
    with ExitStack() as stack:
        return build_llama_weights(_tensor_reader(path, stack), args, capacity=capacity, device=device, dtype=dtype,
                                   where=str(path), int8=int8, bf16=bf16)


class LlamaLM:
    """CausalLM over the lean Llama-family forward with a preallocated per-slot KV cache."""

    lean_forward = True

    def __init__(
        self,
        name: str,
        weights: LlamaWeights,
        *,
        num_slots: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
        graph_tokens: int = 0,
        buckets: tuple[int, ...] = (),
        draft_loop_steps: int = 0,
    ) -> None:
        """`graph_tokens`, `draft_loop_steps` (CUDA only): forwards of up to that many tokens, and greedy draft loops
        of up to that many forwards, replay CUDA graphs. `buckets`: eager forwards asking for their last logits are
        padded to the smallest of these token counts that fits (each one run once here, so no count is met first
        in a request)."""
        a = weights.args
        self.name = name
        self.weights = weights
        self.vocab_size = int(weights.embed.shape[0])
        self.max_context = max_context
        self.num_slots = num_slots
        self.device = device
        self.dtype = dtype
        self.cache = KVCache(
            num_layers=a.layers,
            num_slots=num_slots,
            kv_heads=a.kv_heads,
            capacity=max_context,
            head_dim=a.head_dim,
            device=device,
            dtype=dtype,
        )
        self.graphs: GraphedForward | None = None
        self.native: NativeStep | None = None  # forwards of up to `native_rows` tokens, when `use_native` found it can
        self.native_rows = 1
        self.draft_loop: GraphedDraftLoop | None = None
        self.buckets = buckets
        t0 = time.perf_counter()
        if device.type == "cuda":
            from specrpc.models.cuda_graphs import GraphedDraftLoop, GraphedForward

            if graph_tokens > 0:
                self.graphs = GraphedForward(weights, self.cache.slot_k, self.cache.slot_v, graph_tokens)
            if draft_loop_steps > 0:
                self.draft_loop = GraphedDraftLoop(weights, self.cache.slot_k, self.cache.slot_v, draft_loop_steps)
        for size in buckets:  # meet every padded shape once now (slot 0, left empty)
            self.forward(torch.zeros(min(size, max_context), dtype=torch.long, device=device), 0, 0)
            self.truncate(0, 0)
        if self.graphs is not None or self.draft_loop is not None or buckets:
            log.info("%s: CUDA graphs (%d forwards, %d draft loops) and %d padded sizes %s ready in %.2f s", name,
                     len(self.graphs.graphs) if self.graphs else 0,
                     len(self.draft_loop.graphs) if self.draft_loop else 0, len(buckets), list(buckets),
                     time.perf_counter() - t0)

    @classmethod
    def load(
        cls,
        path: Path,
        cfg: dict[str, Any],
        *,
        num_slots: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
        int8_decode: bool = False,
        graph_tokens: int = 0,
        buckets: tuple[int, ...] = (),
        draft_loop_steps: int = 0,
        int8_weights: bool = False,
        bf16_weights: bool = False,
        native_decode: bool = False,
    ) -> LlamaLM:
        """Build from a checkpoint directory and its parsed config.json; each slot holds `max_context` positions.
        `int8_decode`: decode-sized products through int8 weight copies (CPU; for a draft, not a target).
        `int8_weights`, `bf16_weights`: every projection and the head as int8 / bf16 alone, no float copy (CPU).
        `graph_tokens`, `buckets`, `draft_loop_steps`: see `__init__` (0 / empty: off). `native_decode`: forwards of
        a few tokens through the native step where it can run them (`use_native`)."""
        args = LlamaArgs.from_config(cfg)
        weights = load_llama_weights(path, args, capacity=max_context, device=device, dtype=dtype, int8=int8_weights,
                                     bf16=bf16_weights)
        if int8_decode and not (int8_weights or bf16_weights):
            weights = with_int8_decode(weights)
        lm = cls(path.name, weights, num_slots=num_slots, max_context=max_context, device=device, dtype=dtype,
                 graph_tokens=graph_tokens, buckets=buckets, draft_loop_steps=draft_loop_steps)
        if native_decode and lm.use_native():
            return lm
        if weights.head.packed is not None and weights.head.q8 is None and not weights.head.bf16_only:
            lm.tune_decode()
        return lm

    def use_native(self) -> bool:
        """Run forwards of up to `native_rows` tokens through the native step (specrpc/native) if it supports this
        model here; longer ones keep the oneDNN copy, so the float [K, N] copy is dropped where one exists. Returns
        whether the native step is on (why not is logged)."""
        why = native_step.supported(self.weights, self.device, self.dtype)
        if why is not None:
            log.info("%s: native decode off (%s)", self.name, why)
            return False
        self.native = NativeStep(self.weights, self.cache)
        self.weights = _map_linears(self.weights, lambda p: p if p.packed is None or p.bf16_only
                                    else dataclasses.replace(p, wt=None, packed_rows=1))
        only_int8 = all(p.wt is None and p.packed is None for p in self.weights.linears())
        # int8 weights alone (--weights int8): every decode and verify through the native step, so greedy speculation
        # equals greedy decoding at int8 exactly (the torch int8 kernel rounds differently); else where it is faster
        self.native_rows = native_step.MAX_TOKENS if only_int8 else self._native_rows()
        log.info("%s: native decode on, up to %d tokens a forward", self.name, self.native_rows)
        return True

    def _native_rows(self, context: int = 32, repeats: int = 5) -> int:
        """The most tokens a forward runs through the native step (a decode step, a verify, a draft's catch-up)
        before the torch forward is faster (the native step reads each weight once for all its tokens but computes
        their products one row at a time): measured here on slot 0 (left empty), native against torch forwards of
        2, 3, … tokens, up to `MAX_TOKENS`; it stops at the first count where torch wins."""
        most = native_step.MAX_TOKENS
        context = min(context, self.max_context - most - 1)
        if context < 1:
            return 1
        ids = (torch.arange(context + most, device=self.device) * 7919) % self.vocab_size  # [context + most]
        self.forward(ids[:context], 0, 0)

        def timed(count: int, native: bool) -> float:
            times = []
            for _ in range(repeats + 1):
                self.truncate(0, context)
                self.native_rows = most if native else 0
                t0 = time.perf_counter()
                self.forward(ids[context : context + count], context, 0, num_logits=count)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        rows = 1
        for count in range(2, most + 1):
            if timed(count, True) >= timed(count, False):
                break
            rows = count
        self.native_rows = rows
        self.truncate(0, 0)
        return rows

    def tune_decode(self, context: int = 32, repeats: int = 5) -> bool:
        """Time one-token steps through MKL's gemv and through oneDNN (alternating, after a warm-up of each) and
        keep the faster (when oneDNN wins, the plain copy is dropped); returns whether oneDNN won. Uses slot 0, which
        is left empty. Call once, at load."""
        context = min(context, self.max_context - 1)  # a small cache still fits context + 1 positions
        if context < 1:
            return False
        variants = [with_packed_decode(self.weights, on) for on in (False, True)]
        ids = (torch.arange(context + 1, device=self.device) * 7919) % self.vocab_size  # [context + 1]
        self.forward(ids[:context], 0, 0)
        times: list[list[float]] = [[], []]
        for i in range(2 * (repeats + 1)):
            self.weights = variants[i % 2]
            self.truncate(0, context)
            t0 = time.perf_counter()
            self.forward(ids[context:], context, 0)
            if i >= 2:
                times[i % 2].append(time.perf_counter() - t0)
        packed = statistics.median(times[1]) < statistics.median(times[0])
        self.weights = variants[int(packed)]
        if packed:  # the plain copy would serve nothing: free it (half the weight memory)
            self.weights = _map_linears(self.weights, lambda p: dataclasses.replace(p, wt=None))
        self.truncate(0, 0)
        return packed

    def forward(self, ids: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 of `slot` → float32 logits [num_logits, V] of the last positions."""
        count = ids.shape[0]
        if not 1 <= num_logits <= count:
            raise ValueError(f"num_logits must be in 1..{count}, got {num_logits}")
        self.cache.begin_write(slot, start, count)
        with torch.inference_mode():
            if self.graphs is not None and self.graphs.covers(count, num_logits):
                logits = self.graphs.forward(ids, start, slot, num_logits)
            elif self.native is not None and count <= self.native_rows:
                logits = self.native.run(ids, start, slot, num_logits)  # [num_logits, V]
            elif self.native is not None and self.native.int8 and num_logits <= native_step.MAX_TOKENS:
                # int8 prefill: native chunks take half the time of torch's products on dequantized weights, and
                # compute as decoding does
                logits = self.native.run_chunks(ids, start, slot, num_logits)  # [num_logits, V]
            else:
                size = bucket_for(count, self.buckets, self.max_context - start) if num_logits == 1 else count
                padded = ids if size == count else torch.cat([ids, ids.new_zeros(size - count)])  # [size]
                logits = llama_forward(
                    self.weights, self.cache.slot_k[slot], self.cache.slot_v[slot], padded, start, num_logits, count
                )
        self.cache.commit(slot, start + count)
        return logits

    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """Several slots in one forward (`llama_forward_batch`) → per row float32 logits [num_logits, V]. One row
        takes `forward` (CUDA graphs, padded sizes); more rows run eagerly, their tokens concatenated for every
        matrix product."""
        check_rows(rows)
        if len(rows) == 1:
            r = rows[0]
            return [self.forward(r.ids, r.start, r.slot, r.num_logits)]
        for r in rows:
            self.cache.begin_write(r.slot, r.start, r.ids.shape[0])
        with torch.inference_mode():
            native = self.native
            if native is not None and (sum(r.ids.shape[0] for r in rows) <= self.native_rows or (native.int8 and all(
                    r.num_logits <= native_step.MAX_TOKENS for r in rows))):
                logits = native.run_rows(rows)  # each row's tokens through the products they take alone
            else:
                logits = llama_forward_batch(self.weights, self.cache.k, self.cache.v, rows)
        for r in rows:
            self.cache.commit(r.slot, r.start + r.ids.shape[0])
        return logits

    def greedy_draft(self, logits: torch.Tensor, position: int, slot: int, k: int) -> torch.Tensor | None:
        """k greedy draft tokens [k] on the device: the argmax of `logits` [1, V] (the catch-up's) at `position` and
        k-1 more, as one graph replay (CUDA) or one native call (CPU); None where neither runs them (draft step by
        step)."""
        if self.draft_loop is None or not 1 <= k - 1 <= self.draft_loop.max_steps:
            first = logits[0].argmax().view(1)  # [1]
            rest = self.feed_greedy(first, position, slot, k - 1) if k >= 2 else None  # [k - 1]
            return None if rest is None else torch.cat([first, rest])
        self.cache.begin_write(slot, position, k - 1)
        with torch.inference_mode():
            tokens = self.draft_loop.run(logits[0].argmax().view(1), position, slot, k - 1)  # [k]
        self.cache.commit(slot, position + k - 1)
        return tokens

    def feed_greedy(self, ids: torch.Tensor, start: int, slot: int, k: int) -> torch.Tensor | None:
        """ids [F] at positions start.. of `slot`, then k greedy tokens [k] (the argmax after the feed, and k-1 more
        one-token forwards), in one native call; None where the native step does not take it (draft otherwise)."""
        if self.native is None or k < 1 or ids.shape[0] > self.native_rows:
            return None
        count = ids.shape[0] + k - 1
        self.cache.begin_write(slot, start, count)
        with torch.inference_mode():
            tokens = self.native.greedy(ids, start, slot, k - 1)  # [k]
        self.cache.commit(slot, start + count)
        return tokens

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to `length` positions."""
        self.cache.truncate(slot, length)

    def length(self, slot: int) -> int:
        """Valid positions in `slot`."""
        return self.cache.length(slot)

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> bool:
        """`slot` takes positions [start, length) of `source` (`KVCache.copy_prefix`)."""
        self.cache.copy_prefix(source, slot, length, start)
        return True

    def cache_bytes(self) -> int:
        """Bytes of the preallocated K/V tensors."""
        return self.cache.nbytes()
