"""What the idle checks of the paths chosen at load cost (`--recheck-s`, `LlamaLM.recheck`): a check that finds no
drift, a whole re-measure and its longest phase, and how long a request that comes during a re-measure waits for it
to stop (the request arriving at a random point of it), for the shipped target and draft.

    .venv/bin/python tools/recheck_cost.py --threads 2 [--weights int8] [--tries 12]

Prints one Markdown row per model. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch

from specrpc.config import ASSETS
from specrpc.models import load_model
from specrpc.models.llama import LlamaLM

CONTEXT = 400  # what the borrowed slot caches: a prompt, put back after every check


def past(at: float) -> bool:
    """Whether the clock is past `at` (a request has come)."""
    return time.perf_counter() >= at


def drifted(lm: LlamaLM) -> None:
    """Make the next check find a drift (the reference halved, one strike already counted)."""
    lm.drift.reference_s /= 2
    lm.drift.strikes = lm.drift.confirm - 1


def row(name: str, weights: str, tries: int) -> str:
    lm = load_model(str(ASSETS / name), device=torch.device("cpu"), dtype=torch.float32, num_slots=2,
                    max_context=2048, native_decode=True, int8_weights=weights == "int8",
                    int8_decode=name == "draft" and weights != "int8")
    assert isinstance(lm, LlamaLM) and lm.native is not None
    lm.forward(torch.arange(3, 3 + CONTEXT), 0, 1)
    checks = []
    for _ in range(tries):
        lm.drift.strikes = 0
        t0 = time.perf_counter()
        lm.recheck(1, lambda: False)
        checks.append(time.perf_counter() - t0)
    phases = []
    with lm.cache.borrowed(1, CONTEXT):
        for phase in lm._native_phases(rows=not lm.rows_fixed()):
            t0 = time.perf_counter()
            phase(1)
            phases.append(time.perf_counter() - t0)
    waits = []
    for _ in range(tries):
        drifted(lm)
        t0 = time.perf_counter()
        at = t0 + random.uniform(0.0, sum(phases))
        lm.recheck(1, functools.partial(past, at))
        waits.append(time.perf_counter() - max(at, t0))
        lm._remeasure = []  # the next try starts a re-measure of its own
    ms = [t * 1e3 for t in checks]
    return (f"| {name} | {weights} | {statistics.median(ms):.1f} / {max(ms):.1f} | {sum(phases):.2f} | "
            f"{len(phases)} | {max(phases) * 1e3:.0f} | {statistics.median(waits) * 1e3:.1f} / "
            f"{max(waits) * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", choices=("dtype", "int8"), default="dtype")
    parser.add_argument("--tries", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | weights | check ms, median / max | re-measure s | phases | longest phase ms | "
          "a request waits ms, median / max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in ("target", "draft"):
        print(row(name, args.weights, args.tries), flush=True)


if __name__ == "__main__":
    main()
