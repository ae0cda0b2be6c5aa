"""Shared fixtures: a real server on a loopback port serving the shipped models on CPU."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
import pytest_asyncio

from specrpc.config import Config, Limits, ServerConfig, build_config
from specrpc.server import Running, start_server
from specrpc.v1 import generator_pb2_grpc as pb_grpc


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_config(**engine: object) -> Config:
    """Small slots and context so the suite stays fast on a 2-core CPU (SPECRPC_TARGET/SPECRPC_DRAFT override the
    shipped models, as for `specrpc serve`)."""
    base = build_config(None).engine
    return Config(
        engine=replace(base, max_sessions=4, max_context=512, threads=1, **engine),  # type: ignore[arg-type]
        server=ServerConfig(host="127.0.0.1", port=0, metrics_port=free_port(), log_format="console",
                            session_ttl_s=60.0, grace_s=2.0),
        limits=Limits(max_new_tokens=256),
    )


@pytest_asyncio.fixture(scope="session")
async def server() -> AsyncIterator[Running]:
    """One real server for the session's service tests."""
    running = await start_server(test_config())
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture(scope="session")
async def channel(server: Running) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.GeneratorStub:
    return pb_grpc.GeneratorStub(channel)
