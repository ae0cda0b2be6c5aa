"""An editor's completion loop: simulated keystrokes, each cancelling the completion in flight and asking again.

    .venv/bin/python clients/examples/editor_loop.py --port 50051

Per keystroke it prints how the previous request ended, the prompt tokens reused from the session's KV cache
(cancel-on-keystroke keeps the prefix warm), the latency (time to the first token and to the end) and the tokens
accepted from the session's last completion (typing along a suggestion gets the rest of it back at once).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from specrpc_client import AsyncClient, AsyncGeneration, CompletionSession

SNIPPET = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


async def watch(keystroke: int, buffer: str, gen: AsyncGeneration) -> None:
    """Consume one completion and print one line when it ends (finished or cancelled by the next keystroke)."""
    async for _ in gen:
        pass
    total_ms = ((gen.ended_at or time.perf_counter()) - gen.started_at) * 1e3
    ttft = f"{gen.ttft_ms:6.1f} ms" if gen.ttft_ms is not None else "     - "
    typed = repr(buffer[-12:])
    if gen.summary is None:
        print(f"#{keystroke:3d} {typed:>16}  cancelled after {total_ms:6.1f} ms ({len(gen.chunks)} chunks)")
        return
    s = gen.summary
    print(f"#{keystroke:3d} {typed:>16}  cached {s.cached_prompt_tokens:3d}/{s.prompt_tokens:3d} prompt tokens  "
          f"TTFT {ttft}  total {total_ms:6.1f} ms  {s.completion_tokens} tokens "
          f"({s.suggestion_tokens_accepted} from the last suggestion)  -> {gen.text[:40]!r}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--delay-ms", type=float, default=120.0, help="time between keystrokes")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--text", default=SNIPPET, help="what the simulated user types")
    args = ap.parse_args()

    async with AsyncClient(f"{args.host}:{args.port}", token=args.token, timeout=30) as client:
        await client.wait_ready()
        session = CompletionSession(client, max_new_tokens=args.max_new_tokens)
        print(f"session {session.session_id}: typing {len(args.text)} characters, one every {args.delay_ms:g} ms")
        watchers: list[asyncio.Task[None]] = []
        for i in range(1, len(args.text) + 1):
            buffer = args.text[:i]
            gen = session.complete(buffer)  # cancels the completion still in flight
            watchers.append(asyncio.create_task(watch(i, buffer, gen)))
            await asyncio.sleep(args.delay_ms / 1e3)
        await asyncio.gather(*watchers)


if __name__ == "__main__":
    asyncio.run(main())
