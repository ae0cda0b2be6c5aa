"""The device thread's two ways of stepping many streams, through the real server (shipped pair, CPU): batched steps
(one engine step for every runnable stream) and round-robin give every stream its solo output, streams that join
while others decode included, and a stream's prefill does not hold the others back."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from service_helpers import collect, ids_of

from specrpc.config import build_config
from specrpc.edges.server import Running
from specrpc.engine.generation import StepResult
from specrpc.serving import scheduler as scheduler_module
from specrpc.serving.scheduler import Job, Scheduler
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

PROMPTS = ["def parse(line):\n    ", "import os\n\nclass Cache:\n    def __init__(self", "for i in range(10):\n",
           "# " + "a long comment that takes more than one prefill chunk " * 12 + "\nx ="]


@pytest.fixture
def batching(server: Running) -> Iterator[None]:
    """Restore the scheduler's mode after the test."""
    scheduler = server.runtime.scheduler
    old = scheduler.batching
    yield
    scheduler.call(lambda: setattr(scheduler, "batching", old)).result()


def request(prompt: str, i: int) -> pb.GenerateRequest:
    spec = [pb.SpeculationParams(), pb.SpeculationParams(num_draft_tokens=0), pb.SpeculationParams(num_draft_tokens=3)]
    return pb.GenerateRequest(prompt=prompt, max_new_tokens=24 + 4 * i, speculation=spec[i % 3],
                              sampling=pb.SamplingParams(temperature=0.0))


async def concurrently(stub: pb_grpc.GeneratorStub, delays: list[float]) -> list[list[int]]:
    async def one(i: int, prompt: str) -> list[int]:
        await asyncio.sleep(delays[i])
        chunks, _ = await collect(stub.Generate(request(prompt, i)))
        return ids_of(chunks)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


@pytest.mark.parametrize("mode", [True, False], ids=["batched", "round-robin"])
async def test_concurrent_greedy_streams_equal_their_solo_runs(stub: pb_grpc.GeneratorStub, server: Running,
                                                               batching: None, mode: bool) -> None:
    scheduler = server.runtime.scheduler
    scheduler.call(lambda: setattr(scheduler, "batching", mode)).result()
    solo = [ids_of((await collect(stub.Generate(request(p, i))))[0]) for i, p in enumerate(PROMPTS)]
    widths: Counter[float] = Counter()  # jobs per engine step, by the step's measured seconds
    scheduler.on_step = lambda job, result, seconds: widths.update([seconds])
    try:
        assert await concurrently(stub, [0.0, 0.0, 0.0, 0.0]) == solo
        assert await concurrently(stub, [0.0, 0.05, 0.1, 0.02]) == solo  # the long prompt joins while others decode
    finally:
        scheduler.on_step = None
    assert (max(widths.values()) == len(PROMPTS)) == mode


async def test_a_prefill_shares_its_step_with_the_decoding_streams(stub: pb_grpc.GeneratorStub, server: Running,
                                                                    batching: None) -> None:
    """With batched steps, a prompt arriving while another stream decodes is prefilled in the same engine steps
    as that stream's decode steps (the decoding stream waits no step for it), in chunks that keep those steps short
    (`Engine.prefill_budget`)."""
    scheduler = server.runtime.scheduler
    scheduler.call(lambda: setattr(scheduler, "batching", True)).result()
    long_prompt = "# " + "spam and eggs " * 60
    assert 100 < len(server.runtime.encode(long_prompt)) < 400
    steps: list[tuple[str, int, float]] = []  # (stream, tokens, seconds of the engine step it was in)

    def record(job: Job, result: StepResult, seconds: float) -> None:
        steps.append(("long" if len(job.request.prompt_ids) > 100 else "short", len(result.token_ids), seconds))

    scheduler.on_step = record
    try:
        decoding = stub.Generate(pb.GenerateRequest(prompt="x = 1\n", max_new_tokens=200,
                                                    speculation=pb.SpeculationParams(num_draft_tokens=0)))
        async for _ in decoding:
            break
        _, summary = await collect(stub.Generate(pb.GenerateRequest(prompt=long_prompt, max_new_tokens=2)))
        decoding.cancel()
    finally:
        scheduler.on_step = None
    assert summary.completion_tokens == 2
    long = [s for s in steps if s[0] == "long"]
    prefill = long[: next(i for i, s in enumerate(long) if s[1]) + 1]  # its chunks, the last with its first token
    assert prefill[-1][1] == 1 and len(prefill) > 1, "a long prompt in several chunks, its first token out"
    for chunk in prefill:
        assert any(s[0] == "short" and s[2] == chunk[2] and s[1] == 1 for s in steps), "same step, a token each"


async def test_readers_are_woken_off_the_device_thread(stub: pb_grpc.GeneratorStub, server: Running,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched step's chunks wake their readers from the waker thread: a wake-up's socket write lets go of the
    interpreter, and the event loop, taking it there, would hold the device thread back for its work on the chunks
    (the forward, which holds no interpreter, runs beside that work instead)."""
    wakers: Counter[str] = Counter()
    wake_all = scheduler_module.wake_all

    def recorded(jobs: list[Job]) -> None:
        wakers[threading.current_thread().name] += 1
        wake_all(jobs)

    monkeypatch.setattr(scheduler_module, "wake_all", recorded)
    assert await concurrently(stub, [0.0, 0.0, 0.0, 0.0])
    assert wakers and set(wakers) == {"specrpc-waker"}, wakers


async def test_a_request_cancelled_before_its_first_step_reports_its_prompt(stub: pb_grpc.GeneratorStub,
                                                                            server: Running) -> None:
    """A request a newer one on its session cancels while it waits for the device thread (its job submitted, not
    started: the thread is held here) ends cancelled with its prompt's tokens in the summary, as one superseded
    before it was submitted does, not 0 (an editor's keystrokes under load)."""
    runtime = server.runtime
    release = threading.Event()
    held = runtime.scheduler.call(lambda: release.wait(10))
    try:
        first = asyncio.ensure_future(collect(stub.Generate(pb.GenerateRequest(
            prompt=PROMPTS[0], max_new_tokens=4, session_id="held-keystrokes"))))
        for _ in range(500):  # until the first job is handed to the held device thread
            if runtime.registry.in_use:
                break
            await asyncio.sleep(0.01)
        assert runtime.registry.in_use == 1
        second = asyncio.ensure_future(collect(stub.Generate(pb.GenerateRequest(
            prompt=PROMPTS[1], max_new_tokens=4, session_id="held-keystrokes"))))
        await asyncio.sleep(0.2)  # its cancel of the first reaches the job before the thread does
    finally:
        release.set()
    held.result(10)
    (_, cancelled), (_, answered) = await first, await second
    assert cancelled.finish_reason == pb.FINISH_REASON_CANCELLED
    assert cancelled.prompt_tokens == len(runtime.encode(PROMPTS[0])) > 0
    assert answered.prompt_tokens == len(runtime.encode(PROMPTS[1]))


def test_batching_setting_defaults_on_and_is_validated() -> None:
    assert build_config(None, env={}).engine.batching == "on"
    assert build_config(None, env={"SPECRPC_BATCHING": "off"}).engine.batching == "off"
    with pytest.raises(ValueError, match="--batching must be on or off"):
        build_config(None, env={"SPECRPC_BATCHING": "maybe"})


def test_the_idle_task_runs_once_a_spell_and_gives_way_to_work() -> None:
    """`on_idle` runs on the device thread once the device has had nothing to do for `idle_after_s`, once per idle
    spell however long (work makes another), its `busy()` turns true as soon as a call waits, and a failing idle task
    leaves the device thread serving."""
    ran: list[str] = []
    running, saw_busy = threading.Event(), threading.Event()

    def idle(busy: Callable[[], bool]) -> None:
        ran.append(threading.current_thread().name)
        if len(ran) == 2:  # the second spell: a call comes while it runs
            running.set()
            deadline = time.monotonic() + 10
            while not busy() and time.monotonic() < deadline:
                time.sleep(0.001)
            if busy():
                saw_busy.set()
        if len(ran) == 3:
            raise RuntimeError("an idle task that fails")

    scheduler = Scheduler(engine=None, on_idle=idle, idle_after_s=0.05)  # type: ignore[arg-type]  # calls alone
    scheduler.start()
    try:
        time.sleep(0.2)
        assert ran == [], "nothing before the first work"
        assert scheduler.call(lambda: 1).result(timeout=10) == 1
        time.sleep(0.3)
        assert ran == ["specrpc-device"], "once for the spell, however long"
        scheduler.call(lambda: None).result(timeout=10)
        assert running.wait(10)
        assert scheduler.call(lambda: "after").result(timeout=10) == "after"
        assert saw_busy.is_set()
        deadline = time.monotonic() + 10
        while len(ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ran) == 3 and scheduler.call(lambda: "still serving").result(timeout=10) == "still serving"
    finally:
        scheduler.stop()


def test_an_idle_task_that_asks_again_runs_again_in_the_same_spell() -> None:
    """An `on_idle` that returns seconds runs again after them while the device stays idle (a long-idle server still
    checks its paths); one that returns None waits for the next spell."""
    ran: list[float] = []

    def idle(busy: Callable[[], bool]) -> float | None:
        ran.append(time.monotonic())
        return 0.05 if len(ran) < 3 else None

    scheduler = Scheduler(engine=None, on_idle=idle, idle_after_s=0.05)  # type: ignore[arg-type]  # calls alone
    scheduler.start()
    try:
        scheduler.call(lambda: None).result(timeout=10)
        deadline = time.monotonic() + 10
        while len(ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert len(ran) == 3, "twice more in the spell, then not before work"
        assert all(b - a >= 0.04 for a, b in itertools.pairwise(ran)), "each after the seconds it asked"
    finally:
        scheduler.stop()
