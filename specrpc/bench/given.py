"""`specrpc bench given`: drafts a request brings or earlier requests left, in process on the shipped pair, greedy,
the contenders of each row interleaved case by case (machine drift hits them alike), each with its own policy
carried from request to request as a server slot's is. Three rows:

- rewrite: functions or classes of 20-60 lines in held-out files (unseen in training), one identifier renamed on a line,
  then "# The same code again:" and the region's first line; the model copies the changed region, and the
  unchanged region is the prediction (what an editor holds: the copy departs from it at the changed line and
  re-aligns after). The default with the prediction against the default without it (goal ≥ 1.5×).
- repeated: independent requests for tool-call functions (five tools, new values each time) whose outputs repeat
  the same structure, measured after a warm-up that fills the suffix trie; prompt lookup with the suffix source
  against prompt lookup alone (goal ≥ 1.5×).
- code: the usual code-completion and infill prompts (`workloads.build_cases`), the suffix trie over all earlier
  outputs (as with --shared-suffix-drafts): the default with it against the default without (goal ≥ 0.97×).

Every contender's tokens are compared with target-only's (greedy: identical, fp32 on CPU). Prints Markdown; writes
given.json and given.md."""

from __future__ import annotations

import argparse
import ast
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrpc.bench.common import machine_line, one_slot_runtime, pair_line, write_results
from specrpc.bench.contenders import Run, decode_rate, measure
from specrpc.bench.run import summarize
from specrpc.bench.workloads import build_cases, heldout_files
from specrpc.config import EngineConfig
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.prediction import PredictionProposer
from specrpc.engine.sampling import SamplingParams
from specrpc.engine.suffix import SuffixProposer, SuffixTrie
from specrpc.serving.runtime import Runtime
from specrpc.training.corpus import SourceFile

GREEDY = SamplingParams(temperature=0.0)
AGAIN = "\n# The same code again:\n"

RENAMED = re.compile(r"\b(?!(?:def|class|return|if|elif|else|for|while|in|not|and|or|is|None|True|False|self|import|"
                     r"from|try|except|finally|with|as|pass|raise|lambda|yield|break|continue|del|global)\b)"
                     r"([A-Za-z_]\w{2,})\b")
"""An identifier (not a keyword, `self` or a short name) to rename: the rewrite's small change."""


@dataclass(frozen=True)
class GivenCase:
    """One prompt of a row, with the client's prediction ('' for none)."""

    workload: str
    name: str
    prompt: str
    prediction: str
    max_new_tokens: int


@dataclass(frozen=True)
class Contender:
    """How a row's request drafts: its proposer (None: the server's default) and k (None: the policy's), whether it
    brings the case's prediction, and whether it drafts from the suffix trie of the contender's earlier outputs."""

    name: str
    proposer: str | None
    k: int | None
    prediction: bool = False
    suffix: bool = False


TARGET_ONLY = Contender("target-only", None, 0)
DEFAULT = Contender("default", None, None)
LOOKUP = Contender("prompt lookup only", "lookup", None)
ROWS: dict[str, tuple[Contender, ...]] = {
    "rewrite": (TARGET_ONLY, LOOKUP, DEFAULT, Contender("default + prediction", None, None, prediction=True)),
    "repeated": (TARGET_ONLY, LOOKUP, Contender("prompt lookup + suffix", "lookup", None, suffix=True), DEFAULT,
                 Contender("default + suffix", None, None, suffix=True)),
    "code": (TARGET_ONLY, DEFAULT, Contender("default + suffix", None, None, suffix=True)),
}
GOALS: dict[str, tuple[str, str, float]] = {  # row: (contender, against, at least this ratio of tokens/s)
    "rewrite": ("default + prediction", "default", 1.5),
    "repeated": ("prompt lookup + suffix", "prompt lookup only", 1.5),
    "code": ("default + suffix", "default", 0.97),
}


def rewrite_cases(files: list[SourceFile], n: int, rng: random.Random, context_chars: int = 400) -> list[GivenCase]:
    """`n` regions, each a function or class of 20-60 lines in another file, one identifier renamed on one line after
    the first; the prompt is up to `context_chars` before the region, the changed region, AGAIN and its first line
    (without its line break); the prediction is the unchanged region after that."""
    cases: list[GivenCase] = []
    for f in rng.sample(files, len(files)):
        if len(cases) == n:
            break
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        spans = [(node.lineno - 1, node.end_lineno) for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.decorator_list
                 and node.end_lineno is not None and 20 <= node.end_lineno - node.lineno + 1 <= 60]
        if not spans:
            continue
        lines = f.text.splitlines(keepends=True)
        start, end = rng.choice(spans)
        region = lines[start:end]
        changeable = [j for j in range(1, len(region)) if RENAMED.search(region[j])]
        if not changeable:
            continue
        j = rng.choice(changeable)
        changed = [*region[:j], RENAMED.sub(lambda m: m.group(1) + "_new", region[j], count=1), *region[j + 1 :]]
        first = changed[0].rstrip("\n")  # the prompt ends inside the line: its line break and the next line's
        # indentation are one token, which a prompt cut after the line break would split
        before = "".join(lines[:start])
        prompt = before[max(0, len(before) - context_chars) :] + "".join(changed) + AGAIN + first
        cases.append(GivenCase("rewrite", f"{f.relpath}:{start + 1}+{len(region)}", prompt,
                               "".join(region)[len(first) :], 0))
    return cases


TOOLS = [("get_weather", "city", ["Paris", "Oslo", "Lima", "Kyoto", "Cairo"]),
         ("search_flights", "destination", ["Rome", "Quito", "Perth", "Dakar", "Hanoi"]),
         ("book_hotel", "town", ["Bergen", "Porto", "Cusco", "Nara", "Luxor"]),
         ("send_email", "recipient", ["ana", "bo", "chen", "dara", "eli"]),
         ("get_stock_price", "symbol", ["ACME", "INIT", "ZETA", "OMNI", "KILO"])]


def repeated_cases(n: int, rng: random.Random, max_new_tokens: int = 96) -> list[GivenCase]:
    """`n` independent requests, each for a tool-call function of one of five tools with new values (a number, a
    value, a count): an agent's requests, alike in structure, different in content."""
    cases = []
    for i in range(n):
        tool, field, values = TOOLS[i % len(TOOLS)]
        value, count = rng.choice(values), rng.randint(1, 9)
        prompt = (f'import json\n\n\ndef tool_call_{i}({field}, count):\n    """Call {tool} for {value} ({count}): '
                  f'the request as JSON."""\n    request = {{\n        "name": "{tool}",\n        "arguments": {{\n')
        cases.append(GivenCase("repeated", f"{tool}:{i}", prompt, "", max_new_tokens))
    return cases


def code_cases(n: int, seed: int) -> list[GivenCase]:
    """The usual code-completion and infill prompts (`workloads.build_cases`), as completions of their prefix."""
    return [GivenCase("code", c.name, c.prompt, "", c.max_new_tokens) for c in build_cases(n, seed, ("code",))]


def run_row(runtime: Runtime, contenders: tuple[Contender, ...], cases: list[GivenCase], warmup: int,
            rounds: int) -> dict[str, list[Run]]:
    """Every case through every contender (their order rotating case by case), `rounds` times; the first `warmup`
    cases of each round run (filling tries and policies) but are not kept. Each round starts with empty tries, so
    that no case drafts from its own output of an earlier round."""
    engine = runtime.engine
    policies = {c.name: engine.new_policy(shared=False) for c in contenders}
    runs: dict[str, list[Run]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        tries = {c.name: SuffixTrie() for c in contenders if c.suffix}
        for i, case in enumerate(cases):
            ids = runtime.encode(case.prompt)
            predicted = runtime.encode_plain(case.prediction) if case.prediction else []
            n = case.max_new_tokens or len(predicted) + 16
            turn = (r * len(cases) + i) % len(contenders)
            for c in contenders[turn:] + contenders[:turn]:
                request = GenerationRequest(
                    ids, n, GREEDY, c.k, c.proposer or engine.default_proposer, runtime.stop_token_ids,
                    prediction=PredictionProposer(predicted, len(ids), runtime.decode_text)
                    if c.prediction and predicted else None,
                    suffix=SuffixProposer(tries[c.name]) if c.suffix else None)
                run = measure(engine, 0, policies[c.name], request)
                if c.suffix:
                    tries[c.name].add(run.tokens)  # as the server indexes a finished request's output
                if i >= warmup:
                    runs[c.name].append(run)
            print(f"round {r + 1}/{rounds}, {case.workload} case {i + 1}/{len(cases)}", file=sys.stderr, flush=True)
    return runs


def row_results(runs: dict[str, list[Run]], workload: str) -> dict[str, Any]:
    """Per contender: figures, speed-up over target-only, tokens/s over the row's baseline (aggregate and the
    median of per-request ratios) and the share of requests with target-only's tokens."""
    base = summarize(runs[TARGET_ONLY.name])["tokens_per_s"]
    goal, against, at_least = GOALS[workload]
    against_rate = summarize(runs[against])["tokens_per_s"]
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        s = summarize(rs)
        paired = [decode_rate(a) / decode_rate(b) for a, b in zip(rs, runs[against], strict=True) if decode_rate(b)]
        out[name] = {"summary": s, "speedup": s["tokens_per_s"] / base if base else 0.0,
                     "over_baseline": s["tokens_per_s"] / against_rate if against_rate else 0.0,
                     "paired_over_baseline": statistics.median(paired) if paired else 0.0,
                     "identical": sum(a.tokens == b.tokens for a, b in zip(rs, runs[TARGET_ONLY.name], strict=True))
                     / len(rs)}
    out["goal"] = {"contender": goal, "against": against, "at_least": at_least,
                   "ratio": out[goal]["over_baseline"], "met": out[goal]["over_baseline"] >= at_least}
    return out


def markdown(results: dict[str, Any]) -> str:
    """A table per row and its goal."""
    lines = [f"Machine: {results['machine']}  ", f"{results['pair']}  ", f"Command: `{results['command']}`", ""]
    for workload, row in results["rows"].items():
        goal = row["goal"]
        lines += [f"**{workload}** ({results['cases'][workload]} requests measured)", "",
                  f"| contender | tokens/s | × target-only | × {goal['against']} (paired median) | mean accepted "
                  "len | acceptance | identical |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in row.items():
            if name == "goal":
                continue
            s = r["summary"]
            lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['over_baseline']:.2f}× "
                         f"({r['paired_over_baseline']:.2f}×) | {s['mean_accepted_length']:.2f} | "
                         f"{s['acceptance']:.2f} | {r['identical']:.2f} |")
        lines += ["", f"Goal: {goal['contender']} ≥ {goal['at_least']}× {goal['against']}: {goal['ratio']:.2f}× "
                  f"({'met' if goal['met'] else 'not met'})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench given`."""
    parser = argparse.ArgumentParser(prog="specrpc bench given", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=EngineConfig().target)
    parser.add_argument("--draft", default=EngineConfig().draft)
    parser.add_argument("--rows", default="rewrite,repeated,code", help="comma-separated subset of "
                        + ",".join(ROWS))
    parser.add_argument("--cases", type=int, default=8, help="rewrite regions; code prompts")
    parser.add_argument("--repeated", type=int, default=50, help="repeated-structure requests measured")
    parser.add_argument("--warmup", type=int, default=10, help="repeated-structure requests before measuring")
    parser.add_argument("--rounds", type=int, default=1, help="passes over each row's cases")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="override every case's length (0: keep)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    parser.add_argument("--weights", default="dtype", choices=["dtype", "int8", "bf16"])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    rows = [w for w in args.rows.split(",") if w]
    unknown = [w for w in rows if w not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    runtime = one_slot_runtime(args.target, args.draft, args.threads, args.dtype, args.weights)
    rng = random.Random(args.seed)
    makers = {"rewrite": lambda: rewrite_cases(heldout_files(), args.cases, rng),
              "repeated": lambda: repeated_cases(args.warmup + args.repeated, rng),
              "code": lambda: code_cases(args.cases, args.seed)}
    results: dict[str, Any] = {
        "machine": machine_line(runtime.device, runtime.dtype),
        "pair": pair_line(args.target, args.draft),
        "command": "specrpc bench given " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cases": {}, "rows": {},
    }
    for workload in rows:
        cases = makers[workload]()
        if args.max_new_tokens:
            cases = [GivenCase(c.workload, c.name, c.prompt, c.prediction, args.max_new_tokens) for c in cases]
        warmup = args.warmup if workload == "repeated" else 0
        runs = run_row(runtime, ROWS[workload], cases, warmup, args.rounds)
        results["cases"][workload] = (len(cases) - warmup) * args.rounds
        results["rows"][workload] = row_results(runs, workload)
    write_results(args.out, "given", results, markdown(results))
    runtime.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
