"""Assemble and run the grpc.aio server (Generator, health NOT_SERVING until warm, reflection), the HTTP API beside it
(--http-port), metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from specrpc.config import Config
from specrpc.edges.auth import TokenAuth
from specrpc.edges.gateway import Gateway
from specrpc.edges.grpc.health import (
    HealthStatus,
    add_generator,
    add_health,
    add_reflection,
    set_health,
)
from specrpc.edges.grpc.service import GeneratorService
from specrpc.edges.grpc.wire import DecodeGuard
from specrpc.edges.http.api import HttpApi, HttpServer
from specrpc.edges.metrics import Metrics
from specrpc.serving.runtime import Runtime

log = structlog.get_logger(__name__)

SWITCH_INTERVAL_S = 0.0002


@dataclass
class Running:
    """A started server and what a caller (or a test) needs to reach and stop it."""

    server: grpc.aio.Server
    port: int
    metrics_port: int
    health: HealthStatus
    runtime: Runtime
    service: GeneratorService
    metrics: Metrics
    janitor: asyncio.Task[None]
    auth: TokenAuth | None = None
    http: HttpServer | None = None
    http_port: int = 0

    async def set_serving(self, serving: bool) -> None:
        """Health status for the overall server and the Generator service."""
        await set_health(self.health, serving)

    async def stop(self, grace_s: float) -> None:
        """Drain: NOT_SERVING, new generation calls UNAVAILABLE, in-flight streams get `grace_s` to finish; then
        stop, aborting what is left. The port stays open while draining, so a new call gets a clear UNAVAILABLE
        from the service instead of racing the listener's shutdown; health Watch streams, which never end by
        themselves, do not hold the grace period. (One `server.stop`: a second call while the first one's grace
        runs can crash grpcio.)"""
        self.service.refuse_new_streams()
        await self.health.enter_graceful_shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.service.drained(), grace_s)
            # The last handler has returned, but its final status may still be on its way to the socket; a hard stop
            # now could cut it (a proxy then reports "upstream prematurely closed"). New calls are refused meanwhile.
            await asyncio.sleep(FLUSH_S)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(0)
        self.janitor.cancel()
        await asyncio.to_thread(self.runtime.stop)
        self.metrics.close()


FLUSH_S = 0.25
"""Seconds between the last stream's end and the hard stop of a drain, for its final status to reach the wire."""


async def _janitor(runtime: Runtime, metrics: Metrics, period_s: float) -> None:
    """Evict idle sessions (the gauges read the registry live)."""
    while True:
        runtime.registry.evict_expired()
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


def _auth(config: Config) -> TokenAuth | None:
    s = config.server
    return TokenAuth(s.auth_tokens_file, exempt_health=s.auth_exempt_health) if s.auth_tokens_file else None


async def start_server(config: Config, runtime: Runtime | None = None,
                       on_listening: Callable[[int], object] | None = None,
                       auth: TokenAuth | None = None) -> Running:
    """Bind and start listening with health NOT_SERVING (health checks and reflection answer at once, Generator
    calls get UNAVAILABLE), then load and warm the models and report SERVING. `on_listening(port)` is called as soon
    as the port is bound, before the models are loaded. With --auth-tokens-file every call needs a bearer token
    (`auth`, or one built from the config)."""
    s = config.server
    if auth is None:
        auth = _auth(config)
    credentials = _credentials(config)
    # The device thread runs many short torch calls holding the GIL; with the default 5 ms switch interval the
    # event loop waits that long to forward each chunk. 0.2 ms keeps streaming latency well under a model step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    limit = config.limits.max_message_bytes
    # auth first: an unauthenticated caller learns nothing, not even whether its message decodes
    interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = [*([auth] if auth is not None else []), DecodeGuard()]
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ])
    health_servicer = add_health(server)
    await set_health(health_servicer, False)
    address = f"{s.host}:{s.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if s.reflection:
        add_reflection(server)
    metrics = Metrics()
    gateway = Gateway(config, metrics)
    service = GeneratorService(config, metrics, gateway=gateway)
    add_generator(server, service)
    await server.start()
    http: HttpServer | None = None
    http_port = 0
    if s.http_port:
        http = HttpServer(config, HttpApi(config, gateway, auth))
        try:
            http_port = await http.start()
        except BaseException:
            await server.stop(0)
            raise
    log.info("listening", address=f"{s.host}:{port}", http_port=http_port, tls=credentials is not None,
             mutual_tls=bool(credentials is not None and s.tls_client_ca),
             auth="bearer" if auth is not None else "off", auth_tokens=auth.token_count if auth else 0)
    if on_listening is not None:
        on_listening(port)
    try:
        if runtime is None:
            runtime = await asyncio.to_thread(Runtime, config)
        await asyncio.to_thread(runtime.start)
        service.attach(runtime)
        metrics.track(runtime.registry)
        metrics_port = metrics.serve(s.metrics_port, s.host) if s.metrics_port else 0
    except BaseException:
        if http is not None:
            await http.stop()
        await server.stop(0)
        if runtime is not None:
            await asyncio.to_thread(runtime.stop)
        metrics.close()
        raise
    janitor = asyncio.create_task(_janitor(runtime, metrics, min(5.0, s.session_ttl_s / 4)))
    running = Running(server, port, metrics_port, health_servicer, runtime, service, metrics, janitor, auth, http,
                      http_port)
    await running.set_serving(True)
    log.info("serving", port=port, http_port=http_port, metrics_port=metrics_port, device=str(runtime.device),
             dtype=str(runtime.dtype), draft=runtime.draft is not None)
    return running


def _on_sighup(auth: TokenAuth | None) -> None:
    if auth is None:
        log.info("SIGHUP ignored: no --auth-tokens-file to reload")
        return
    auth.reload()


async def serve(config: Config) -> None:
    """Run until SIGTERM/SIGINT, then drain for --grace-s and return (exit status 0). A signal that arrives while
    the models are still loading stops the start-up. SIGHUP reloads --auth-tokens-file (and is ignored without
    one, instead of killing the process)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    auth = _auth(config)
    loop.add_signal_handler(signal.SIGHUP, _on_sighup, auth)
    starting = asyncio.create_task(start_server(config, auth=auth))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stopped during start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return
    stopping.cancel()
    running = starting.result()
    await stop.wait()
    log.info("draining", grace_s=config.server.grace_s)
    await running.stop(config.server.grace_s)
    log.info("stopped")
