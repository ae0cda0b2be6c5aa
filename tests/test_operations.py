"""Operations: health (NOT_SERVING until warm, while draining; HTTP /health alike), reflection, Prometheus metrics,
and a graceful SIGTERM drain of `specrpc serve` run as a process."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx2
import pytest
from conftest import free_port
from conftest import test_config as make_config
from engine_helpers import counted_calls
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import GREEDY_K0, collect, first_tokens, ids_of, read_rest, rpc_error

from specrpc.config import Config
from specrpc.edges.server import Running, start_server
from specrpc.engine import engine as engine_module
from specrpc.engine.policy import CostModel
from specrpc.models import Drift
from specrpc.models.backends import memo
from specrpc.models.llama import lm as llama_lm
from specrpc.serving.runtime import Runtime
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

GENERATOR = "specrpc.v1.Generator"
HEALTH = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPO = Path(__file__).resolve().parents[1]


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


# ---- health and reflection on the shared server --------------------------------------------------------------------


async def test_health_reports_serving(channel: grpc.aio.Channel) -> None:
    assert await health_status(channel) == SERVING
    assert await health_status(channel, GENERATOR) == SERVING
    error = await rpc_error(health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5))
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_services(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=GENERATOR),
    ]
    responses = [r async for r in stub.ServerReflectionInfo(iter(requests), timeout=10)]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {GENERATOR, HEALTH} <= names
    files = responses[1].file_descriptor_response.file_descriptor_proto
    assert files and any(b"specrpc/v1/generator.proto" in f for f in files)


# ---- metrics -------------------------------------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_requests_tokens_and_slots(
    stub: pb_grpc.GeneratorStub, server: Running, long_streams: float
) -> None:
    assert server.metrics_port
    before = await asyncio.to_thread(scrape, server.metrics_port)
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(
        prompt="def add(a, b):\n    return", max_new_tokens=12, speculation=pb.SpeculationParams(num_draft_tokens=3))))
    await rpc_error(stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=-1))))
    # a stream in flight shows in the slot gauge at once
    call = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=256, speculation=GREEDY_K0))
    await first_tokens(call)
    during = await asyncio.to_thread(scrape, server.metrics_port)
    call.cancel()
    while server.runtime.registry.in_use:
        await asyncio.sleep(0.01)
    after = await asyncio.to_thread(scrape, server.metrics_port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("specrpc_requests_total", rpc="Generate", code="OK", protocol="grpc") == 1
    assert delta("specrpc_requests_total", rpc="Generate", code="INVALID_ARGUMENT", protocol="grpc") == 1
    assert delta("specrpc_requests_total", rpc="Generate", code="CANCELLED", protocol="grpc") == 1
    cancelled_tokens = delta("specrpc_completion_tokens_total") - summary.completion_tokens
    assert summary.completion_tokens == len(ids_of(chunks)) and cancelled_tokens >= 1
    assert delta("specrpc_prompt_tokens_total") >= summary.prompt_tokens
    assert delta("specrpc_time_to_first_token_seconds_count") == 2
    assert delta("specrpc_draft_tokens_proposed_total") == summary.speculation.draft_tokens_proposed > 0
    assert delta("specrpc_draft_tokens_accepted_total") == summary.speculation.draft_tokens_accepted
    assert delta("specrpc_verify_steps_total") >= summary.speculation.verify_steps
    assert value(after, "specrpc_kv_slots_total") == server.runtime.registry.total
    assert value(during, "specrpc_kv_slots_in_use") == 1
    assert value(after, "specrpc_kv_slots_in_use") == 0
    assert value(after, "specrpc_active_sessions") == len(server.runtime.registry.sessions)


# ---- start-up and drain of an in-process server --------------------------------------------------------------------


def test_what_loading_made_is_frozen_while_serving() -> None:
    """A started runtime freezes the collector's view of what loading made (no full collection traverses the models
    and tokenizer while serving); stopping hands it back."""
    config = make_config()
    runtime = Runtime(replace(config, engine=replace(config.engine, max_sessions=1, max_context=128)))
    runtime.start()
    try:
        assert gc.get_freeze_count() > 100_000  # the tokenizer's and models' objects
    finally:
        runtime.stop()
    assert gc.get_freeze_count() == 0


def test_a_restart_takes_the_step_costs_it_kept_over_the_paths_it_kept(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A start whose models took their paths from an earlier start's memo takes that start's step costs too, after a
    warm-up whose one-token step times as then, without calibrating; a memo whose step took a tenth of today's is
    measured again and rewritten, and a start with other settings keeps costs of its own."""
    monkeypatch.setattr(memo, "directory", lambda: tmp_path / "memos")
    # What is kept and taken back is this test's subject, not the checks' tolerance: the suite's other worker shares
    # the cores, so each check's tolerance is widened past its bursts; a tenth is still off.
    monkeypatch.setattr(llama_lm, "Drift", functools.partial(Drift, tolerance=4.0))
    monkeypatch.setattr(engine_module, "Drift", functools.partial(Drift, tolerance=4.0))
    calibrations = counted_calls(monkeypatch, engine_module.Engine, "calibrate")
    config = make_config()
    config = replace(config, engine=replace(config.engine, max_sessions=1, max_context=128, remember_execution=True))

    def started(config: Config) -> Runtime:
        runtime = Runtime(config)
        runtime.start()
        runtime.stop()
        return runtime

    first = started(config)
    assert calibrations == [1] and first.costs_chosen == "measured"
    (kept,) = (tmp_path / "memos").glob("*-costs-*.json")
    second = started(config)
    assert calibrations == [1] and second.costs_chosen == "remembered"
    assert second.engine.costs.entry() == first.engine.costs.entry() == json.loads(kept.read_text())
    entry = json.loads(kept.read_text())
    kept.write_text(json.dumps({**entry, "target_step_s": entry["target_step_s"] / 10}))
    assert started(config).costs_chosen == "measured" and calibrations == [1, 1]
    assert json.loads(kept.read_text())["target_step_s"] > entry["target_step_s"] / 5, "rewritten with today's"
    other = replace(config, engine=replace(config.engine, max_draft_tokens=4))
    assert started(other).costs_chosen == "measured" and len(list((tmp_path / "memos").glob("*-costs-*.json"))) == 2


async def test_health_not_serving_until_warm_and_while_draining(server: Running,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config()
    config = replace(config, engine=replace(config.engine, max_sessions=1, max_context=128),
                     server=replace(config.server, metrics_port=0))
    load_gate, warm_gate = threading.Event(), threading.Event()
    loaded: list[Runtime] = []

    def gated_runtime(config: Config) -> Runtime:
        """Runtime whose loading and warm-up each wait for the test."""
        load_gate.wait(60)
        runtime = Runtime(config)
        warm_up = runtime.start

        def gated_start() -> None:
            warm_gate.wait(60)
            warm_up()

        runtime.start = gated_start  # type: ignore[method-assign]
        loaded.append(runtime)
        return runtime

    monkeypatch.setattr("specrpc.edges.server.Runtime", gated_runtime)
    listening: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    starting = asyncio.create_task(start_server(config, on_listening=listening.set_result))
    try:
        port = await asyncio.wait_for(listening, timeout=30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, httpx2.AsyncClient(
                base_url=f"http://127.0.0.1:{config.server.http_port}", timeout=10) as http:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=GENERATOR))
            assert (await watch.read()).status == NOT_SERVING
            stub = pb_grpc.GeneratorStub(channel)
            for phase, gate in (("loading", load_gate), ("warming up", warm_gate)):
                assert await health_status(channel) == NOT_SERVING, phase
                assert await health_status(channel, GENERATOR) == NOT_SERVING, phase
                error = await rpc_error(stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=2), timeout=5))
                assert error.code() == grpc.StatusCode.UNAVAILABLE and "SERVING" in (error.details() or ""), phase
                error = await rpc_error(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
                assert error.code() == grpc.StatusCode.UNAVAILABLE, phase
                # the HTTP edge, listening from the start too: /health and requests 503 until warm
                assert (await http.get("/health")).status_code == 503, phase
                refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading", phase
                assert not starting.done(), phase
                gate.set()
                if phase == "loading":
                    while not loaded:
                        await asyncio.sleep(0.01)
            running = await asyncio.wait_for(starting, timeout=60)
            runtime = loaded[0]
            assert running.runtime is runtime
            assert (await asyncio.wait_for(watch.read(), timeout=5)).status == SERVING
            assert await health_status(channel) == SERVING
            assert (await http.get("/health")).status_code == 200

            # drain with a stream in flight: NOT_SERVING at once, new calls refused, the stream completes
            runtime.stop_token_ids = frozenset()
            runtime.scheduler.on_step = lambda job, result, seconds: time.sleep(0.01)
            call = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=40,
                                                    speculation=GREEDY_K0))
            await first_tokens(call)
            stopping = asyncio.create_task(running.stop(10.0))
            assert (await asyncio.wait_for(watch.read(), timeout=2)).status == NOT_SERVING
            error = await rpc_error(stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=2), timeout=5))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (error.details() or "")
            assert (await http.get("/health")).status_code == 503
            refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            _, summary = await read_rest(call)
            assert summary.finish_reason == pb.FINISH_REASON_LENGTH and summary.completion_tokens == 40
            await asyncio.wait_for(stopping, timeout=3)  # the health Watch stream does not hold the grace period
            watch.cancel()
    finally:
        load_gate.set()
        warm_gate.set()
        if not starting.done():
            starting.cancel()


async def test_a_failed_start_frees_the_port(tmp_path: Path) -> None:
    config = make_config(target=str(tmp_path / "missing"), draft="none")
    config = replace(config, server=replace(config.server, metrics_port=0))
    ports: list[int] = []
    with pytest.raises(OSError):
        await start_server(config, on_listening=ports.append)
    assert ports
    server = grpc.aio.server()
    assert server.add_insecure_port(f"127.0.0.1:{ports[0]}") == ports[0]  # the port was released


# ---- `specrpc serve` as a process ----------------------------------------------------------------------------------


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`python -m specrpc.cli serve` on a free port with the configured models (logs in tmp_path/serve.log)."""
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "specrpc.cli", "serve", "--port", str(port), "--metrics-port", "0",
           "--max-sessions", "2", "--max-context", "1100", "--max-new-tokens", "1024", "--threads", "1",
           "--grace-s", "3",
           "--log-format", "console"]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process, port, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def wait_for_health(channel: grpc.aio.Channel, process: subprocess.Popen[bytes], log: Path,
                          want: set[int], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"specrpc serve exited early:\n{log.read_text()}"
        try:
            status = await health_status(channel)
            if status in want:
                return status
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    pytest.fail(f"no health status in {want} within {timeout} s:\n{log.read_text()}")


FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 200)]
"""Channel options for a server that is not listening yet (the default backoff waits seconds between tries)."""


async def test_sigterm_drains_in_flight_streams_and_exits_0(
    server: Running, serve_process: tuple[subprocess.Popen[bytes], int, Path]
) -> None:
    process, port, log = serve_process
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as channel:
        await wait_for_health(channel, process, log, {SERVING})
        stub = pb_grpc.GeneratorStub(channel)
        call = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=1024,
                                                speculation=GREEDY_K0), timeout=30)
        await first_tokens(call)
        process.send_signal(signal.SIGTERM)
        # new calls are refused once the signal has landed: UNAVAILABLE (a call already on the wire when the server
        # stops listening may be CANCELLED by gRPC before any handler sees it)
        refused: list[grpc.StatusCode] = []
        for _ in range(100):
            try:
                await collect(stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=1), timeout=5))
                assert not refused, "a call was accepted after one was refused"
            except grpc.aio.AioRpcError as error:
                refused.append(error.code())
                if len(refused) == 3:
                    break
            await asyncio.sleep(0.02)
        assert refused[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), refused
        assert refused[1:] == [grpc.StatusCode.UNAVAILABLE] * 2, refused
        # the stream in flight completes, or ends UNAVAILABLE/CANCELLED when the grace period runs out
        try:
            _, summary = await read_rest(call)
            assert summary.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
        except grpc.aio.AioRpcError as error:
            assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), error
    code = await asyncio.to_thread(process.wait, 30)
    assert code == 0, log.read_text()
    assert "draining" in log.read_text()


async def test_sigterm_during_start_up_exits_0(
    server: Running, serve_process: tuple[subprocess.Popen[bytes], int, Path]
) -> None:
    process, port, log = serve_process
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as channel:
        await wait_for_health(channel, process, log, {NOT_SERVING, SERVING})
    process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(process.wait, 60)
    assert code == 0, log.read_text()


async def test_warm_up_runs_on_the_device_thread_and_seeds_every_slot_policy(server: Running) -> None:
    runtime = server.runtime
    threads: list[str] = []
    engine = runtime.engine

    def recorded(measure: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object) -> object:
            threads.append(threading.current_thread().name)
            return measure(*args)
        return run

    # the costs calibrated, or taken back from an earlier start of this suite's after a warm-up (`recall_costs`)
    engine.calibrate, engine.recall_costs = recorded(engine.calibrate), recorded(engine.recall_costs)  # type: ignore
    try:
        costs = await asyncio.wrap_future(runtime.scheduler.call(runtime._calibrate))
    finally:
        del engine.calibrate, engine.recall_costs
    assert threads and set(threads) == {"specrpc-device"}
    for slot in runtime.registry.slots:  # each slot's policy reads the calibrated costs, the device's for every one
        assert slot.policy.costs is costs and costs.target_step_s != CostModel().target_step_s
