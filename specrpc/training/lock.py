"""The training lock: a training run on the shared cores says so, and benchmarks, the soak and the long fuzz refuse to
start beside it (their figures would be void: they would measure the training as much as the server).

The lock is a small JSON file per training process in one folder of the machine's temporary directory (one folder per
machine, whichever checkout trains; a file per process, so a short training such as the test suite's never removes a
long one's). A file counts only while its process is alive and running: a stale one (the process gone) is ignored, and
a training paused with `kill -STOP <pid>` (resumed with `kill -CONT <pid>`) lets a measurement run, which is how a
benchmark is taken while a long training waits. `SPECRPC_BESIDE_TRAINING=1` lets a run start anyway where its figures
are read by nobody (the test suite's smoke runs set it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCKS = Path(tempfile.gettempdir()) / "specrpc-training"


@contextmanager
def hold(folder: Path = LOCKS) -> Iterator[None]:
    """Hold the lock while the body trains; removed on exit (a crash leaves a stale file that `holder` ignores)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "command": " ".join(sys.argv)}))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _state(pid: int) -> str | None:
    """The process's scheduler state letter (R, S, T for stopped, …), None if it does not exist. Without /proc
    (not Linux), a live process counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "R"
    return stat.rsplit(")", 1)[1].split()[0]


def holder(folder: Path = LOCKS) -> str | None:
    """Why a measurement must not start now (a running training named by pid and command), or None."""
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        state = _state(pid)
        if state is not None and state not in ("T", "t", "Z", "X"):
            return _reason(pid, record, path)
    return None


def _reason(pid: int, record: dict[str, str], path: Path) -> str:
    return (f"a training run (pid {pid}, started {record.get('started', '?')}: {record.get('command', '?')}) is "
            f"running on this machine, so a measurement now would be void. Pause it with `kill -STOP {pid}` and "
            f"resume it afterwards with `kill -CONT {pid}`, or wait for it to finish (lock: {path})")


def refuse_beside_training(what: str, folder: Path = LOCKS) -> None:
    """Exit with the reason when a training runs: `what` (a benchmark, the soak, …) would measure it too."""
    if os.environ.get("SPECRPC_BESIDE_TRAINING") == "1":
        return
    reason = holder(folder)
    if reason is not None:
        raise SystemExit(f"{what} refuses to start: {reason}")
