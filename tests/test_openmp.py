"""One OpenMP team per process: a thread gives its workers back, and work can be run on the device thread."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest
import torch

from specrpc.openmp import _pause_functions, release_workers
from specrpc.serving.scheduler import Scheduler

T = TypeVar("T")


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as fh:
            return fh.read().strip()
    except OSError:  # the thread has exited
        return ""


def gone(tids: set[int], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not tids & thread_ids():
            return True
        time.sleep(0.01)
    return False


def on_a_thread(fn: Callable[[], T]) -> T:
    """fn() on a fresh thread; its result, or its exception raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return cast(T, box["result"])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_thread_releases_its_openmp_workers() -> None:
    if not _pause_functions():
        pytest.skip("torch did not load libgomp")

    def work() -> tuple[set[int], bool, bool, float]:
        me = threading.get_native_id()
        before = thread_ids()
        a = torch.randn(512, 512)
        for _ in range(3):
            a = torch.tanh(a @ a)  # large enough for a parallel region
        # OpenMP workers are cloned from this thread and keep its name; gRPC's and others' threads name themselves
        workers = {t for t in thread_ids() - before - {me} if comm(t) == comm(me)}
        released = release_workers()
        went = gone(workers)
        b = torch.ones(256, 256)
        total = float((b @ b).sum())  # the runtime still works: a new team starts
        return workers, released, went, total

    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # before the thread starts: setting it may start threads of its own
    try:
        workers, released, went, total = on_a_thread(work)
    finally:
        torch.set_num_threads(saved)
    assert workers, "a parallel op on a fresh thread should have started OpenMP workers"
    assert released is True
    assert went, f"workers {workers} still alive after release_workers()"
    assert total == 256.0 ** 3


def test_release_without_a_team_is_harmless() -> None:
    def twice() -> bool:
        first = release_workers()
        return release_workers() == first

    assert on_a_thread(twice)


def test_scheduler_call_runs_on_the_device_thread_and_propagates_errors() -> None:
    scheduler = Scheduler(engine=None)  # type: ignore[arg-type]  # calls need no engine
    with pytest.raises(RuntimeError, match="not running"):
        scheduler.call(lambda: None)
    scheduler.start()
    try:
        assert scheduler.call(lambda: threading.current_thread().name).result(timeout=10) == "specrpc-device"

        def boom() -> None:
            raise ValueError("bad call")

        with pytest.raises(ValueError, match="bad call"):
            scheduler.call(boom).result(timeout=10)
        assert scheduler.call(lambda: 42).result(timeout=10) == 42  # the device thread survived the error
    finally:
        scheduler.stop()
    with pytest.raises(RuntimeError, match="not running"):
        scheduler.call(lambda: None)


def test_a_call_that_exits_does_not_take_the_device_thread_down() -> None:
    scheduler = Scheduler(engine=None)  # type: ignore[arg-type]  # calls need no engine
    scheduler.start()
    try:
        exiting = scheduler.call(lambda: sys.exit(3))
        after = scheduler.call(lambda: "still here")
        assert isinstance(exiting.exception(timeout=10), SystemExit)
        assert after.result(timeout=10) == "still here"
    finally:
        scheduler.stop()
