"""Where a decode step goes: one target step and one draft step at k = 0 and in a verify, per op (torch.profiler),
against the bandwidth floor (weights + KV bytes read ÷ the bandwidth a large matrix-vector product reaches here).

    .venv/bin/python tools/profile_step.py --threads 2 --context 400 [--weights int8] [--dtype bfloat16]

Prints a Markdown table. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from specrpc.config import ASSETS
from specrpc.models import load_model
from specrpc.models.llama import Linear, LlamaLM


def bandwidth_gb_s(repeats: int = 30) -> float:
    """Bytes per second one 8192×4096 fp32 matrix-vector product (128 MiB, larger than any cache) reads."""
    w = torch.randn(8192, 4096)
    x = torch.randn(1, 4096)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(x, w.t())
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / statistics.median(times) / 1e9


def linear_bytes(p: Linear) -> int:
    """Bytes a product reads from `p` at decode (the copy a one-row product takes)."""
    if p.q8 is not None:
        return p.q8.numel() + (p.q8_scale.numel() * 2 if p.q8_scale is not None else 0)
    t = p.wt if p.wt is not None else p.packed
    assert t is not None
    return t.numel() * t.element_size()


def weight_bytes(lm: LlamaLM) -> int:
    """Weight bytes one decode step reads: every projection and the head (one embedding row aside)."""
    w = lm.weights
    linears = [w.head, *(q for layer in w.layers for q in (layer.qkv, layer.o, layer.up, layer.down))]
    return sum(linear_bytes(p) for p in linears)


def kv_bytes(lm: LlamaLM, context: int) -> int:
    """K and V bytes attention reads at `context` positions."""
    a = lm.weights.args
    return 2 * a.layers * a.kv_heads * context * a.head_dim * lm.cache.slot_k[0].element_size()


def step_ms(lm: LlamaLM, context: int, width: int, repeats: int) -> float:
    """Median wall time of a `width`-token forward at `context` (slot 0 rolled back each time)."""
    ids = torch.arange(width) % lm.vocab_size
    times = []
    for _ in range(repeats):
        lm.truncate(0, context)
        t0 = time.perf_counter()
        lm.forward(ids, context, 0, num_logits=width)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def op_table(lm: LlamaLM, context: int, width: int, repeats: int) -> tuple[list[tuple[str, float, int]], float]:
    """Self CPU ms per step by op name (most first) and ops per step."""
    ids = torch.arange(width) % lm.vocab_size
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            lm.truncate(0, context)
            lm.forward(ids, context, 0, num_logits=width)
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        per[e.key][0] += e.self_cpu_time_total / 1e3 / repeats
        per[e.key][1] += e.count / repeats
    rows = sorted(((k, v[0], round(v[1])) for k, v in per.items()), key=lambda r: -r[1])
    return rows, sum(r[2] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", default="dtype", choices=["dtype", "int8"])
    parser.add_argument("--verify", type=int, default=5, help="tokens of the verify step profiled (k + 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    gbs = bandwidth_gb_s()
    print(f"threads {args.threads}, context {args.context}, dtype {args.dtype}, weights {args.weights}; "
          f"bandwidth of one 128 MiB fp32 matrix-vector product: {gbs:.1f} GB/s\n")
    for name in ("target", "draft"):
        lm = load_model(ASSETS / name, device=cpu, dtype=dtype, num_slots=1, max_context=args.context + 16,
                        int8_weights=args.weights == "int8",
                        int8_decode=name == "draft" and args.weights == "dtype")  # as `specrpc serve` runs the draft
        assert isinstance(lm, LlamaLM)
        prompt = torch.arange(args.context) * 7919 % lm.vocab_size
        with torch.inference_mode():
            lm.forward(prompt, 0, 0)
        for width in (1, args.verify):
            with torch.inference_mode():
                ms = step_ms(lm, args.context, width, args.repeats)
                rows, ops = op_table(lm, args.context, width, max(5, args.repeats // 5))
            floor_bytes = weight_bytes(lm) + kv_bytes(lm, args.context + width)
            floor_ms = floor_bytes / (gbs * 1e9) * 1e3
            profiled = sum(r[1] for r in rows)
            print(f"### {name}, {width} token{'s' if width > 1 else ''} at context {args.context}\n")
            print(f"Step {ms:.2f} ms (wall, median of {args.repeats}); floor {floor_ms:.2f} ms "
                  f"({weight_bytes(lm) / 1e6:.1f} MB weights + {kv_bytes(lm, args.context + width) / 1e6:.1f} MB "
                  f"KV at {gbs:.1f} GB/s); {ops} ops per step; ops' self time {profiled:.2f} ms under the profiler.\n")
            print("| op | self ms per step | calls per step |\n| --- | --- | --- |")
            for key, self_ms, count in rows[:12]:
                print(f"| `{key}` | {self_ms:.3f} | {count} |")
            rest: Any = rows[12:]
            print(f"| (other {len(rest)} ops) | {sum(r[1] for r in rest):.3f} | {sum(r[2] for r in rest)} |\n")


if __name__ == "__main__":
    main()
