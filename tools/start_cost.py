"""What remembering the paths chosen at load saves a start (`--remember-execution`): the seconds from nothing to a
loaded runtime (both models loaded, their paths chosen), in fresh processes taking turns, each start measuring its
paths afresh against each start taking the choice the last one kept (one remembered start runs first to keep one).

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
for model in (runtime.target, runtime.draft):
    if model is not None and model.chosen:
        print(f"{model.name}: {model.chosen}")
print(imported - t0, loaded - imported)
"""


def start(remember: bool, threads: int) -> tuple[float, float]:
    """(seconds importing, seconds loading) of one start in a fresh process; what a remembered start found is
    printed (its one-token checks against the memo's time)."""
    env = {**os.environ, "SPECRPC_REMEMBER_EXECUTION": "1" if remember else "0", "SPECRPC_RECHECK_S": "0"}
    if threads:
        env["SPECRPC_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    imported, loaded = (float(v) for v in done.stdout.split()[-2:])
    for line in done.stdout.splitlines()[:-1]:
        if remember:
            print(f"  {loaded:.2f} s: {line}")
    return imported, loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=4, help="starts of each kind, taking turns")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()
    if args.starts < 1:
        parser.error("--starts must be at least 1")
    start(True, args.threads)  # keeps a choice for the remembered starts
    loads: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.starts):
        for remember in (False, True):
            loads[remember].append(start(remember, args.threads)[1])
    for remember, times in loads.items():
        print(f"{'remembered' if remember else 'measured  '}: load median {statistics.median(times):.2f} s "
              f"(min {min(times):.2f}, max {max(times):.2f}; {', '.join(f'{t:.2f}' for t in times)})")
    print(f"remembered / measured, medians: {statistics.median(loads[True]) / statistics.median(loads[False]):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
