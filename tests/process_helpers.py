"""Helpers for tests that run `specrpc serve` as a process or need TLS material: certificates, a served process,
waiting for health, reading its log."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from conftest import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 200)]
"""Channel options for a server that is not listening yet (the default backoff waits seconds between tries)."""


def have_openssl() -> bool:
    return any((Path(p) / "openssl").exists() for p in os.get_exec_path())


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """ca.pem/ca.key, server.pem/server.key (SAN localhost and 127.0.0.1) and client.pem/client.key signed by the CA,
    plus other-ca.pem with client2.pem/client2.key signed by another CA (a client the server must refuse)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1", "-subj",
                 f"/CN={ca}", cwd=d)
    for name, ca, ext in (("server", "ca", ["-extfile", "san.ext"]), ("client", "ca", []),
                          ("client2", "other-ca", [])):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", *ext, cwd=d)


@dataclass
class Served:
    """A `specrpc serve` process."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve_process(tmp_path: Path, args: Sequence[str] = (), name: str = "serve") -> Iterator[Served]:
    """`python -m specrpc.cli serve` on a free port with the configured models, 1 torch thread, small slots (logs in
    tmp_path/<name>.log); killed on exit if still running."""
    port = free_port()
    log = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "specrpc.cli", "serve", "--port", str(port), "--metrics-port", "0",
           "--max-sessions", "4", "--max-context", "512", "--max-new-tokens", "512", "--threads", "1",
           "--grace-s", "3", "--log-format", "json", *args]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Served(process, port, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def wait_serving(channel: grpc.aio.Channel, served: Served, timeout: float = 120,
                       metadata: Sequence[tuple[str, str]] = ()) -> None:
    """Poll health until SERVING; fail with the log if the process exits or time runs out."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert served.process.poll() is None, f"specrpc serve exited early:\n{served.log_text()}"
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2, metadata=metadata)
            if response.status == SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    pytest.fail(f"not SERVING within {timeout} s:\n{served.log_text()}")
