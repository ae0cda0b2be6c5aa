"""What a Llama-family config.json says (Llama, Mistral, Qwen2, Qwen3, StarCoder2), parsed into `LlamaArgs`.

What differs between the families is data, not branches in the forward: the norm (RMSNorm, or LayerNorm with a bias
for StarCoder2), the MLP (`LlamaArgs.gated`: SwiGLU's gate·up, or StarCoder2's c_fc → GELU(tanh) → c_proj), Qwen3's
per-head q/k RMSNorm before RoPE (`LlamaArgs.qk_norm`), the RoPE variant and the per-layer sliding windows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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

