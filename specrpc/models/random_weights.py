"""Random-weight Llama-family models built from a config.json dict: in memory for benchmarks at real sizes (no
multi-GB file is written or read), or written as a transformers checkpoint directory for small shapes.

Every tensor is drawn from its own generator, seeded from `seed` and the tensor's name, so a model is the same
whatever order its tensors are built in (and the same in memory as written, on the same device and dtype)."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from specrpc.models.llama import LlamaArgs, LlamaLM, TensorSource, build_llama_weights, checkpoint_shapes

MAX_WRITE_BYTES = 8 * 2**30
"""Largest checkpoint `write_checkpoint` writes (it holds every tensor in memory once)."""


def random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """Norm weights 1, biases and matrices N(0, std), drawn on `device` from a generator seeded by (seed, name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)


def random_source(cfg: dict[str, Any], seed: int, device: torch.device, dtype: torch.dtype) -> TensorSource:
    """Tensor name → random tensor of the checkpoint's shape, built on demand (None for names it lacks)."""
    shapes = checkpoint_shapes(cfg)
    std = float(cfg.get("initializer_range", 0.02))

    def get(name: str) -> torch.Tensor | None:
        shape = shapes.get(name)
        return None if shape is None else random_tensor(name, shape, seed, std, device, dtype)

    return get


def random_lm(cfg: dict[str, Any], name: str, *, seed: int, num_slots: int, max_context: int, device: torch.device,
              dtype: torch.dtype, graph_tokens: int = 0, buckets: tuple[int, ...] = (),
              draft_loop_steps: int = 0, int8: bool = False, bf16: bool = False) -> LlamaLM:
    """A lean-forward model of `cfg`'s shapes with random weights, built directly on `device` in `dtype` (graphs,
    padding sizes and draft loops as `LlamaLM` takes them; `int8` / `bf16`: projections and head as int8 / bf16
    weights)."""
    args = LlamaArgs.from_config(cfg)
    weights = build_llama_weights(random_source(cfg, seed, device, dtype), args, capacity=max_context, device=device,
                                  dtype=dtype, where=f"random {name}", int8=int8, bf16=bf16)
    return LlamaLM(name, weights, num_slots=num_slots, max_context=max_context, device=device, dtype=dtype,
                   graph_tokens=graph_tokens, buckets=buckets, draft_loop_steps=draft_loop_steps)


def checkpoint_bytes(cfg: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of `cfg`'s weights at `dtype`."""
    return sum(math.prod(s) for s in checkpoint_shapes(cfg).values()) * torch.tensor([], dtype=dtype).element_size()


def write_checkpoint(cfg: dict[str, Any], path: Path, *, seed: int, dtype: torch.dtype = torch.bfloat16,
                     tokenizer: bool = False) -> Path:
    """config.json + model.safetensors with random weights (transformers loads it); with `tokenizer`, also a
    byte-level BPE tokenizer (`write_byte_tokenizer`), so that converters that need one (llama.cpp's) take it."""
    from safetensors.torch import save_file

    size = checkpoint_bytes(cfg, dtype)
    if size > MAX_WRITE_BYTES:
        raise ValueError(f"a {size / 2**30:.1f} GiB checkpoint is over the {MAX_WRITE_BYTES / 2**30:.0f} GiB limit "
                         "for writing; use a --scale that shrinks it, or build it in memory")
    path.mkdir(parents=True, exist_ok=True)
    get = random_source(cfg, seed, torch.device("cpu"), dtype)
    tensors = {name: t for name in checkpoint_shapes(cfg) if (t := get(name)) is not None}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    torch_dtype = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": torch_dtype}, indent=2) + "\n")
    if tokenizer:
        write_byte_tokenizer(path, int(cfg["vocab_size"]))
    return path


BYTE_TOKENIZER_MERGES = 256
"""Merges of the tokenizer `write_byte_tokenizer` makes (at most; fewer when the vocabulary is smaller)."""


def write_byte_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of a byte-level BPE with GPT-2's pre-tokenizer, within `vocab_size`
    ids: `<|endoftext|>` (id 0), the 256 byte symbols, then merges of pairs of common letters. The ids past these
    are embedding rows no text maps to; random weights make every token meaningless anyway."""
    from itertools import product

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    if len(vocab) > vocab_size:
        raise ValueError(f"a byte-level tokenizer needs {len(vocab)} ids, the model has {vocab_size}")
    merges: list[tuple[str, str]] = []
    for a, b in product("etaoinsrhl", "etaoinsrhlcdu"):
        if len(vocab) >= vocab_size or len(merges) >= BYTE_TOKENIZER_MERGES:
            break
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",  # type: ignore[no-untyped-call]
                            pad_token="<|endoftext|>").save_pretrained(str(path))
