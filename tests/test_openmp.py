"""One OpenMP team per process: a thread gives its workers back, and work can be run on the device thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from specrpc.openmp import _pause_functions, release_workers
from specrpc.scheduler import Scheduler


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def gone(tids: set[int], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not tids & thread_ids():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_thread_releases_its_openmp_workers() -> None:
    if not _pause_functions():
        pytest.skip("torch did not load an OpenMP runtime with omp_pause_resource_all")
    report: dict[str, object] = {}

    def work() -> None:
        before = thread_ids()
        a = torch.randn(512, 512)
        for _ in range(3):
            a = torch.tanh(a @ a)  # large enough for a parallel region
        workers = thread_ids() - before - {threading.get_native_id()}
        report["workers"] = workers
        report["released"] = release_workers()
        report["gone"] = gone(workers)
        b = torch.randn(512, 512)
        (b @ b).sum().item()  # the runtime still works: a new team starts
        report["after"] = thread_ids()

    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # before the thread starts: setting it may start threads of its own
    try:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(saved)
    assert report["workers"], "a parallel op on a fresh thread should have started OpenMP workers"
    assert report["released"] is True
    assert report["gone"], f"workers {report['workers']} still alive after release_workers()"


def test_release_without_a_team_is_harmless() -> None:
    def work() -> None:
        release_workers()
        release_workers()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()


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
