"""A lone voice turn's latencies against running servers, rounds alternating between them: the time to the first
token and to the first phrase of a Converse turn in phrase mode, and the barge-in (cancel sent → the turn's summary)
on a second turn interrupted after its first phrase. Each round opens a fresh voice session on each server in turn.

    .venv/bin/specrpc serve --port 50061 --batching on &
    .venv/bin/specrpc serve --port 50062 --batching off &
    .venv/bin/python tools/voice_latency.py --target on=127.0.0.1:50061 --target off=127.0.0.1:50062 --rounds 14

Prints per server the median and range (over the rounds after `--warmup`) of each latency, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from specrpc_client import AsyncClient, Phrase

TURN = "Hello! Who are you?"
BARGE_IN_TURN = "Tell me a long story about a lighthouse keeper."


async def one_round(address: str, max_new_tokens: int) -> tuple[float, float, float]:
    """(first token ms, first phrase ms, barge-in ms) of one fresh voice session on `address`."""
    async with AsyncClient(address) as client, client.voice_session(system="Be brief.",
                                                                      max_new_tokens=max_new_tokens) as voice:
        reply = voice.say(TURN)
        first_token: float | None = None
        first_phrase: float | None = None
        async for event in reply.events():
            now = (time.perf_counter() - reply.started_at) * 1e3
            if first_token is None and getattr(event, "token_ids", None):
                first_token = now
            if first_phrase is None and isinstance(event, Phrase):
                first_phrase = now
        interrupted = voice.say(BARGE_IN_TURN)
        async for _ in interrupted:
            break
        t0 = time.perf_counter()
        await voice.barge_in()
        barge_in = (time.perf_counter() - t0) * 1e3
        if first_token is None or first_phrase is None:
            raise RuntimeError(f"{address}: the turn ended without a token or a phrase")
        return first_token, first_phrase, barge_in


async def run(targets: dict[str, str], rounds: int, warmup: int,
              max_new_tokens: int) -> dict[str, list[tuple[float, float, float]]]:
    """Every target once per round, the order alternating round by round."""
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in targets}
    names = list(targets)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            measured = await one_round(targets[name], max_new_tokens)
            if r >= warmup:
                results[name].append(measured)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="NAME=HOST:PORT (repeat for each server)")
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=2, help="first rounds not counted")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    targets = dict(t.split("=", 1) for t in args.target)
    results = asyncio.run(run(targets, args.rounds, args.warmup, args.max_new_tokens))
    for name, rows in results.items():
        columns = list(zip(*rows, strict=True))
        print(f"{name}: " + " | ".join(
            f"{label} {statistics.median(c):.1f} ms ({min(c):.1f}–{max(c):.1f})"
            for label, c in zip(("first token", "first phrase", "barge-in"), columns, strict=True)))


if __name__ == "__main__":
    main()
