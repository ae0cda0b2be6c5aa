"""`specrpc bench ties`: how often greedy speculation leaves target-only's tokens, in process on the shipped pair, on
held-out prompts (`workloads.build_cases`: files unseen in training; `--files`: your own), and why.

Two modes, each its own engine: the default (every forward shape takes its fastest path, so a verify or a batch
wider than the native step's forwards runs through torch and rounds apart from a one-token step) and
`--deterministic` (every forward through the native step's per-token products). In each mode every case runs
target-only (k = 0: the reference), adaptive and each fixed k of `--ks` on one stream, and `--streams` cases at once
in one batched engine step (target-only and adaptive). A stream whose tokens differ from its mode's target-only
run diverged; at its first differing position, one forward of that mode's target over the prompt and the agreed
tokens gives the target's top-2 logit gap there: a floating-point near-tie shows a gap at float32 rounding's scale,
a bug a wide one. The deterministic mode must not diverge at all (exit status 1 if it does).

Speed: adaptive on one stream, default against deterministic, interleaved case by case (the modes' order
alternating, the contenders' rotating), so machine drift hits both alike. Prints Markdown; writes ties.json and
ties.md."""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specrpc.bench.common import machine_line, pair_line, write_results
from specrpc.bench.contenders import Run, decode_rate, measure
from specrpc.bench.run import prompt_ids, summarize
from specrpc.bench.workloads import WORKLOADS, Case, build_cases
from specrpc.config import Config, EngineConfig, Limits, ServerConfig
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.sampling import SamplingParams
from specrpc.serving.runtime import Runtime
from specrpc.training.corpus import SourceFile

GREEDY = SamplingParams(temperature=0.0)
MODES = ("default", "deterministic")
TARGET_ONLY = "target-only"
ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Divergence:
    """Where a stream first left its mode's target-only tokens, and the target's logits there."""

    case: str
    contender: str
    position: int  # index of the first differing generated token
    reference: int  # target-only's token there
    token: int  # the contender's
    gap: float | None  # the target's top-1 minus top-2 logit at that position (None: the streams differ in length)
    top_two: bool  # whether the two tokens are the target's two most likely there


def load(args: argparse.Namespace, deterministic: bool) -> Runtime:
    """One mode's runtime on the pair, its one-stream and batched step costs measured (the policy starts there)."""
    config = Config(engine=EngineConfig(target=args.target, draft=args.draft, max_sessions=max(1, args.streams),
                                        max_context=1024, threads=args.threads, deterministic=deterministic,
                                        remember_execution=False),
                    server=ServerConfig(port=0, log_format="console", log_level="warning"), limits=Limits())
    runtime = Runtime(config)
    runtime.engine.calibrate(budget_s=args.calibration_s)
    if args.streams > 1:
        runtime.engine.calibrate_batches(list(range(args.streams)))
    return runtime


def request(runtime: Runtime, ids: list[int], n: int, k: int | None) -> GenerationRequest:
    """A greedy request with k draft tokens a step (None: the adaptive policy's), stopping where the server would."""
    return GenerationRequest(ids, n, GREEDY, k, runtime.engine.default_proposer, runtime.stop_token_ids)


def solo_contenders(ks: list[int]) -> list[tuple[str, int | None]]:
    """One-stream contenders: target-only, adaptive, each fixed k."""
    return [(TARGET_ONLY, 0), (ADAPTIVE, None), *((f"k={k}", k) for k in ks)]


def run_together(runtime: Runtime, requests: list[GenerationRequest]) -> list[list[int]]:
    """Every request on its own slot (fresh state), advanced together by the engine's batched step."""
    engine = runtime.engine
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    out: list[list[int]] = [[] for _ in requests]
    while not all(g.finished for g in gens):
        live = [i for i, g in enumerate(gens) if not g.finished]
        for i, result in zip(live, engine.step([gens[i] for i in live]), strict=True):
            if isinstance(result, Exception):
                raise result
            out[i] += result.token_ids
    return out


def divergence(runtime: Runtime, case: str, contender: str, prompt: list[int], reference: list[int],
               tokens: list[int]) -> Divergence | None:
    """None where `tokens` equal `reference`; else the first differing position and the target's logit gap there,
    from one forward of this mode's target over the prompt and the agreed tokens (on slot 0, emptied after)."""
    if tokens == reference:
        return None
    j = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b),
             min(len(reference), len(tokens)))
    if j >= min(len(reference), len(tokens)):  # one stopped where the other went on: no token to compare
        return Divergence(case, contender, j, reference[j] if j < len(reference) else -1,
                          tokens[j] if j < len(tokens) else -1, None, False)
    target = runtime.target
    target.truncate(0, 0)
    with torch.inference_mode():
        logits = target.forward(torch.tensor(prompt + reference[:j], dtype=torch.long, device=target.device),
                                0, 0)[0]  # [V]
    runtime.engine.new_slot(0)  # the slot's cache and state emptied together
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    return Divergence(case, contender, j, reference[j], tokens[j], gap,
                      {reference[j], tokens[j]} == set(top.indices.tolist()))


def mode_results(runs: dict[str, list[list[int]]], divergences: list[Divergence]) -> dict[str, Any]:
    """Per contender: streams, identical and diverged counts, how many divergences took the target's two most likely
    tokens, and the largest top-2 gap at a divergence."""
    out: dict[str, Any] = {}
    for name, streams in runs.items():
        mine = [d for d in divergences if d.contender == name]
        gaps = [d.gap for d in mine if d.gap is not None]
        out[name] = {"streams": len(streams), "identical": len(streams) - len(mine), "diverged": len(mine),
                     "between_top_two": sum(d.top_two for d in mine), "max_gap": max(gaps) if gaps else None}
    return out


def speed(solo: dict[str, dict[str, list[Run]]]) -> dict[str, Any]:
    """Adaptive on one stream: tokens/s of each mode, their ratio and the median of per-case ratios."""
    default, deterministic = solo["default"][ADAPTIVE], solo["deterministic"][ADAPTIVE]
    rates = {m: summarize(solo[m][ADAPTIVE])["tokens_per_s"] for m in MODES}
    paired = [decode_rate(b) / decode_rate(a) for a, b in zip(default, deterministic, strict=True)
              if decode_rate(a) and decode_rate(b)]
    return {"default_tokens_per_s": rates["default"], "deterministic_tokens_per_s": rates["deterministic"],
            "ratio": rates["deterministic"] / rates["default"] if rates["default"] else 0.0,
            "paired_median": statistics.median(paired) if paired else 0.0}


def measure_modes(runtimes: dict[str, Runtime], cases: list[Case], ks: list[int], streams: int,
                  max_new_tokens: int) -> dict[str, Any]:
    """Every case through every mode and contender, interleaved; then the batched groups."""
    solo: dict[str, dict[str, list[Run]]] = {m: {name: [] for name, _ in solo_contenders(ks)} for m in runtimes}
    tokens: dict[str, dict[str, list[list[int]]]] = {m: {} for m in runtimes}
    divergences: dict[str, list[Divergence]] = {m: [] for m in runtimes}
    policies = {m: {name: rt.engine.new_policy(shared=False) for name, _ in solo_contenders(ks)}
                for m, rt in runtimes.items()}
    prompts = {m: [prompt_ids(rt, c) for c in cases] for m, rt in runtimes.items()}
    contenders = solo_contenders(ks)
    for i, case in enumerate(cases):
        n = max_new_tokens or case.max_new_tokens
        modes = list(runtimes) if i % 2 == 0 else list(reversed(runtimes))
        for mode in modes:
            rt = runtimes[mode]
            turn = i % len(contenders)
            for name, k in contenders[turn:] + contenders[:turn]:
                solo[mode][name].append(measure(rt.engine, 0, policies[mode][name],
                                                request(rt, prompts[mode][i], n, k)))
        print(f"case {i + 1}/{len(cases)}", file=sys.stderr, flush=True)
    for mode, rt in runtimes.items():
        for name, _ in contenders:
            tokens[mode][name] = [r.tokens for r in solo[mode][name]]
        if streams > 1:
            groups = [range(g, min(g + streams, len(cases))) for g in range(0, len(cases), streams)]
            for label, k in ((f"{streams} streams, {TARGET_ONLY}", 0), (f"{streams} streams, {ADAPTIVE}", None)):
                tokens[mode][label] = [t for group in groups for t in run_together(
                    rt, [request(rt, prompts[mode][i], max_new_tokens or cases[i].max_new_tokens, k)
                         for i in group])]
        reference = tokens[mode][TARGET_ONLY]
        for name, streams_tokens in tokens[mode].items():
            if name == TARGET_ONLY:
                continue
            for i, got in enumerate(streams_tokens):
                d = divergence(rt, cases[i].name, name, prompts[mode][i], reference[i], got)
                if d is not None:
                    divergences[mode].append(d)
    return {"modes": {m: mode_results({k: v for k, v in tokens[m].items() if k != TARGET_ONLY}, divergences[m])
                      for m in runtimes},
            "divergences": {m: [asdict(d) for d in divergences[m]] for m in runtimes},
            "speed": speed(solo) if len(runtimes) == 2 else None}


def markdown(results: dict[str, Any]) -> str:
    """The per-mode table, each divergence, and what --deterministic costs."""
    lines = [f"Machine: {results['machine']}  ", f"{results['pair']}  ", f"Command: `{results['command']}`", "",
             f"{results['cases']} prompts from {results['prompts']}, greedy; each stream against its mode's "
             "target-only tokens.", "",
             "| mode | contender | streams | identical | diverged | of them between the top two | max top-2 gap at a "
             "divergence |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, rows in results["modes"].items():
        for name, r in rows.items():
            gap = "-" if r["max_gap"] is None else f"{r['max_gap']:.2e}"
            lines.append(f"| {mode} | {name} | {r['streams']} | {r['identical']} | {r['diverged']} | "
                         f"{r['between_top_two']} | {gap} |")
    for mode, found in results["divergences"].items():
        if found:
            lines += ["", f"Divergences ({mode}):", "", "| contender | case | position | target-only / it | top-2 gap "
                      "| the two most likely |", "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {d['contender']} | {d['case']} | {d['position']} | {d['reference']} / {d['token']} | "
                      f"{'-' if d['gap'] is None else format(d['gap'], '.2e')} | {'yes' if d['top_two'] else 'no'} |"
                      for d in found]
    if results.get("skipped"):
        lines += ["", f"deterministic: skipped ({results['skipped']})"]
    s = results.get("speed")
    if s:
        lines += ["", f"--deterministic, adaptive on one stream: {s['deterministic_tokens_per_s']:.1f} tokens/s "
                      f"against the default's {s['default_tokens_per_s']:.1f} ({s['ratio']:.2f}×; paired median "
                      f"{s['paired_median']:.2f}×)"]
    if results["streams_note"]:
        lines += ["", results["streams_note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench ties`; 1 when the deterministic mode diverged."""
    parser = argparse.ArgumentParser(prog="specrpc bench ties", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=EngineConfig().target)
    parser.add_argument("--draft", default=EngineConfig().draft)
    parser.add_argument("--cases", type=int, default=8, help="prompts per workload")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of "
                        + ",".join(WORKLOADS))
    parser.add_argument("--ks", default="2,5,8", help="fixed draft lengths (each within --max-draft-tokens 8)")
    parser.add_argument("--streams", type=int, default=4, help="streams at once in the batched rows (1: none)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="override every case's length (0: keep)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--calibration-s", type=float, default=3.0, help="time budget of each mode's calibration")
    parser.add_argument("--files", type=Path, nargs="+", help="Python files to cut the prompts from instead of the "
                        "held-out split (your own code; unseen in training only if it is)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    ks = [int(k) for k in args.ks.split(",") if k]
    if any(not 1 <= k <= EngineConfig().max_draft_tokens for k in ks):
        parser.error(f"--ks: each k in 1..{EngineConfig().max_draft_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from specrpc.logs import configure

    configure("console", "warning")
    runtimes = {"default": load(args, deterministic=False)}
    skipped = ""
    try:
        runtimes["deterministic"] = load(args, deterministic=True)
    except ValueError as exc:  # no native step here (no C++ compiler), or a model it cannot run
        skipped = str(exc)
    files = [SourceFile(str(f), f.read_text(), "given") for f in args.files] if args.files else None
    cases = build_cases(args.cases, args.seed, workloads, files)
    results: dict[str, Any] = {
        "machine": machine_line(runtimes["default"].device, runtimes["default"].dtype),
        "pair": pair_line(args.target, args.draft),
        "command": "specrpc bench ties " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cases": len(cases), "prompts": "the files given" if files else "held-out files", "skipped": skipped,
        "streams_note": "" if args.streams > 1 else "batched rows: none (--streams 1)",
    }
    results |= measure_modes(runtimes, cases, ks, args.streams, args.max_new_tokens)
    write_results(args.out, "ties", results, markdown(results))
    for rt in runtimes.values():
        rt.stop()
    deterministic = results["modes"].get("deterministic", {})
    return 1 if any(r["diverged"] for r in deterministic.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
