"""The lean forward of Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3, StarCoder2), weights read straight
from safetensors: `config` parses config.json, `weights` holds the weight formats and their products, `checkpoint`
reads and fuses a checkpoint's tensors, `rope` and `forward` compute, and `lm.LlamaLM` owns the KV cache and picks a
backend (`specrpc.models.backends`) per forward shape."""

from specrpc.models.llama.checkpoint import TensorSource, build_llama_weights, checkpoint_shapes
from specrpc.models.llama.config import LEAN_MODEL_TYPES, LlamaArgs, UnsupportedModelError
from specrpc.models.llama.lm import LlamaLM, padded_sizes
from specrpc.models.llama.weights import Linear, LlamaWeights, bf16_available, int8_available

__all__ = [
    "LEAN_MODEL_TYPES",
    "Linear",
    "LlamaArgs",
    "LlamaLM",
    "LlamaWeights",
    "TensorSource",
    "UnsupportedModelError",
    "bf16_available",
    "build_llama_weights",
    "checkpoint_shapes",
    "int8_available",
    "padded_sizes",
]
