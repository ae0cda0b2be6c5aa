"""Security: bearer-token authentication (specrpc/edges/auth.py), TLS and mutual TLS (server._credentials), request
limits that name their flag and value, the per-client stream quota, and logs that carry neither tokens nor prompt text.

In-process servers wrap the shared server's Generator service; one `specrpc serve` process checks the whole path
(flags → TLS + mTLS + auth, SIGHUP reload, SIGTERM exit 0)."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from process_helpers import FAST_RECONNECT, have_openssl, make_certs, serve_process, wait_serving
from service_helpers import CLIENT_WRITE_RACE, collect, first_tokens, long_request, rpc_error, status_of, wait_until

from specrpc.config import Config, ServerConfig, build_config, parse_networks, validate
from specrpc.edges import auth as auth_mod
from specrpc.edges.auth import StreamQuota, TokenAuth, bearer_token, peer_host, read_tokens
from specrpc.edges.grpc.health import HEALTH_NAME, SERVICE_NAME
from specrpc.edges.server import Running, _credentials
from specrpc.logs import configure
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

TOKEN_A = "tok-A-4f9c2e8d1b7a"
TOKEN_B = "tok-B-93e1d0c2aa55"
TOKEN_C = "tok-C-7d21b6e4f0c9"
SECRET_PROMPT = "zebra-quokka-secret-prompt"
needs_openssl = pytest.mark.skipif(not have_openssl(), reason="no openssl")


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


# ---- units: tokens file, header parsing, constant-time check, quota ----------------------------------------------


def test_tokens_file_ignores_blank_lines_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# service accounts\n\n  {TOKEN_A}  \n# {TOKEN_C} (revoked)\n{TOKEN_B}\n\n")
    assert read_tokens(path) == (TOKEN_A.encode(), TOKEN_B.encode())
    path.write_text("has a space\n")
    with pytest.raises(ValueError, match="tokens:1"):
        read_tokens(path)
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no tokens"):
        TokenAuth(path)
    with pytest.raises(OSError):
        TokenAuth(tmp_path / "missing")


def test_bearer_header_parsing_and_peer_identity() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == b"abc"
    assert bearer_token([("x-other", "1"), ("authorization", "bearer  abc ")]) == b"abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([]) is None and bearer_token(None) is None
    assert peer_host("ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:5555") == "ipv6:[::1]"
    assert peer_host("ipv6:%5B::1%5D:5555") == "ipv6:%5B::1%5D"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_token_check_compares_against_every_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokens"
    path.write_text("\n".join([TOKEN_A, TOKEN_B, TOKEN_C]) + "\n")
    auth = TokenAuth(path)
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", counting)
    for token, ok in ((TOKEN_A, True), (TOKEN_C, True), ("nope", False), ("", False)):
        calls.clear()
        assert auth.valid(token.encode()) is ok
        assert len(calls) == 3, "no short-circuit: every accepted token is compared"
    assert not auth.valid(None)


def test_stream_quota_counts_per_client() -> None:
    quota = StreamQuota(2, by_token=True)
    a = quota.client_id("ipv4:10.0.0.1:1000", bearer(TOKEN_A))
    a_elsewhere = quota.client_id("ipv4:10.0.0.2:2000", bearer(TOKEN_A))
    assert a == a_elsewhere and TOKEN_A not in a
    anonymous = quota.client_id("ipv4:10.0.0.1:1000", ())
    assert anonymous == quota.client_id("ipv4:10.0.0.1:3000", ()) == "ipv4:10.0.0.1"
    quota.acquire(a)
    quota.acquire(a)
    with pytest.raises(auth_mod.TooManyStreams, match=r"--max-streams-per-client.*") as info:
        quota.acquire(a)
    assert "at most 2" in str(info.value)
    quota.acquire(anonymous)
    quota.release(a)
    quota.acquire(a)
    for client in (a, a, anonymous):
        quota.release(client)
    assert not quota.open
    unlimited = StreamQuota(0, by_token=False)
    for _ in range(100):
        unlimited.acquire("x")


def test_stream_quota_behind_trusted_proxies_counts_the_forwarded_client() -> None:
    proxies = parse_networks("10.0.0.0/8, ::1")
    quota = StreamQuota(1, by_token=False, trusted=proxies)
    xff = lambda value: (("x-forwarded-for", value),)  # noqa: E731
    # through a trusted proxy, each forwarded client is its own
    assert quota.client_id("ipv4:10.1.2.3:4000", xff("203.0.113.7")) == "ipv4:203.0.113.7"
    assert quota.client_id("ipv6:%5B::1%5D:4000", xff("203.0.113.8")) == "ipv4:203.0.113.8"
    # the right-most untrusted hop counts: what the client itself wrote to the left can't spoof it
    assert quota.client_id("ipv4:10.1.2.3:4000", xff("1.1.1.1, 198.51.100.2, 10.9.9.9")) == "ipv4:198.51.100.2"
    # from an untrusted peer the header is ignored; garbage or only-proxy chains fall back to the peer
    assert quota.client_id("ipv4:192.0.2.1:4000", xff("203.0.113.7")) == "ipv4:192.0.2.1"
    assert quota.client_id("ipv4:10.1.2.3:4000", xff("not-an-ip")) == "ipv4:10.1.2.3"
    assert quota.client_id("ipv4:10.1.2.3:4000", xff("10.0.0.5")) == "ipv4:10.1.2.3"
    assert quota.client_id("ipv4:10.1.2.3:4000", ()) == "ipv4:10.1.2.3"
    # without --trusted-proxies nobody's header counts
    assert StreamQuota(1, by_token=False).client_id("ipv4:10.1.2.3:4000", xff("203.0.113.7")) == "ipv4:10.1.2.3"
    with pytest.raises(ValueError, match=r"--trusted-proxies: 'nginx'"):
        validate(build_config(None, env={"SPECRPC_TRUSTED_PROXIES": "10.0.0.0/8,nginx"}))


def test_security_features_are_off_by_default_on_loopback() -> None:
    config = build_config(None, env={})
    s = config.server
    assert s.host == "127.0.0.1"
    assert (s.tls_cert, s.tls_key, s.tls_client_ca, s.auth_tokens_file) == ("", "", "", "")
    assert s.auth_exempt_health and not s.log_prompts
    assert _credentials(config) is None
    limits = config.limits
    assert limits.max_message_bytes == 4 * 1024 * 1024 and limits.max_streams_per_client == 16
    assert limits.max_new_tokens and limits.max_stop_strings and limits.max_stop_chars and limits.max_extra_files
    for bad, message in (({"tls_cert": "c.pem"}, "--tls-key"), ({"tls_client_ca": "ca.pem"}, "--tls-client-ca")):
        with pytest.raises(ValueError, match=message):
            validate(replace(config, server=replace(s, **bad)))  # type: ignore[arg-type]


# ---- an in-process server with the auth interceptor --------------------------------------------------------------


AuthServer = Callable[..., Awaitable[tuple[int, TokenAuth]]]


@pytest_asyncio.fixture
async def auth_server(server: Running, tmp_path: Path) -> AsyncIterator[AuthServer]:
    """Start grpc.aio servers around the shared Generator service with TokenAuth, health and reflection, as
    start_server assembles them; returns (port, interceptor)."""
    started: list[grpc.aio.Server] = []

    async def start(tokens: str = f"{TOKEN_A}\n{TOKEN_B}\n", exempt_health: bool = True,
                    credentials: grpc.ServerCredentials | None = None) -> tuple[int, TokenAuth]:
        path = tmp_path / f"tokens-{len(started)}"
        path.write_text(tokens)
        auth = TokenAuth(path, exempt_health=exempt_health)
        srv = grpc.aio.server(interceptors=[auth], options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GeneratorServicer_to_server(server.service, srv)
        servicer: Any = health.aio.HealthServicer()  # type: ignore[attr-defined]
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
        reflection.enable_server_reflection([SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME], srv)
        port = srv.add_secure_port("127.0.0.1:0", credentials) if credentials else srv.add_insecure_port(
            "127.0.0.1:0")
        await srv.start()
        started.append(srv)
        return port, auth

    yield start
    for srv in started:
        await srv.stop(0)


class ClientWriteRace(Exception):
    """grpc.aio's client reports INTERNAL "Internal error from Core" when it is still writing requests as the server
    refuses the call: the server's status is lost on the client, so the call is made again."""


async def _calls(channel: grpc.aio.Channel, metadata: Any) -> dict[str, grpc.StatusCode]:
    """Status of each Generator method called with `metadata`."""
    stub = pb_grpc.GeneratorStub(channel)
    codes: dict[str, grpc.StatusCode] = {}

    async def status(name: str, call: Any) -> None:
        code, details = await status_of(call)
        if (code, details) == CLIENT_WRITE_RACE:
            raise ClientWriteRace
        codes[name] = code
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert "authorization: Bearer" in details or "invalid or revoked" in details, details
            assert TOKEN_A not in details and TOKEN_B not in details

    await status("Generate", stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=2), metadata=metadata,
                                           timeout=30))
    await status("Infill", stub.Infill(pb.InfillRequest(prefix="def f(", suffix=")", max_new_tokens=2),
                                       metadata=metadata, timeout=30))
    await status("GetModelInfo", stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30))

    requests = [pb.ConverseRequest(start=pb.SessionStart(max_new_tokens=2)),
                pb.ConverseRequest(turn=pb.Turn(text="hi"))]
    for _ in range(5):
        try:
            await status("Converse", stub.Converse(iter(requests), metadata=metadata, timeout=30))
            break
        except ClientWriteRace:
            continue
    return codes


async def test_auth_refuses_missing_and_wrong_tokens_and_accepts_each_valid_one(
    auth_server: AuthServer, server: Running
) -> None:
    port, _ = await auth_server()
    ok = grpc.StatusCode.OK
    infill = ok if server.runtime.fim is not None else grpc.StatusCode.FAILED_PRECONDITION
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unauth = {name: grpc.StatusCode.UNAUTHENTICATED for name in ("Generate", "Infill", "GetModelInfo",
                                                                      "Converse")}
        assert await _calls(channel, ()) == unauth
        assert await _calls(channel, bearer("wrong-token")) == unauth
        assert await _calls(channel, bearer(TOKEN_A + "x")) == unauth
        assert await _calls(channel, (("authorization", TOKEN_A),)) == unauth  # no Bearer scheme
        for token in (TOKEN_A, TOKEN_B):
            assert await _calls(channel, bearer(token)) == {"Generate": ok, "Infill": infill, "GetModelInfo": ok,
                                                            "Converse": ok}
        error = await rpc_error(pb_grpc.GeneratorStub(channel).Generate(pb.GenerateRequest(prompt="x"), timeout=10))
        assert "missing credentials" in (error.details() or "")
    await wait_until(lambda: server.runtime.registry.in_use == 0, what="slots released")


async def _health_and_reflection(channel: grpc.aio.Channel) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    codes = []
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        codes.append(grpc.StatusCode.OK)
    except grpc.aio.AioRpcError as error:
        codes.append(error.code())
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [response] = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=10)]
        assert SERVICE_NAME in {s.name for s in response.list_services_response.service}
        codes.append(grpc.StatusCode.OK)
    except grpc.aio.AioRpcError as error:
        codes.append(error.code())
    return codes[0], codes[1]


async def test_health_and_reflection_stay_open_only_when_exempt(auth_server: AuthServer) -> None:
    open_port, _ = await auth_server()
    closed_port, _ = await auth_server(exempt_health=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{open_port}") as channel:
        assert await _health_and_reflection(channel) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{closed_port}") as channel:
        unauth = grpc.StatusCode.UNAUTHENTICATED
        assert await _health_and_reflection(channel) == (unauth, unauth)


async def test_reload_revokes_and_adds_tokens(auth_server: AuthServer) -> None:
    port, auth = await auth_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(TOKEN_A), timeout=10)
        auth.path.write_text(f"# A revoked\n{TOKEN_B}\n{TOKEN_C}\n")
        assert auth.reload() and auth.token_count == 2
        error = await rpc_error(stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(TOKEN_A), timeout=10))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in (error.details() or "")
        for token in (TOKEN_B, TOKEN_C):
            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(token), timeout=10)
        # an unreadable or invalid file keeps the tokens in force; an empty one revokes them all
        auth.path.write_text("not a token\n")
        assert not auth.reload() and auth.token_count == 2
        auth.path.unlink()
        assert not auth.reload()
        await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(TOKEN_B), timeout=10)
        auth.path.write_text("# everyone revoked\n")
        assert auth.reload() and auth.token_count == 0
        error = await rpc_error(stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(TOKEN_B), timeout=10))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_python_client_token_is_accepted(auth_server: AuthServer) -> None:
    from specrpc_client import AsyncClient, Unauthenticated

    port, _ = await auth_server()
    async with AsyncClient(f"127.0.0.1:{port}", token=TOKEN_B, timeout=30) as client:
        assert (await client.model_info()).kv_slots_total > 0
        summary = await client.generate("hello", max_new_tokens=2).result()
        assert summary is not None and summary.completion_tokens <= 2
    async with AsyncClient(f"127.0.0.1:{port}", token="bad", timeout=30) as client:
        with pytest.raises(Unauthenticated) as info:
            await client.model_info()
        assert "revoked" in info.value.details


async def test_logs_carry_neither_tokens_nor_prompt_text(auth_server: AuthServer, server: Running) -> None:
    assert not server.service.config.server.log_prompts
    configure("json", "info")  # another test (the bench smoke test) may have left the level at warning
    port, _ = await auth_server()
    with structlog.testing.capture_logs() as events:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GeneratorStub(channel)
            for metadata in (bearer(TOKEN_A), bearer(TOKEN_C), ()):
                try:
                    await collect(stub.Generate(pb.GenerateRequest(prompt=SECRET_PROMPT, max_new_tokens=4),
                                                metadata=metadata, timeout=30))
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        # the request line is written when the job is done, which can be just after the client saw the summary
        for _ in range(100):
            if any(e.get("event") == "request" for e in events):
                break
            await asyncio.sleep(0.05)
    text = json.dumps(events, default=str)
    assert any(e.get("event") == "request" for e in events), events  # the request line was logged
    assert any(e.get("event") == "unauthenticated call refused" for e in events), events
    for secret in (TOKEN_A, TOKEN_C, SECRET_PROMPT, "zebra"):
        assert secret not in text, f"{secret!r} leaked into the logs: {text}"
    request_line = next(e for e in events if e.get("event") == "request")
    assert "output" not in request_line and "prompt" not in request_line


# ---- limits -------------------------------------------------------------------------------------------------------


async def test_over_a_limit_the_error_names_the_flag_and_its_value(
    stub: pb_grpc.GeneratorStub, server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    lim = server.service.limits
    cases: list[tuple[Any, grpc.StatusCode, tuple[str, ...]]] = [
        (stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=lim.max_new_tokens + 1)),
         grpc.StatusCode.INVALID_ARGUMENT, ("--max-new-tokens", str(lim.max_new_tokens))),
        (stub.Generate(pb.GenerateRequest(prompt="x", stop=["s"] * (lim.max_stop_strings + 1))),
         grpc.StatusCode.INVALID_ARGUMENT, ("--max-stop-strings", str(lim.max_stop_strings))),
        (stub.Generate(pb.GenerateRequest(prompt="x", stop=["s" * (lim.max_stop_chars + 1)])),
         grpc.StatusCode.INVALID_ARGUMENT, ("--max-stop-chars", str(lim.max_stop_chars))),
        (stub.Infill(pb.InfillRequest(prefix="a", extra=[pb.ExtraFile(path="f")] * (lim.max_extra_files + 1))),
         grpc.StatusCode.INVALID_ARGUMENT, ("--max-extra-files", str(lim.max_extra_files))),
        (stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=1e9))),
         grpc.StatusCode.INVALID_ARGUMENT, ("--max-temperature", str(lim.max_temperature))),
        (stub.Generate(pb.GenerateRequest(prompt="x", speculation=pb.SpeculationParams(num_draft_tokens=99))),
         grpc.StatusCode.INVALID_ARGUMENT, ("--max-draft-tokens", str(server.runtime.config.engine.max_draft_tokens))),
        # gRPC itself refuses a message over --max-message-bytes before any handler runs
        (stub.Generate(pb.GenerateRequest(prompt="x" * (lim.max_message_bytes + 1))),
         grpc.StatusCode.RESOURCE_EXHAUSTED, (str(lim.max_message_bytes),)),
    ]
    for call, code, words in cases:
        error = await rpc_error(call)
        assert error.code() == code, (words, error.details())
        for word in words:
            assert word in (error.details() or ""), (word, error.details())
    monkeypatch.setattr(server.service, "limits", replace(lim, max_prompt_tokens=8))
    error = await rpc_error(stub.Generate(pb.GenerateRequest(prompt="one two three four five six seven eight nine "
                                                             "ten eleven twelve", max_new_tokens=2)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-tokens" in (error.details() or "") and "at most 8" in (error.details() or "")


async def test_streams_per_client_limit(stub: pb_grpc.GeneratorStub, server: Running, long_streams: float,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.service, "quota", StreamQuota(2, by_token=False))
    calls = [stub.Generate(long_request(prompt=f"Story {i}:"), timeout=30) for i in range(2)]
    for call in calls:
        await first_tokens(call)
    error = await rpc_error(stub.Generate(long_request(), timeout=10))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-streams-per-client" in (error.details() or "") and "at most 2" in (error.details() or "")
    error = await rpc_error(stub.Converse(iter([pb.ConverseRequest(start=pb.SessionStart())]), timeout=10))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # Converse counts too
    assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).kv_slots_in_use == 2  # unary: not counted
    calls[0].cancel()
    await wait_until(lambda: sum(server.service.quota.open.values()) == 1, what="the cancelled stream uncounted")
    replacement = stub.Generate(long_request(prompt="Story 3:"), timeout=30)
    await first_tokens(replacement)
    for call in (calls[1], replacement):
        call.cancel()
    await wait_until(lambda: not server.service.quota.open and server.runtime.registry.in_use == 0,
                     what="quota and slots released")


async def test_streams_per_client_are_counted_per_token(auth_server: AuthServer, server: Running,
                                                        long_streams: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.service, "quota", StreamQuota(1, by_token=True))
    port, _ = await auth_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        a = stub.Generate(long_request(prompt="Story A:"), metadata=bearer(TOKEN_A), timeout=30)
        await first_tokens(a)
        error = await rpc_error(stub.Generate(long_request(), metadata=bearer(TOKEN_A), timeout=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 1" in (error.details() or "")
        b = stub.Generate(long_request(prompt="Story B:"), metadata=bearer(TOKEN_B), timeout=30)
        await first_tokens(b)  # another token from the same address has its own quota
        assert all(TOKEN_A not in client and TOKEN_B not in client for client in server.service.quota.open)
        a.cancel()
        b.cancel()
    await wait_until(lambda: not server.service.quota.open and server.runtime.registry.in_use == 0,
                     what="quota and slots released")


# ---- TLS and mutual TLS -------------------------------------------------------------------------------------------


def _tls_config(certs: Path, mutual: bool) -> Config:
    return Config(server=ServerConfig(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"),
                                      tls_client_ca=str(certs / "ca.pem") if mutual else ""))


def _tls_channel(port: int, certs: Path, client: str | None = None) -> grpc.aio.Channel:
    key = (certs / f"{client}.key").read_bytes() if client else None
    chain = (certs / f"{client}.pem").read_bytes() if client else None
    creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), key, chain)
    return grpc.aio.secure_channel(f"localhost:{port}", creds)


async def _model_info_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        return error.code()
    finally:
        await channel.close()


@pytest_asyncio.fixture(scope="module")
async def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not have_openssl():
        pytest.skip("no openssl")
    d = tmp_path_factory.mktemp("certs")
    await asyncio.to_thread(make_certs, d)
    return d


@needs_openssl
async def test_tls_server_from_config(server: Running, certs: Path,
                                      extra_server: Callable[..., Awaitable[int]]) -> None:
    port = await extra_server(credentials=_credentials(_tls_config(certs, mutual=False)))
    channel = _tls_channel(port, certs)
    _, summary = await collect(pb_grpc.GeneratorStub(channel).Generate(
        pb.GenerateRequest(prompt="hello", max_new_tokens=2), timeout=30))
    assert summary.completion_tokens <= 2
    assert await _model_info_code(channel) == grpc.StatusCode.OK
    assert await _model_info_code(_tls_channel(port, certs, "client")) == grpc.StatusCode.OK  # a cert is optional
    plaintext = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    assert await _model_info_code(plaintext) == grpc.StatusCode.UNAVAILABLE


@needs_openssl
async def test_mutual_tls_refuses_clients_without_a_trusted_certificate(
    server: Running, certs: Path, extra_server: Callable[..., Awaitable[int]]
) -> None:
    port = await extra_server(credentials=_credentials(_tls_config(certs, mutual=True)))
    assert await _model_info_code(_tls_channel(port, certs, "client")) == grpc.StatusCode.OK
    assert await _model_info_code(_tls_channel(port, certs)) == grpc.StatusCode.UNAVAILABLE  # no certificate
    assert await _model_info_code(_tls_channel(port, certs, "client2")) == grpc.StatusCode.UNAVAILABLE  # other CA
    assert await _model_info_code(grpc.aio.insecure_channel(f"127.0.0.1:{port}")) == grpc.StatusCode.UNAVAILABLE


# ---- the whole path: `specrpc serve` with mTLS, tokens, SIGHUP and SIGTERM ---------------------------------------


@needs_openssl
async def test_serve_with_mtls_and_tokens_reloads_on_sighup(server: Running, certs: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# ops\n{TOKEN_A}\n{TOKEN_B}\n")
    args = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
            "--tls-client-ca", str(certs / "ca.pem"), "--auth-tokens-file", str(tokens)]
    with serve_process(tmp_path, args) as served:
        key, chain = (certs / "client.key").read_bytes(), (certs / "client.pem").read_bytes()
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), key, chain)
        async with grpc.aio.secure_channel(f"localhost:{served.port}", creds, options=FAST_RECONNECT) as channel:
            await wait_serving(channel, served)  # health needs no token
            stub = pb_grpc.GeneratorStub(channel)
            request = pb.GenerateRequest(prompt=SECRET_PROMPT, max_new_tokens=3)
            error = await rpc_error(stub.Generate(request, timeout=30))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            _, summary = await collect(stub.Generate(request, metadata=bearer(TOKEN_A), timeout=30))
            assert summary.completion_tokens <= 3

            tokens.write_text(f"{TOKEN_B}\n{TOKEN_C}\n")  # revoke A, add C
            served.process.send_signal(signal.SIGHUP)

            async def revoked() -> bool:
                try:
                    await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(TOKEN_A), timeout=10)
                    return False
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                    return True

            for _ in range(200):
                if await revoked():
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail(f"SIGHUP did not revoke the token:\n{served.log_text()}")
            for token in (TOKEN_B, TOKEN_C):
                _, summary = await collect(stub.Generate(request, metadata=bearer(token), timeout=30))
            assert served.process.poll() is None  # SIGHUP reloads, it does not kill
        # without a client certificate the handshake fails
        no_cert = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        assert await _model_info_code(grpc.aio.secure_channel(f"localhost:{served.port}", no_cert)) == (
            grpc.StatusCode.UNAVAILABLE)
        served.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(served.process.wait, 30) == 0
        log = served.log_text()
        assert "auth tokens reloaded" in log and '"mutual_tls": true' in log
        for secret in (TOKEN_A, TOKEN_B, TOKEN_C, SECRET_PROMPT):
            assert secret not in log, f"{secret!r} leaked into the server log"


async def test_serve_refuses_an_empty_tokens_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# nobody yet\n")
    with serve_process(tmp_path, ["--auth-tokens-file", str(tokens)]) as served:
        assert await asyncio.to_thread(served.process.wait, 60) == 2
        assert "has no tokens" in served.log_text()
