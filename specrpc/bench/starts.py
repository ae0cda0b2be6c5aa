"""`specrpc bench --starts N`: how much a server's speed depends on its start. `specrpc serve` is started N times in
another process, each time warm-up and calibration included; every start gets the same prompts, greedy, adaptive
and k = 0 alternating prompt by prompt, through gRPC. Reported per start: the median per-request decode tokens/s of
each (tokens after the first ÷ the time after the first), their ratio, and the spread over the starts.

With `--llama-server` (one `--gguf-target`), llama.cpp's llama-server runs beside each start, plain and under each
speculative setting (each its own process, started afresh with ours, idle while another contender runs: its n-gram
modes learn from the replies they gave, and every start repeats the prompts), every prompt through each of them in
the same turn as ours (its rate from its own timings): per start, adaptive and k = 0 ÷ llama.cpp plain and adaptive
÷ its best setting in that start, the comparison of a user's server and a user's llama.cpp.

With `--stream-intervals MS,…` every mode also runs with each request asking for that stream interval
(`stream_interval_ms`), interleaved with the rest in the same start: per start, each mode's rate at each interval ÷
its rate at the server's own (what handing tokens over costs, measured by a shipped command in one server).

With `--against CHECKOUT` the starts alternate between this checkout's server and another checkout's (the same
interpreter and models, its code), round by round with the first one alternating: per mode the median over rounds of
this ÷ that, and whether every request's tokens were the same (a redesign's before-and-after)."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc

from specrpc.bench.common import free_port, pair_line, server_env
from specrpc.bench.contenders import Runner
from specrpc.bench.contenders import decode_rate as run_decode_rate
from specrpc.bench.keystrokes import wait_serving
from specrpc.bench.llama_server import LlamaServer, LlamaServerSpec
from specrpc.bench.workloads import Case
from specrpc.engine.sampling import SamplingParams
from specrpc.models import execution_line, load_tokenizer
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

MODES: dict[str, int | None] = {"adaptive": None, "k=3": 3, "k=0": 0}
"""Contenders per start: the policy's k (None), a fixed k with the server's proposer, and target-only."""


def serve_command(target: str, draft: str, port: int, threads: int, dtype: str, weights: str) -> list[str]:
    """`specrpc serve` on loopback with the bench's model options."""
    command = [sys.executable, "-m", "specrpc.cli", "serve", "--target", target, "--draft", draft, "--host",
               "127.0.0.1", "--port", str(port), "--max-context", "2048", "--max-sessions", "2", "--metrics-port",
               "0", "--log-format", "console", "--log-level", "warning", "--grace-s", "1", "--dtype", dtype,
               "--weights", weights]
    return command + (["--threads", str(threads)] if threads else [])


def interval_name(mode: str, interval_ms: int) -> str:
    """The contender of `mode` whose requests ask for a stream interval of `interval_ms` ("adaptive @0 ms")."""
    return f"{mode} @{interval_ms} ms"


async def decode_rate(stub: pb_grpc.GeneratorStub, case: Case, k: int | None, interval_ms: int | None = None
                      ) -> tuple[float, list[int]]:
    """One greedy request's decode tokens/s as the client sees it (0 when it produced fewer than two tokens), and its
    tokens; `interval_ms`: the request's stream interval (None: the server's)."""
    spec = pb.SpeculationParams() if k is None else pb.SpeculationParams(num_draft_tokens=k)
    common: dict[str, Any] = {"max_new_tokens": case.max_new_tokens, "sampling": pb.SamplingParams(temperature=0.0),
                              "speculation": spec}
    if interval_ms is not None:
        common["stream_interval_ms"] = interval_ms
    call: Any = (stub.Generate(pb.GenerateRequest(prompt=case.prompt, **common)) if case.suffix is None
                 else stub.Infill(pb.InfillRequest(prefix=case.prompt, suffix=case.suffix, **common)))
    t0 = time.perf_counter()
    first = last = 0.0
    ids: list[int] = []
    async for response in call:
        if response.HasField("chunk") and response.chunk.token_ids:
            now = time.perf_counter() - t0
            if not ids:
                first = now
            ids += response.chunk.token_ids
            last = now
    return ((len(ids) - 1) / (last - first) if len(ids) > 1 and last > first else 0.0), ids


GREEDY = SamplingParams(temperature=0.0)


async def one_start(port: int, process: subprocess.Popen[bytes], cases: list[Case],
                    peers: dict[str, Runner] | None = None, prompts: list[list[int]] | None = None,
                    intervals: tuple[int, ...] = ()) -> dict[str, Any]:
    """Every case through each mode (and each mode at each of `intervals`, the requests' stream interval) and each
    llama-server contender of `peers` (given `prompts`, the cases' token ids), alternating which goes first; the
    medians per contender."""
    peers = peers or {}
    ours: dict[str, tuple[int | None, int | None]] = {name: (k, None) for name, k in MODES.items()}
    ours |= {interval_name(name, ms): (k, ms) for ms in intervals for name, k in MODES.items()}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await wait_serving(channel, process)
        stub = pb_grpc.GeneratorStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        names = [*ours, *peers]
        rates: dict[str, list[float]] = {name: [] for name in names}
        tokens: dict[str, list[list[int]]] = {name: [] for name in names}
        for i, case in enumerate(cases):
            for name in names if i % 2 == 0 else list(reversed(names)):
                if name in ours:
                    rate, ids = await decode_rate(stub, case, *ours[name])
                else:
                    assert prompts is not None
                    run = await asyncio.to_thread(peers[name], prompts[i], case.max_new_tokens, GREEDY)
                    rate, ids = run_decode_rate(run), run.tokens  # llama.cpp's own timings
                rates[name].append(rate)
                tokens[name].append(ids)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    out = {"median_tokens_per_s": medians, "rates": rates, "tokens": tokens,
           "ratio": medians["adaptive"] / medians["k=0"] if medians["k=0"] else 0.0,
           "execution": {name: execution_line((p.tokens, p.path) for p in paths)
                         for name, paths in (("target", info.target_execution), ("draft", info.draft_execution))}}
    if peers:
        out["llama_cpp"] = against_peers(medians, tokens, list(peers))
    if intervals:
        out["intervals"] = against_server_interval(medians, intervals)
    return out


def against_server_interval(medians: dict[str, float], intervals: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """Per mode, its median rate with each requested stream interval ÷ its median at the server's own."""
    return {name: {ms: medians[interval_name(name, ms)] / medians[name] if medians[name] else 0.0
                   for ms in intervals} for name in MODES}


def against_peers(medians: dict[str, float], tokens: dict[str, list[list[int]]], peers: list[str]) -> dict[str, Any]:
    """One start's comparison with llama.cpp: the plain contender (the first of `peers`) and the fastest of the
    others, adaptive and k = 0 ÷ plain, adaptive ÷ that best; and per llama.cpp contender, the share of prompts
    where ours (k = 0, stopping at end of text) is its reply's start (it decodes all its tokens)."""
    plain, settings = peers[0], peers[1:]
    best = max(settings, key=medians.__getitem__) if settings else plain

    def ratio(a: str, b: str) -> float:
        return medians[a] / medians[b] if medians[b] else 0.0

    same = {name: sum(theirs[: len(ours)] == ours for ours, theirs in zip(tokens["k=0"], tokens[name], strict=True))
            / max(1, len(tokens[name])) for name in peers}
    return {"plain": plain, "best": best, "adaptive_vs_plain": ratio("adaptive", plain),
            "adaptive_vs_best": ratio("adaptive", best), "k0_vs_plain": ratio("k=0", plain), "identical": same}


def start_once(cases: list[Case], command: list[str], port: int, cwd: str | None = None,
               peers: dict[str, Runner] | None = None, prompts: list[list[int]] | None = None,
               intervals: tuple[int, ...] = ()) -> dict[str, Any]:
    """One server start (from `cwd`: its checkout's code), every case through each mode (at each of `intervals` too,
    and through each of `peers`); stopped after."""
    process = subprocess.Popen(command, env=server_env(), cwd=cwd)
    try:
        return asyncio.run(one_start(port, process, cases, peers, prompts, intervals))
    finally:
        process.terminate()
        process.wait(30)


def run(cases: list[Case], starts: int, target: str, draft: str, threads: int, dtype: str,
        weights: str, peers: list[LlamaServerSpec] | None = None, logs: Path | None = None,
        intervals: tuple[int, ...] = ()) -> dict[str, Any]:
    """`starts` server starts, one after the other, the same cases each time; with `peers` (llama-server
    contenders, the plain one first; their logs under `logs`), every case through each of them too; with
    `intervals`, every mode at each requested stream interval too."""
    out: list[dict[str, Any]] = []
    prompts: list[list[int]] | None = None
    if peers:
        tokenizer = load_tokenizer(target)
        prompts = [list(tokenizer(case.prompt).input_ids) for case in cases]  # as the server encodes them
    for i in range(starts):
        t0 = time.perf_counter()
        with ExitStack() as stack:  # llama.cpp started afresh too: its n-gram caches learn from the replies it gave
            runners: dict[str, Runner] = {}
            for spec in peers or []:
                assert prompts is not None
                log = ((logs or Path(".")) / "llama-server" / f"start-{i + 1}"
                       / (spec.name.replace(" + ", "+").replace(" ", "_") + ".log"))  # each start's own
                runner = stack.enter_context(LlamaServer(spec, log)).runner()
                runner(prompts[0][:32], 8, GREEDY)  # warm-up
                runners[spec.name] = runner
            port = free_port()
            result = start_once(cases, serve_command(target, draft, port, threads, dtype, weights), port,
                                peers=runners, prompts=prompts, intervals=intervals)
        out.append(result)
        m = result["median_tokens_per_s"]
        print(f"start {i + 1}/{starts}: adaptive {m['adaptive']:.1f} tokens/s, k=0 {m['k=0']:.1f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    spread = {name: {"min": min(s["median_tokens_per_s"][name] for s in out),
                     "median": statistics.median(s["median_tokens_per_s"][name] for s in out),
                     "max": max(s["median_tokens_per_s"][name] for s in out)} for name in MODES}
    return {"starts": out, "spread": spread, "pair": pair_line(target, draft), "cases": len(cases),
            "threads": threads or "default", "dtype": dtype,
            "weights": weights}


def compare(cases: list[Case], rounds: int, other: str, target: str, draft: str, threads: int, dtype: str,
            weights: str) -> dict[str, Any]:
    """`rounds` rounds of one start of this checkout's server and one of `other`'s (absolute model paths: the other
    server runs in that checkout), alternating which goes first; per round and mode this ÷ that of the median
    tokens/s, and whether each request's tokens matched."""
    target, draft, other = os.path.abspath(target), os.path.abspath(draft), os.path.abspath(other)
    per_round: list[dict[str, Any]] = []
    identical = True
    for r in range(rounds):
        results: dict[str, dict[str, Any]] = {}
        for side in (("this", "other") if r % 2 == 0 else ("other", "this")):
            port = free_port()
            command = serve_command(target, draft, port, threads, dtype, weights)
            results[side] = start_once(cases, command, port, cwd=other if side == "other" else None)
        this, that = results["this"], results["other"]
        identical = identical and this["tokens"] == that["tokens"]
        ratios = {name: this["median_tokens_per_s"][name] / that["median_tokens_per_s"][name]
                  if that["median_tokens_per_s"][name] else 0.0 for name in MODES}
        per_round.append({"this": this["median_tokens_per_s"], "other": that["median_tokens_per_s"],
                          "ratio": ratios})
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{name} {ratios[name]:.3f}×" for name in MODES),
              file=sys.stderr, flush=True)
    return {"rounds": per_round, "identical_tokens": identical, "other": other, "pair": pair_line(target, draft),
            "cases": len(cases),
            "median_ratio": {name: statistics.median(r["ratio"][name] for r in per_round) for name in MODES},
            "threads": threads or "default", "dtype": dtype, "weights": weights}


def compare_markdown(results: dict[str, Any]) -> str:
    """Per round and the medians, as Markdown."""
    lines = [results["pair"], "",
             f"This checkout against `{results['other']}`: {len(results['rounds'])} rounds of one server start "
             f"each, {results['cases']} prompts per start (greedy; median per-request decode tokens/s through gRPC; "
             f"threads {results['threads']}, dtype {results['dtype']}, weights {results['weights']}). Identical "
             f"tokens: {'yes' if results['identical_tokens'] else 'NO'}.", "",
             "| round | " + " | ".join(f"{m} this | {m} other | {m} ratio" for m in MODES) + " |",
             "| --- |" + " --- | --- | --- |" * len(MODES)]
    for i, r in enumerate(results["rounds"]):
        lines.append(f"| {i + 1} | " + " | ".join(
            f"{r['this'][m]:.1f} | {r['other'][m]:.1f} | {r['ratio'][m]:.3f}×" for m in MODES) + " |")
    lines += ["", "Median ratio (this ÷ other): " + "; ".join(
        f"{m} {v:.3f}×" for m, v in results["median_ratio"].items()), ""]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """Per start and the spread, as Markdown."""
    lines = [results["pair"], "",
             f"Spread over {len(results['starts'])} server starts ({results['cases']} prompts each, greedy, "
             f"threads {results['threads']}, dtype {results['dtype']}, weights {results['weights']}; median "
             "per-request decode tokens/s through gRPC):", "",
             "| start | adaptive | k = 0 | adaptive ÷ k = 0 |", "| --- | --- | --- | --- |"]
    for i, s in enumerate(results["starts"]):
        m = s["median_tokens_per_s"]
        lines.append(f"| {i + 1} | {m['adaptive']:.1f} | {m['k=0']:.1f} | {s['ratio']:.2f}× |")
    sp = results["spread"]
    lines += ["", "The paths each start chose at load (forward sizes: path), target / draft:", ""]
    lines += [f"{i + 1}. {s['execution']['target']} / {s['execution']['draft'] or 'none'}"
              for i, s in enumerate(results["starts"])]
    lines += ["", "Spread (min – median – max): " + "; ".join(
        f"{name} {v['min']:.1f} – {v['median']:.1f} – {v['max']:.1f}" for name, v in sp.items()), ""]
    if "llama_cpp" in results["starts"][0]:
        lines += ["Against llama.cpp's llama-server beside each start (its rate from its own timings; identical: "
                  "prompts where ours, k = 0, is the start of its reply):", "",
                  "| start | llama.cpp plain tokens/s | k = 0 ÷ plain | adaptive ÷ plain | adaptive ÷ best (setting) "
                  "| plain identical |", "| --- | --- | --- | --- | --- | --- |"]
        for i, s in enumerate(results["starts"]):
            peer = s["llama_cpp"]
            lines.append(f"| {i + 1} | {s['median_tokens_per_s'][peer['plain']]:.1f} | {peer['k0_vs_plain']:.2f}× | "
                         f"{peer['adaptive_vs_plain']:.2f}× | {peer['adaptive_vs_best']:.2f}× ({peer['best']}) | "
                         f"{peer['identical'][peer['plain']]:.2f} |")
        lines.append("")
    if "intervals" in results["starts"][0]:
        intervals = list(results["starts"][0]["intervals"]["adaptive"])
        lines += ["Each mode with its requests asking for a stream interval (`stream_interval_ms`), ÷ the same mode at "
                  "the server's own, interleaved in each start:", "",
                  "| start | " + " | ".join(f"{m} @{ms} ms" for ms in intervals for m in MODES) + " |",
                  "| --- |" + " --- |" * (len(intervals) * len(MODES))]
        for i, s in enumerate(results["starts"]):
            lines.append(f"| {i + 1} | " + " | ".join(f"{s['intervals'][m][ms]:.3f}×" for ms in intervals
                                                        for m in MODES) + " |")
        lines.append("")
    return "\n".join(lines)
