"""`specrpc bench bpb`: what `--weights int8` costs in quality against llama.cpp's q8_0, as bits per byte of the
shipped pair on held-out code (the model card's sets and measure, `training/evaluate.py`), with the weights in three
formats, each rounded as its engine stores it:

- float32: the checkpoint;
- int8 (`--weights int8`): symmetric int8 per output row with a bf16 scale (`weights._quantize`), every projection
  and the head; the embedding lookup stays float (`checkpoint.py`);
- q8_0 (llama.cpp): int8 per block of 32 weights along a row with a float16 scale, rounded as ggml's
  `quantize_row_q8_0_ref` (and gguf-py's converter, bit for bit) does; every projection and the token embedding,
  which the shipped pair ties to the head, so both.

All three run through one float32 forward (transformers), so the figures differ by the weights alone. The engines
also round activations in their integer products (ggml's q8_0 dot products take q8_0 activations; the native int8
step on a CPU with AVX-512 VNNI, or AVX2 without AVX-512, quantizes activations per 32 columns): that is not in these
figures.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specrpc.bench.common import write_results
from specrpc.models.llama.weights import int8_linear
from specrpc.training.corpus import EVALUATION_PACKAGES, evaluation_sources, is_heldout, iter_sources
from specrpc.training.evaluate import measure, token_stream
from specrpc.training.train import ASSETS

Q8_0_BLOCK = 32
"""Weights per q8_0 block (ggml's QK8_0): one float16 scale each."""


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K a multiple of 32) rounded to q8_0 and back to float32: per block of 32 along a row, d = amax / 127
    in float32, q = round-half-away-from-zero(w / d) by ggml's `roundf`, stored as q × float16(d)."""
    blocks = w.float().reshape(-1, Q8_0_BLOCK)  # [N·K/32, 32]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127  # [B, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = blocks * inv
    a = x.abs()
    q = torch.sign(x) * (a.floor() + (2 * (a - a.floor())).floor())  # gguf-py's np_roundf, exact to roundf
    return (q * d.to(torch.float16).float()).reshape(w.shape)


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] rounded as `--weights int8` stores it (`int8_linear`: int8 per output row, bf16 scale), back to
    float32."""
    p = int8_linear(w, None)
    assert p.q8 is not None and p.q8_scale is not None
    return p.q8.float() * p.q8_scale.float()[:, None]


FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {"float32": None, "int8": int8_rows,
                                                                      "q8_0": q8_0}


@torch.no_grad()
def rounded(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A copy of the Llama `model` with its weights rounded to `fmt` as that format's engine stores them."""
    fn = FORMATS[fmt]
    out = copy.deepcopy(model)
    if fn is None:
        return out
    for layer in out.model.layers:  # type: ignore[union-attr]
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                     layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            proj.weight.copy_(fn(proj.weight))
    head = cast(torch.nn.Linear, out.lm_head)
    embed = cast(torch.nn.Embedding, out.model.embed_tokens)  # type: ignore[union-attr]
    if fmt == "q8_0":  # token_embd and output both q8_0 (one tensor where tied)
        tied = head.weight is embed.weight
        embed.weight.copy_(fn(embed.weight))
        if not tied:
            head.weight.copy_(fn(head.weight))
    else:  # int8: the head rounded, the lookup kept float (untied where tied)
        head.weight = torch.nn.Parameter(fn(head.weight), requires_grad=False)
    return out


def run(assets: Path, max_tokens: int, window: int) -> dict[str, Any]:
    """Per held-out set and format: the target's and the draft's bits per byte."""
    tdir, ddir = assets / "target", assets / "draft"
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(tdir, local_files_only=True, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(ddir, local_files_only=True, dtype=torch.float32).eval()
    sets = {"stdlib_heldout": [f for f in iter_sources() if is_heldout(f.relpath)],
            **{f"third_party_{name}": evaluation_sources(name) for name in EVALUATION_PACKAGES}}
    models = {fmt: (rounded(target, fmt), rounded(draft, fmt)) for fmt in FORMATS}  # rounded once, for every set
    out: dict[str, Any] = {"max_tokens": max_tokens, "window": window, "sets": {}}
    for name, files in sets.items():
        ids = token_stream(tok, files, max_tokens)
        per: dict[str, Any] = {}
        for fmt, (t, d) in models.items():
            m = measure(t, d, tok, ids, window)
            per[fmt] = {"target": m["target_bits_per_byte"], "draft": m["draft_bits_per_byte"],
                        "tokens": m["tokens"], "bytes": m["bytes"]}
            print(f"{name} {fmt}: target {per[fmt]['target']:.4f}, draft {per[fmt]['draft']:.4f} bits per byte",
                  file=sys.stderr, flush=True)
        out["sets"][name] = per
    return out


def markdown(results: dict[str, Any]) -> str:
    """One row per set and model: bits per byte at each format and each quantized format's excess over float32."""
    lines = [f"Bits per byte on held-out code ({results['max_tokens']:,} tokens a set at most, windows of "
             f"{results['window']}), float32 activations throughout:", "",
             "| set | model | float32 | int8 (per row) | q8_0 (per 32) | int8 − float32 | q8_0 − float32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, per in results["sets"].items():
        for model in ("target", "draft"):
            f, i, q = (per[fmt][model] for fmt in FORMATS)
            lines.append(f"| {name} | {model} | {f:.4f} | {i:.4f} | {q:.4f} | {i - f:+.4f} | {q - f:+.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench bpb`."""
    parser = argparse.ArgumentParser(prog="specrpc bench bpb", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", type=Path, default=ASSETS)
    parser.add_argument("--max-tokens", type=int, default=60_000, help="held-out tokens per set")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench-results/bpb"))
    args = parser.parse_args(argv)
    results = run(args.assets, args.max_tokens, args.window)
    write_results(args.out, "bpb", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
