"""Load a Hugging Face checkpoint directory as a CausalLM (lean Llama-family path or transformers fallback)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specrpc.models.hf_fallback import HFCausalLM
from specrpc.models.llama import LEAN_MODEL_TYPES, LlamaLM, UnsupportedModelError, bf16_available, int8_available
from specrpc.models.protocol import CausalLM

log = logging.getLogger(__name__)


def load_model(
    path: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    num_slots: int,
    max_context: int,
    lean: bool = True,
    int8_decode: bool = False,
    graph_tokens: int = 0,
    buckets: tuple[int, ...] = (),
    draft_loop_steps: int = 0,
    int8_weights: bool = False,
    bf16_weights: bool = False,
    native_decode: bool = False,
    deterministic: bool = False,
    remember: bool = False,
) -> CausalLM:
    """Load `path` with `num_slots` KV slots of `max_context` positions each (include the verify reserve:
    max_context + k_max + 1). Llama / Mistral / Qwen2 / Qwen3 / StarCoder2 take the lean forward unless `lean` is
    False or the config needs something it lacks; anything else runs through transformers. `int8_decode` (lean
    path on CPU only): serve products of a few rows from int8 weight copies, which changes the model's outputs
    slightly; for drafts.
    `graph_tokens` (lean path on CUDA only): forwards of up to that many tokens replay CUDA graphs; `buckets` (lean
    path): eager forwards are padded to these token counts, each met once at load; `draft_loop_steps` (lean path on
    CUDA only): greedy draft loops of up to that many forwards replay one graph. `int8_weights` (lean path on a CPU
    with torch's int8 kernel, ValueError elsewhere): every projection and the head stored as int8 alone, weight-only
    (outputs change slightly; greedy speculation still equals greedy target-only decoding at int8). `bf16_weights`
    (lean path on a CPU whose oneDNN computes bf16): the same with bf16 weights, activations kept at `dtype`.
    `native_decode` (lean path, float32 on a CPU with a C++ compiler): one-token forwards through the native step
    (specrpc/native). `deterministic` (lean path, where the native step runs; ValueError elsewhere): every forward
    through the native step, so the logits of a position never depend on the forward it shares (`LlamaLM.use_native`).
    `remember` (with `native_decode`): the native step's choice kept for the next start on this machine, and taken
    from the last one once it checks out (`Memo`).
    """
    path = Path(path)
    if int8_weights and not (lean and int8_available(device)):
        raise ValueError(f"--weights int8 needs the lean forward on a CPU whose torch has the int8 kernel "
                         f"(device {device}, lean {lean}); use --weights dtype")
    if bf16_weights and not (lean and bf16_available(device)):
        raise ValueError(f"--weights bf16 needs the lean forward on a CPU whose oneDNN computes bf16 "
                         f"(device {device}, lean {lean}); use --weights dtype")
    cfg = json.loads((path / "config.json").read_text())
    if deterministic and not (lean and cfg.get("model_type") in LEAN_MODEL_TYPES):
        raise ValueError(f"--deterministic needs the lean forward and its native step, which {path.name} "
                         f"({cfg.get('model_type')}, lean {lean}) does not take")
    if lean and cfg.get("model_type") in LEAN_MODEL_TYPES:
        try:
            return LlamaLM.load(path, cfg, device=device, dtype=dtype, num_slots=num_slots, max_context=max_context,
                                int8_decode=int8_decode and int8_available(device), graph_tokens=graph_tokens,
                                buckets=buckets, draft_loop_steps=draft_loop_steps, int8_weights=int8_weights,
                                bf16_weights=bf16_weights, native_decode=native_decode,
                                deterministic=deterministic, remember=remember)
        except UnsupportedModelError as e:
            if int8_weights or bf16_weights or deterministic:
                raise ValueError(f"{path.name}: --weights int8 / bf16 and --deterministic need the lean forward, "
                                 f"which this model can't take ({e})") from e
            log.warning("%s: lean forward unavailable (%s); using transformers", path.name, e)
    return HFCausalLM.load(path, device=device, dtype=dtype, num_slots=num_slots, max_context=max_context)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer (local files only)."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return tokenizer
