"""Load and soak test: N concurrent clients on loopback for T seconds, mixing Generate, Infill, Converse and
cancels, against a `specrpc serve` it starts (or --target host:port). Stops by itself.

Reports the load held (streams, tokens/s), errors by status code, p50/p99 latency (TTFT and total) per kind, and
the server's resident memory (RSS) after warm-up and at the end, with a pass/fail on its growth.

    .venv/bin/python tools/loadtest.py --clients 8 --duration 180                      # ~3 minutes
    .venv/bin/python tools/loadtest.py --clients 8 --duration 3600 --json soak.json    # the one-hour soak
    .venv/bin/python tools/loadtest.py --target host:50051 --token T --server-pid PID  # a server already running

The server it starts gets one bearer token per client (so per-client stream quotas are per client), 1 torch thread,
and as many KV slots as clients. Exit status: 0 pass, 1 fail (an unexpected status code, a hung stream, the server
exiting, or RSS growth after warm-up over the limit), 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from specrpc.v1 import generator_pb2 as pb  # noqa: E402
from specrpc.v1 import generator_pb2_grpc as pb_grpc  # noqa: E402

KINDS = {"generate": 0.35, "keystrokes": 0.15, "infill": 0.2, "converse": 0.15, "cancel": 0.15}
"""Share of each kind of work a client picks next."""
EXPECTED = {"OK", "CANCELLED"}
"""Final statuses that count as success (CANCELLED: only the cancels this tool makes itself)."""
TOLERATED = {"RESOURCE_EXHAUSTED"}
"""Reported but not a failure: the server refusing load it cannot hold is correct behaviour."""
CALL_TIMEOUT_S = 120.0
VERBOSE = False
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        ",
    "# Read a CSV file and print the sum of the second column\nimport csv\n",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox",
    "for i in range(10):\n    print(",
]
INFILLS = [
    ("def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"),
    ("def is_even(n):\n    ", "\n"),
    ("with open(path) as fh:\n    data = ", "\nprint(len(data))\n"),
]
TURNS = ["Hello! What can you do?", "Tell me a short story.", "Why is the sky blue?", "Thanks, and one more thing."]


@dataclass
class Record:
    """One stream as the client saw it."""

    kind: str
    code: str
    ttft_ms: float | None
    total_ms: float
    tokens: int


@dataclass
class Stats:
    records: list[Record] = field(default_factory=list)
    hung: int = 0

    def add(self, kind: str, code: str, started: float, first: float | None, tokens: int) -> None:
        now = time.perf_counter()
        self.records.append(Record(kind, code, None if first is None else (first - started) * 1e3,
                                   (now - started) * 1e3, tokens))


# ---- the server under test -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process in MiB (Linux /proc), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def wait_serving(target: str, metadata: Sequence[tuple[str, str]], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2, metadata=metadata)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.2)
    raise SystemExit(f"loadtest: {target} not SERVING within {timeout} s")


# ---- clients ------------------------------------------------------------------------------------------------------


async def read_stream(call: Any, stop_after: int | None = None) -> tuple[str, float | None, int]:
    """Read a Generate/Infill stream; cancel it after `stop_after` chunks. (status, first-token time, tokens)."""
    first: float | None = None
    tokens = 0
    chunks = 0
    try:
        async for response in call:
            if response.WhichOneof("event") == "chunk":
                chunks += 1
                if response.chunk.token_ids:
                    first = first or time.perf_counter()
                    tokens += len(response.chunk.token_ids)
                if stop_after is not None and chunks >= stop_after:
                    call.cancel()
                    break
        code = (await call.code()).name
    except grpc.aio.AioRpcError as error:
        code = error.code().name
        if VERBOSE and code not in EXPECTED:
            print(f"loadtest: {code}: {error.details()}", file=sys.stderr)
    except asyncio.CancelledError:
        code = "CANCELLED"
    return code, first, tokens


async def one_converse(stub: pb_grpc.GeneratorStub, rng: random.Random, args: argparse.Namespace,
                       metadata: Sequence[tuple[str, str]], stats: Stats) -> None:
    """A voice-style session: 2-3 turns, one of them interrupted by a barge-in cancel; each turn is one record."""
    call = stub.Converse(timeout=CALL_TIMEOUT_S, metadata=metadata)
    try:
        await call.write(pb.ConverseRequest(start=pb.SessionStart(system="You are a helpful assistant.",
                                                                  phrase_mode=True,
                                                                  max_new_tokens=args.max_new_tokens)))
        response = await call.read()
        if response is grpc.aio.EOF:
            stats.add("converse", (await call.code()).name, time.perf_counter(), None, 0)
            return
        barge_in = rng.randrange(3)
        for turn in range(rng.randint(2, 3)):
            started = time.perf_counter()
            first: float | None = None
            tokens = 0
            await call.write(pb.ConverseRequest(turn=pb.Turn(text=rng.choice(TURNS))))
            chunks = 0
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    stats.add("converse", (await call.code()).name, started, first, tokens)
                    return
                kind = response.WhichOneof("event")
                if kind == "chunk" and response.chunk.token_ids:
                    first = first or time.perf_counter()
                    tokens += len(response.chunk.token_ids)
                    chunks += 1
                    if turn == barge_in and chunks == 3:
                        await call.write(pb.ConverseRequest(cancel=pb.Cancel()))
                elif kind == "summary":
                    break
            stats.add("converse", "OK", started, first, tokens)
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        if VERBOSE and error.code().name not in EXPECTED:
            print(f"loadtest: converse {error.code().name}: {error.details()}", file=sys.stderr)
        stats.add("converse", error.code().name, time.perf_counter(), None, 0)


async def client(index: int, target: str, token: str | None, args: argparse.Namespace, deadline: float,
                 stats: Stats) -> None:
    rng = random.Random(args.seed * 1000 + index)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    kinds, weights = zip(*KINDS.items(), strict=True)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        typed = ""
        while time.perf_counter() < deadline:
            kind = rng.choices(kinds, weights)[0]
            started = time.perf_counter()
            n = rng.randint(max(1, args.max_new_tokens // 4), args.max_new_tokens)
            try:
                if kind == "converse":
                    await asyncio.wait_for(one_converse(stub, rng, args, metadata, stats), CALL_TIMEOUT_S)
                    continue
                if kind == "infill":
                    prefix, suffix = rng.choice(INFILLS)
                    call = stub.Infill(pb.InfillRequest(prefix=prefix, suffix=suffix, max_new_tokens=n,
                                                        session_id=f"infill-{index}"),
                                       timeout=CALL_TIMEOUT_S, metadata=metadata)
                    result = await asyncio.wait_for(read_stream(call), CALL_TIMEOUT_S)
                elif kind == "keystrokes":  # an editor: the buffer grows, each request on the same session
                    typed = typed + rng.choice([" x", " = ", "(", "a", "\n    "]) if len(typed) < 200 else ""
                    call = stub.Generate(pb.GenerateRequest(prompt=PROMPTS[index % len(PROMPTS)] + typed,
                                                            max_new_tokens=n, session_id=f"editor-{index}"),
                                         timeout=CALL_TIMEOUT_S, metadata=metadata)
                    result = await asyncio.wait_for(read_stream(call, stop_after=rng.randint(1, 6)), CALL_TIMEOUT_S)
                else:
                    sampling = pb.SamplingParams(temperature=rng.choice([0.0, 0.0, 0.7]), top_p=0.95,
                                                 seed=rng.randrange(2**32))
                    call = stub.Generate(pb.GenerateRequest(prompt=rng.choice(PROMPTS), max_new_tokens=n,
                                                            sampling=sampling),
                                         timeout=CALL_TIMEOUT_S, metadata=metadata)
                    stop_after = rng.randint(1, 8) if kind == "cancel" else None
                    result = await asyncio.wait_for(read_stream(call, stop_after), CALL_TIMEOUT_S)
                code, first, tokens = result
                stats.add(kind, code, started, first, tokens)
            except TimeoutError:
                stats.hung += 1
                stats.add(kind, "HUNG", started, None, 0)


# ---- report ---------------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of RSS over time."""
    if len(samples) < 3:
        return None
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return None if var == 0 else sum((t - mt) * (y - my) for t, y in samples) / var * 60


def summarize(stats: Stats, seconds: float) -> dict[str, Any]:
    by_kind: dict[str, list[Record]] = defaultdict(list)
    for r in stats.records:
        by_kind[r.kind].append(r)
    kinds = {}
    for kind, records in sorted(by_kind.items()):
        ok = [r for r in records if r.code in EXPECTED]
        ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        total = [r.total_ms for r in ok if r.code == "OK"]
        kinds[kind] = {
            "streams": len(records), "codes": dict(Counter(r.code for r in records)),
            "tokens": sum(r.tokens for r in records),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "total_ms_p50": percentile(total, 50), "total_ms_p99": percentile(total, 99),
        }
    ttft_all = [r.ttft_ms for r in stats.records if r.code in EXPECTED and r.ttft_ms is not None]
    total_all = [r.total_ms for r in stats.records if r.code == "OK"]
    tokens = sum(r.tokens for r in stats.records)
    return {
        "seconds": round(seconds, 1), "streams": len(stats.records),
        "streams_per_s": round(len(stats.records) / seconds, 2), "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1), "codes": dict(Counter(r.code for r in stats.records)),
        "hung": stats.hung, "ttft_ms_p50": percentile(ttft_all, 50), "ttft_ms_p99": percentile(ttft_all, 99),
        "total_ms_p50": percentile(total_all, 50), "total_ms_p99": percentile(total_all, 99), "kinds": kinds,
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    print(f"\n== load: {report['clients']} clients for {s['seconds']} s against {report['target']}")
    print(f"streams {s['streams']} ({s['streams_per_s']}/s), tokens {s['tokens']} ({s['tokens_per_s']}/s), "
          f"hung {s['hung']}")
    print(f"status codes: {s['codes']}")
    print(f"TTFT ms p50 {fmt(s['ttft_ms_p50'])} p99 {fmt(s['ttft_ms_p99'])}; total ms p50 {fmt(s['total_ms_p50'])} "
          f"p99 {fmt(s['total_ms_p99'])}")
    print(f"{'kind':<11} {'streams':>7} {'tokens':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'total p50':>10} "
          f"{'total p99':>10}  codes")
    for kind, k in s["kinds"].items():
        print(f"{kind:<11} {k['streams']:>7} {k['tokens']:>7} {fmt(k['ttft_ms_p50']):>9} {fmt(k['ttft_ms_p99']):>9} "
              f"{fmt(k['total_ms_p50']):>10} {fmt(k['total_ms_p99']):>10}  {k['codes']}")
    m = report["memory"]
    if m["rss_mib_after_warmup"] is not None:
        print(f"server RSS MiB: at start {fmt(m['rss_mib_start'])}, after warm-up {fmt(m['rss_mib_after_warmup'])}, "
              f"peak {fmt(m['rss_mib_peak'])}, end {fmt(m['rss_mib_end'])}; growth after warm-up "
              f"{fmt(m['growth_mib'])} MiB (limit {m['limit_mib']}); slope {fmt(m['slope_mib_per_min'], 2)} MiB/min, "
              f"{fmt(m['slope_last_half_mib_per_min'], 2)} MiB/min over the last half")
    else:
        print("server RSS: unknown (give --server-pid for a server started elsewhere on this machine)")
    print(f"verdict: {'PASS' if report['pass'] else 'FAIL'}" + (f" ({'; '.join(report['why'])})" if report["why"]
                                                                  else ""))


# ---- main -----------------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tokens: list[str | None] = [None] * args.clients
    server: subprocess.Popen[bytes] | None = None
    workdir = tempfile.TemporaryDirectory(prefix="specrpc-loadtest-")
    pid = args.server_pid
    if args.target:
        target = args.target
        if args.token:
            tokens = [args.token] * args.clients
    else:
        port = free_port()
        target = f"127.0.0.1:{port}"
        tokens = [secrets.token_urlsafe(24) for _ in range(args.clients)]  # one per client: per-token quotas
        tokens_file = Path(workdir.name) / "tokens"
        tokens_file.write_text("# loadtest clients\n" + "\n".join(t for t in tokens if t) + "\n")
        cmd = [sys.executable, "-m", "specrpc.cli", "serve", "--port", str(port), "--metrics-port", "0",
               "--threads", str(args.threads), "--max-sessions", str(max(args.clients, 2)),
               "--auth-tokens-file", str(tokens_file), "--log-format", "json", *args.server_arg]
        log = open(Path(workdir.name) / "serve.log", "wb")  # noqa: SIM115 - closed below
        server = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        pid = server.pid
        print(f"loadtest: started `{' '.join(cmd[1:])}` (pid {pid})", file=sys.stderr)
    try:
        await wait_serving(target, [("authorization", f"Bearer {tokens[0]}")] if tokens[0] else [])
        samples: list[tuple[float, float]] = []
        start_rss = rss_mib(pid) if pid else None
        stats = Stats()
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        warmup = min(args.warmup, args.duration / 2)

        async def sample() -> None:
            while True:
                value = rss_mib(pid) if pid else None
                if value is not None:
                    samples.append((time.perf_counter() - t0, value))
                await asyncio.sleep(args.sample_s)

        sampler = asyncio.create_task(sample())
        clients = [asyncio.create_task(client(i, target, tokens[i], args, deadline, stats))
                   for i in range(args.clients)]
        done, pending = await asyncio.wait(clients, timeout=args.duration + CALL_TIMEOUT_S + 30)
        for task in pending:
            task.cancel()
            stats.hung += 1
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        seconds = time.perf_counter() - t0
        await asyncio.sleep(2)  # let the server settle (slots released, allocator idle) before the final reading
        sampler.cancel()
        end_rss = rss_mib(pid) if pid else None
        if end_rss is not None:
            samples.append((time.perf_counter() - t0, end_rss))
        after_warmup = [v for t, v in samples if t >= warmup]
        warm_rss = after_warmup[0] if after_warmup else None
        growth = None if warm_rss is None or end_rss is None else end_rss - warm_rss
        summary = summarize(stats, seconds)
        why = []
        unexpected = {c: n for c, n in summary["codes"].items() if c not in EXPECTED | TOLERATED}
        if unexpected:
            why.append(f"unexpected status codes {unexpected}")
        if stats.hung:
            why.append(f"{stats.hung} hung streams")
        if growth is not None and growth > args.max_rss_growth_mib:
            why.append(f"RSS grew {growth:.1f} MiB after warm-up (limit {args.max_rss_growth_mib})")
        if server is not None and server.poll() is not None:
            why.append(f"the server exited with {server.returncode}")
        return {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "target": target, "clients": args.clients, "duration_s": args.duration,
            "max_new_tokens": args.max_new_tokens, "mix": KINDS, "summary": summary,
            "memory": {"rss_mib_start": start_rss, "rss_mib_after_warmup": warm_rss, "rss_mib_end": end_rss,
                       "rss_mib_peak": max((v for _, v in samples), default=None), "growth_mib": growth,
                       "limit_mib": args.max_rss_growth_mib, "warmup_s": warmup,
                       "slope_mib_per_min": slope_mib_per_min([(t, v) for t, v in samples if t >= warmup]),
                       "slope_last_half_mib_per_min": slope_mib_per_min(
                           [(t, v) for t, v in samples if t >= warmup + (seconds - warmup) / 2]),
                       "samples": [(round(t, 1), round(v, 1)) for t, v in samples]},
            "pass": not why, "why": why,
        }
    finally:
        if server is not None:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    code = server.wait(30)
                    if code != 0:
                        print(f"loadtest: the server exited with {code}", file=sys.stderr)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            log.close()
            if args.keep_log:
                target_log = Path(args.keep_log)
                target_log.write_bytes((Path(workdir.name) / "serve.log").read_bytes())
        workdir.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--duration", type=float, default=180, help="seconds of load (default 180)")
    parser.add_argument("--warmup", type=float, default=60,
                        help="seconds before the RSS baseline is taken (default 60, at most half the duration): "
                             "the first minute fills caches (oneDNN primitives per shape, allocator pools)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="largest reply per request (default 48)")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64,
                        help="fail when RSS grows more than this after warm-up (default 64)")
    parser.add_argument("--sample-s", type=float, default=5, help="RSS sampling period (default 5 s)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the clients' choices")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server it starts (default 1)")
    parser.add_argument("--target", help="host:port of a running server instead of starting one")
    parser.add_argument("--token", help="bearer token for --target")
    parser.add_argument("--server-pid", type=int, help="pid of the --target server, for its RSS (same machine)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `specrpc serve` flag for the server it starts (repeat; e.g. --server-arg=--lean)")
    parser.add_argument("--json", help="write the full report (with RSS samples) to this file")
    parser.add_argument("--keep-log", help="copy the started server's log to this file")
    parser.add_argument("--verbose", action="store_true", help="print the details of every unexpected status")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")
    global VERBOSE
    VERBOSE = args.verbose
    report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)) + "\n")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
