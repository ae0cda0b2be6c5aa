"""Published config.json values of real model families, for benchmarks at the sizes users run without their
weights (`specrpc bench realistic` builds random weights of these shapes). Shape-relevant keys only, copied from the
checkpoints' config.json on the Hugging Face hub (the Qwen2.5-Coder and Llama 3.x model cards and configs)."""

from __future__ import annotations

from typing import Any

_QWEN25_CODER: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": None,
    "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
    "torch_dtype": "bfloat16",
}
_LLAMA3: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-05,
    "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001,
    "pretraining_tp": 1, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-Coder-7B: 28 layers, 28 query / 4 KV heads, untied embeddings, padded vocabulary of 152064
    "qwen2.5-coder-7b": {**_QWEN25_CODER, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                         "num_attention_heads": 28, "num_key_value_heads": 4, "max_window_layers": 28,
                         "tie_word_embeddings": False, "vocab_size": 152064},
    # Qwen/Qwen2.5-Coder-1.5B: 28 layers, 12 / 2 heads, tied embeddings
    "qwen2.5-coder-1.5b": {**_QWEN25_CODER, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                           "num_attention_heads": 12, "num_key_value_heads": 2, "max_window_layers": 28,
                           "tie_word_embeddings": True, "vocab_size": 151936},
    # Qwen/Qwen2.5-Coder-0.5B: 24 layers, 14 / 2 heads, tied embeddings
    "qwen2.5-coder-0.5b": {**_QWEN25_CODER, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                           "num_attention_heads": 14, "num_key_value_heads": 2, "max_window_layers": 24,
                           "tie_word_embeddings": True, "vocab_size": 151936},
    # meta-llama/Llama-3.1-8B: 32 layers, 32 / 8 heads, llama3 RoPE (factor 8)
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "rope_scaling": _llama3_rope(8.0), "tie_word_embeddings": False},
    # meta-llama/Llama-3.2-1B: 16 layers, 32 / 8 heads of 64, llama3 RoPE (factor 32), tied embeddings
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "rope_scaling": _llama3_rope(32.0), "tie_word_embeddings": True},
}

PAIRS: dict[str, tuple[str, str]] = {
    "qwen2.5-coder-7b/0.5b": ("qwen2.5-coder-7b", "qwen2.5-coder-0.5b"),
    "llama-3.1-8b/3.2-1b": ("llama-3.1-8b", "llama-3.2-1b"),
    "qwen2.5-coder-1.5b/0.5b": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
}
"""target / draft pairs sharing a tokenizer (so their vocabularies line up as the engine needs)."""


def config(name: str, scale: int = 1) -> dict[str, Any]:
    """The published config of `name` (a key of CONFIGS), with every width, the head counts, the depth and the
    vocabulary divided by `scale` (head_dim kept; at least one of each; query heads a multiple of KV heads) so a CPU
    can run the same family's shape in miniature. scale 1 is the published config itself."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(CONFIGS)}")
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    cfg = dict(CONFIGS[name])
    if scale == 1:
        return cfg
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = max(1, kv // scale)
    heads = max(kv, heads // scale // kv * kv)
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, hidden_size=heads * head_dim,
               intermediate_size=max(8, cfg["intermediate_size"] // scale),
               num_hidden_layers=max(1, cfg["num_hidden_layers"] // scale),
               vocab_size=max(256, cfg["vocab_size"] // scale))
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    for special in ("bos_token_id", "eos_token_id"):  # the published ids lie past the shrunk vocabulary
        cfg.pop(special, None)
    return cfg
