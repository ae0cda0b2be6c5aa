"""Mixed-traffic soak on both edges at once, for hours: editor keystroke sessions (gRPC Infill and llama.cpp /infill,
cancel-previous), voice turns with barge-in and rewind (gRPC Converse), OpenAI chat with long histories (streamed,
resent whole each turn), plain completions (gRPC Generate, OpenAI /v1/completions), and hostile clients that
disconnect mid-stream, stall without reading, or send garbage. Against a `specrpc serve` it starts (or --target and
--http-target with --server-pid).

Reports the server's RSS sampled every --sample-s (60 s), latency p50/p90 (time to first event, and total) per
traffic kind per --window-s (10 minutes), status counts per kind, and hung streams (no event for --hang-s, 30 s, while
the client reads). Verdict: no unexpected status, no hung stream, the server alive, RSS at the end within --rss-pct
(5 %) of its value after --baseline-s (5 minutes), and (with two whole windows or more, unless --no-latency-check)
each kind's p50 and p90 time to first event in the last whole window within --latency-pct (20 %) of the first's
(totals are reported, not judged: they move with the share of barge-ins and drops; hostile clients are not judged).

    .venv/bin/python tools/soak.py --duration 3600 --json soak.json       # make soak HOURS=1
    .venv/bin/python tools/soak.py --duration 40 --window-s 10 --sample-s 2 --baseline-s 10 --no-latency-check

Exit status: 0 pass, 1 fail, 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from specrpc.training.lock import refuse_beside_training  # noqa: E402
from specrpc.v1 import generator_pb2 as pb  # noqa: E402
from specrpc.v1 import generator_pb2_grpc as pb_grpc  # noqa: E402

CLIENTS = {"editor": 2, "voice": 1, "chat": 1, "completion": 1, "hostile": 1}
"""Concurrent clients per traffic kind (scaled by --scale)."""
OK_GRPC = {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}  # CANCELLED: only this tool's own cancels
OK_HTTP = {"200", "429", "dropped", "stalled"}
HOSTILE_OK = {"400", "404", "405", "413", "INVALID_ARGUMENT"}
"""What a hostile client must get back: a refusal naming the problem, never a server error."""

CODE = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def push(self, x):\n",
        "for i in range(10):\n    print(", "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"]
SUFFIXES = ["\n\n\nprint(main())\n", "\n", "\n    return result\n"]
WORDS = ["Hello! What can you do?", "Tell me a short story.", "Why is the sky blue?", "And then?", "Thanks."]


class Hung(Exception):
    """No event for --hang-s while the client was reading."""


@dataclass
class Sample:
    kind: str
    edge: str
    outcome: str
    at: float  # seconds since the start
    first_ms: float | None
    total_ms: float


@dataclass
class Soak:
    args: argparse.Namespace
    t0: float = field(default_factory=time.perf_counter)
    samples: list[Sample] = field(default_factory=list)
    hung: Counter[str] = field(default_factory=Counter)
    rss: list[tuple[float, float]] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, kind: str, edge: str, outcome: str, started: float, first: float | None) -> None:
        end = time.perf_counter()
        self.samples.append(Sample(kind, edge, outcome, started - self.t0,
                                   None if first is None else (first - started) * 1e3, (end - started) * 1e3))

    async def events(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """`stream`'s items, raising Hung when one takes longer than --hang-s."""
        iterator = aiter(stream)
        while True:
            try:
                item = await asyncio.wait_for(anext(iterator), self.args.hang_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise Hung from None
            yield item


# ---- gRPC -----------------------------------------------------------------------------------------------------------

async def grpc_stream(soak: Soak, kind: str, call: Any, cancel_after: int | None = None) -> None:
    """Read a Generate/Infill stream (cancelling it after `cancel_after` events) and record it."""
    started, first, n = time.perf_counter(), None, 0
    outcome = "OK"
    try:
        async for _ in soak.events(call):
            first = first or time.perf_counter()
            n += 1
            if cancel_after is not None and n >= cancel_after:
                call.cancel()
                outcome = "CANCELLED"
                break
    except grpc.aio.AioRpcError as error:
        outcome = error.code().name
    except Hung:
        call.cancel()
        soak.hung[kind] += 1
        outcome = "hung"
    soak.add(kind, "grpc", outcome, started, first)


async def editor(soak: Soak, rng: random.Random, index: int, channel: grpc.aio.Channel,
                 http: httpx2.AsyncClient) -> None:
    """One keystroke session: type a line a character at a time, a completion per keystroke (cancel-previous:
    the server supersedes the older one), every other session over llama.cpp's /infill."""
    stub = pb_grpc.GeneratorStub(channel)
    session = f"editor-{index}-{rng.randrange(1 << 30)}"
    prefix, suffix, line = rng.choice(CODE), rng.choice(SUFFIXES), ""
    over_http = rng.random() < 0.5
    for char in "    result = compute(value)"[: rng.randint(4, 20)]:
        line += char
        if over_http:
            body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": line, "n_predict": 8, "stream": True,
                    "t_max_predict_ms": 500, "cache_prompt": True}
            await http_stream(soak, "editor", http, "/infill", body, session)
        else:
            request = pb.InfillRequest(prefix=prefix, suffix=suffix, typed_line=line, session_id=session,
                                       max_new_tokens=8, max_time_ms=500)
            await grpc_stream(soak, "editor", stub.Infill(request, timeout=120, metadata=(("x-session-id", session),)))
        await asyncio.sleep(rng.uniform(0.05, 0.3))


async def voice(soak: Soak, rng: random.Random, index: int, channel: grpc.aio.Channel,
                http: httpx2.AsyncClient) -> None:
    """A Converse session of a few turns; one in three is barged in on after its first phrase and rewound to what
    was 'spoken'."""
    stub = pb_grpc.GeneratorStub(channel)
    outbox: asyncio.Queue[pb.ConverseRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ConverseRequest]:
        while (item := await outbox.get()) is not None:
            yield item

    call = stub.Converse(requests(), timeout=600)
    await outbox.put(pb.ConverseRequest(start=pb.SessionStart(system="You are a voice assistant.", phrase_mode=True,
                                                              max_new_tokens=24)))
    events = soak.events(call)
    try:
        await anext(events)  # started
        for _ in range(rng.randint(2, 5)):
            barge = rng.random() < 1 / 3
            started, first = time.perf_counter(), None
            await outbox.put(pb.ConverseRequest(turn=pb.Turn(text=rng.choice(WORDS))))
            async for response in events:
                event = response.WhichOneof("event")
                if event in ("chunk", "phrase") and first is None:
                    first = time.perf_counter()
                    if barge:
                        await outbox.put(pb.ConverseRequest(cancel=pb.Cancel()))
                if event == "summary":
                    break
            soak.add("voice", "grpc", "CANCELLED" if barge else "OK", started, first)
            if barge:
                await outbox.put(pb.ConverseRequest(rewind=pb.Rewind(spoken_chars=rng.randint(0, 20))))
                async for response in events:
                    if response.WhichOneof("event") == "rewound":
                        break
            await asyncio.sleep(rng.uniform(0.2, 1.0))  # the user speaks
        await outbox.put(None)
        async for _ in events:
            pass
    except grpc.aio.AioRpcError as error:
        soak.add("voice", "grpc", error.code().name, time.perf_counter(), None)
    except Hung:
        call.cancel()
        soak.hung["voice"] += 1
        soak.add("voice", "grpc", "hung", time.perf_counter(), None)
    finally:
        outbox.put_nowait(None)


# ---- HTTP -----------------------------------------------------------------------------------------------------------

async def http_stream(soak: Soak, kind: str, http: httpx2.AsyncClient, path: str, body: dict[str, Any],
                      session: str = "", drop_after: int | None = None, stall_s: float = 0.0) -> None:
    """POST `body` and read the SSE answer (dropping the connection after `drop_after` events, or stalling
    `stall_s` without reading after the first); record it."""
    headers = {"x-session-id": session} if session else {}
    started, first, outcome = time.perf_counter(), None, ""
    try:
        async with http.stream("POST", path, json=body, headers=headers) as response:
            outcome = str(response.status_code)
            if response.status_code != 200:
                await response.aread()
            else:
                n = 0
                async for _ in soak.events(response.aiter_lines()):
                    first = first or time.perf_counter()
                    n += 1
                    if drop_after is not None and n >= drop_after:
                        outcome = "dropped"
                        break
                    if stall_s and n == 1:
                        await asyncio.sleep(stall_s)  # a client that stops reading: the server must not hang
                        outcome = "stalled"
    except Hung:
        soak.hung[kind] += 1
        outcome = "hung"
    except httpx2.HTTPError as exc:
        outcome = f"error {type(exc).__name__}"
    soak.add(kind, "http", outcome, started, first)


async def chat(soak: Soak, rng: random.Random, index: int, channel: grpc.aio.Channel,
               http: httpx2.AsyncClient) -> None:
    """An OpenAI chat whose whole history is resent each turn, growing long (up to 40 messages)."""
    session = f"chat-{index}-{rng.randrange(1 << 30)}"
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant. " * 4}]
    for _ in range(rng.randint(5, 20)):
        messages.append({"role": "user", "content": rng.choice(WORDS) + " " + rng.choice(CODE)})
        body = {"messages": messages, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
        await http_stream(soak, "chat", http, "/v1/chat/completions", body, session)
        messages.append({"role": "assistant", "content": "Sure. " * rng.randint(1, 8)})
        await asyncio.sleep(rng.uniform(0.1, 0.5))


async def completion(soak: Soak, rng: random.Random, index: int, channel: grpc.aio.Channel,
                     http: httpx2.AsyncClient) -> None:
    """Plain completions without a session: gRPC Generate or OpenAI /v1/completions (not streamed)."""
    stub = pb_grpc.GeneratorStub(channel)
    prompt = rng.choice(CODE)
    if rng.random() < 0.5:
        await grpc_stream(soak, "completion", stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=16),
                                                            timeout=120))
        return
    started = time.perf_counter()
    try:
        response = await asyncio.wait_for(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16}),
                                          soak.args.hang_s)
        outcome = str(response.status_code)
    except TimeoutError:
        soak.hung["completion"] += 1
        outcome = "hung"
    soak.add("completion", "http", outcome, started, None)


GARBAGE = [b"", b"{", b"\xff\xfe\x00\x01", b"[1, 2, 3]", b'{"messages": 5, "temperature": "hot"}',
           b'{"prompt": {"a": 1}, "temperature": "hot"}', b'{"max_tokens": -1, "n_predict": -7, "prompt": "x"}',
           b'{"messages": [{"role": "bogus", "content": "x"}], "temperature": "hot"}']
"""Bodies every route refuses (a JSON object always carries a field no route takes as it is)."""


async def hostile(soak: Soak, rng: random.Random, index: int, channel: grpc.aio.Channel,
                  http: httpx2.AsyncClient) -> None:
    """Clients that drop a stream mid-way, stall without reading, or send garbage (HTTP bodies, gRPC bytes)."""
    stub = pb_grpc.GeneratorStub(channel)
    what = rng.choice(["drop_http", "drop_grpc", "stall", "garbage_http", "garbage_grpc"])
    body = {"prompt": rng.choice(CODE), "max_tokens": 64, "stream": True}
    if what == "drop_http":
        await http_stream(soak, "hostile", http, "/v1/completions", body, drop_after=rng.randint(1, 3))
    elif what == "stall":
        await http_stream(soak, "hostile", http, "/v1/completions", body, stall_s=rng.uniform(1, 5))
    elif what == "drop_grpc":
        await grpc_stream(soak, "hostile", stub.Generate(pb.GenerateRequest(prompt=body["prompt"], max_new_tokens=64),
                                                         timeout=120), cancel_after=rng.randint(1, 3))
    elif what == "garbage_http":
        started = time.perf_counter()
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/infill", "/completion"])
        response = await http.post(path, content=rng.choice(GARBAGE), headers={"content-type": "application/json"})
        ok = response.status_code in (400, 404, 405, 413) and "error" in response.json()
        soak.add("hostile", "http", str(response.status_code) if ok else f"bad {response.status_code}", started, None)
    else:
        started = time.perf_counter()
        raw = channel.unary_stream("/specrpc.v1.Generator/Generate")  # bytes in, bytes out: no (de)serializer
        call = raw(rng.choice(GARBAGE[2:4]) + b"\x0a\xff", timeout=30)
        try:
            async for _ in call:
                pass
            outcome = "OK"
        except grpc.aio.AioRpcError as error:
            outcome = error.code().name
        soak.add("hostile", "grpc", outcome, started, None)
    await asyncio.sleep(rng.uniform(0.2, 1.0))


TRAFFIC: dict[str, Callable[[Soak, random.Random, int, grpc.aio.Channel, httpx2.AsyncClient], Awaitable[None]]]
TRAFFIC = {"editor": editor, "voice": voice, "chat": chat, "completion": completion, "hostile": hostile}


async def client(soak: Soak, kind: str, index: int, grpc_target: str, http_target: str, deadline: float) -> None:
    rng = random.Random(f"{soak.args.seed}-{kind}-{index}")
    async with grpc.aio.insecure_channel(grpc_target) as channel, \
            httpx2.AsyncClient(base_url=http_target, timeout=httpx2.Timeout(600, connect=10)) as http:
        while time.perf_counter() < deadline:
            await TRAFFIC[kind](soak, rng, index, channel, http)


# ---- the report -----------------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def windows(soak: Soak) -> list[dict[str, Any]]:
    """Per --window-s: per kind, requests and p50/p90 of time to first event and of total time (ms)."""
    by: dict[int, dict[str, list[Sample]]] = defaultdict(lambda: defaultdict(list))
    for s in soak.samples:
        by[int(s.at // soak.args.window_s)][s.kind].append(s)
    out = []
    for w in sorted(by):
        kinds = {}
        for kind, samples in sorted(by[w].items()):
            firsts = [s.first_ms for s in samples if s.first_ms is not None]
            totals = [s.total_ms for s in samples]
            kinds[kind] = {"n": len(samples), "first_p50": percentile(firsts, 50), "first_p90": percentile(firsts, 90),
                           "total_p50": percentile(totals, 50), "total_p90": percentile(totals, 90)}
        out.append({"from_s": w * soak.args.window_s, "kinds": kinds})
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def verdict(soak: Soak, report: dict[str, Any], alive: bool) -> list[str]:
    args, why = soak.args, []
    for (kind, outcome), n in report["outcomes"].items():
        expected = HOSTILE_OK | OK_GRPC | {"OK", "dropped", "stalled"} if kind == "hostile" else OK_GRPC | OK_HTTP
        if outcome not in expected:
            why.append(f"{kind}: {n} × {outcome}")
    if sum(soak.hung.values()):
        why.append(f"hung streams {dict(soak.hung)}")
    if not alive:
        why.append("the server exited")
    memory = report["memory"]
    if memory["baseline_mib"] and memory["end_mib"]:
        drift = 100 * (memory["end_mib"] - memory["baseline_mib"]) / memory["baseline_mib"]
        memory["drift_pct"] = round(drift, 2)
        if abs(drift) > args.rss_pct:
            why.append(f"RSS {memory['end_mib']:.0f} MiB at the end vs {memory['baseline_mib']:.0f} after "
                       f"{args.baseline_s:.0f}s ({drift:+.1f} %, limit {args.rss_pct} %)")
    # whole windows only (the requests that started just before the end make a short last one); time to first event,
    # what a user waits for (totals move with the share of barge-ins and drops); hostile clients' times mean nothing
    win = [w for w in report["windows"] if w["from_s"] + args.window_s <= args.duration + 1]
    if len(win) >= 2 and args.latency_check:
        first, last = win[0]["kinds"], win[-1]["kinds"]
        for kind in sorted(set(first) & set(last) - {"hostile"}):
            for key in ("first_p50", "first_p90"):
                a, b = first[kind][key], last[kind][key]
                if a and b and abs(b - a) / a * 100 > args.latency_pct:
                    why.append(f"{kind} {key} {a:.0f} → {b:.0f} ms (limit ±{args.latency_pct} %)")
    return why


def print_report(report: dict[str, Any]) -> None:
    print(f"soak: {report['seconds']:.0f} s, {report['requests']} requests; hung streams {report['hung']}")
    print("outcomes:", ", ".join(f"{k}/{o} {n}" for (k, o), n in sorted(report["outcomes"].items())))
    memory = report["memory"]
    print(f"RSS MiB: start {memory['start_mib']}, after baseline {memory['baseline_mib']}, end {memory['end_mib']}, "
          f"drift {memory.get('drift_pct')} %")
    heads = ("first p50", "first p90", "total p50", "total p90")
    print(f"{'window':>8} {'kind':<11} {'n':>5} " + " ".join(f"{h:>10}" for h in heads))
    for w in report["windows"]:
        for kind, k in w["kinds"].items():
            cells = [f"{k[c]:.0f}" if k[c] is not None else "-" for c in ("first_p50", "first_p90", "total_p50",
                                                                          "total_p90")]
            print(f"{w['from_s']:>7.0f}s {kind:<11} {k['n']:>5} " + " ".join(f"{c:>10}" for c in cells))
    print("verdict:", "PASS" if report["pass"] else "FAIL: " + "; ".join(report["why"]))


# ---- running --------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_serving(target: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.5)
    raise SystemExit(f"soak: {target} not SERVING within {timeout:.0f} s")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server: subprocess.Popen[bytes] | None = None
    workdir = tempfile.TemporaryDirectory(prefix="specrpc-soak-")
    pid, grpc_target, http_target = args.server_pid, args.target, args.http_target
    clients = {kind: max(1, round(n * args.scale)) for kind, n in CLIENTS.items()}
    if not grpc_target:
        port, http_port = free_port(), free_port()
        grpc_target, http_target = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        cmd = [sys.executable, "-m", "specrpc.cli", "serve", "--port", str(port), "--http-port", str(http_port),
               "--metrics-port", "0", "--threads", str(args.threads), "--max-sessions", str(sum(clients.values()) + 2),
               "--log-format", "json", *args.server_arg]
        log = open(Path(workdir.name) / "serve.log", "wb")  # noqa: SIM115 - closed below
        server = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        pid = server.pid
        print(f"soak: started `{' '.join(cmd[1:])}` (pid {pid})", file=sys.stderr)
    soak = Soak(args)
    try:
        await wait_serving(grpc_target)
        soak.t0 = time.perf_counter()
        start_rss = rss_mib(pid) if pid else None
        deadline = soak.t0 + args.duration

        async def sample() -> None:
            while True:
                value = rss_mib(pid) if pid else None
                if value is not None:
                    soak.rss.append((soak.now(), value))
                await asyncio.sleep(args.sample_s)

        sampler = asyncio.create_task(sample())
        tasks = [asyncio.create_task(client(soak, kind, i, grpc_target, http_target, deadline))
                 for kind, n in clients.items() for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=args.duration + 4 * args.hang_s + 60)
        for task in pending:  # a client stuck past every timeout: count it as hung
            task.cancel()
            soak.hung["client"] += 1
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        seconds = soak.now()
        await asyncio.sleep(2)
        sampler.cancel()
        end_rss = rss_mib(pid) if pid else None
        if end_rss is not None:
            soak.rss.append((soak.now(), end_rss))
        baseline = next((v for t, v in soak.rss if t >= args.baseline_s), None)
        outcomes = Counter((s.kind, s.outcome) for s in soak.samples)
        report: dict[str, Any] = {
            "command": " ".join(["tools/soak.py", *sys.argv[1:]]), "seconds": seconds, "clients": clients,
            "requests": len(soak.samples), "hung": dict(soak.hung), "outcomes": outcomes,
            "memory": {"start_mib": start_rss, "baseline_mib": baseline, "end_mib": end_rss,
                       "samples": [(round(t), round(v, 1)) for t, v in soak.rss]},
            "windows": windows(soak),
        }
        alive = server is None or server.poll() is None
        report["why"] = verdict(soak, report, alive)
        report["pass"] = not report["why"]
        return report
    finally:
        if server is not None:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            log.close()
        workdir.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--duration", type=float, default=3600, help="seconds of traffic")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the clients per kind")
    parser.add_argument("--window-s", type=float, default=600, help="latency percentiles per this many seconds")
    parser.add_argument("--sample-s", type=float, default=60, help="RSS sample period")
    parser.add_argument("--baseline-s", type=float, default=300, help="RSS is compared to its value after this")
    parser.add_argument("--rss-pct", type=float, default=5.0, help="allowed RSS drift from the baseline, %%")
    parser.add_argument("--latency-pct", type=float, default=20.0, help="allowed p50/p90 drift, first→last window")
    parser.add_argument("--no-latency-check", dest="latency_check", action="store_false",
                        help="report the latency drift without failing on it (short runs)")
    parser.add_argument("--hang-s", type=float, default=30, help="a stream without an event this long is hung")
    parser.add_argument("--threads", type=int, default=2, help="the started server's --threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="", help="gRPC HOST:PORT of a running server (else one is started)")
    parser.add_argument("--http-target", default="", help="its HTTP base URL (with --target)")
    parser.add_argument("--server-pid", type=int, default=0, help="its pid, for RSS (with --target)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `specrpc serve` argument")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    refuse_beside_training("the soak")
    if bool(args.target) != bool(args.http_target) or args.duration <= 0 or args.window_s <= 0:
        parser.error("--target and --http-target go together; --duration and --window-s must be positive")
    report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        serializable = {**report, "outcomes": {f"{k}/{o}": n for (k, o), n in report["outcomes"].items()}}
        Path(args.json).write_text(json.dumps(serializable, indent=2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
