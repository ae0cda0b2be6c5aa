"""`specrpc bench --starts N`: how much a server's speed depends on its start. `specrpc serve` is started N times in
another process, each time warm-up and calibration included; every start gets the same prompts, greedy, adaptive
and k = 0 alternating prompt by prompt, through gRPC. Reported per start: the median per-request decode tokens/s of
each (tokens after the first ÷ the time after the first), their ratio, and the spread over the starts."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc

from specrpc.bench.common import free_port
from specrpc.bench.keystrokes import wait_serving
from specrpc.bench.workloads import Case
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

MODES: dict[str, int | None] = {"adaptive": None, "k=0": 0}
"""Contenders per start: the policy's k (None) and target-only."""


def serve_command(target: str, draft: str, port: int, threads: int, dtype: str, weights: str) -> list[str]:
    """`specrpc serve` on loopback with the bench's model options."""
    command = [sys.executable, "-m", "specrpc.cli", "serve", "--target", target, "--draft", draft, "--host",
               "127.0.0.1", "--port", str(port), "--max-context", "2048", "--max-sessions", "2", "--metrics-port",
               "0", "--log-format", "console", "--log-level", "warning", "--grace-s", "1", "--dtype", dtype,
               "--weights", weights]
    return command + (["--threads", str(threads)] if threads else [])


async def decode_rate(stub: pb_grpc.GeneratorStub, case: Case, k: int | None) -> float:
    """One greedy request's decode tokens/s as the client sees it (0 when it produced fewer than two tokens)."""
    spec = pb.SpeculationParams() if k is None else pb.SpeculationParams(num_draft_tokens=k)
    common: dict[str, Any] = {"max_new_tokens": case.max_new_tokens, "sampling": pb.SamplingParams(temperature=0.0),
                              "speculation": spec}
    call: Any = (stub.Generate(pb.GenerateRequest(prompt=case.prompt, **common)) if case.suffix is None
                 else stub.Infill(pb.InfillRequest(prefix=case.prompt, suffix=case.suffix, **common)))
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async for response in call:
        if response.HasField("chunk") and response.chunk.token_ids:
            now = time.perf_counter() - t0
            if tokens == 0:
                first = now
            tokens += len(response.chunk.token_ids)
            last = now
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0


async def one_start(port: int, process: subprocess.Popen[bytes], cases: list[Case]) -> dict[str, Any]:
    """Every case through each mode, alternating which goes first; the medians per mode."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await wait_serving(channel, process)
        stub = pb_grpc.GeneratorStub(channel)
        rates: dict[str, list[float]] = {name: [] for name in MODES}
        for i, case in enumerate(cases):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for name in order:
                rates[name].append(await decode_rate(stub, case, MODES[name]))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"median_tokens_per_s": medians, "rates": rates,
            "ratio": medians["adaptive"] / medians["k=0"] if medians["k=0"] else 0.0}


def run(cases: list[Case], starts: int, target: str, draft: str, threads: int, dtype: str,
        weights: str) -> dict[str, Any]:
    """`starts` server starts, one after the other, the same cases each time."""
    out: list[dict[str, Any]] = []
    for i in range(starts):
        port = free_port()
        process = subprocess.Popen(serve_command(target, draft, port, threads, dtype, weights), env=os.environ.copy())
        try:
            t0 = time.perf_counter()
            result = asyncio.run(one_start(port, process, cases))
        finally:
            process.terminate()
            process.wait(30)
        out.append(result)
        m = result["median_tokens_per_s"]
        print(f"start {i + 1}/{starts}: adaptive {m['adaptive']:.1f} tokens/s, k=0 {m['k=0']:.1f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    spread = {name: {"min": min(s["median_tokens_per_s"][name] for s in out),
                     "median": statistics.median(s["median_tokens_per_s"][name] for s in out),
                     "max": max(s["median_tokens_per_s"][name] for s in out)} for name in MODES}
    return {"starts": out, "spread": spread, "cases": len(cases), "threads": threads or "default", "dtype": dtype,
            "weights": weights}


def markdown(results: dict[str, Any]) -> str:
    """Per start and the spread, as Markdown."""
    lines = [f"Spread over {len(results['starts'])} server starts ({results['cases']} prompts each, greedy, "
             f"threads {results['threads']}, dtype {results['dtype']}, weights {results['weights']}; median "
             "per-request decode tokens/s through gRPC):", "",
             "| start | adaptive | k = 0 | adaptive ÷ k = 0 |", "| --- | --- | --- | --- |"]
    for i, s in enumerate(results["starts"]):
        m = s["median_tokens_per_s"]
        lines.append(f"| {i + 1} | {m['adaptive']:.1f} | {m['k=0']:.1f} | {s['ratio']:.2f}× |")
    sp = results["spread"]
    lines += ["", "Spread (min – median – max): " + "; ".join(
        f"{name} {v['min']:.1f} – {v['median']:.1f} – {v['max']:.1f}" for name, v in sp.items()), ""]
    return "\n".join(lines)
