"""Timing at load, made to survive noisy neighbours: the paths compared run in turn, round after round (A B C, B C A,
C A B, …), and each keeps the lower quartile of its rounds. Someone else's work only ever adds time to a call, and on
a shared 2-core machine it stalled more than half of them at times (a one-token forward of a tiny model: 0.09 ms
alone, 190 ms in 9 of 10 calls while three neighbours ran tests), which moves a median but not the lower quartile."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def interleaved_samples(runs: Sequence[Callable[[], object]], repeats: int, warm: int = 1) -> list[list[float]]:
    """Seconds of each call of each of `runs` over `repeats` rounds: each round calls every run once, the order
    rotated by one each round (no run always follows the same other), each timed call after `warm` untimed ones of
    the same run (its weights in the caches as during a run of such steps); a first round is untimed."""
    times: list[list[float]] = [[] for _ in runs]
    for r in range(repeats + 1):
        for j in range(len(runs)):
            i = (j + r) % len(runs)
            for _ in range(warm):
                runs[i]()
            t0 = time.perf_counter()
            runs[i]()
            if r:
                times[i].append(time.perf_counter() - t0)
    return times


def interleaved_times(runs: Sequence[Callable[[], object]], repeats: int, warm: int = 1) -> list[float]:
    """Seconds for one call of each of `runs`, the lower quartile over `repeats` rounds (at least 2) of
    `interleaved_samples`."""
    return [statistics.quantiles(t, n=4)[0] for t in interleaved_samples(runs, repeats, warm)]
