"""Streaming cost per token over HTTP (OpenAI completions, SSE) against gRPC (Generate / Infill) on one running
server, as a client in its own process sees it: the bench's held-out prompts, greedy, each sent over both edges in
turn (alternating which goes first), so both see the same load.

    .venv/bin/specrpc serve --port 50051 --http-port 8080 &
    .venv/bin/python tools/http_vs_grpc.py --grpc 127.0.0.1:50051 --http http://127.0.0.1:8080 --rounds 3

Prints, per edge: decode ms per token (first to last token ÷ tokens after the first, summed over requests), TTFT
p50, tokens; and HTTP's per-token cost relative to gRPC's. Both edges must produce the same tokens (greedy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx2

from specrpc.bench.workloads import Case, build_cases
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc


@dataclass
class Tally:
    """One edge's figures over every request."""

    tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    def add(self, tokens: int, ttft: float, span: float) -> None:
        self.tokens += tokens
        self.decode_tokens += max(0, tokens - 1)
        self.decode_s += span
        if tokens:
            self.ttfts.append(ttft)

    @property
    def ms_per_token(self) -> float:
        return self.decode_s / self.decode_tokens * 1e3 if self.decode_tokens else float("nan")


def over_grpc(stub: pb_grpc.GeneratorStub, case: Case, timeout_s: float) -> tuple[str, int, float, float]:
    """(text, tokens, TTFT s, first-to-last-token s) of one greedy request."""
    common = {"max_new_tokens": case.max_new_tokens, "sampling": pb.SamplingParams(temperature=0.0)}
    t0 = time.perf_counter()
    call = (stub.Generate(pb.GenerateRequest(prompt=case.prompt, **common), timeout=timeout_s)  # type: ignore[arg-type]
            if case.suffix is None else
            stub.Infill(pb.InfillRequest(prefix=case.prompt, suffix=case.suffix, **common),  # type: ignore[arg-type]
                        timeout=timeout_s))
    first = last = 0.0
    tokens = 0
    text = []
    for response in call:
        if response.HasField("chunk") and response.chunk.token_ids:
            last = time.perf_counter() - t0
            first = first or last
            tokens += len(response.chunk.token_ids)
            text.append(response.chunk.text)
    return "".join(text), tokens, first, last - first


def over_http(client: httpx2.Client, case: Case, timeout_s: float) -> tuple[str, int, float, float]:
    """The same over /v1/completions with stream=true (tokens from the final usage)."""
    body: dict[str, object] = {"prompt": case.prompt, "max_tokens": case.max_new_tokens, "temperature": 0,
                               "stream": True, "stream_options": {"include_usage": True}}
    if case.suffix is not None:
        body["suffix"] = case.suffix
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    text = []
    with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                if choice["text"]:
                    last = time.perf_counter() - t0
                    first = first or last
                    text.append(choice["text"])
    return "".join(text), tokens, first, last - first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", required=True, help="host:port of the server's gRPC port")
    parser.add_argument("--http", required=True, help="base URL of the same server's --http-port")
    parser.add_argument("--cases", type=int, default=2, help="prompts per workload (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request (default 120)")
    args = parser.parse_args(argv)
    cases = build_cases(args.cases)
    tallies = {"grpc": Tally(), "http": Tally()}
    mismatches = 0
    with grpc.insecure_channel(args.grpc) as channel, httpx2.Client(base_url=args.http) as client:
        stub = pb_grpc.GeneratorStub(channel)
        runs = {"grpc": lambda case: over_grpc(stub, case, args.timeout),
                "http": lambda case: over_http(client, case, args.timeout)}
        for round_ in range(args.rounds):
            for i, case in enumerate(cases):
                order = ["grpc", "http"] if (round_ + i) % 2 == 0 else ["http", "grpc"]
                texts = {}
                for edge in order:
                    text, tokens, ttft, span = runs[edge](case)
                    tallies[edge].add(tokens, ttft, span)
                    texts[edge] = text
                mismatches += texts["grpc"] != texts["http"]
    for edge, tally in tallies.items():
        ttft = statistics.median(tally.ttfts) * 1e3 if tally.ttfts else float("nan")
        print(f"{edge}: {tally.ms_per_token:.3f} ms/token decode, TTFT p50 {ttft:.1f} ms, {tally.tokens} tokens")
    ratio = tallies["http"].ms_per_token / tallies["grpc"].ms_per_token
    print(f"http/grpc per token: {ratio:.3f} ({(ratio - 1) * 100:+.1f} %); texts differing: {mismatches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
