"""Does a hostile schema slow the other streams? A greedy gRPC stream's inter-token gaps on a running server while
another client sends, back to back over HTTP, chat requests with tools whose schemas are hostile (400 levels deep, a
20,000-value enum, a recursive `$ref`, a bad `pattern`, a 1 MB schema), against the same stream while the same
client sends the same requests with a small benign schema, and against the stream alone. Phases alternate round by
round, so drift hits them alike.

    .venv/bin/specrpc serve --port 50051 --http-port 8080 &
    .venv/bin/python tools/hostile_latency.py --grpc 127.0.0.1:50051 --http http://127.0.0.1:8080 --rounds 3

Prints, per phase, the gaps' p50 / p90 / p99 / max in ms (gaps between streamed messages, per token), and per
hostile schema its statuses and slowest answer. Each request asks for one token, so the requests add compile and
prefill work, not decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import grpc
import httpx2
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from specrpc.v1 import generator_pb2 as pb  # noqa: E402
from specrpc.v1 import generator_pb2_grpc as pb_grpc  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def deep(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE: dict[str, dict[str, Any]] = {
    "deep nesting": deep(400),
    "huge enum": {"type": "object", "properties": {"e": {"enum": [f"value-{i}" for i in range(20_000)]}}},
    "recursive ref": {"type": "object", "properties": {"node": {"$ref": "#/$defs/n"}},
                      "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}},
    "invalid regex": {"type": "object", "properties": {"s": {"type": "string", "pattern": "(unclosed"}}},
    "1 MB schema": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                     for i in range(10_000)}},
}
BENIGN = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
          "required": ["city"]}


async def stream_gaps(stub: pb_grpc.GeneratorStub, tokens: int) -> list[float]:
    """One greedy Generate: the gap before each streamed message after the first, per token it carries (s)."""
    gaps: list[float] = []
    last: float | None = None
    call: Any = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=tokens,
                                                 sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True)),
                              timeout=300)
    async for response in call:
        if response.HasField("chunk") and response.chunk.token_ids:
            now = time.perf_counter()
            if last is not None:
                gaps.extend([(now - last) / len(response.chunk.token_ids)] * len(response.chunk.token_ids))
            last = now
    return gaps


async def sender(http: httpx2.AsyncClient, schemas: dict[str, dict[str, Any]], stop: asyncio.Event,
                 outcomes: dict[str, Counter[int]], slowest: dict[str, float]) -> None:
    """Chat requests with one tool of each schema in turn, one at a time, until `stop`."""
    while not stop.is_set():
        for name, schema in schemas.items():
            body = {"model": "m", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                    "tool_choice": "required", "max_tokens": 1}
            started = time.perf_counter()
            response = await http.post("/v1/chat/completions", content=json.dumps(body),
                                       headers={"content-type": "application/json"})
            outcomes[name][response.status_code] += 1
            slowest[name] = max(slowest[name], time.perf_counter() - started)
            if stop.is_set():
                return


def quantiles_ms(gaps: list[float]) -> str:
    ordered = sorted(gaps)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 for q in (0.5, 0.9, 0.99)]
    return f"{pick[0]:.2f} / {pick[1]:.2f} / {pick[2]:.2f} / {ordered[-1] * 1e3:.2f}"


async def run(args: argparse.Namespace) -> int:
    gaps: dict[str, list[float]] = defaultdict(list)
    outcomes: dict[str, Counter[int]] = defaultdict(Counter)
    slowest: dict[str, float] = defaultdict(float)
    phases = {"alone": None, "benign schemas": {"benign": BENIGN}, "hostile schemas": HOSTILE}
    async with grpc.aio.insecure_channel(args.grpc) as channel, \
            httpx2.AsyncClient(base_url=args.http, timeout=120) as http:
        health = health_pb2_grpc.HealthStub(channel)
        while (await health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=600)).status \
                != health_pb2.HealthCheckResponse.SERVING:
            await asyncio.sleep(0.5)
        stub = pb_grpc.GeneratorStub(channel)
        await stream_gaps(stub, 16)  # warm-up
        for round_ in range(args.rounds):
            order = list(phases) if round_ % 2 == 0 else list(reversed(phases))
            for phase in order:
                stop = asyncio.Event()
                schemas = phases[phase]
                task = (asyncio.create_task(sender(http, schemas, stop, outcomes, slowest))
                        if schemas is not None else None)
                gaps[phase].extend(await stream_gaps(stub, args.tokens))
                stop.set()
                if task is not None:
                    await task
    print(f"{args.rounds} rounds, a {args.tokens}-token greedy stream per phase; inter-token gap p50 / p90 / p99 / "
          "max (ms):\n")
    print("| phase | gaps | p50 / p90 / p99 / max ms | p50 ÷ alone's |\n| --- | --- | --- | --- |")
    alone = statistics.median(gaps["alone"])
    for phase in phases:
        print(f"| {phase} | {len(gaps[phase])} | {quantiles_ms(gaps[phase])} | "
              f"{statistics.median(gaps[phase]) / alone:.2f}× |")
    print("\n| schema | statuses | slowest answer s |\n| --- | --- | --- |")
    for name in ["benign", *HOSTILE]:
        statuses = ", ".join(f"{code}: {n}" for code, n in sorted(outcomes[name].items()))
        print(f"| {name} | {statuses} | {slowest[name]:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", required=True, help="host:port of the server's gRPC edge")
    parser.add_argument("--http", required=True, help="base URL of the same server's HTTP edge")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases (default 3)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of each measured stream (default 256)")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
