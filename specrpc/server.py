"""Assemble and run the grpc.aio server: Generator, health (NOT_SERVING until warm), reflection, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specrpc.config import Config
from specrpc.metrics import Metrics
from specrpc.runtime import Runtime
from specrpc.service import GeneratorService
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

SWITCH_INTERVAL_S = 0.0002
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name


@dataclass
class Running:
    """A started server and what a caller (or a test) needs to reach and stop it."""

    server: grpc.aio.Server
    port: int
    metrics_port: int
    health: health.aio.HealthServicer
    runtime: Runtime
    service: GeneratorService
    metrics: Metrics
    janitor: asyncio.Task[None]

    async def set_serving(self, serving: bool) -> None:
        """Health status for the overall server and the Generator service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Drain: NOT_SERVING, refuse new calls, let in-flight streams finish within `grace_s`, then stop."""
        await self.set_serving(False)
        await self.server.stop(grace_s)
        self.janitor.cancel()
        await asyncio.to_thread(self.runtime.stop)


async def _janitor(runtime: Runtime, metrics: Metrics, period_s: float) -> None:
    """Evict idle sessions and refresh the gauges."""
    while True:
        runtime.registry.evict_expired()
        metrics.active_sessions.set(len(runtime.registry.sessions))
        metrics.kv_slots_in_use.set(runtime.registry.in_use)
        await asyncio.sleep(period_s)


def _credentials(config: Config) -> grpc.ServerCredentials | None:
    s = config.server
    if not s.tls_cert:
        return None
    with open(s.tls_key, "rb") as key, open(s.tls_cert, "rb") as cert:
        pair = (key.read(), cert.read())
    client_ca = None
    if s.tls_client_ca:
        with open(s.tls_client_ca, "rb") as ca:
            client_ca = ca.read()
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


async def start_server(config: Config, runtime: Runtime | None = None) -> Running:
    """Bind, register services (health NOT_SERVING), load and warm the models, then report SERVING."""
    s = config.server
    # The device thread runs many short torch calls holding the GIL; with the default 5 ms switch interval the
    # event loop waits that long to forward each chunk. 0.2 ms keeps streaming latency well under a model step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    limit = config.limits.max_message_bytes
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{s.host}:{s.port}"
    credentials = _credentials(config)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if s.reflection:
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
    metrics = Metrics()
    if runtime is None:
        runtime = await asyncio.to_thread(Runtime, config)
    service = GeneratorService(runtime, config, metrics)
    pb_grpc.add_GeneratorServicer_to_server(service, server)
    await server.start()
    log.info("listening", address=f"{s.host}:{port}", tls=credentials is not None)
    await asyncio.to_thread(runtime.start)
    metrics.kv_slots_total.set(runtime.registry.total)
    metrics_port = metrics.serve(s.metrics_port, s.host) if s.metrics_port else 0
    janitor = asyncio.create_task(_janitor(runtime, metrics, min(5.0, s.session_ttl_s / 4)))
    running = Running(server, port, metrics_port, health_servicer, runtime, service, metrics, janitor)
    await running.set_serving(True)
    log.info("serving", port=port, metrics_port=metrics_port, device=str(runtime.device), dtype=str(runtime.dtype),
             draft=runtime.draft is not None)
    return running


async def serve(config: Config) -> None:
    """Run until SIGTERM/SIGINT, then drain for --grace-s and return (exit status 0)."""
    running = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", grace_s=config.server.grace_s)
    await running.stop(config.server.grace_s)
    log.info("stopped")
