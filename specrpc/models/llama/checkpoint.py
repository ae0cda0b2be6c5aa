"""Llama-family weights from a checkpoint: the tensors a transformers checkpoint holds (`checkpoint_shapes`), read
from safetensors shards, fused (q/k/v into one projection, gate/up into another) and laid out for the forward
(`build_llama_weights`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specrpc.models.llama.config import ACTIVATIONS, LlamaArgs, UnsupportedModelError
from specrpc.models.llama.rope import rope_tables
from specrpc.models.llama.weights import Layer, Linear, LlamaWeights, Norm, make_linear

TensorSource = Callable[[str], torch.Tensor | None]
"""Checkpoint tensor name → tensor (in the checkpoint's [N, K] layout), None when the checkpoint has no such tensor."""


def _effective_window(window: int | None, capacity: int) -> int | None:
    """A window at least as long as the cache never hides anything."""
    return window if window is not None and window < capacity else None


def _tensor_reader(path: Path, stack: ExitStack) -> TensorSource:
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
        return make_linear(torch.cat(ws) if len(ws) > 1 else ws[0], bias, device, dtype, int8, bf16)

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
        head=make_linear(head, None, device, dtype, int8, bf16),
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

