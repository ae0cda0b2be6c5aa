"""`specrpc bench controls`: what a request's controls cost speculation, in process on the shipped pair, greedy, the
contenders of each row interleaved case by case (machine drift hits them alike), each with its own policy carried
from request to request as a server slot's is. Rows:

- json (issue 32): a module's components' settings as JSON strings, two given, the next one opened; target-only
  and the default, each without and with a JSON schema (an object of typed fields, an enum and an array). Goal:
  the default's speed-up over target-only with the schema ≥ 0.9× its speed-up without.
- penalty (issue 36): the usual code-completion prompts (`workloads.build_cases`); the same four contenders without
  and with a repetition penalty over the context's last 64 tokens. Goal: ratio of speed-ups ≥ 0.9.
- costs: along drafted paths of k = 8 tokens (the target's own greedy outputs under the controls, one position
  further each time), the grammar matcher's work as the engine does it (greedy, as the rows run: forced runs, the
  argmax checked per drafted token and per verify row, a mask only where the grammar forbids it; sampled: a mask
  filled and applied per drafted token, the verify's k+1 applied; advances and rollback) and the logits transform
  on the verify's [k+1, V] logits (penalties and logit_bias, plus what min_p adds to the sampling distribution),
  each against a k = 8 verify forward of the target measured at the same positions. Goals: mask work ≤ 10 %,
  transform ≤ 5 % of the step. The rows also report the shares measured inside their runs (`Constraint.work_s`,
  `LogitsTransform.work_s`).

Every contender's tokens are compared with target-only's under the same controls (greedy: identical, fp32 on CPU).
Prints Markdown; writes controls.json and controls.md."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specrpc.bench.common import machine_line, one_slot_runtime, pair_line, write_results
from specrpc.bench.contenders import Run, measure
from specrpc.bench.run import summarize
from specrpc.bench.workloads import build_cases
from specrpc.config import EngineConfig
from specrpc.engine.constraint import Constraint, ConstraintSpec, Grammar
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.logits_transform import LogitsTransform
from specrpc.engine.proposers import feed
from specrpc.engine.sampling import SamplingParams, logits_to_probs
from specrpc.models import BatchRow
from specrpc.serving.runtime import Runtime

GREEDY = SamplingParams(temperature=0.0)
PENALTY = SamplingParams(temperature=0.0, repetition_penalty=1.1, penalty_last_n=64)
"""The penalty row's control: a repetition penalty over the context's last 64 tokens (llama.cpp's defaults' window)."""

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "version": {"type": "integer", "minimum": 0},
        "mode": {"enum": ["debug", "release", "test"]},
        "enabled": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "version", "mode", "enabled", "tags"],
    "additionalProperties": False,
}
"""The json row's schema: a few typed fields, an enum and an array, every field required."""

JSON_TASKS = ["SCHEDULER", "GATEWAY", "INDEXER", "MAILER", "BILLING", "UPLOADER", "SEARCH", "REPORTS"]
"""The components whose settings the json row's prompts ask for."""
JSON_EXAMPLES = ('''API = '{"name": "api", "version": 3, "mode": "release", "enabled": true, "tags": ["web"]}'\n'''
                 '''WORKER = '{"name": "worker", "version": 1, "mode": "debug", "enabled": false, "tags": []}'\n''')
"""Two components' settings before the one a json prompt opens."""

COST_K = 8
COST_PARAMS = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
                             presence_penalty=0.2, penalty_last_n=64,
                             logit_bias=((13, 2.0), (29, -1.5), (101, 1.0), (257, -3.0)))
"""The transform's cost is measured with every logits control on: penalties, logit_bias and min_p."""


@dataclass(frozen=True)
class ControlCase:
    """One prompt of a row and how many tokens it may generate."""

    name: str
    prompt: str
    max_new_tokens: int


@dataclass(frozen=True)
class Contender:
    """A row's contender: k (0: target-only, None: the default's adaptive policy) and whether the row's control
    applies."""

    name: str
    k: int | None
    controlled: bool


def contenders(control: str) -> tuple[Contender, ...]:
    """Target-only and the default, each without and with `control`."""
    return (Contender("target-only", 0, False), Contender("default", None, False),
            Contender(f"target-only + {control}", 0, True), Contender(f"default + {control}", None, True))


def json_cases(n: int, max_new_tokens: int) -> list[ControlCase]:
    """`n` prompts (at most len(JSON_TASKS)): a module's components' settings as JSON strings, two examples, then
    another component's string opened: a JSON object comes next, with or without the schema."""
    return [ControlCase(f"json:{name}", f"# Settings of each component as JSON: name, version, mode (debug, release or "
                        f"test), enabled and tags.\n{JSON_EXAMPLES}{name} = '", max_new_tokens)
            for name in JSON_TASKS[:n]]


def code_cases(n: int, seed: int) -> list[ControlCase]:
    """The usual code-completion prompts (`workloads.build_cases`)."""
    return [ControlCase(c.name, c.prompt, c.max_new_tokens) for c in build_cases(n, seed, ("code",))]


MakeRequest = Callable[[list[int], int, Contender], GenerationRequest]
"""(prompt ids, max new tokens, contender) → the contender's request under the row's controls or without them."""


def request_maker(runtime: Runtime, row: str) -> MakeRequest:
    """How the row's contenders ask: greedy, the server's default proposer, its stop tokens; the control is the
    json row's compiled schema or the penalty row's sampling parameters."""
    engine = runtime.engine
    grammar = runtime.grammars.compile(ConstraintSpec("json_schema", json.dumps(SCHEMA))) if row == "json" else None

    def make(ids: list[int], n: int, c: Contender) -> GenerationRequest:
        sampling = PENALTY if row == "penalty" and c.controlled else GREEDY
        return GenerationRequest(ids, n, sampling, c.k, engine.default_proposer, runtime.stop_token_ids,
                                 grammar=grammar if c.controlled else None)

    return make


def run_row(runtime: Runtime, row: str, cases: list[ControlCase], rounds: int) -> dict[str, list[Run]]:
    """Every case through every contender of the row (their order rotating case by case), `rounds` times."""
    engine = runtime.engine
    row_contenders = contenders(row)
    make = request_maker(runtime, row)
    policies = {c.name: engine.new_policy(shared=False) for c in row_contenders}
    runs: dict[str, list[Run]] = {c.name: [] for c in row_contenders}
    for r in range(rounds):
        for i, case in enumerate(cases):
            ids = runtime.encode(case.prompt)
            turn = (r * len(cases) + i) % len(row_contenders)
            for c in row_contenders[turn:] + row_contenders[:turn]:
                runs[c.name].append(measure(engine, 0, policies[c.name], make(ids, case.max_new_tokens, c)))
            print(f"round {r + 1}/{rounds}, {row} case {i + 1}/{len(cases)}", file=sys.stderr, flush=True)
    return runs


def row_results(runs: dict[str, list[Run]], row: str) -> dict[str, Any]:
    """Per contender: figures, speed-up over target-only under the same controls, the share of requests with its
    tokens, and the share of decode time the control's own work took in the runs (matcher or transform); the goal:
    the default's speed-up with the control ÷ without it."""
    out: dict[str, Any] = {}
    for c in contenders(row):
        rs, base = runs[c.name], runs[contenders(row)[2 if c.controlled else 0].name]
        s, rate = summarize(rs), summarize(base)["tokens_per_s"]
        decode_s = sum(r.total_s - r.ttft_s for r in rs)
        work_s = sum(r.mask_s if row == "json" else r.transform_s for r in rs)
        out[c.name] = {"summary": s, "speedup": s["tokens_per_s"] / rate if rate else 0.0,
                       "identical": sum(a.tokens == b.tokens for a, b in zip(rs, base, strict=True)) / len(rs),
                       "tokens": sum(len(r.tokens) for r in rs),
                       "control_ms_per_step": work_s / max(1, sum(r.steps for r in rs)) * 1e3,
                       "control_share": work_s / decode_s if decode_s else 0.0}
    without, with_ = out["default"]["speedup"], out[f"default + {row}"]["speedup"]
    ratio = with_ / without if without else 0.0
    out["goal"] = {"speedup_without": without, "speedup_with": with_, "at_least": 0.9, "ratio": ratio,
                   "met": ratio >= 0.9}
    return out


def greedy_path(runtime: Runtime, ids: list[int], n: int, params: SamplingParams, grammar: Grammar | None
                ) -> list[int]:
    """The target's own greedy output after `ids` under the controls (k = 0): a path the drafts would follow."""
    engine = runtime.engine
    request = GenerationRequest(ids, n, params, 0, engine.default_proposer, runtime.stop_token_ids, grammar=grammar)
    return measure(engine, 0, engine.new_policy(shared=False), request).tokens


def verify_step(runtime: Runtime, path: list[int], cut: int, k: int) -> tuple[torch.Tensor, float]:
    """The target's verify forward at `cut` (its cache holding path[:cut-1]): the last committed token and the next
    k of `path`, one row of the engine's batched forward. Returns logits [k+1, V] and its seconds; the cache is cut
    back to path[:cut]."""
    target = runtime.engine.target
    target.truncate(0, cut - 1)
    row = BatchRow(torch.tensor(path[cut - 1 : cut + k], dtype=torch.long, device=target.device), cut - 1, 0, k + 1)
    t0 = time.perf_counter()
    logits = target.forward_batch([row])[0]  # [k+1, V]
    logits.sum().item()
    seconds = time.perf_counter() - t0
    target.truncate(0, cut)
    return logits, seconds


def mask_work(constraint: Constraint, logits: torch.Tensor, drafted: list[int], greedy: bool) -> float:
    """Seconds of the matcher's work along `drafted` as the engine does it: drafting (the grammar's forced run
    taken where it is the path's next tokens, `proposers._Stream`; else a drawn token: greedy, the draft's argmax
    checked and a mask filled only where the grammar forbids it, sampled, the position's mask filled and applied to
    its logits: `Constraint.mask_next`), the rollback, and the verify's rows on its logits [k+1, V] (greedy:
    checked, `Constraint.greedy_ids`; sampled: the k+1 masks, reused, applied: `Constraint.mask_rows`)."""
    t0 = time.perf_counter()
    i = 0
    while True:
        forced = constraint.forced()[: len(drafted) - i]
        if forced and forced == drafted[i : i + len(forced)]:
            constraint.advance_all(forced)
            i += len(forced)
        if i >= len(drafted):
            break
        if not greedy or not constraint.take(drafted[i]):
            constraint.mask_next(logits[i : i + 1])  # [1, V]
            constraint.advance(drafted[i])
        i += 1
    constraint.rewind(len(drafted))
    if greedy:
        constraint.greedy_ids(logits, drafted)  # [k+1]
    else:
        constraint.mask_rows(logits, drafted)  # [k+1, V]
    return time.perf_counter() - t0


def cost_walk(runtime: Runtime, prompt: list[int], path: list[int], cuts: int, k: int,
              work: Callable[[int, torch.Tensor, list[int]], float]) -> tuple[list[float], list[float]]:
    """At up to `cuts` successive positions of prompt + path (one token further each time, k drafted tokens after
    each): the verify forward's seconds and `work`'s (given the cut, the verify's logits and the drafted tokens),
    interleaved."""
    full = prompt + path
    runtime.engine.new_slot(0)  # both caches emptied
    start = len(prompt)
    feed(runtime.engine.target, 0, full[: start - 1], 0, runtime.config.engine.prefill_chunk)
    steps: list[float] = []
    works: list[float] = []
    for cut in range(start, min(start + cuts, len(full) - k)):
        logits, step_s = verify_step(runtime, full, cut, k)
        steps.append(step_s)
        works.append(work(cut, logits, full[cut : cut + k]))
    runtime.engine.target.truncate(0, 0)
    return steps, works


def median(values: list[float]) -> float:
    """The median (0 for none)."""
    return statistics.median(values) if values else 0.0


def mask_costs(runtime: Runtime, prompts: list[list[int]], cuts: int, path_tokens: int
               ) -> tuple[list[float], list[float], list[float]]:
    """Verify forwards' seconds and the matcher's (`mask_work`, greedy as the rows run, and sampled) at up to `cuts`
    positions along the target's schema replies to `prompts` (JSON replies end early: as many prompts as it
    takes)."""
    grammar = runtime.grammars.compile(ConstraintSpec("json_schema", json.dumps(SCHEMA)))
    steps: list[float] = []
    works: list[float] = []
    sampled: list[float] = []
    for ids in prompts:
        if len(works) >= cuts:
            break
        path = greedy_path(runtime, ids, path_tokens, GREEDY, grammar)
        greedy_c, sampled_c, committed = grammar.start(), grammar.start(), len(ids)  # each fills its own masks

        def matcher(cut: int, logits: torch.Tensor, drafted: list[int], g: Constraint = greedy_c,
                    s: Constraint = sampled_c, full: list[int] = ids + path) -> float:
            nonlocal committed
            for token in full[committed:cut]:  # the tokens committed since the last position
                g.commit(token)
                s.commit(token)
            committed = cut
            sampled.append(mask_work(s, logits, drafted, greedy=False))
            return mask_work(g, logits, drafted, greedy=True)

        more_steps, more_works = cost_walk(runtime, ids, path, cuts - len(works), COST_K, matcher)
        steps += more_steps
        works += more_works
    return steps, works, sampled


def transform_costs(runtime: Runtime, prompts: list[list[int]], cuts: int, path_tokens: int
                    ) -> tuple[list[float], list[float], list[float]]:
    """Verify forwards' seconds, the transform's along them (`LogitsTransform.along` under COST_PARAMS, as
    `Generation.shaped` calls it) and what min_p adds to `logits_to_probs` (with it less without it, the
    difference of two timings at each position), at up to `cuts` positions along the target's greedy replies."""
    plain = replace(COST_PARAMS, min_p=0.0)
    steps: list[float] = []
    along: list[float] = []
    min_p: list[float] = []
    for ids in prompts:
        if len(along) >= cuts:
            break
        path = greedy_path(runtime, ids, path_tokens, replace(COST_PARAMS, temperature=0.0), None)
        transform = LogitsTransform(COST_PARAMS, runtime.stop_token_ids, len(ids))

        def transformed(cut: int, logits: torch.Tensor, drafted: list[int], t: LogitsTransform = transform,
                        full: list[int] = ids + path) -> float:
            t0 = time.perf_counter()
            shaped = t.along(logits, full[:cut], drafted)  # [k+1, V]
            t1 = time.perf_counter()
            logits_to_probs(shaped, COST_PARAMS)  # [k+1, V] with min_p
            t2 = time.perf_counter()
            logits_to_probs(shaped, plain)  # [k+1, V] without: what sampling costs anyway
            min_p.append((t2 - t1) - (time.perf_counter() - t2))
            return t1 - t0

        more_steps, more_along = cost_walk(runtime, ids, path, cuts - len(along), COST_K, transformed)
        steps += more_steps
        along += more_along
    return steps, along, min_p


def costs(runtime: Runtime, json_prompts: list[list[int]], code_prompts: list[list[int]], cuts: int,
          path_tokens: int) -> dict[str, Any]:
    """The k = 8 costs of the matcher and of the transform against the verify forward (medians over positions)."""
    mask_steps, mask_s, sampled_s = mask_costs(runtime, json_prompts, cuts, path_tokens)
    transform_steps, along_s, min_p_s = transform_costs(runtime, code_prompts, cuts, path_tokens)
    step = median(mask_steps + transform_steps)
    mask, sampled = median(mask_s), median(sampled_s)
    transform = median(along_s) + max(0.0, median(min_p_s))
    return {"k": COST_K, "step_ms": step * 1e3, "positions": {"mask": len(mask_s), "transform": len(along_s)},
            "mask": {"ms": mask * 1e3, "share": mask / step if step else 0.0, "at_most": 0.10},
            "mask_sampled": {"ms": sampled * 1e3, "share": sampled / step if step else 0.0, "at_most": 0.10},
            "transform": {"ms": transform * 1e3, "share": transform / step if step else 0.0, "at_most": 0.05,
                          "along_ms": median(along_s) * 1e3, "min_p_ms": median(min_p_s) * 1e3}}


def markdown(results: dict[str, Any]) -> str:
    """A table per row with its goal, and the cost table."""
    lines = [f"Machine: {results['machine']}  ", f"{results['pair']}  ", f"Command: `{results['command']}`", ""]
    work = {"json": "mask work", "penalty": "transform"}
    for row, figures in results["rows"].items():
        goal = figures["goal"]
        lines += [f"**{row}** ({results['cases'][row]} requests per contender)", "",
                  f"| contender | tokens/s | × target-only (same controls) | mean accepted len | acceptance | "
                  f"{work[row]} ms/step (share) | identical |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in figures.items():
            if name == "goal":
                continue
            s = r["summary"]
            lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {s['mean_accepted_length']:.2f}"
                         f" | {s['acceptance']:.2f} | {r['control_ms_per_step']:.3f} ({r['control_share']:.1%}) | "
                         f"{r['identical']:.2f} |")
        lines += ["", f"Goal: speed-up with {row} ≥ {goal['at_least']}× without: {goal['speedup_with']:.2f}× ÷ "
                  f"{goal['speedup_without']:.2f}× = {goal['ratio']:.2f} ({'met' if goal['met'] else 'not met'})", ""]
    c = results.get("costs")
    if c:
        lines += [f"**costs at k = {c['k']}** (medians over {c['positions']['mask']} and "
                  f"{c['positions']['transform']} positions; verify forward {c['step_ms']:.2f} ms)", "",
                  "| work | ms | share of the verify step | goal |", "| --- | --- | --- | --- |"]
        for name, label in (("mask", "grammar matcher, greedy (forced runs, argmax checks, masks where they bite)"),
                            ("mask_sampled", "grammar matcher, sampled (every draft and verify mask applied)"),
                            ("transform", "logits transform on [k+1, V] (penalties, logit_bias, min_p)")):
            f = c[name]
            lines.append(f"| {label} | {f['ms']:.3f} | {f['share']:.1%} | ≤ {f['at_most']:.0%}: "
                         f"{'met' if f['share'] <= f['at_most'] else 'not met'} |")
        lines.append("")
    return "\n".join(lines)


ROWS = ("json", "penalty", "costs")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench controls`."""
    parser = argparse.ArgumentParser(prog="specrpc bench controls", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=EngineConfig().target)
    parser.add_argument("--draft", default=EngineConfig().draft)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    parser.add_argument("--cases", type=int, default=8, help=f"prompts per row (json: at most {len(JSON_TASKS)})")
    parser.add_argument("--rounds", type=int, default=2, help="passes over each row's prompts")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="override every prompt's length (0: json 96, code prompts their own 64-128)")
    parser.add_argument("--cost-positions", type=int, default=40, help="positions the k = 8 costs are measured at")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    parser.add_argument("--weights", default="dtype", choices=["dtype", "int8", "bf16"])
    parser.add_argument("--native-decode", default=True, action=argparse.BooleanOptionalAction,
                        help="the native step where it is faster, as `specrpc serve` (off: torch at every shape, "
                             "quicker to load)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    rows = [w for w in args.rows.split(",") if w]
    unknown = [w for w in rows if w not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    runtime = one_slot_runtime(args.target, args.draft, args.threads, args.dtype, args.weights, args.native_decode)
    cases = {"json": json_cases(args.cases, args.max_new_tokens or 96), "penalty": code_cases(args.cases, args.seed)}
    if args.max_new_tokens:
        cases["penalty"] = [replace(c, max_new_tokens=args.max_new_tokens) for c in cases["penalty"]]
    results: dict[str, Any] = {
        "machine": machine_line(runtime.device, runtime.dtype),
        "pair": pair_line(args.target, args.draft),
        "command": "specrpc bench controls " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cases": {}, "rows": {}, "samples": {},  # samples: each contender's first reply of a row
    }
    for row in (r for r in rows if r != "costs"):
        runs = run_row(runtime, row, cases[row], args.rounds)
        results["cases"][row] = len(cases[row]) * args.rounds
        results["rows"][row] = row_results(runs, row)
        results["samples"][row] = {name: runtime.decode_text(rs[0].tokens) for name, rs in runs.items()}
    if "costs" in rows:
        path_tokens = max(args.max_new_tokens or 96, COST_K + 1)
        results["costs"] = costs(runtime, [runtime.encode(c.prompt) for c in cases["json"]],
                                 [runtime.encode(c.prompt) for c in cases["penalty"]], args.cost_positions,
                                 path_tokens)
    write_results(args.out, "controls", results, markdown(results))
    runtime.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
