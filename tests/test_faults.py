"""Faults: a storm of cancelled streams, an engine step that raises for one stream, device out-of-memory, a session
evicted mid-use, and SIGTERM with streams of every kind in flight on a `specrpc serve` process.

Every call must end within a timeout (no hangs), with a status that says what happened; afterwards no KV slot,
stream count or session lock is left held and the server still serves."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from conftest import models_missing
from conftest import test_config as make_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_helpers import FAST_RECONNECT, serve_process, wait_serving
from service_helpers import (
    CLIENT_WRITE_RACE,
    GREEDY_K0,
    collect,
    first_tokens,
    ids_of,
    long_request,
    read_rest,
    rpc_error,
    wait_until,
)

from specrpc.config import Limits
from specrpc.edges.server import Running, start_server
from specrpc.engine.generation import StepResult
from specrpc.serving.scheduler import Job
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

Stub = pb_grpc.GeneratorStub
CALL_TIMEOUT_S = 30.0
"""No call may take longer than this: a stream still open after it counts as hung."""


async def assert_clean(server: Running, timeout: float = 10.0) -> None:
    """Nothing left held: slots, stream counts, the device thread's jobs, session locks and jobs; slot bookkeeping
    consistent (every slot free, held by a session, or both-not: busy)."""
    registry, service = server.runtime.registry, server.service
    await wait_until(lambda: registry.in_use == 0 and not service.quota.open and service.gateway.streams == 0
                     and server.runtime.scheduler.active == 0, timeout=timeout, what="slots, streams and jobs released")
    for session in registry.sessions.values():
        assert not session.lock.locked() and session.job is None, session.id
    held = {s.slot.index for s in registry.sessions.values()}
    assert not registry.busy and not (registry.free & held), "a slot both free and held by a session"
    assert registry.free | held == set(range(registry.total)), "a slot neither free nor held: leaked"


async def assert_serving(server: Running, stub: Stub) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=4),
                                                  timeout=CALL_TIMEOUT_S))
    assert summary.completion_tokens == len(ids_of(chunks)) >= 1
    await assert_clean(server)


@pytest.fixture
def inject(server: Running, long_streams: float) -> Iterator[Callable[[Callable[[Job], None]], None]]:
    """Install a per-step fault hook on top of `long_streams` (which keeps streams running); restored after."""
    scheduler = server.runtime.scheduler
    slow = scheduler.on_step

    def install(fault: Callable[[Job], None]) -> None:
        def hook(job: Job, result: StepResult, seconds: float) -> None:
            if slow is not None:
                slow(job, result, seconds)
            fault(job)

        scheduler.on_step = hook

    yield install
    scheduler.on_step = slow


def marked(prompt: str, server: Running) -> Callable[[Job], bool]:
    """True for the job whose prompt is exactly `prompt`'s tokens."""
    ids = server.runtime.encode(prompt)
    return lambda job: list(job.request.prompt_ids) == ids


def prompt_is(prompt: str, server: Running) -> Callable[[Any], bool]:
    """True for a GenerationRequest whose prompt is exactly `prompt`'s tokens."""
    ids = server.runtime.encode(prompt)
    return lambda request: list(request.prompt_ids) == ids


def after_steps(is_victim: Callable[[Job], bool], steps: int, error: Callable[[], BaseException]
                ) -> Callable[[Job], None]:
    """A fault that raises `error()` at the victim's `steps`-th step."""
    counts: Counter[int] = Counter()

    def fault(job: Job) -> None:
        if is_victim(job):
            counts[id(job)] += 1
            if counts[id(job)] == steps:
                raise error()

    return fault


# ---- one stream fails, the others go on ---------------------------------------------------------------------------


async def _victim_among_healthy(stub: Stub, victim_prompt: str, n: int = 24) -> tuple[grpc.aio.AioRpcError,
                                                                                        list[pb.GenerationSummary]]:
    """Run the victim with two healthy streams; the victim's error and the healthy summaries."""
    healthy = [stub.Generate(long_request(prompt=f"Healthy story {i}:", max_new_tokens=n), timeout=CALL_TIMEOUT_S)
               for i in range(2)]
    victim = stub.Generate(long_request(prompt=victim_prompt, max_new_tokens=n), timeout=CALL_TIMEOUT_S)
    for call in healthy:
        await first_tokens(call)
    error = await rpc_error(victim)
    summaries = [(await read_rest(call))[1] for call in healthy]
    return error, summaries


async def test_an_engine_step_that_raises_fails_only_its_stream(stub: Stub, server: Running, inject: Any) -> None:
    victim = "The victim's story:"
    inject(after_steps(marked(victim, server), 3, lambda: RuntimeError("injected engine fault")))
    before = server.metrics.registry.get_sample_value("specrpc_requests_total",
                                                      {"rpc": "Generate", "code": "INTERNAL", "protocol": "grpc"}) or 0
    error, summaries = await _victim_among_healthy(stub, victim)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "injected engine fault" in (error.details() or "") and "this stream" in (error.details() or "")
    for summary in summaries:
        assert summary.finish_reason == pb.FINISH_REASON_LENGTH and summary.completion_tokens == 24
    after = server.metrics.registry.get_sample_value("specrpc_requests_total",
                                                     {"rpc": "Generate", "code": "INTERNAL", "protocol": "grpc"})
    assert after == before + 1
    await assert_clean(server)
    inject(lambda job: None)
    _, summary = await collect(stub.Generate(long_request(prompt=victim, max_new_tokens=5), timeout=CALL_TIMEOUT_S))
    assert summary.completion_tokens == 5  # the same request works once the fault is gone


async def test_a_failing_prefill_on_a_session_fails_that_request_and_the_session_recovers(
    stub: Stub, server: Running, long_streams: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.runtime.scheduler.engine
    start = engine.start
    victim = prompt_is("Prefill fails here:", server)

    def failing_start(slot: Any, request: Any) -> Any:
        if victim(request):
            raise RuntimeError("injected prefill fault")
        return start(slot, request)

    monkeypatch.setattr(engine, "start", failing_start)
    session = "fault-session"
    await collect(stub.Generate(long_request(prompt="Prefill fails", max_new_tokens=3, session_id=session),
                                timeout=CALL_TIMEOUT_S))
    error = await rpc_error(stub.Generate(long_request(prompt="Prefill fails here:", session_id=session),
                                          timeout=CALL_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INTERNAL and "injected prefill fault" in (error.details() or "")
    monkeypatch.setattr(engine, "start", start)
    _, summary = await collect(stub.Generate(long_request(prompt="Prefill fails here:", max_new_tokens=3,
                                                          session_id=session), timeout=CALL_TIMEOUT_S))
    assert summary.completion_tokens == 3 and summary.cached_prompt_tokens == 0  # the slot was reset: cold
    await assert_clean(server)


@pytest.mark.parametrize("error", [
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                         "to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"),
], ids=["cuda", "cpu"])
async def test_device_out_of_memory_is_resource_exhausted_for_that_stream(
    stub: Stub, server: Running, inject: Any, error: Callable[[], BaseException]
) -> None:
    victim = "A story too big for memory:"
    inject(after_steps(marked(victim, server), 2, error))
    failure, summaries = await _victim_among_healthy(stub, victim)
    assert failure.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory" in (failure.details() or "") and "retry" in (failure.details() or "")
    assert all(s.finish_reason == pb.FINISH_REASON_LENGTH and s.completion_tokens == 24 for s in summaries)
    inject(lambda job: None)
    await assert_serving(server, stub)


# ---- sessions evicted while in use -----------------------------------------------------------------------------------


async def test_session_evicted_mid_stream_completes_and_the_next_request_starts_cold(
    stub: Stub, server: Running, long_streams: float
) -> None:
    registry = server.runtime.registry
    session = "evicted-mid-stream"
    prompt = "A long tale of eviction:"
    call = stub.Generate(long_request(prompt=prompt, max_new_tokens=30, session_id=session), timeout=CALL_TIMEOUT_S)
    await first_tokens(call)
    registry.close(session)  # forced eviction while the stream runs on the session's slot
    assert session not in registry.sessions
    _, summary = await read_rest(call)
    assert summary.finish_reason == pb.FINISH_REASON_LENGTH and summary.completion_tokens == 30
    await assert_clean(server)
    # the session is gone: the next request opens it afresh (a free slot that still holds the prompt may serve its
    # prefix, as for any request) and gives exactly what a request without a session gives
    reference, _ = await collect(stub.Generate(long_request(prompt=prompt, max_new_tokens=3), timeout=CALL_TIMEOUT_S))
    chunks, again = await collect(stub.Generate(long_request(prompt=prompt, max_new_tokens=3, session_id=session),
                                                timeout=CALL_TIMEOUT_S))
    assert ids_of(chunks) == ids_of(reference) and again.completion_tokens == 3 and session in registry.sessions
    registry.close(session)


async def test_ttl_zero_spares_a_running_session_and_evicts_it_once_idle(
    stub: Stub, server: Running, long_streams: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = server.runtime.registry
    session = "ttl-zero"
    prompt = "The shortest-lived session:"
    reference, _ = await collect(stub.Generate(long_request(prompt=prompt, max_new_tokens=3, session_id=session),
                                               timeout=CALL_TIMEOUT_S))
    monkeypatch.setattr(registry, "ttl_s", 0.0)
    call = stub.Generate(long_request(prompt=prompt, max_new_tokens=20, session_id=session), timeout=CALL_TIMEOUT_S)
    await first_tokens(call)
    for _ in range(5):
        registry.evict_expired(time.monotonic() + 3600)  # as the janitor would, long past the TTL
        assert session in registry.sessions, "a session with a stream in flight was evicted"
        await asyncio.sleep(0.01)
    _, summary = await read_rest(call)
    assert summary.completion_tokens == 20 and summary.cached_prompt_tokens > 0
    await wait_until(lambda: registry.in_use == 0, what="slot released")
    assert registry.evict_expired(time.monotonic() + 1) >= 1 and session not in registry.sessions
    chunks, _ = await collect(stub.Generate(long_request(prompt=prompt, max_new_tokens=3, session_id=session),
                                            timeout=CALL_TIMEOUT_S))
    assert ids_of(chunks) == ids_of(reference)
    registry.close(session)
    await assert_clean(server)


async def test_converse_session_evicted_mid_reply_ends_cleanly_and_resumes_cold(
    stub: Stub, server: Running, long_streams: float
) -> None:
    registry = server.runtime.registry
    call = stub.Converse(timeout=CALL_TIMEOUT_S)
    await call.write(pb.ConverseRequest(start=pb.SessionStart(session_id="converse-evicted", max_new_tokens=30,
                                                              speculation=GREEDY_K0)))
    assert (await call.read()).WhichOneof("event") == "started"
    await call.write(pb.ConverseRequest(turn=pb.Turn(text="Tell me a story.")))
    response = await asyncio.wait_for(call.read(), 10)
    assert response.WhichOneof("event") == "chunk"
    registry.close("converse-evicted")
    while (response := await asyncio.wait_for(call.read(), 10)).WhichOneof("event") != "summary":
        assert response.WhichOneof("event") == "chunk"
    assert response.summary.generation.completion_tokens == 30
    await call.write(pb.ConverseRequest(turn=pb.Turn(text="Another one.")))  # the history is in the stream: works
    while (response := await asyncio.wait_for(call.read(), 10)).WhichOneof("event") != "summary":
        pass
    assert response.summary.turn_index == 1 and response.summary.generation.completion_tokens == 30
    await call.done_writing()
    assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
    registry.close("converse-evicted")
    await assert_clean(server)


async def test_a_cancelled_stream_frees_its_slot_before_the_next_step_of_any_other(
    stub: Stub, server: Running, long_streams: float
) -> None:
    """Every slot busy with a slow stream (each step takes 0.2 s): a stream cancelled just after its own step is
    ended before the next step of any other stream, not after a whole round of theirs (0.6 s here)."""
    registry, scheduler = server.runtime.registry, server.runtime.scheduler
    scheduler.on_step = lambda job, result, seconds: time.sleep(0.2)  # (long_streams restores its hook)
    calls = [stub.Generate(long_request(prompt=f"Slow story {i}:"), timeout=CALL_TIMEOUT_S)
             for i in range(registry.total)]
    for call in calls:
        await first_tokens(call)
    victim = calls[0]
    await first_tokens(victim)  # its step has just happened: the other streams' steps come next
    victim.cancel()
    took = await wait_until(lambda: registry.in_use == registry.total - 1, timeout=5, what="the slot freed")
    assert took < 0.4, f"the cancelled stream held its slot for {took:.2f} s"
    for call in calls[1:]:
        call.cancel()
    await assert_clean(server)


async def test_a_request_right_after_a_cancel_waits_for_the_released_slot(
    stub: Stub, server: Running, long_streams: float
) -> None:
    """Every slot busy; a client cancels one stream and asks again at once, before the device thread has let go of
    the cancelled stream's slot (the test holds the device thread between steps): the new request (and a new
    conversation) waits for that slot instead of failing RESOURCE_EXHAUSTED; with nothing cancelled the refusal
    stays immediate."""
    registry, scheduler = server.runtime.registry, server.runtime.scheduler
    gate, parked = threading.Event(), threading.Event()
    gate.set()

    def hook(job: Job, result: StepResult, seconds: float) -> None:
        time.sleep(0.01)
        if not gate.is_set():
            parked.set()  # the device thread waits here, after a step and before it looks at cancellations again
            gate.wait(10)

    scheduler.on_step = hook  # (long_streams restores its own)
    calls = [stub.Generate(long_request(prompt=f"Busy story {i}:"), timeout=CALL_TIMEOUT_S)
             for i in range(registry.total)]
    try:
        for call in calls:
            await first_tokens(call)
        started = time.perf_counter()
        error = await rpc_error(stub.Generate(long_request(max_new_tokens=2), timeout=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.perf_counter() - started < 1.0
        for i, follow_up in enumerate(("generate", "converse")):
            parked.clear()
            gate.clear()
            await wait_until(parked.is_set, timeout=5, what="the device thread parked after a step")
            calls[i].cancel()
            await wait_until(lambda: registry._releasing(), timeout=5, what="the cancel seen by the server")
            if follow_up == "generate":  # (it keeps its slot: every slot is busy again for the next round)
                calls.append(stub.Generate(long_request(prompt="Right after"), timeout=CALL_TIMEOUT_S))
                waiting = asyncio.ensure_future(first_tokens(calls[-1]))
            else:
                conversation = stub.Converse(iter([pb.ConverseRequest(start=pb.SessionStart())]),
                                             timeout=CALL_TIMEOUT_S)
                waiting = asyncio.ensure_future(conversation.read())
            await asyncio.sleep(0.2)
            assert registry.in_use == registry.total and not waiting.done(), "not waiting for the slot"
            gate.set()
            response = await asyncio.wait_for(waiting, 10)  # admitted, not RESOURCE_EXHAUSTED
            if follow_up == "converse":
                assert response.WhichOneof("event") == "started"
                assert await conversation.code() == grpc.StatusCode.OK
    finally:
        gate.set()
        for call in calls:
            call.cancel()
    await assert_clean(server)


# ---- cancellation storm ---------------------------------------------------------------------------------------------


STORM_STREAMS = 300
STORM_CONCURRENCY = 6
STORM_OUTCOMES = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest_asyncio.fixture(scope="module")
async def storm_server() -> AsyncIterator[Running]:
    """A server with 8 slots whose streams last (each step also sleeps 2 ms; end-of-sequence does not end them)."""
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    base = make_config()
    config = replace(base, engine=replace(base.engine, max_sessions=8, max_context=256),
                     server=replace(base.server, metrics_port=0),
                     limits=Limits(max_new_tokens=64, default_max_new_tokens=64))
    running = await start_server(config)
    running.runtime.scheduler.on_step = lambda job, result, seconds: time.sleep(0.002)
    running.runtime.stop_token_ids = frozenset()
    yield running
    await running.stop(0.5)


async def _read_some(call: Any, n: int) -> None:
    """Read up to n responses (fewer if the stream ends first)."""
    for _ in range(n):
        if await call.read() is grpc.aio.EOF:
            return


async def _storm_one(stub: Stub, port: int, rng: random.Random, i: int) -> str:
    """One stream of the storm, ended one of several ways; returns how (and its status)."""
    kind = rng.choice(["cancel", "cancel-at-once", "disconnect", "deadline", "complete", "session", "converse",
                       "converse-cancel-action", "infill"])
    n = rng.randint(0, 12)
    session = f"storm-{rng.randint(0, 3)}" if kind == "session" else ""
    request = pb.GenerateRequest(prompt=f"Storm stream {i}: once upon a time", max_new_tokens=rng.randint(1, 32),
                                 session_id=session,
                                 speculation=pb.SpeculationParams(num_draft_tokens=rng.randint(0, 4)))
    try:
        if kind == "disconnect":
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            call = pb_grpc.GeneratorStub(channel).Generate(request)
            await _read_some(call, n)
            await channel.close()  # the connection goes away mid-stream
            return f"{kind}:{(await call.code()).name}"
        if kind in ("converse", "converse-cancel-action"):
            conv = stub.Converse(timeout=CALL_TIMEOUT_S)
            await conv.write(pb.ConverseRequest(start=pb.SessionStart(max_new_tokens=32, phrase_mode=True)))
            await conv.write(pb.ConverseRequest(turn=pb.Turn(text=f"Tell story {i}.")))
            await _read_some(conv, n)
            if kind == "converse":
                conv.cancel()
            else:
                await conv.write(pb.ConverseRequest(cancel=pb.Cancel()))  # barge-in, then hang up
                await conv.done_writing()
                while await conv.read() is not grpc.aio.EOF:
                    pass
            return f"{kind}:{(await conv.code()).name}"
        timeout = rng.uniform(0.005, 0.3) if kind == "deadline" else CALL_TIMEOUT_S
        if kind == "infill":
            call = stub.Infill(pb.InfillRequest(prefix=f"def story_{i}(", suffix="):\n", max_new_tokens=32),
                               timeout=timeout)
        else:
            call = stub.Generate(request, timeout=timeout)
        if kind == "cancel-at-once":
            call.cancel()
        elif kind in ("complete", "deadline") or (kind == "infill" and n > 6):
            while await call.read() is not grpc.aio.EOF:  # to its end (or its deadline)
                pass
        else:
            await _read_some(call, n)
            call.cancel()
        return f"{kind}:{(await call.code()).name}"
    except grpc.aio.AioRpcError as error:
        if kind.startswith("converse") and (error.code(), error.details()) == CLIENT_WRITE_RACE:
            return f"{kind}:CLIENT_RACE"  # the client wrote after the server ended the call: its status is lost
        return f"{kind}:{error.code().name}"
    except asyncio.InvalidStateError:  # a write after the server ended the call (it refused the stream)
        return f"{kind}:{(await conv.code()).name}"
    except asyncio.CancelledError:
        return f"{kind}:CANCELLED"


async def test_cancellation_storm_leaves_nothing_behind(storm_server: Running) -> None:
    rng = random.Random(20240613)
    gate = asyncio.Semaphore(STORM_CONCURRENCY)
    hung: list[int] = []

    async with grpc.aio.insecure_channel(f"127.0.0.1:{storm_server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)

        async def one(i: int, seed: int) -> str:
            async with gate:
                try:
                    return await asyncio.wait_for(_storm_one(stub, storm_server.port, random.Random(seed), i),
                                                  CALL_TIMEOUT_S)
                except TimeoutError:
                    hung.append(i)
                    return "hung"

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i, rng.randrange(2**32)) for i in range(STORM_STREAMS)))
        took = time.perf_counter() - t0
        assert not hung, f"streams {hung} did not finish within {CALL_TIMEOUT_S} s"
        counts = Counter(outcomes)
        print(f"storm: {STORM_STREAMS} streams in {took:.1f} s: {dict(sorted(counts.items()))}")
        codes = {grpc.StatusCode[o.split(":")[1]] for o in outcomes if not o.endswith(":CLIENT_RACE")}
        assert codes <= STORM_OUTCOMES, counts
        assert sum(v for k, v in counts.items() if k.endswith(":CANCELLED")) >= STORM_STREAMS // 3, counts
        # fewer streams than slots: a slot is short only while a cancelled stream's slot is not yet released
        assert sum(v for k, v in counts.items() if k.endswith(":RESOURCE_EXHAUSTED")) <= STORM_STREAMS // 10, counts
        await assert_clean(storm_server)
        await assert_serving(storm_server, stub)


# ---- SIGTERM with streams of every kind in flight ----------------------------------------------------------------


async def test_sigterm_with_many_streams_in_flight_ends_every_one_and_exits_0(tmp_path: Path) -> None:
    """tests/test_operations.py drains one stream that finishes within the grace period; here four streams of
    every kind outlast a short grace: each completes or ends UNAVAILABLE/CANCELLED, none hangs, exit 0. A SIGHUP
    first (no tokens file) must not kill the server."""
    args = ["--max-sessions", "4", "--max-context", "1100", "--max-new-tokens", "1024", "--grace-s", "0.5"]
    with serve_process(tmp_path, args) as served:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}", options=FAST_RECONNECT) as channel:
            await wait_serving(channel, served)
            served.process.send_signal(signal.SIGHUP)
            stub = pb_grpc.GeneratorStub(channel)
            long = {"max_new_tokens": 1024, "speculation": GREEDY_K0}
            calls: dict[str, Any] = {
                "generate": stub.Generate(pb.GenerateRequest(prompt="Once upon a time", **long), timeout=60),
                "session": stub.Generate(pb.GenerateRequest(prompt="def main():", session_id="s", **long),
                                         timeout=60),
                "infill": stub.Infill(pb.InfillRequest(prefix="def f(", suffix=")", **long), timeout=60),
            }
            conv = stub.Converse(timeout=60)
            await conv.write(pb.ConverseRequest(start=pb.SessionStart(**long)))
            await conv.write(pb.ConverseRequest(turn=pb.Turn(text="Tell me everything.")))
            calls["converse"] = conv
            for call in calls.values():
                assert await asyncio.wait_for(call.read(), 30) is not grpc.aio.EOF
            assert served.process.poll() is None, "SIGHUP killed the server"
            served.process.send_signal(signal.SIGTERM)

            async def finish(call: Any) -> str:
                try:
                    while (response := await call.read()) is not grpc.aio.EOF:
                        last = response
                    assert last.WhichOneof("event") == "summary"
                    return "OK"
                except grpc.aio.AioRpcError as error:
                    return error.code().name

            ends = await asyncio.wait_for(asyncio.gather(*(finish(c) for c in calls.values())), 30)
        print("streams at SIGTERM:", dict(zip(calls, ends, strict=True)))
        assert set(ends) <= {"OK", "UNAVAILABLE", "CANCELLED"}, dict(zip(calls, ends, strict=True))
        assert await asyncio.to_thread(served.process.wait, 30) == 0, served.log_text()
        log = served.log_text()
        assert "SIGHUP ignored" in log and "draining" in log and "stopped" in log
