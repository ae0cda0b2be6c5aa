"""`specrpc bench realistic`: speculation at the sizes users run, without their weights. Random-weight models of a
real family's published shapes (specrpc/bench/families.py) are built in memory; acceptance is simulated (each draft
accepted with probability α until the first rejection), so the costs are measured and the acceptance is not.
Reports D(k), V(k) for k = 1..8 and, per α, tokens/s and speed-up over target-only for adaptive and fixed k against the
bound E/(D + V). Tables say "measured costs, simulated acceptance": never model results.

    specrpc bench realistic --pair qwen2.5-coder-7b/0.5b --out bench-realistic          # a GPU, full size
    specrpc bench realistic --quick --device cpu --out bench-realistic-cpu              # CPU, shapes / 16
    specrpc bench realistic --write-checkpoint DIR --model qwen2.5-coder-1.5b --scale 8  # a random HF checkpoint
    specrpc bench realistic --write-checkpoint DIR --model qwen2.5-coder-1.5b --tokenizer  # + tokenizer, for GGUF
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specrpc.bench.contenders import Run, engine_runner
from specrpc.bench.families import CONFIGS, PAIRS, config
from specrpc.bench.run import summarize
from specrpc.bench.simulated import simulated_verifier
from specrpc.config import EngineConfig
from specrpc.engine.engine import Engine
from specrpc.engine.policy import expected_tokens
from specrpc.engine.sampling import SamplingParams
from specrpc.models import padded_sizes
from specrpc.models.random_weights import random_lm, write_checkpoint
from specrpc.serving.runtime import resolve_device, resolve_dtype

LABEL = "measured costs, simulated acceptance (random weights: tokens meaningless; not model results)"
GREEDY = SamplingParams(temperature=0.0)


def build_engine(pair: str, scale: int, device: torch.device, dtype: torch.dtype, max_context: int,
                 seed: int = 0, weights: str = "dtype") -> Engine:
    """Target and draft of `pair` with random weights (one slot each), CUDA graphs for draft and verify steps, on a
    CPU the native step where it runs (as served); `weights` int8 / bf16: weight-only int8 / bf16 projections (CPU)."""
    target_name, draft_name = PAIRS[pair]
    capacity = max_context + 8 + 1
    cuda = device.type == "cuda"  # as the server runs there: graphs, padded eager shapes, one-replay draft loops
    kw: dict[str, Any] = {"num_slots": 1, "max_context": capacity, "device": device, "dtype": dtype,
                          "graph_tokens": 9 if cuda else 0,
                          "buckets": padded_sizes(9, 512) if cuda else (),
                          "int8": weights == "int8", "bf16": weights == "bf16"}
    t0 = time.perf_counter()
    target = random_lm(config(target_name, scale), target_name, seed=seed, **kw)
    draft = random_lm(config(draft_name, scale), draft_name, seed=seed + 1, draft_loop_steps=7 if cuda else 0, **kw)
    if device.type == "cpu":  # the paths `LlamaLM.load` chooses for the server (native decode, its default)
        for lm in (target, draft):
            lm.choose_paths()
    print(f"{pair} (scale 1/{scale}): built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return Engine(target, draft, EngineConfig(max_sessions=1, max_context=max_context, max_draft_tokens=8,
                                              proposer="draft", prefill_chunk=512))


def run_pair(engine: Engine, alphas: list[float], ks: list[int], prompt_len: int, new_tokens: int, rounds: int,
             seed: int = 0) -> dict[str, Any]:
    """Calibrate (D, V), then per α: target-only, adaptive and every fixed k, interleaved, `rounds` prompts each."""
    costs = engine.calibrate(context=prompt_len)
    rng = random.Random(seed)
    vocab = min(engine.target.vocab_size, engine.draft.vocab_size if engine.draft else engine.target.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(rounds)]
    out: dict[str, Any] = {"target_step_ms": costs.target_step_s * 1e3, "draft_step_ms": costs.draft_step_s * 1e3,
                           "c": costs.c, "D": {k: costs.d(k) for k in range(1, 9)},
                           "V": {k: costs.v(k) for k in range(1, 9)}, "alphas": {}}
    engine.verifier = simulated_verifier(1.0, seed, vocab)
    base_runner = engine_runner(engine, 0, "draft")
    base_runner(prompts[0][:16], 4, GREEDY)  # warm-up
    base = summarize([base_runner(p, new_tokens, GREEDY) for p in prompts])["tokens_per_s"]
    out["target_only_tokens_per_s"] = base
    for alpha in alphas:
        engine.verifier = simulated_verifier(alpha, seed, vocab)
        runners = {"adaptive": engine_runner(engine, None, "draft"),
                   **{f"k={k}": engine_runner(engine, k, "draft") for k in ks}}
        runs: dict[str, list[Run]] = {name: [] for name in runners}
        for runner in runners.values():  # warm-up: each contender's first forwards are not measured
            runner(prompts[0][:16], 8, GREEDY)
        for p in prompts:
            for name, runner in runners.items():
                runs[name].append(runner(p, new_tokens, GREEDY))
        rows: dict[str, Any] = {}
        for name, rs in runs.items():
            s = summarize(rs)
            row = {"tokens_per_s": s["tokens_per_s"], "speedup": s["tokens_per_s"] / base if base else 0.0,
                   "mean_k": s["mean_k"], "mean_accepted_length": s["mean_accepted_length"],
                   "itl_p99_ms": s["itl_p99_ms"]}
            if name.startswith("k="):
                k = int(name[2:])
                row["bound"] = expected_tokens(alpha, k) / (costs.d(k) + costs.v(k))
                row["of_bound"] = row["speedup"] / row["bound"]
            rows[name] = row
        out["alphas"][str(alpha)] = rows
    return out


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown, every table labelled as measured costs with a simulated acceptance."""
    lines = [f"Machine: {results['machine']}  ", f"Command: `{results['command']}`  ", f"**{LABEL}**", ""]
    for pair, r in results["pairs"].items():
        lines += [f"### {pair}, shapes 1/{results['scale']}: measured costs, simulated acceptance", "",
                  f"Target step {r['target_step_ms']:.3f} ms, draft step {r['draft_step_ms']:.3f} ms: "
                  f"D(k) for k = 1..8: " + ", ".join(f"{v:.3f}" for v in r["D"].values())
                  + "; V(k): " + ", ".join(f"{v:.3f}" for v in r["V"].values())
                  + f"; target-only {r['target_only_tokens_per_s']:.1f} tokens/s.", "",
                  "| α | contender | tokens/s | × target-only | bound E/(D+V) | of bound | mean k | ITL p99 ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        best_lines = []
        for alpha, rows in r["alphas"].items():
            for name, row in rows.items():
                bound = f"{row['bound']:.2f}" if "bound" in row else ""
                of = f"{row['of_bound']:.2f}" if "of_bound" in row else ""
                lines.append(f"| {alpha} | {name} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {bound} | "
                             f"{of} | {row['mean_k']:.1f} | {row['itl_p99_ms']:.2f} |")
            best = max((n for n in rows if n.startswith("k=")), key=lambda n: rows[n]["speedup"], default=None)
            if best is not None:
                b = rows[best]
                best_lines.append(f"- α = {alpha}: best fixed {best} at {b['speedup']:.2f}× target-only, "
                                  f"{b['of_bound']:.2f} of its bound; adaptive {rows['adaptive']['speedup']:.2f}× "
                                  f"= {rows['adaptive']['speedup'] / b['speedup']:.2f} of the best.")
        lines += ["", *best_lines, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench realistic`."""
    parser = argparse.ArgumentParser(prog="specrpc bench realistic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append", choices=sorted(PAIRS),
                        help="target/draft pair (repeatable; default: the 7B/0.5B and 8B/1B pairs)")
    parser.add_argument("--scale", type=int, default=0, help="divide widths, heads, depth, vocabulary (1: published)")
    parser.add_argument("--quick", action="store_true", help="CPU rehearsal: scale 16, 2 α, k 1,2,4, short runs")
    parser.add_argument("--alphas", default="0.6,0.7,0.8,0.9")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="fixed k contenders")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="prompts per contender and α")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16")
    parser.add_argument("--weights", default="dtype", choices=["dtype", "int8", "bf16"],
                        help="int8 / bf16: weight-only int8 / bf16 target and draft (CPU); int8 against llama.cpp's "
                             "q8_0")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-realistic"))
    parser.add_argument("--write-checkpoint", type=Path, metavar="DIR",
                        help="write a random-weight checkpoint of --model (at --scale) to DIR instead, and exit")
    parser.add_argument("--model", choices=sorted(CONFIGS), help="the model --write-checkpoint writes")
    parser.add_argument("--tokenizer", action="store_true",
                        help="with --write-checkpoint: also write a byte-level BPE tokenizer (GPT-2's pre-tokenizer, "
                             "the family's vocabulary size), e.g. for llama.cpp's GGUF converter")
    args = parser.parse_args(argv)
    if args.quick:
        args.scale = args.scale or 16
        args.alphas, args.ks = ("0.6,0.9", "1,2,4") if args.alphas == "0.6,0.7,0.8,0.9" else (args.alphas, args.ks)
        args.prompt_tokens, args.new_tokens, args.rounds = 32, 24, 1
    scale = args.scale or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.write_checkpoint:
        if not args.model:
            parser.error("--write-checkpoint needs --model")
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        path = write_checkpoint(config(args.model, scale), args.write_checkpoint, seed=args.seed, dtype=dtype,
                                tokenizer=args.tokenizer)
        made = "a byte-level BPE tokenizer" if args.tokenizer else "no tokenizer"
        print(f"wrote {path} ({args.model}, scale 1/{scale}, {dtype}, random weights, {made})")
        return 0
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    alphas = [float(a) for a in args.alphas.split(",") if a]
    ks = [int(k) for k in args.ks.split(",") if k]
    if any(not 1 <= k <= 8 for k in ks):
        parser.error("--ks must lie in 1..8")
    pairs = args.pair or ["qwen2.5-coder-7b/0.5b", "llama-3.1-8b/3.2-1b"]
    results: dict[str, Any] = {
        "label": LABEL, "machine": f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch "
        f"{torch.__version__}, {dtype}" + (f", {args.weights} weights" if args.weights != "dtype" else ""),
        "command": "specrpc bench realistic " + " ".join(argv or sys.argv[1:]),
        "scale": scale, "pairs": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for pair in pairs:
        engine = build_engine(pair, scale, device, dtype, args.prompt_tokens + args.new_tokens + 16, args.seed,
                              weights=args.weights)
        results["pairs"][pair] = run_pair(engine, alphas, ks, args.prompt_tokens, args.new_tokens, args.rounds,
                                          args.seed)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (args.out / "realistic.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (args.out / "realistic.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
