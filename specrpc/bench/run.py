"""`specrpc bench`: every contender side by side in one process on the same pair and prompts, then end to end
through gRPC on loopback, then a concurrency sweep. Prints a Markdown table; writes JSON and PNG charts."""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from specrpc.bench.common import NO_RECHECK, machine_line, pair_line, percentile
from specrpc.bench.contenders import Run, Runner, decode_rate, engine_runner, hf_runner
from specrpc.bench.llama_server import SKIP_LINE, LlamaServer, specs, sweep
from specrpc.bench.workloads import Case, build_cases
from specrpc.config import MAX_STREAM_INTERVAL_MS, Config, EngineConfig, Limits, ServerConfig
from specrpc.engine.generation import StepResult
from specrpc.engine.policy import BatchCosts, expected_tokens
from specrpc.engine.sampling import SamplingParams
from specrpc.openmp import release_workers
from specrpc.prompts.fim import InfillInput
from specrpc.serving.runtime import Runtime
from specrpc.serving.scheduler import Job


def summarize(runs: list[Run]) -> dict[str, float]:
    """Latency and throughput figures over a contender's runs."""
    itl: list[float] = []
    for r in runs:
        for i in range(1, len(r.chunk_times)):
            per_token = (r.chunk_times[i] - r.chunk_times[i - 1]) / r.chunk_sizes[i]
            itl += [per_token] * r.chunk_sizes[i]
    decode_tokens = sum(len(r.tokens) - 1 for r in runs)
    decode_time = sum(r.total_s - r.ttft_s for r in runs)
    proposed, accepted = sum(r.proposed for r in runs), sum(r.accepted for r in runs)
    steps = sum(r.steps for r in runs)
    return {
        "ttft_p50_ms": percentile([r.ttft_s for r in runs], 50) * 1e3,
        "ttft_p95_ms": percentile([r.ttft_s for r in runs], 95) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        "e2e_tokens_per_s": sum(len(r.tokens) for r in runs) / sum(r.total_s for r in runs),
        "acceptance": accepted / proposed if proposed else 0.0,
        "alpha": accepted / trials if (trials := sum(r.trials for r in runs)) else 0.0,
        "mean_accepted_length": decode_tokens / steps if steps else 0.0,
        "mean_k": statistics.fmean([k for r in runs for k in r.ks]) if any(r.ks for r in runs) else 0.0,
    }


def request_figures(r: Run) -> dict[str, float]:
    """One request's figures, kept beside a contender's summary so that a run whose summary surprises can be read
    request by request (where a policy drafted little, where a step stalled)."""
    return {"tokens": len(r.tokens), "ttft_ms": r.ttft_s * 1e3, "tokens_per_s": decode_rate(r),
            "steps": r.steps, "proposed": r.proposed, "accepted": r.accepted,
            "mean_k": statistics.fmean(r.ks) if r.ks else 0.0,
            "longest_gap_ms": max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)),
                                  default=0.0) * 1e3}


def prompt_ids(runtime: Runtime, case: Case) -> list[int]:
    """Token ids of a case as the service would build them."""
    if case.suffix is None:
        return runtime.encode(case.prompt)
    return runtime.infill_prompt(InfillInput(case.prompt, case.suffix, layout="psm")).ids


def run_contenders(runtime: Runtime, contenders: dict[str, Runner], cases: list[Case], params: SamplingParams,
                   rounds: int) -> dict[str, list[Run]]:
    """Each case through every contender in turn (interleaved, so machine noise hits all alike)."""
    results: dict[str, list[Run]] = {name: [] for name in contenders}
    for r in range(rounds):
        for i, case in enumerate(cases):
            ids = prompt_ids(runtime, case)
            t0 = time.perf_counter()
            for name, runner in contenders.items():
                p = params if params.greedy else replace(params, seed=i)
                results[name].append(runner(ids, case.max_new_tokens, p))
            print(f"round {r + 1}/{rounds}, case {i + 1}/{len(cases)} ({case.workload}): every contender in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


def predicted_speedup(alpha: float, k: int, runtime: Runtime) -> float:
    """S = E(α, k) / (D(k) + V(k)) from the device's costs (calibrated, then refined by every lone step) and α per
    tested draft token (as the policy estimates it: accepted ÷ (accepted + first rejections))."""
    costs = runtime.engine.costs
    return expected_tokens(alpha, k) / (costs.d(k) + costs.v(k))


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def grpc_phase(runtime: Runtime, config: Config, cases: list[Case], params: SamplingParams,
                     concurrency: list[int], overhead_rounds: int = 2, sweep_rounds: int = 3,
                     fresh: bool = False, sweep_ks: tuple[int, ...] = ()) -> dict[str, Any]:
    """End to end through a real server on loopback, its clients in a process of their own (`RemoteClients`):
    per-request figures and the concurrency sweep (each point the median of `sweep_rounds`). `fresh`: every request
    of the sweep opens with a line of its own (`FRESH_LINE`), so that it finds none of its prompt cached and prefills
    it whole beside the other streams' decoding, as new sessions arriving do (else a stream's next request finds its
    prompt cached from the rounds before). `sweep_ks`: fixed k contenders in the sweep too ("k=K"), beside the default
    and target-only: what the default's choice of k at each width leaves on the table."""
    from specrpc.bench.grpc_client import RemoteClients
    from specrpc.edges.server import start_server

    running = await start_server(config, runtime=runtime)
    out: dict[str, Any] = {}
    started: list[RemoteClients] = []
    try:
        clients = await RemoteClients.start(running.port, params.temperature, params.top_p, params.top_k)
        started.append(clients)

        async def one(case: Case, k: int | None, seed: int) -> tuple[Run, int]:
            """One request through gRPC from the client process (`RemoteClients`)."""
            reply = await clients.one(case.prompt, case.suffix, case.max_new_tokens, k, seed)
            return Run(**reply["run"]), int(reply["messages"])

        requests = itertools.count()

        async def sweep_one(case: Case, k: int | None, seed: int) -> tuple[Run, int]:
            """A request of the sweep: `one`, its prompt made its own where `fresh`."""
            return await one(replace(case, prompt=FRESH_LINE.format(next(requests)) + case.prompt) if fresh else case,
                             k, seed)

        for name, k in (("grpc adaptive", None), ("grpc target-only", 0)):
            runs = []
            messages = 0
            for i, case in enumerate(cases):
                run, m = await one(case, k, i)
                runs.append(run)
                messages += m
            out[name] = {"summary": summarize(runs), "messages": messages, "total_s": sum(r.total_s for r in runs)}

        # The overhead: target-only (deterministic, one token per message) in process and through gRPC,
        # alternating case by case so that machine noise hits both alike. An in-process run leases a slot from
        # the server's registry (so no request uses it meanwhile), empties it, runs on the device thread (as the
        # server's requests do: one OpenMP team) and empties it again, so that no request later reuses a
        # prefix the registry believes the slot holds.
        runners: dict[int, Runner] = {}  # per slot: target-only, stopping where the server does
        loop = asyncio.get_running_loop()

        async def here_run(case: Case) -> Run:
            ids = prompt_ids(runtime, case)
            lease = await runtime.registry.acquire("", ids)
            index = lease.slot.index
            if index not in runners:
                runners[index] = engine_runner(runtime.engine, 0, "draft", runtime.stop_token_ids, index)

            def run_and_empty() -> Run:
                try:
                    return runners[index](ids, case.max_new_tokens, params)
                finally:
                    runtime.engine.reset_slot(lease.slot)

            try:
                future = runtime.scheduler.call(run_and_empty)
            except BaseException:
                runtime.registry.release(lease)
                raise
            # the slot goes back once the device thread is done with it, even if this task is cancelled first
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(runtime.registry.release, lease))
            return await asyncio.wrap_future(future)

        def empty_slots() -> None:  # so that the request through gRPC prefills its whole prompt too
            for slot in runtime.registry.slots:
                if slot.index not in runtime.registry.busy:
                    runtime.engine.reset_slot(slot)

        pairs: list[tuple[Run, Run, int]] = []
        for r in range(overhead_rounds):
            for i, case in enumerate(cases):
                await asyncio.wrap_future(runtime.scheduler.call(empty_slots))
                if (r + i) % 2:  # alternate which side goes first: the second run of a prompt finds warmer caches
                    there, m = await one(case, 0, i)
                    here = await here_run(case)
                else:
                    here = await here_run(case)
                    there, m = await one(case, 0, i)
                pairs.append((here, there, m))
        out["overhead"] = {
            "ttft_delta_ms": statistics.median((b.ttft_s - a.ttft_s) * 1e3 for a, b, _ in pairs),
            # the same without prefill's run-to-run spread: what the client waits beyond the server's own TTFT
            # (call set-up, validation, tokenizing, hand-offs and the first message's way out)
            "edge_ttft_ms": statistics.median([(b.ttft_s - b.server_ttft_s) * 1e3 for _, b, _ in pairs
                                               if b.server_ttft_s > 0] or [float("nan")]),
            "per_message_us": sum(b.total_s - a.total_s for a, b, _ in pairs) / sum(m for *_, m in pairs) * 1e6,
            "requests": len(pairs), "messages": sum(m for *_, m in pairs),
            "identical": sum(a.tokens == b.tokens for a, b, _ in pairs) / len(pairs),
        }

        sweep: dict[str, dict[str, Any]] = {}
        contenders = (("adaptive", None), ("target-only", 0), *((f"k={k}", k) for k in sweep_ks))
        modes = ("batched", "round-robin")

        async def mode(name: str) -> None:
            await asyncio.wrap_future(runtime.scheduler.call(functools.partial(set_batching, runtime, name)))

        # A warm-up pass of each contender in each mode at each width first (its prompts cached as a session's
        # next request finds them, target and draft alike); then rounds, each over every width in turn, that
        # alternate the modes and, within a mode, which contender goes first: each point the median over the
        # rounds. A point is under a second at the mercy of this machine's drift, so batched and round-robin
        # are measured round by round, not one after the other, and so are the widths that "× one stream"
        # compares (one width's rounds after another's put minutes of drift between them). The rounds go up
        # and down the widths in turn (warm-ups downwards, so the first round starts where they ended): a point
        # measured right after the widest one met its aftermath, and one mode went first there more often.
        # One stream's two modes go request by request in turn (the path is the same: only drift tells them
        # apart).
        await asyncio.wrap_future(runtime.scheduler.call(empty_slots))
        for streams in concurrency[::-1]:
            for batching in modes:
                await mode(batching)
                for _, k in contenders:
                    await sweep_point(sweep_one, cases, streams, k, runtime)
        points: dict[tuple[int, str, str], list[dict[str, float]]] = {
            (streams, b, name): [] for streams in concurrency for b in modes for name, _ in contenders}
        for r in range(sweep_rounds):
            for streams in concurrency if r % 2 == 0 else concurrency[::-1]:
                if streams == 1:  # both modes at once, request by request (`one_stream_points`)
                    for name, k in (contenders if r % 2 else contenders[::-1]):
                        both = await one_stream_points(sweep_one, cases, k, runtime,
                                                       modes if r % 2 == 0 else modes[::-1], mode, POINT_STREAMS)
                        for batching, figures in both.items():
                            points[(1, batching, name)].append(figures)
                    continue
                for batching in modes if r % 2 == 0 else modes[::-1]:
                    await mode(batching)
                    for name, k in (contenders if r % 2 else contenders[::-1]):
                        points[(streams, batching, name)].append(
                            await sweep_point(sweep_one, cases, streams, k, runtime, POINT_STREAMS))
        for (streams, batching, name), measured in points.items():
            key = f"{streams}:{batching}:{name}"
            sweep[key] = {field: statistics.median(p[field] for p in measured) for field in measured[0]}
            sweep[key]["streams"] = streams
            sweep[key]["rounds"] = sweep_rounds
            sweep[key].update(paired_ratios(points, streams, batching, name))
        await asyncio.wrap_future(runtime.scheduler.call(functools.partial(set_batching, runtime, "batched")))
        for key, value in list(sweep.items()):  # the batched figures also under their former names
            if ":batched:" in key:
                sweep[key.replace(":batched:", ":")] = value
        out["concurrency"] = sweep
        out["fresh"] = fresh
    finally:
        for clients in started:
            await clients.close()
        await running.server.stop(0)
        running.janitor.cancel()
    return out


def paired_ratios(points: dict[tuple[int, str, str], list[dict[str, float]]], streams: int, mode: str,
                  name: str) -> dict[str, Any]:
    """A point's ratios to the points it is compared with, each the median of the ratios within a round (the
    medians of two points divided come from different rounds, and this machine drifts between rounds): aggregate
    ÷ the same width in the other mode ("paired_over_other_mode"), adaptive's ÷ target-only's at this width and
    mode ("paired_over_target_only", adaptive only), a fixed k's ÷ the default's ("paired_over_default", "k=K" only),
    and target-only's ÷ one stream's in this mode ("paired_times_one_stream", target-only only); and the point's
    aggregate in each round ("round_tokens_per_s")."""

    def median_ratio(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
        ratios = [x["aggregate_tokens_per_s"] / y["aggregate_tokens_per_s"] for x, y in zip(a, b, strict=True)
                  if y["aggregate_tokens_per_s"]]
        return statistics.median(ratios) if ratios else 0.0

    mine = points[(streams, mode, name)]
    other = "round-robin" if mode == "batched" else "batched"
    out: dict[str, Any] = {"paired_over_other_mode": median_ratio(mine, points[(streams, other, name)]),
                           "round_tokens_per_s": [p["aggregate_tokens_per_s"] for p in mine]}
    if name != "target-only" and (streams, mode, "target-only") in points:
        out["paired_over_target_only"] = median_ratio(mine, points[(streams, mode, "target-only")])
    if name.startswith("k=") and (streams, mode, "adaptive") in points:
        out["paired_over_default"] = median_ratio(mine, points[(streams, mode, "adaptive")])
    if name == "target-only" and (1, mode, name) in points:
        out["paired_times_one_stream"] = median_ratio(mine, points[(1, mode, name)])
    return out


def set_batching(runtime: Runtime, mode: str) -> None:
    """On the device thread: batched steps ("batched") or round-robin for what follows."""
    runtime.scheduler.batching = mode == "batched"


FRESH_LINE = "# request {}\n"
"""The line that opens each request of a `--sweep-fresh` sweep (its number filled in)."""

POINT_STREAMS = 8
"""A measured sweep point runs at least the requests of this many streams: a narrower one repeats its cases (one
stream runs them 8 times), so that the one-stream point, the denominator of every "× one stream", is not the
shortest measurement of the sweep and the noisiest (four requests, under half a second)."""


class FullSteps:
    """The scheduler's `on_step` hook during a sweep point, called on the device thread for each stream a step
    advanced, one after the other, with the step's seconds: one float object for all the streams of a batched step
    (the same object, not only the same value), a new one for each round-robin step. Per step: whether each stream
    got tokens."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, list[bool]]] = []

    def __call__(self, job: Job, result: StepResult, seconds: float) -> None:
        if not self.steps or self.steps[-1][0] is not seconds:
            self.steps.append((seconds, []))
        self.steps[-1][1].append(bool(result.token_ids))

    def median_s(self, streams: int) -> float:
        """Median seconds of the steps that gave each of `streams` streams tokens (no prompt chunk before a prompt's
        last in them); 0.0 where none did."""
        full = [seconds for seconds, got in self.steps if len(got) == streams and all(got)]
        return statistics.median(full) if full else 0.0


async def sweep_point(one: Callable[[Case, int | None, int], Awaitable[tuple[Run, int]]], cases: list[Case],
                      streams: int, k: int | None, runtime: Runtime, span: int = 1) -> dict[str, float]:
    """`streams` clients at once, each running every case one after the other, ceil(span / streams) times over
    (client i starting at case i, so that the clients carry equal work and stay in flight together: a prompt that
    stops early would otherwise leave its client idle and the batch narrower than `streams`), with k (None:
    adaptive): aggregate and per-stream tokens/s, ITL p50/p99, mean k, the bound plain batched decoding has from
    the measured batch costs for the same work (`bound_tokens_per_s`), and the median full step (every stream
    decoding) against the bound's forward of `streams` tokens."""
    t0 = time.perf_counter()
    repeats = -(-span // streams)
    batches = [[cases[(i + j) % len(cases)] for j in range(len(cases) * repeats)] for i in range(streams)]

    async def worker(batch: list[Case]) -> list[Run]:
        return [(await one(c, k, j))[0] for j, c in enumerate(batch)]

    scheduler = runtime.scheduler
    full, hook = FullSteps(), scheduler.on_step
    scheduler.on_step = full
    try:
        results = await asyncio.gather(*(worker(b) for b in batches))
    finally:
        scheduler.on_step = hook
    figures = point_figures(results, time.perf_counter() - t0, streams, runtime)
    step_s, costs = full.median_s(streams), runtime.engine.batch_costs
    figures["full_step_share"] = costs.target(streams) / step_s if step_s and costs.target_s else 0.0
    return figures


async def one_stream_points(one: Callable[[Case, int | None, int], Awaitable[tuple[Run, int]]], cases: list[Case],
                            k: int | None, runtime: Runtime, modes: tuple[str, ...],
                            switch: Callable[[str], Awaitable[None]], span: int) -> dict[str, dict[str, float]]:
    """`sweep_point` of one stream in each of `modes` at once: every case `span` times, each request run in every
    mode in turn (`switch`ing between them; the first mode alternating), each mode's figures over its own
    requests. A lone stream takes the same path in both modes, so their ratio measures nothing but the machine's
    drift between two points run one after the other (several percent here in a few seconds); request by
    request, drift hits both alike (a round's ratio within ±3 % here, against ±4 % pass by pass over the cases and
    0.78-1.15 point by point)."""
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    walls = dict.fromkeys(modes, 0.0)
    for j in range(len(cases) * span):
        for m in modes if j % 2 == 0 else modes[::-1]:
            await switch(m)
            t0 = time.perf_counter()
            runs[m].append((await one(cases[j % len(cases)], k, j))[0])
            walls[m] += time.perf_counter() - t0
    return {m: point_figures([runs[m]], walls[m], 1, runtime) for m in modes}


def point_figures(results: list[list[Run]], wall: float, streams: int, runtime: Runtime) -> dict[str, float]:
    """A sweep point's figures from each stream's runs and the point's wall time (see `sweep_point`)."""
    runs = [r for rs in results for r in rs]
    s = summarize(runs)
    per_stream = [sum(len(r.tokens) for r in rs) / sum(r.total_s for r in rs) for rs in results if rs]
    steps = sum(r.steps for r in runs)
    prompt_tokens = sum(r.prompt_tokens for r in runs)
    costs = runtime.engine.batch_costs
    return {
        "aggregate_tokens_per_s": sum(len(r.tokens) for r in runs) / wall,
        "per_stream_tokens_per_s": statistics.fmean(per_stream) if per_stream else 0.0,
        "itl_p50_ms": s["itl_p50_ms"], "itl_p99_ms": s["itl_p99_ms"],
        "ttft_p99_ms": percentile([r.ttft_s for r in runs], 99) * 1e3,
        "mean_k": sum(r.proposed for r in runs) / steps if steps else 0.0,
        "bound_tokens_per_s": bound_tokens_per_s(runs, streams, costs, runtime.config.engine.prefill_chunk),
        "prefilled_share": sum(r.prefilled for r in runs) / prompt_tokens if prompt_tokens else 0.0,
    }


def with_context(cases: list[Case], n: int) -> list[Case]:
    """Each case with the prompts of the next n - 1 cases of its workload (in turn) before its own, a blank line
    apart: the same completions after a longer context, as an editor's other open files."""
    out: list[Case] = []
    for case in cases:
        peers = [c for c in cases if c.workload == case.workload]
        i = next(j for j, c in enumerate(peers) if c is case)
        before = [peers[(i + j) % len(peers)].prompt for j in range(1, min(n, len(peers)))]
        out.append(replace(case, prompt="\n\n".join([*before, case.prompt])))
    return out


def bound_tokens_per_s(runs: list[Run], streams: int, costs: BatchCosts, chunk: int) -> float:
    """The aggregate tokens/s plain batched decoding would give `runs`' work at `streams` streams, from the measured
    batch costs: every token after a request's first at `streams` tokens a forward of `streams` tokens, and each
    prompt's prefill (the tokens the server did not find cached, in chunks of `chunk`) riding along the other
    streams' decoding, a chunk of c tokens costing what it adds to their forward, target(streams - 1 + c) -
    target(streams - 1); its last forward gives the request's first token. The aggregate counts the time to each
    first token, so a bound without the prefill would not bound it. 0.0 before anything was measured."""
    if not costs.target_s:
        return 0.0
    others = streams - 1
    base = costs.target(others) if others else 0.0
    prefill = sum(costs.target(others + min(chunk, r.prefilled - at)) - base
                  for r in runs for at in range(0, r.prefilled, chunk))
    decode = sum(max(0, len(r.tokens) - 1) for r in runs) / streams * costs.target(streams)
    seconds = prefill + decode
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    lines = [f"Machine: {results['machine']}  ", f"{results['pair']}  ", f"Command: `{results['command']}`  ",
             f"Cases: {results['cases']} ({results['workload_names']}), sampling {results['params']}", ""]
    lines += ["| contender | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p99 ms | tokens/s | speed-up | "
              "acceptance / α | mean accepted len | mean k | efficiency | identical |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results["contenders"].items():
        s = r["summary"]
        eff = f"{r['efficiency']:.2f}" if r.get("efficiency") is not None else ""
        ident = f"{r['identical']:.2f}" if r.get("identical") is not None else ""
        lines.append(f"| {name} | {s['ttft_p50_ms']:.1f} | {s['ttft_p95_ms']:.1f} | {s['itl_p50_ms']:.2f} | "
                     f"{s['itl_p99_ms']:.2f} | {s['tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                     f"{s['acceptance']:.2f} / {s['alpha']:.2f} | {s['mean_accepted_length']:.2f} | "
                     f"{s['mean_k']:.1f} | {eff} | {ident} |")
    if "llama_cpp" in results:
        lines += ["", llama_cpp_lines(results)]
    if "grpc" in results:
        g = results["grpc"]
        lines += ["", "| through gRPC | TTFT p50 ms | ITL p50 ms | tokens/s | messages |",
                  "| --- | --- | --- | --- | --- |"]
        for name in ("grpc adaptive", "grpc target-only"):
            s = g[name]["summary"]
            lines.append(f"| {name} | {s['ttft_p50_ms']:.2f} | {s['itl_p50_ms']:.2f} | {s['tokens_per_s']:.1f} | "
                         f"{g[name]['messages']} |")
        o = results["grpc_overhead"]
        sweep: dict[str, dict[str, Any]] = g["concurrency"]
        rounds = int(min((v.get("rounds", 1) for v in sweep.values()), default=1))
        # each point once: the batched ones also stand under their former names ("streams:contender")
        prefilled = statistics.median(v.get("prefilled_share", 0.0) for key, v in sweep.items() if key.count(":") == 2)
        lines += ["", f"gRPC overhead (target-only, {o['requests']} requests alternating in-process and through "
                  f"gRPC, {o['messages']} messages, identical tokens {o['identical']:.2f}): median TTFT "
                  f"{o['ttft_delta_ms']:+.2f} ms over in-process (client TTFT beyond the server's own: median "
                  f"{o['edge_ttft_ms']:.2f} ms); {o['per_message_us']:.0f} µs per streamed message "
                  "(total-time difference ÷ messages).", "",
                  f"Concurrency sweep, each row the median of {rounds} rounds, contenders alternating; "
                  + ("each request a prompt of its own, prefilled whole" if g.get("fresh") else
                     "a stream's prompts found cached from the rounds before where a slot still holds them (with "
                     "as many slots as streams, a stream out of step with the others can find its next prompt gone)")
                  + f" ({prefilled:.0%} of the prompt tokens prefilled, median over the points; each point's in its "
                  "last column):",
                  "",
                  "| streams | mode | adaptive tokens/s | per stream | target-only tokens/s | adaptive ÷ target-only "
                  "| target-only × one stream | bound (batched target-only with each prompt's prefill, measured batch "
                  "costs) | bound × one stream's | reached of the bound's × | adaptive ÷ bound | the bound's forward ÷ "
                  "target-only's full step | adaptive ITL p50 / p99 ms | target-only ITL p99 ms | mean k | "
                  "prompt tokens prefilled, adaptive / target-only |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        one = {mode: sweep.get(f"1:{mode}:target-only", {}).get("aggregate_tokens_per_s")
               for mode in ("batched", "round-robin")}
        one_bound = sweep.get("1:batched:target-only", {}).get("bound_tokens_per_s")
        widths = sorted({int(v["streams"]) for v in sweep.values()})
        for streams in widths:
            for mode in ("batched", "round-robin"):
                if f"{streams}:{mode}:adaptive" not in sweep:
                    continue
                a, t = sweep[f"{streams}:{mode}:adaptive"], sweep[f"{streams}:{mode}:target-only"]
                ratio = a["aggregate_tokens_per_s"] / t["aggregate_tokens_per_s"] if t["aggregate_tokens_per_s"] else 0
                scale = t["aggregate_tokens_per_s"] / base if (base := one[mode]) else 0.0
                bound_scale = t["bound_tokens_per_s"] / one_bound if one_bound else 0.0
                reached = f"{scale / bound_scale:.2f}" if scale and bound_scale else ""
                of_bound = f"{a['aggregate_tokens_per_s'] / b:.2f}" if (b := t["bound_tokens_per_s"]) else ""
                lines.append(f"| {streams} | {mode} | {a['aggregate_tokens_per_s']:.1f} | "
                             f"{a['per_stream_tokens_per_s']:.1f} | {t['aggregate_tokens_per_s']:.1f} | "
                             f"{ratio:.2f}× | {f'{scale:.2f}×' if scale else ''} | {t['bound_tokens_per_s']:.1f} | "
                             f"{f'{bound_scale:.2f}×' if bound_scale else ''} | {reached} | "
                             f"{of_bound} | "
                             f"{f'{share:.2f}' if (share := t.get('full_step_share')) else ''} | "
                             f"{a['itl_p50_ms']:.1f} / {a['itl_p99_ms']:.1f} | {t['itl_p99_ms']:.1f} | "
                             f"{a['mean_k']:.2f} | {a['prefilled_share']:.0%} / {t['prefilled_share']:.0%} |")
        lines += ["", "The same ratios paired by round (each the median of its ratios within a round; the table above "
                  "divides medians, which may come from different rounds):", "",
                  "| streams | batched ÷ round-robin, adaptive | batched ÷ round-robin, target-only | target-only × "
                  "one stream, batched | adaptive ÷ target-only, batched |", "| --- | --- | --- | --- | --- |"]
        for streams in widths:
            a, t = sweep.get(f"{streams}:batched:adaptive", {}), sweep.get(f"{streams}:batched:target-only", {})
            if "paired_over_other_mode" in a and "paired_over_other_mode" in t:
                times_one, over_t = t.get("paired_times_one_stream"), a.get("paired_over_target_only")
                lines.append(f"| {streams} | {a['paired_over_other_mode']:.3f} | {t['paired_over_other_mode']:.3f} | "
                             f"{f'{times_one:.2f}×' if times_one else ''} | {f'{over_t:.2f}×' if over_t else ''} |")
        fixed = sorted({name for key in sweep if key.count(":") == 2 and (name := key.split(":")[2]).startswith("k=")})
        if fixed:
            lines += ["", "Fixed k in the sweep against the default (each ratio the median of the rounds' ratios):", "",
                      "| streams | mode | contender | tokens/s | ÷ the default, paired by round | mean k |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for streams, mode, name in itertools.product(widths, ("batched", "round-robin"), fixed):
                point = sweep.get(f"{streams}:{mode}:{name}")
                if point is None or "paired_over_default" not in point:
                    continue
                lines.append(f"| {streams} | {mode} | {name} | {point['aggregate_tokens_per_s']:.1f} | "
                             f"{point['paired_over_default']:.2f}× | {point['mean_k']:.2f} |")
    if "workloads" in results:
        lines += ["", "| workload | contender | tokens/s | × target-only | ITL p99 ms |",
                  "| --- | --- | --- | --- | --- |"]
        for w, per in results["workloads"].items():
            base = per["target-only"]["tokens_per_s"]
            for name, s in per.items():
                lines.append(f"| {w} | {name} | {s['tokens_per_s']:.1f} | "
                             f"{s['tokens_per_s'] / base if base else 0.0:.2f}× | {s['itl_p99_ms']:.2f} |")
    c = results["costs"]
    lines += ["", "The device's costs after the runs (calibrated, refined by every lone step), in target steps: "
              "drafting k tokens D(k) = " + ", ".join(f"{k}: {v:.2f}" for k, v in c["D"].items() if int(k))
              + "; verifying k+1 tokens V(k) = " + ", ".join(f"{k}: {v:.2f}" for k, v in c["V"].items()) + "."]
    m = results["memory"]
    lines += ["", f"Memory: weights {m['weight_bytes'] / 2**20:.1f} MiB (target+draft, computed), KV caches "
              f"{m['kv_cache_bytes'] / 2**20:.1f} MiB (computed); RSS grew {m['rss_load_delta'] / 2**20:.1f} MiB "
              "while loading both models and allocating the caches (measured)."]
    return "\n".join(lines) + "\n"


def best_speculative(info: dict[str, Any], contenders: dict[str, Any]) -> dict[str, str]:
    """Per llama.cpp plain contender: the fastest of its speculative settings in this run (decode tokens/s)."""
    return {plain: max(names, key=lambda n: contenders[n]["summary"]["tokens_per_s"])
            for plain, names in info["speculative"].items() if names}


def llama_cpp_lines(results: dict[str, Any]) -> str:
    """The skip line, or each contender's decode tokens/s over each llama.cpp plain contender's and over the best
    of its speculative settings (same prompts, same run; llama.cpp's figures from its own timings)."""
    info = results["llama_cpp"]
    if info.get("skipped"):
        return str(info["skipped"])
    contenders = results["contenders"]
    best: dict[str, str] = info["best"]
    bases = [*info["plain"], *best.values()]
    out = [f"llama.cpp: `{info['binary']}`, {info['threads']} threads; decode tokens/s from its own timings "
           "((n - 1) / predicted_ms; its own predicted_per_second in results.json). Best speculative setting: "
           + ("; ".join(f"{plain}: {name}" for plain, name in best.items()) or "none run") + ".", "",
           "| contender | tokens/s | identical | " + " | ".join(f"× {p}" for p in bases) + " |",
           "| --- | --- | --- | " + " | ".join("---" for _ in bases) + " |"]
    for name, r in contenders.items():
        rate = r["summary"]["tokens_per_s"]
        ratios = [rate / b if (b := contenders[p]["summary"]["tokens_per_s"]) else 0.0 for p in bases]
        ident = f"{r['identical']:.2f}" if r.get("identical") is not None else ""
        out.append(f"| {name} | {rate:.1f} | {ident} | " + " | ".join(f"{x:.2f}×" for x in ratios) + " |")
    return "\n".join(out)


def charts(results: dict[str, Any], accepted_lengths: list[int], out: Path) -> list[Path]:
    """tokens/s per contender, accepted-length histogram, speed-up vs k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = list(results["contenders"])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, [results["contenders"][n]["summary"]["tokens_per_s"] for n in names])
    ax.set_xlabel("decode tokens/s")
    ax.invert_yaxis()
    fig.tight_layout()
    paths.append(out / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=100)
    fig, ax = plt.subplots(figsize=(6, 4))
    if accepted_lengths:
        ax.hist(accepted_lengths, bins=range(1, max(accepted_lengths) + 2), align="left", rwidth=0.8)
    ax.set_xlabel("tokens committed per verify step (adaptive)")
    ax.set_ylabel("steps")
    fig.tight_layout()
    paths.append(out / "accepted_length.png")
    fig.savefig(paths[-1], dpi=100)
    ks = sorted(int(n.split("=")[1]) for n in names if n.startswith("k="))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [results["contenders"][f"k={k}"]["speedup"] for k in ks], marker="o", label="measured")
    ax.plot(ks, [results["contenders"][f"k={k}"]["predicted_speedup"] for k in ks], marker="x", label="predicted")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speed-up over target-only")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "speedup_vs_k.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close("all")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench`."""
    parser = argparse.ArgumentParser(prog="specrpc bench", description=__doc__)
    parser.add_argument("--target", default=EngineConfig().target)
    parser.add_argument("--draft", default=EngineConfig().draft)
    parser.add_argument("--cases", type=int, default=4, help="prompts per workload (code, infill, text)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the cases")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--ks", default="1,2,3,4,6,8", help="fixed k contenders")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers contenders")
    parser.add_argument("--no-grpc", action="store_true", help="skip the gRPC phase and concurrency sweep")
    parser.add_argument("--sweep-rounds", type=int, default=3,
                        help="measured rounds per concurrency point (contenders alternating; the median is reported)")
    parser.add_argument("--sweep-fresh", action="store_true",
                        help="every request of the concurrency sweep a prompt of its own (a first line naming it), "
                             "prefilled whole beside the other streams' decoding, as new sessions arriving")
    parser.add_argument("--sweep-ks", default="",
                        help="fixed k contenders in the concurrency sweep too, beside the default and target-only "
                             "(e.g. 1,2)")
    parser.add_argument("--concurrency", default="1,2,4,8,16",
                        help="streams at once in the sweep, batched and round-robin (raises --max-sessions to fit)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    parser.add_argument("--weights", default="dtype", choices=["dtype", "int8", "bf16"],
                        help="int8 / bf16: weight-only int8 / bf16 target and draft (CPU); int8 against llama.cpp's "
                             "q8_0")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--max-new-tokens", type=int, default=0, help="override every case's length (0: keep)")
    parser.add_argument("--context-cases", type=int, default=1,
                        help="each case's prompt preceded by the prompts of the next N - 1 cases of its workload: a "
                             "longer context, as an editor's other open files (1: the case alone)")
    parser.add_argument("--max-prompt-tokens", type=int, default=0,
                        help="cut every case's prompt to its last N tokens (0: keep): a large model's prefill on a CPU")
    parser.add_argument("--workloads", default="code,infill,text", help="comma-separated subset of code,infill,text")
    peer = parser.add_argument_group("llama.cpp as a contender (specrpc/bench/llama_server.py; greedy only)")
    peer.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary (without it, the "
                      "llama.cpp contenders are skipped)")
    peer.add_argument("--gguf-target", action="append", default=[], metavar="FILE",
                      help="the target as GGUF (tools/convert_gguf.py); repeatable, e.g. f32 and q8_0: each runs plain")
    peer.add_argument("--gguf-draft", action="append", default=[], metavar="FILE",
                      help="the draft as GGUF, one per --gguf-target in the same order: each pair also runs "
                           "speculative, once per draft setting of --llama-spec")
    peer.add_argument("--llama-spec", default="all", metavar="KEYS",
                      help="llama.cpp's speculative settings, each its own contender per target: all (default: "
                           "draft-N-P for --spec-draft-n-max N in 3, 8, 16 and --spec-draft-p-min P in 0, 0.5, with a "
                           "--gguf-draft; ngram-mod and ngram-cache without one), none (plain only), or a "
                           "comma-separated subset, e.g. draft-3-0,ngram-mod")
    parser.add_argument("--starts", type=int, default=0, metavar="N",
                        help="run only the start-to-start spread: `specrpc serve` started N times, the same prompts "
                             "each time, median decode tokens/s of adaptive and k=0 per start through gRPC; with "
                             "--llama-server, each prompt through llama.cpp's contenders too (bench/starts.py)")
    parser.add_argument("--stream-intervals", default="", metavar="MS,…",
                        help="with --starts N: each mode also with its requests asking for each of these stream "
                             "intervals (stream_interval_ms, 0..1000), interleaved in the same start, ÷ the server's "
                             "own")
    parser.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                        help="with --starts N: N rounds alternating a server of this checkout and one of CHECKOUT "
                             "(another revision of specrpc, its stubs generated), identical tokens checked")
    keys = parser.add_argument_group("keystroke replay (specrpc/bench/keystrokes.py)")
    keys.add_argument("--keystrokes", action="store_true",
                      help="run only the keystroke replay: lines typed in held-out files, an Infill per key through "
                           "gRPC to a `specrpc serve` in another process, each layout against prefix-first")
    keys.add_argument("--keystroke-files", type=int, default=4, help="held-out files, one line typed in each")
    keys.add_argument("--keystroke-layouts", default="typed_line,spm,psm",
                      help="layouts to compare (those the model was not trained for are skipped)")
    keys.add_argument("--keystroke-intervals", default="120,900", help="milliseconds between keys")
    keys.add_argument("--keystroke-chars", type=int, default=0, help="characters typed per line (0: the whole line)")
    args = parser.parse_args(argv)
    if args.keystrokes:
        from specrpc.bench.keystrokes import markdown as keystroke_table
        from specrpc.bench.keystrokes import run as replay_keystrokes

        replayed = replay_keystrokes(args.target, args.draft, args.out, args.keystroke_files,
                                     [x for x in args.keystroke_layouts.split(",") if x],
                                     [int(x) for x in args.keystroke_intervals.split(",") if x], threads=args.threads,
                                     max_new_tokens=args.max_new_tokens or 16, limit=args.keystroke_chars)
        print(keystroke_table(replayed))
        return 0
    try:
        peers = specs(args.llama_server, args.gguf_target, args.gguf_draft, args.threads or torch.get_num_threads(),
                      sweep(args.llama_spec))
    except ValueError as exc:
        parser.error(str(exc))
    if args.stream_intervals and (not args.starts or args.against is not None):
        parser.error("--stream-intervals goes with --starts N (and not with --against): each start's modes run at "
                     "each interval too")
    try:
        intervals = tuple(int(x) for x in args.stream_intervals.split(",") if x)
    except ValueError:
        parser.error(f"--stream-intervals: comma-separated milliseconds; got {args.stream_intervals!r}")
    if any(not 0 <= ms <= MAX_STREAM_INTERVAL_MS for ms in intervals):
        parser.error(f"--stream-intervals: each in 0..{MAX_STREAM_INTERVAL_MS}")
    if peers and args.temperature != 0:
        parser.error("the llama.cpp contenders run greedy only: use --temperature 0 or leave out --llama-server")
    if args.starts:
        from specrpc.bench import starts

        if peers and (len(args.gguf_target) != 1 or "infill" in args.workloads.split(",") or args.against):
            parser.error("--starts with --llama-server: one --gguf-target, no infill workload, no --against")
        cases = build_cases(args.cases, workloads=tuple(w for w in args.workloads.split(",") if w))
        if args.max_new_tokens:
            cases = [replace(c, max_new_tokens=args.max_new_tokens) for c in cases]
        args.out.mkdir(parents=True, exist_ok=True)
        if args.against is not None:
            compared = starts.compare(cases, args.starts, str(args.against), args.target, args.draft, args.threads,
                                      args.dtype, args.weights)
            (args.out / "against.json").write_text(json.dumps(compared, indent=2))
            (args.out / "against.md").write_text(starts.compare_markdown(compared))
            print(starts.compare_markdown(compared))
            return 0 if compared["identical_tokens"] else 1
        spread = starts.run(cases, args.starts, args.target, args.draft, args.threads, args.dtype, args.weights,
                            peers, args.out, intervals)
        (args.out / "starts.json").write_text(json.dumps(spread, indent=2))
        (args.out / "starts.md").write_text(starts.markdown(spread))
        print(starts.markdown(spread))
        return 0
    if not peers:
        print(SKIP_LINE, file=sys.stderr, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",") if k]
    widest = max([int(c) for c in args.concurrency.split(",") if c] or [1])
    context = max(1024, 512 * args.context_cases)  # the code cases' prompts are up to 500 tokens
    engine_config = EngineConfig(target=args.target, draft=args.draft, max_sessions=max(8, widest), max_context=context,
                                 max_draft_tokens=max([*ks, 8]), threads=args.threads, dtype=args.dtype,
                                 weights=args.weights, recheck_s=NO_RECHECK, remember_execution=False)
    config = Config(engine=engine_config, server=ServerConfig(port=0, log_format="console", log_level="warning"),
                    limits=Limits())
    from specrpc.logs import configure

    configure("console", "warning")
    rss0 = rss_bytes()
    runtime = Runtime(config)
    rss_load = rss_bytes() - rss0
    runtime.engine.calibrate()
    runtime.engine.calibrate_batches([slot.index for slot in runtime.registry.slots])
    cases = build_cases(args.cases, workloads=tuple(w for w in args.workloads.split(",") if w))
    if args.max_new_tokens:
        cases = [replace(c, max_new_tokens=args.max_new_tokens) for c in cases]
    if args.context_cases > 1:
        cases = with_context(cases, args.context_cases)
    if args.max_prompt_tokens:
        cases = [replace(c, prompt=runtime.decode_text(runtime.encode(c.prompt)[-args.max_prompt_tokens :]))
                 for c in cases]
    params = SamplingParams(temperature=args.temperature)
    engine = runtime.engine
    contenders: dict[str, Runner] = {"target-only": engine_runner(engine, 0, "draft"),
                                     "adaptive": engine_runner(engine, None, engine.default_proposer),
                                     "adaptive draft only": engine_runner(engine, None, "draft")}
    if engine.draft is not None and engine.draft.window:  # what the draft's window gives (docs/how-it-works.md)
        contenders["adaptive, draft on the whole context"] = engine_runner(engine, None, engine.default_proposer,
                                                                           draft_window=0)
    contenders.update({f"k={k}": engine_runner(engine, k, "draft") for k in ks})
    contenders["prompt lookup only"] = engine_runner(engine, None, "lookup")
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        # Same device and dtype as the engine (bf16 on CUDA), so the ratios compare implementations, not hardware.
        hf_target = AutoModelForCausalLM.from_pretrained(args.target, dtype=runtime.dtype).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=runtime.dtype).eval()
        hf_target.to(runtime.device)
        hf_draft.to(runtime.device)
        eos = runtime.tokenizer.eos_token_id
        contenders["hf generate"] = hf_runner(hf_target, None, eos)
        contenders["hf assisted"] = hf_runner(hf_target, hf_draft, eos)
    with ExitStack() as servers:
        for spec in peers:  # started one by one; each sits idle while another contender runs
            log = args.out / "llama-server" / (spec.name.replace(" + ", "+").replace(" ", "_") + ".log")
            server = servers.enter_context(LlamaServer(spec, log))
            contenders[spec.name] = server.runner()
        for runner in contenders.values():  # warm-up
            runner(prompt_ids(runtime, cases[0])[:32], 8, params)
        runs = run_contenders(runtime, contenders, cases, params, args.rounds)
    base = summarize(runs["target-only"])["tokens_per_s"]
    reference = [r.tokens for r in runs["target-only"]]
    results: dict[str, Any] = {
        "machine": machine_line(runtime.device, runtime.dtype)
                   + (f", {args.weights} weights" if args.weights != "dtype" else ""),
        "pair": pair_line(args.target, args.draft),
        "command": "specrpc bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cases": len(cases), "workload_names": args.workloads, "params": asdict(params),
        "costs": {"c": engine.costs.c, "D": {k: engine.costs.d(k) for k in range(max(ks) + 1)},
                  "V": {k: engine.costs.v(k) for k in range(max(ks) + 1)}},
        "contenders": {},
    }
    results["llama_cpp"] = ({"binary": args.llama_server, "threads": peers[0].threads,
                             "plain": [p.name for p in peers if p.setting is None],
                             "speculative": {plain.name: [p.name for p in peers if p.setting is not None
                                                          and p.target == plain.target]
                                             for plain in peers if plain.setting is None},
                             "commands": {p.name: " ".join(p.command(0)) for p in peers}}
                            if peers else {"skipped": SKIP_LINE})
    for name, rs in runs.items():
        s = summarize(rs)
        if any(r.reported_tokens_per_s for r in rs):
            s["reported_tokens_per_s_median"] = statistics.median(r.reported_tokens_per_s for r in rs)
        entry: dict[str, Any] = {"summary": s, "speedup": s["tokens_per_s"] / base if base else 0.0,
                                 "requests": [request_figures(r) for r in rs]}  # in case order, round after round
        if params.greedy:
            entry["identical"] = sum(r.tokens == ref for r, ref in zip(rs, reference, strict=True)) / len(rs)
        if name.startswith("k="):
            k = int(name.split("=")[1])
            entry["predicted_speedup"] = predicted_speedup(s["alpha"], k, runtime)
            entry["efficiency"] = entry["speedup"] / entry["predicted_speedup"]
        results["contenders"][name] = entry
    if peers:
        results["llama_cpp"]["best"] = best_speculative(results["llama_cpp"], results["contenders"])
    results["workloads"] = {  # per workload: where a contender wins or loses, and its ITL tail
        w: {name: summarize([r for r, c in zip(rs, cases * args.rounds, strict=True) if c.workload == w])
            for name, rs in runs.items()}
        for w in dict.fromkeys(c.workload for c in cases)
    }
    results["memory"] = {
        "weight_bytes": runtime.target_info.weight_bytes + (runtime.draft_info.weight_bytes if runtime.draft_info
                                                            else 0),
        "kv_cache_bytes": runtime.target.cache_bytes() + (runtime.draft.cache_bytes() if runtime.draft else 0),
        "rss_load_delta": rss_load,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))  # in-process part first
    print(markdown(results), file=sys.stderr, flush=True)
    if not args.no_grpc:
        concurrency = [int(c) for c in args.concurrency.split(",") if c]
        release_workers()  # from here on torch runs on the server's device thread alone
        grpc_results = asyncio.run(grpc_phase(runtime, config, cases, params, concurrency,
                                              sweep_rounds=args.sweep_rounds, fresh=args.sweep_fresh,
                                              sweep_ks=tuple(int(k) for k in args.sweep_ks.split(",") if k)))
        results["grpc"] = grpc_results
        results["grpc_overhead"] = grpc_results.pop("overhead")
    adaptive_lengths = [n for r in runs["adaptive"] for n in r.accepted_lengths]
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    charts(results, adaptive_lengths, args.out)
    print(table)
    runtime.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
