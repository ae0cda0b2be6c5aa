"""Scale-out: three `specrpc serve` replicas behind nginx with the shipped deploy/nginx/ config, on both edges (gRPC
and the OpenAI / llama.cpp HTTP API): session affinity on the `x-session-id` metadata or header, health-driven `down`
marking by deploy/nginx/upstream.py, a graceful drain (SIGTERM) that finishes the streams in flight (a gRPC Converse
and an HTTP SSE stream) while new calls move, and fail-over when a replica dies.

Which replica served a call is read from each replica's own Prometheus counter of completed Generate calls (it is
incremented before the call's status is sent, so it cannot lag behind the client), cross-checked by the server's
`cached_prompt_tokens` (only the replica that holds the session's KV cache can report reuse).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from conftest import models_missing
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "nginx"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
SERVICE = "specrpc.v1.Generator"
SERVING: int = health_pb2.HealthCheckResponse.SERVING
START_TIMEOUT_S = 90.0  # three replicas loading models at once on a busy 2-core CPU
CALL_TIMEOUT_S = 30.0

pytestmark = [
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (`.ci/run` installs it: apt-get install nginx)"),
    pytest.mark.timeout(240),
]


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, diagnose: Callable[[], str] = str) -> Any:
    """Poll until `condition()` is truthy (returned) or fail after `timeout_s` naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{diagnose()}")
        time.sleep(0.1)


def health_status(address: str, timeout_s: float = 1.0) -> int | None:
    """grpc.health.v1 Check of the Generator service at `address` (None when it does not answer)."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout_s)
        except grpc.RpcError:
            return None
    return int(response.status)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


@dataclass
class Replica:
    """One `specrpc serve` subprocess."""

    name: str
    port: int
    metrics_port: int
    http_port: int
    log: Path
    process: subprocess.Popen[bytes]
    attempt: int = 1

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def generate_ok(self, rpc: str = "Generate") -> int:
        """Completed (OK) calls of `rpc` (Generate; over HTTP e.g. Completions), from the replica's Prometheus
        counter."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("specrpc_requests_total{") and f'rpc="{rpc}"' in line and 'code="OK"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)


@dataclass
class Cluster:
    """Replicas, a NOT_SERVING decoy, the health sidecar and nginx, all on loopback."""

    root: Path
    replicas: list[Replica] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    decoy: grpc.Server | None = None
    decoy_address: str = ""
    nginx_port: int = 0
    nginx_http_port: int = 0
    channel: grpc.Channel | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.nginx_http_port}"

    @property
    def stub(self) -> pb_grpc.GeneratorStub:
        assert self.channel is not None
        return pb_grpc.GeneratorStub(self.channel)

    def spawn(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                       start_new_session=True)
        self.processes.append(process)
        return process

    def diagnose(self) -> str:
        parts = [f"--- {r.name} ({r.address}, exit {r.process.poll()}):\n{tail(r.log)}" for r in self.replicas]
        for name in ("upstream.log", "specrpc-upstream.inc", "specrpc-http-upstream.inc", "nginx.log",
                     "logs/access.log", "logs/http-access.log"):
            parts.append(f"--- {name}:\n{tail(self.root / name)}")
        return "\n".join(parts)

    def counts(self, rpc: str = "Generate") -> list[int]:
        """Each replica's OK calls of `rpc` (-1 once dead). A call is counted in gRPC's done callback (HTTP: when its
        response ends), a moment after the client has read the stream's end, so read until two reads 0.1 s apart
        agree."""
        def read() -> list[int]:
            return [r.generate_ok(rpc) if r.process.poll() is None else -1 for r in self.replicas]

        last, deadline = read(), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = read()
            if now == last:
                break
            last = now
        return last

    def ok_calls(self, replicas: list[Replica], rpc: str = "Generate") -> int:
        """OK calls of `rpc` of `replicas` together (settled as in `counts`)."""
        counts = self.counts(rpc)
        return sum(counts[self.replicas.index(r)] for r in replicas)

    def expect_ok_calls(self, replicas: list[Replica], expected: int) -> None:
        """Wait for `replicas`' OK Generate calls to reach `expected` (counts land after the client has read the
        end of the stream), then require exactly that many."""
        wait_until(lambda: self.ok_calls(replicas) >= expected, 10, f"{expected} OK Generate calls", self.diagnose)
        assert self.ok_calls(replicas) == expected, self.diagnose()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        for process in reversed(self.processes):  # nginx, sidecar, then the replicas (SIGTERM: drain, exit)
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: nginx and its workers, or one replica
                process.wait(timeout=10)
        if self.decoy is not None:
            self.decoy.stop(0)
        shutil.rmtree(self.root, ignore_errors=True)


def start_decoy() -> tuple[grpc.Server, str]:
    """A replica that is up but NOT_SERVING (as one loading its models or draining): health only, and any Generator
    call it received would fail with UNIMPLEMENTED."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    for name in ("", SERVICE):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all held open while choosing, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_replica(c: Cluster, name: str, attempt: int = 1) -> Replica:
    port, metrics_port, http_port = free_ports(3)
    log = c.root / f"replica-{name}.log"
    process = c.spawn([sys.executable, "-m", "specrpc.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                       "--metrics-port", str(metrics_port), "--http-port", str(http_port), "--threads", "1",
                       "--max-sessions", "2", "--max-context", "512", "--grace-s", "5", "--log-format", "console"],
                      log)
    return Replica(name, port, metrics_port, http_port, log, process, attempt)


def nginx_config(root: Path, port: int, http_port: int) -> None:
    """The shipped nginx.conf and specrpc.conf in a fresh prefix, listening on `port` instead of 8080 (gRPC) and on
    `http_port` instead of 8081 (HTTP), with an access log for the HTTP server."""
    (root / "logs").mkdir(exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    shutil.copy(DEPLOY / "nginx.conf", root / "nginx.conf")
    conf = (DEPLOY / "specrpc.conf").read_text()
    assert conf.count("listen 8080 http2;") == 1, "deploy/nginx/specrpc.conf should listen on 8080 exactly once"
    assert conf.count("listen 8081;") == 1, "deploy/nginx/specrpc.conf should listen on 8081 exactly once"
    conf = conf.replace("listen 8080 http2;", f"listen 127.0.0.1:{port} http2;")
    conf = conf.replace("listen 8081;", f"listen 127.0.0.1:{http_port};\n    access_log logs/http-access.log specrpc;")
    (root / "specrpc.conf").write_text(conf)


def start_nginx(c: Cluster) -> subprocess.Popen[bytes]:
    """nginx with the shipped config on a free port, in the foreground (`daemon off`), prefix `c.root`."""
    assert NGINX is not None
    c.nginx_port, c.nginx_http_port = free_ports(2)
    nginx_config(c.root, c.nginx_port, c.nginx_http_port)
    if c.channel is not None:
        c.channel.close()
    c.channel = grpc.insecure_channel(f"127.0.0.1:{c.nginx_port}")
    return c.spawn([NGINX, "-p", str(c.root), "-c", str(c.root / "nginx.conf")], c.root / "nginx.log")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    assert NGINX is not None
    root = Path(tempfile.mkdtemp(prefix="specrpc-scale-out-"))
    root.chmod(0o755)  # nginx workers run as `nobody` when the test runs as root
    c = Cluster(root)
    try:
        started = time.monotonic()
        c.decoy, c.decoy_address = start_decoy()
        for name in ("a", "b", "c"):
            c.replicas.append(start_replica(c, name))

        def replicas_serving() -> bool:
            for i, r in enumerate(c.replicas):
                if r.process.poll() is not None:
                    # Another process took one of its free ports between our check and its bind: try new ones.
                    assert "Address already in use" in tail(r.log, 200) and r.attempt < 3, \
                        f"replica {r.name} exited\n{c.diagnose()}"
                    c.replicas[i] = start_replica(c, r.name, r.attempt + 1)
            return all(health_status(r.address) == SERVING for r in c.replicas)

        wait_until(replicas_serving, START_TIMEOUT_S, "the replicas SERVING", c.diagnose)
        include, http_include = root / "specrpc-upstream.inc", root / "specrpc-http-upstream.inc"
        c.spawn([sys.executable, str(DEPLOY / "upstream.py"), "watch", "--interval", "0.3", "--no-initial-reload",
                 "--nginx-pid", str(root / "nginx.pid"), "--out", str(include), "--http-out", str(http_include),
                 *[f"{r.address},{r.http_port}" for r in c.replicas], c.decoy_address], root / "upstream.log")
        expected = {f"server {r.address} max_fails=2 fail_timeout=10s;" for r in c.replicas}
        expected.add(f"server {c.decoy_address} max_fails=2 fail_timeout=10s down;")
        expected_http = {f"server 127.0.0.1:{r.http_port} max_fails=2 fail_timeout=10s;" for r in c.replicas}

        def include_settled() -> bool:
            lines = {ln for ln in tail(include, 100).splitlines() if ln.startswith("server ")}
            http_lines = {ln for ln in tail(http_include, 100).splitlines() if ln.startswith("server ")}
            return lines == expected and http_lines == expected_http

        wait_until(include_settled, 10, "upstream.py to list the replicas up and the decoy down", c.diagnose)
        attempts = [start_nginx(c)]

        def through_nginx() -> bool:
            if attempts[-1].poll() is not None:
                assert "Address already in use" in tail(root / "nginx.log", 50) and len(attempts) < 3, \
                    f"nginx exited\n{c.diagnose()}"
                attempts.append(start_nginx(c))  # its free port was taken meanwhile: another one
            return health_status(f"127.0.0.1:{c.nginx_port}") == SERVING and http_health(c) == 200

        wait_until(through_nginx, 15, "health SERVING through nginx (gRPC and HTTP)", c.diagnose)
        print(f"cluster up in {time.monotonic() - started:.1f}s")
        yield c
    finally:
        c.close()


def generate(c: Cluster, session: str, prompt: str, max_new_tokens: int = 2) -> pb.GenerationSummary:
    """One Generate through nginx; the session id goes in the body and, for nginx, as `x-session-id` metadata."""
    metadata = (("x-session-id", session),) if session else ()
    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, session_id=session,
                                 speculation=pb.SpeculationParams(num_draft_tokens=0))
    summary = None
    for response in c.stub.Generate(request, metadata=metadata, timeout=CALL_TIMEOUT_S):
        if response.WhichOneof("event") == "summary":
            summary = response.summary
    assert summary is not None, "the stream ended without a summary"
    return summary


def served_by(c: Cluster, before: list[int], rpc: str = "Generate") -> list[int]:
    """Calls of `rpc` each replica completed since `before`."""
    return [now - then for now, then in zip(c.counts(rpc), before, strict=True)]


def http_health(c: Cluster) -> int:
    """The status of GET /health through nginx's HTTP server (0 when nothing answers)."""
    try:
        return httpx2.get(f"{c.http_url}/health", timeout=2).status_code
    except httpx2.HTTPError:
        return 0


def complete(c: Cluster, session: str, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
    """One OpenAI completion (greedy) through nginx's HTTP server, the session in the `x-session-id` header; it
    must answer 200 (a draining replica's 503 is nginx's to pass on, never the client's)."""
    headers = {"x-session-id": session} if session else {}
    response = httpx2.post(f"{c.http_url}/v1/completions", headers=headers, timeout=CALL_TIMEOUT_S,
                           json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, f"{response.status_code}: {response.text}\n{c.diagnose()}"
    body: dict[str, Any] = response.json()
    return body


def cached_tokens(completion: dict[str, Any]) -> int:
    return int(completion["usage"]["prompt_tokens_details"]["cached_tokens"])


@dataclass
class SseStream:
    """A streamed completion read on its own thread: the data lines as they arrive."""

    events: list[str] = field(default_factory=list)
    status: int = 0
    error: str = ""
    first: threading.Event = field(default_factory=threading.Event)

    def read(self, c: Cluster, session: str, prompt: str, max_tokens: int) -> None:
        try:
            with httpx2.stream("POST", f"{c.http_url}/v1/completions", headers={"x-session-id": session},
                               timeout=CALL_TIMEOUT_S, json={"prompt": prompt, "max_tokens": max_tokens,
                                                             "temperature": 0, "stream": True}) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except httpx2.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.first.set()


def call_with_one_retry(c: Cluster, call: Callable[[], pb.GenerationSummary],
                        expected: str = "") -> pb.GenerationSummary:
    """`call()`, allowing at most one client-visible UNAVAILABLE (whose message contains `expected`) that a single
    retry after a short back-off fixes, as a gRPC client's retry policy would."""
    started = time.monotonic()
    try:
        result = call()
        retried = ""
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        assert code == grpc.StatusCode.UNAVAILABLE and expected in (details or ""), f"{code}: {details}\n{c.diagnose()}"
        time.sleep(0.2)
        result = call()
        retried = f" after one UNAVAILABLE ({details})"
    print(f"call took {time.monotonic() - started:.3f}s{retried}")
    return result


def marked_down_and_reloaded(c: Cluster, replica: Replica) -> bool:
    """upstream.py has written `replica` down and then reloaded nginx."""
    if f"server {replica.address} max_fails=2 fail_timeout=10s down;" not in tail(c.root / "specrpc-upstream.inc", 100):
        return False
    log = tail(c.root / "upstream.log", 1000)
    return log.rfind("reloaded nginx") > log.rfind(f"{replica.address} down")


PROMPT = "def fibonacci(n):\n    "
HTTP_STREAM_TOKENS = 160  # long enough to be in flight at SIGTERM, short enough for --grace-s 5 on a busy CPU
MORE = "if n < 2:\n        return n\n    "


def test_one_session_stays_on_one_replica(cluster: Cluster) -> None:
    before = cluster.counts()
    prompt, cached = PROMPT, []
    for _ in range(3):
        cached.append(generate(cluster, "affinity", prompt).cached_prompt_tokens)
        prompt += MORE
    served = served_by(cluster, before)
    assert max(served) == 3 == sum(served), f"one replica should serve all 3 calls: {served}\n{cluster.diagnose()}"
    assert cached[0] == 0 < cached[1] < cached[2], f"the session's prefix should be reused and grow: {cached}"


def test_sessions_and_sessionless_calls_spread_and_skip_not_serving(cluster: Cluster) -> None:
    # The decoy is on the ring but NOT_SERVING, so upstream.py wrote it `down`: a call routed there would fail.
    before = cluster.counts()
    for i in range(30):
        generate(cluster, f"spread-{i}", PROMPT, max_new_tokens=1)
    by_session = served_by(cluster, before)
    assert all(n > 0 for n in by_session), f"30 sessions should reach every replica: {by_session}"
    before = cluster.counts()
    for _ in range(30):
        generate(cluster, "", PROMPT, max_new_tokens=1)
    sessionless = served_by(cluster, before)
    assert all(n > 0 for n in sessionless), f"30 calls without a session should reach every replica: {sessionless}"


def test_converse_streams_through_nginx(cluster: Cluster) -> None:
    def requests() -> Iterator[pb.ConverseRequest]:
        yield pb.ConverseRequest(start=pb.SessionStart(session_id="converse"))
        yield pb.ConverseRequest(turn=pb.Turn(text="Hello!", max_new_tokens=3))

    kinds = [r.WhichOneof("event") for r in cluster.stub.Converse(
        requests(), metadata=(("x-session-id", "converse"),), timeout=CALL_TIMEOUT_S)]
    assert kinds[0] == "started" and kinds[-1] == "summary", kinds


HTTP_PROMPT = "# http affinity probe\nclass Cache:\n    "
HTTP_MORE = "def get(self, key):\n        return self.data[key]\n    "


def test_http_session_stays_on_one_replica(cluster: Cluster) -> None:
    before = cluster.counts("Completions")
    prompt, cached = HTTP_PROMPT, []
    for _ in range(3):
        cached.append(cached_tokens(complete(cluster, "http-affinity", prompt)))
        prompt += HTTP_MORE
    served = served_by(cluster, before, "Completions")
    assert max(served) == 3 == sum(served), f"one replica should serve all 3 requests: {served}\n{cluster.diagnose()}"
    assert cached[0] == 0 < cached[1] < cached[2], f"the session's prefix should be reused and grow: {cached}"


def test_http_sessions_spread_and_sessionless_requests_keep_the_client_address(cluster: Cluster) -> None:
    before = cluster.counts("Completions")
    for i in range(30):
        complete(cluster, f"http-spread-{i}", PROMPT, max_tokens=1)
    by_session = served_by(cluster, before, "Completions")
    assert all(n > 0 for n in by_session), f"30 sessions should reach every replica: {by_session}"
    # Without the header nginx hashes the client's address: one client (here 127.0.0.1) keeps one replica.
    before = cluster.counts("Completions")
    for _ in range(6):
        complete(cluster, "", PROMPT, max_tokens=1)
    sessionless = served_by(cluster, before, "Completions")
    assert sorted(sessionless)[-1] == 6 == sum(sessionless), f"one client address, one replica: {sessionless}"


def test_http_unknown_route_is_json_404(cluster: Cluster) -> None:
    response = httpx2.get(f"{cluster.http_url}/metrics", timeout=5)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert http_health(cluster) == 200


def test_draining_replica_finishes_its_streams_and_sheds_new_calls(cluster: Cluster) -> None:
    drained = cluster.replicas[2]
    # A session that hashes to the replica about to drain, with a Converse stream open on it.
    session = ""
    for i in range(40):
        before = cluster.ok_calls([drained])
        generate(cluster, f"drain-{i}", PROMPT, max_new_tokens=1)
        if cluster.ok_calls([drained]) > before:
            session = f"drain-{i}"
            break
    assert session, "no session of 40 hashed to the third replica"
    turns: queue.Queue[pb.ConverseRequest | None] = queue.Queue()
    turns.put(pb.ConverseRequest(start=pb.SessionStart(session_id=session)))
    turns.put(pb.ConverseRequest(turn=pb.Turn(text="Hello!", max_new_tokens=3)))
    stream = cluster.stub.Converse(iter(turns.get, None), metadata=(("x-session-id", session),),
                                   timeout=CALL_TIMEOUT_S)
    events = iter(stream)
    while next(events).WhichOneof("event") != "summary":
        pass
    # An HTTP session that hashes to the same replica (the HTTP ring has its own addresses), with an SSE stream in
    # flight on it when the drain starts.
    http_session = ""
    for i in range(40):
        before = cluster.ok_calls([drained], "Completions")
        complete(cluster, f"http-drain-{i}", PROMPT, max_tokens=1)
        if cluster.ok_calls([drained], "Completions") > before:
            http_session = f"http-drain-{i}"
            break
    assert http_session, "no HTTP session of 40 hashed to the third replica"
    sse = SseStream()
    reader = threading.Thread(target=sse.read, args=(cluster, http_session, HTTP_PROMPT, HTTP_STREAM_TOKENS))
    reader.start()
    assert sse.first.wait(CALL_TIMEOUT_S) and sse.status == 200, f"{sse.status} {sse.error}\n{cluster.diagnose()}"

    drained.process.send_signal(signal.SIGTERM)  # drain: NOT_SERVING at once; streams in flight get --grace-s
    in_flight = "[DONE]" not in sse.events
    # A new request of the HTTP session right away: the draining replica answers 503, which nginx passes on to the
    # next replica on the ring (proxy_next_upstream http_503), so the client sees 200 (asserted in `complete`).
    assert complete(cluster, http_session, PROMPT + MORE)["choices"][0]["finish_reason"] in ("length", "stop")
    print("after SIGTERM:", tail(cluster.root / "logs" / "http-access.log", 1))  # upstream_status=503, 200 if passed on
    # The sidecar sees NOT_SERVING (or a closed port), writes the replica `down` and reloads nginx.
    wait_until(lambda: marked_down_and_reloaded(cluster, drained), 10, "upstream.py to take the draining replica out",
               cluster.diagnose)
    others = [r for r in cluster.replicas if r is not drained and r.process.poll() is None]
    others_before = cluster.ok_calls(others)
    # A new call of the same session succeeds elsewhere. (One UNAVAILABLE is tolerated in case the call still
    # reached the draining replica, which answers "shutting down" to new calls: nginx cannot retry on a gRPC status.)
    summary = call_with_one_retry(cluster, lambda: generate(cluster, session, PROMPT + MORE), "shutting down")
    assert summary.completion_tokens > 0
    cluster.expect_ok_calls(others, others_before + 1)

    turns.put(pb.ConverseRequest(turn=pb.Turn(text="And again?", max_new_tokens=3)))  # the old stream goes on
    reply = []
    for event in events:
        reply.append(event.WhichOneof("event"))
        if reply[-1] == "summary":
            break
    assert reply[-1] == "summary", f"the turn should complete on the draining replica: {reply}"
    turns.put(None)
    # The stream's final status reaches the client through nginx: the drain leaves it time to get on the wire before
    # the hard stop (without that, nginx logged "upstream prematurely closed connection" in 3 runs of 6).
    assert list(events) == []
    assert stream.code() == grpc.StatusCode.OK
    # The HTTP stream that was in flight at SIGTERM ran to its end through nginx: every event, a finish reason, and
    # the terminating [DONE].
    reader.join(CALL_TIMEOUT_S)
    assert in_flight, "the SSE stream ended before the drain started; make it longer (HTTP_STREAM_TOKENS)"
    assert not sse.error and sse.events[-1] == "[DONE]", f"{sse.error} {sse.events[-3:]}\n{cluster.diagnose()}"
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in sse.events[:-1]]
    assert finals[-1] in ("length", "stop") and not any(finals[:-1]), finals
    assert drained.process.wait(timeout=10) == 0, "a drained replica exits 0"


def test_killed_replica_fails_over_to_the_other(cluster: Cluster) -> None:
    # A prompt no other test sends: a replica reuses any free slot's matching prefix, even another session's.
    session, prompt, more = "failover", "# fail-over probe\nclass Probe:\n    ", "def run(self):\n        pass\n    "
    before = cluster.counts()
    generate(cluster, session, prompt)
    assert generate(cluster, session, prompt + more).cached_prompt_tokens > 0
    served = served_by(cluster, before)
    owner = cluster.replicas[served.index(2)] if 2 in served else pytest.fail(f"no single owner: {served}")
    survivors = [r for r in cluster.replicas if r is not owner and r.process.poll() is None]

    owner.process.kill()  # a crash: no drain, no GOAWAY, the listener just disappears
    owner.process.wait(timeout=10)
    before_survivors = cluster.ok_calls(survivors)
    summary = call_with_one_retry(cluster, lambda: generate(cluster, session, prompt + more * 2))
    assert summary.cached_prompt_tokens == 0, "the survivor cannot have the session's cache"
    cluster.expect_ok_calls(survivors, before_survivors + 1)
    assert generate(cluster, session, prompt + more * 3).cached_prompt_tokens > 0, "the session should stick there"

    # The sidecar notices the dead replica, marks it down and reloads nginx; calls keep working through the reload.
    wait_until(lambda: marked_down_and_reloaded(cluster, owner), 10, "upstream.py to take the dead replica out",
               cluster.diagnose)
    for i in range(5):
        generate(cluster, f"after-reload-{i}", PROMPT, max_new_tokens=1)
    cluster.expect_ok_calls(survivors, before_survivors + 7)
