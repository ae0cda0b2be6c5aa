"""Timing at load, made to survive a noisy neighbour: the paths compared are run in turn, round after round (A B C,
B C A, C A B, …), and each keeps the median of its rounds, so a burst of someone else's work that stalls a few calls
moves no median, and a slower stretch slows every path alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def interleaved_medians(runs: Sequence[Callable[[], object]], repeats: int, warm: int = 1) -> list[float]:
    """Median seconds of one call of each of `runs` over `repeats` rounds: each round calls every run once, the order
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
    return [statistics.median(t) for t in times]
