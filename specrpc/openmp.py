"""Keep one OpenMP team per process: the device thread's.

Every thread that runs a parallel torch op becomes the master of its own OpenMP team, whose workers stay alive until
that thread exits. libgomp (the OpenMP runtime of torch's Linux wheels) counts all of them, and once it manages more
threads than the machine has CPUs it cuts its spin-wait between parallel regions to about 100 spins, so every region
then waits for a futex wake-up. On two cores, a model loaded on one thread and decoded on another (the server's
loading thread and device thread, or a test's main thread) made draft steps about 40 % slower for the process's
whole life. A thread done with torch calls `release_workers()`, which gives its team back (OpenMP 5.0
`omp_pause_resource_all`)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Callable

OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the threads, keep the runtime usable
# libgomp only: it is the runtime that throttles its spinning by thread count, and the one whose pause frees the
# calling thread's team (LLVM's libomp and Intel's libiomp5 put the whole process's workers to sleep instead).
_RUNTIME_NAME = re.compile(r"libgomp[-.]")


@functools.cache
def _pause_functions() -> tuple[Callable[[int], int], ...]:
    """`omp_pause_resource_all` of each libgomp loaded in this process (found in /proc/self/maps)."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and fields[5].startswith("/"):
                    paths.add(fields[5].rstrip("\n").removesuffix(" (deleted)"))
    except OSError:  # not Linux: nothing to release
        return ()
    functions: list[Callable[[int], int]] = []
    for path in sorted(paths):
        if not _RUNTIME_NAME.match(os.path.basename(path)):
            continue
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an OpenMP runtime older than 5.0
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        functions.append(pause)
    return tuple(functions)


def release_workers() -> bool:
    """Free the OpenMP worker threads of the calling thread's team (the next parallel op on this thread starts a new
    team). True when torch's libgomp was found and accepted the request (False elsewhere: nothing to do). Call it
    only from a thread that is not inside a parallel region, that is, from Python."""
    import torch  # noqa: F401 - the runtime to release is the one torch loaded

    results = [pause(OMP_PAUSE_SOFT) for pause in _pause_functions()]
    return bool(results) and all(r == 0 for r in results)
