"""What remembering the paths chosen at load and the step costs measured over them saves a start
(`--remember-execution`): the seconds from nothing to a loaded runtime (both models loaded, their paths chosen) and
then to a warm one (step costs calibrated or taken back after a warm-up), in fresh processes taking turns, each start
measuring afresh against each start taking what the last one kept (one remembered start runs first to keep it).

    python tools/start_cost.py --starts 4 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = """
import time
t0 = time.perf_counter()
from specrpc.config import build_config
from specrpc.logs import configure
from specrpc.serving.runtime import Runtime
configure("console", "warning")
imported = time.perf_counter()
runtime = Runtime(build_config(None))
loaded = time.perf_counter()
runtime.start()
warmed = time.perf_counter()
runtime.stop()
for model in (runtime.target, runtime.draft):
    if model is not None and model.chosen:
        print(f"{model.name}: {model.chosen}")
print(f"step costs: {runtime.costs_chosen}")
print(imported - t0, loaded - imported, warmed - loaded)
"""


def start(remember: bool, threads: int) -> tuple[float, float]:
    """(seconds loading, seconds warming up) of one start in a fresh process; what a remembered start found is
    printed (its one-token checks against the memo's time, and whether the step costs were taken back)."""
    env = {**os.environ, "SPECRPC_REMEMBER_EXECUTION": "1" if remember else "0", "SPECRPC_RECHECK_S": "0"}
    if threads:
        env["SPECRPC_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    loaded, warmed = (float(v) for v in done.stdout.split()[-2:])
    for line in done.stdout.splitlines()[:-1]:
        if remember:
            print(f"  {loaded:.2f} + {warmed:.2f} s: {line}")
    return loaded, warmed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=4, help="starts of each kind, taking turns")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()
    if args.starts < 1:
        parser.error("--starts must be at least 1")
    start(True, args.threads)  # keeps a choice for the remembered starts
    starts: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.starts):
        for remember in (False, True):
            starts[remember].append(start(remember, args.threads))
    medians: dict[bool, float] = {}
    for remember, times in starts.items():
        for name, values in (("load", [t[0] for t in times]), ("warm-up", [t[1] for t in times]),
                             ("both", [sum(t) for t in times])):
            print(f"{'remembered' if remember else 'measured  '}: {name} median {statistics.median(values):.2f} s "
                  f"(min {min(values):.2f}, max {max(values):.2f}; {', '.join(f'{t:.2f}' for t in values)})")
        medians[remember] = statistics.median(sum(t) for t in times)
    print(f"remembered / measured, medians of load + warm-up: {medians[True] / medians[False]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
