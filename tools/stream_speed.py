"""Single-stream decode speed of a running server, as a client in its own process sees it: the bench's held-out
prompts (code completion, fill-in-the-middle, prose) streamed one at a time, greedy, for each speculation setting.

    .venv/bin/specrpc serve --port 50051 &
    .venv/bin/python tools/stream_speed.py --target 127.0.0.1:50051 --ks adaptive,0 --rounds 2

Prints, per setting: decode tokens/s (tokens after the first ÷ time from the first to the last token), TTFT p50,
the client's TTFT beyond the server's own (median of client TTFT − the summary's ttft_ms), streamed messages and
tokens. Run two servers (say, two commits) on different ports and alternate `--target`s to
compare them on a noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import grpc

from specrpc.bench.workloads import Case, build_cases
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc


def stream(stub: pb_grpc.GeneratorStub, case: Case, k: int | None, metadata: tuple[tuple[str, str], ...],
           timeout_s: float) -> tuple[int, float, float, int, float]:
    """One greedy request: (tokens, TTFT s, first-to-last-token s, messages with tokens, the server's TTFT s)."""
    spec = pb.SpeculationParams() if k is None else pb.SpeculationParams(num_draft_tokens=k)
    common: dict[str, Any] = {"max_new_tokens": case.max_new_tokens,
                              "sampling": pb.SamplingParams(temperature=0.0), "speculation": spec}
    t0 = time.perf_counter()
    call = (stub.Generate(pb.GenerateRequest(prompt=case.prompt, **common), metadata=metadata, timeout=timeout_s)
            if case.suffix is None else
            stub.Infill(pb.InfillRequest(prefix=case.prompt, suffix=case.suffix, **common), metadata=metadata,
                        timeout=timeout_s))
    first = last = server_ttft = 0.0
    tokens = messages = 0
    for response in call:
        if response.HasField("chunk") and response.chunk.token_ids:
            now = time.perf_counter() - t0
            first = first or now
            last = now
            tokens += len(response.chunk.token_ids)
            messages += 1
        elif response.HasField("summary"):
            server_ttft = response.summary.timing.ttft_ms / 1e3
    return tokens, first, last - first, messages, server_ttft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="host:port of a running server")
    parser.add_argument("--ks", default="adaptive,0", help="comma-separated: adaptive, or a number of draft tokens")
    parser.add_argument("--cases", type=int, default=2, help="prompts per workload (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    parser.add_argument("--token", help="bearer token, when the server requires one")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request (default 120)")
    args = parser.parse_args(argv)
    try:
        ks = [None if k == "adaptive" else int(k) for k in args.ks.split(",") if k]
    except ValueError:
        parser.error(f"--ks takes 'adaptive' or numbers, got {args.ks!r}")
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    cases = build_cases(args.cases)
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for k in ks:
            tokens = decode_tokens = messages = 0
            decode_s = 0.0
            ttfts: list[float] = []
            beyond: list[float] = []
            for _ in range(args.rounds):
                for case in cases:
                    n, ttft, span, m, server_ttft = stream(stub, case, k, metadata, args.timeout)
                    tokens += n
                    decode_tokens += max(0, n - 1)
                    decode_s += span
                    messages += m
                    if n:  # a reply without tokens has no first token
                        ttfts.append(ttft)
                        if server_ttft > 0:
                            beyond.append(ttft - server_ttft)
            rate = decode_tokens / decode_s if decode_s else 0.0
            name = "adaptive" if k is None else f"k={k}"
            ttft = statistics.median(ttfts) * 1e3 if ttfts else float("nan")
            edge = statistics.median(beyond) * 1e3 if beyond else float("nan")
            print(f"{name}: {rate:.1f} decode tokens/s, TTFT p50 {ttft:.1f} ms ({edge:.2f} ms beyond the server's "
                  f"own), {messages} messages, {tokens} tokens over {args.rounds * len(cases)} requests", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
