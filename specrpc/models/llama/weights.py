"""The weights a Llama-family forward reads (`LlamaWeights`: layers of `Linear` projections and `Norm`s, the
embedding, RoPE tables) and the matrix product each weight format takes (`linear`).

Weights are kept transposed, `wt` [K, N]. On CPU in float32 `wt` is contiguous (MKL gemv for one row) and a second,
oneDNN-blocked copy `packed` serves every product with more than one row (verify, prefill), at twice the weight
memory; one-row products take whichever of the two `LlamaLM.tune_decode` finds faster at load. Measured on the
2-core AVX-512 dev box, one thread, summed over the five product shapes of one d=384 layer + the 8192-row head:
M=1: `x @ wt` 0.60 ms, F.linear 1.36, oneDNN 1.11; M=5: oneDNN 0.97, `x @ wt` 2.26, F.linear 2.58. Whole
d=384/8-layer step: decode 6.0 ms, 5-token verify 7.2 ms (F.linear only: 7.9 / 13.8). Elsewhere (CUDA) `wt` is the
transposed view of the row-major weight, so `x @ wt` is exactly `F.linear`. With int8 weights (`--weights int8`,
CPU) a projection keeps only `q8` and its scales (`int8_linear`); with bf16 weights only a bf16 `packed`
(`bf16_linear`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrpc.models.llama.config import LlamaArgs


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


INT8_KERNEL_COLS = 16
"""torch's int8 kernel (`_weight_int8pack_mm`) takes inputs whose width is a multiple of this: it crashes the
process on others (seen with 72 columns and 4 rows or more); such a projection's products take the other paths."""


def int8_available(device: torch.device) -> bool:
    """Whether torch has a CPU int8 weight-only kernel (`_weight_int8pack_mm`) to serve int8 decode."""
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")


def bf16_available(device: torch.device) -> bool:
    """Whether oneDNN computes bf16 products on this CPU (`bf16_linear`)."""
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → symmetric per-output-row int8 [N, K] and bf16 scales [N] (the kernel's activation type)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()  # [N, K]
    return q, scale.to(torch.bfloat16)


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


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-blocked copy of w [N, K] for products of more than one row, or None where oneDNN can't do it."""
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed


def bf16_linear(w: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """w [N, K] as a oneDNN-blocked bf16 weight alone: every product, whatever its rows, rounds its activations to
    bf16 and runs the same kernel (whose rows do not depend on each other), so a token's logits are the same
    decoded alone or verified; the result and the bias stay in the activations' dtype."""
    packed = _onednn_pack(w.to(torch.bfloat16).contiguous())
    if packed is None:
        raise ValueError("--weights bf16 needs oneDNN's bf16 products on this CPU")
    return Linear(wt=None, packed=packed, bias=bias, bf16_only=True)


def make_linear(w: torch.Tensor, b: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 int8: bool = False, bf16: bool = False) -> Linear:
    """Store w [N, K] (checkpoint layout) for `linear` on `device`; `int8`: as int8 alone (CPU, `int8_linear`);
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


def linear(x: torch.Tensor, p: Linear) -> torch.Tensor:
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


def linear_add(x: torch.Tensor, p: Linear, residual: torch.Tensor) -> torch.Tensor:
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


def map_linears(w: LlamaWeights, fn: Callable[[Linear], Linear]) -> LlamaWeights:
    """`w` with `fn` applied to every projection and the head."""
    layers = tuple(
        dataclasses.replace(layer, qkv=fn(layer.qkv), o=fn(layer.o), up=fn(layer.up), down=fn(layer.down))
        for layer in w.layers
    )
    return dataclasses.replace(w, layers=layers, head=fn(w.head))


def with_int8_decode(w: LlamaWeights) -> LlamaWeights:
    """Every projection and the head get an int8 copy for decode-sized products (a draft's proposals: any
    distribution is a valid draft, and verification keeps the output the target's)."""
    return map_linears(w, quantize_int8)


def with_packed_decode(w: LlamaWeights, on: bool = True) -> LlamaWeights:
    """One-row products through the oneDNN-blocked copy too (`on`), or through MKL's gemv on `wt` (not `on`).
    Which is faster depends on the CPU and the thread count: on the dev box, one decode step of the shipped target
    took 7.7 ms with gemv and 9.2 with oneDNN on one thread, but 8.0 against 6.7 on two."""
    return map_linears(w, lambda p: dataclasses.replace(p, packed_rows=1 if on else 2))
