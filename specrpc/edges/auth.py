"""Who may call, and how many streams each caller may hold: bearer-token authentication (a grpc.aio server
interceptor, tokens reloaded on SIGHUP) and the per-client concurrent-stream quota.

A token never reaches a log line, an error message or a metric: clients are identified by a short hash of their
token (or by their address when authentication is off).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog

from specrpc.config import IPNetwork

log = structlog.get_logger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
AUTH_HEADER = "authorization"
FORWARDED_HEADER = "x-forwarded-for"
BEARER = "bearer "
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                   "/grpc.reflection.v1.ServerReflection/")
"""Methods that stay open with --auth-exempt-health, so load balancers, probes and grpcurl `list` work."""


class TooManyStreams(Exception):
    """A client already holds --max-streams-per-client streams: RESOURCE_EXHAUSTED."""


def read_tokens(path: str | Path) -> tuple[bytes, ...]:
    """Accepted tokens from a file: one per line, surrounding whitespace stripped, blank lines and `#` comments
    ignored. Raises OSError when the file cannot be read and ValueError when a line is not a usable token."""
    tokens: list[bytes] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if any(c.isspace() for c in token) or not token.isprintable() or not token.isascii():
            raise ValueError(f"{path}:{number}: a token must be printable ASCII without spaces")
        tokens.append(token.encode())
    return tuple(tokens)


def metadata_values(metadata: Iterable[tuple[str, str | bytes]] | None, name: str) -> list[str]:
    """Every value of request metadata `name` (lower case), in order."""
    return [value.decode("latin-1") if isinstance(value, bytes) else value
            for key, value in metadata or () if key.lower() == name]


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    """The token of an `authorization: Bearer <token>` header (scheme case-insensitive), or None."""
    values = metadata_values(metadata, AUTH_HEADER)
    if values and values[0][: len(BEARER)].lower() == BEARER:
        return values[0][len(BEARER):].strip().encode("utf-8", "surrogateescape")
    return None


def client_id_of_token(token: bytes) -> str:
    """A stable, non-reversible name for a token (for quotas and logs): `token:` + 12 hex digits of SHA-256."""
    return "token:" + hashlib.sha256(token).hexdigest()[:12]


def peer_host(peer: str) -> str:
    """`ipv4:127.0.0.1:5555` → `ipv4:127.0.0.1`, `ipv6:[::1]:5555` → `ipv6:[::1]`; other forms unchanged."""
    if peer.startswith(("ipv4:", "ipv6:")) and peer.count(":") >= 2:
        return peer.rsplit(":", 1)[0]
    return peer


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic only in grpc-stubs
    """Refuse calls without a valid `authorization: Bearer <token>` with UNAUTHENTICATED. Every accepted token
    is compared in constant time (no early exit), so the answer's timing does not tell which prefix matched."""

    def __init__(self, path: str | Path, exempt_health: bool = True) -> None:
        self.path = Path(path)
        self.exempt_health = exempt_health
        self._tokens = read_tokens(self.path)
        if not self._tokens:
            raise ValueError(f"--auth-tokens-file {self.path} has no tokens (one per line; # starts a comment)")

    @property
    def token_count(self) -> int:
        """How many tokens are accepted now."""
        return len(self._tokens)

    def reload(self) -> bool:
        """Read the tokens file again (SIGHUP). On an unreadable or invalid file the old tokens stay and False is
        returned; an empty file revokes every token."""
        try:
            tokens = read_tokens(self.path)
        except (OSError, ValueError) as exc:
            log.error("auth tokens not reloaded; keeping the previous ones", file=str(self.path), error=str(exc))
            return False
        self._tokens = tokens
        log.info("auth tokens reloaded", file=str(self.path), tokens=len(tokens))
        if not tokens:
            log.warning("the auth tokens file is empty: every authenticated call is refused", file=str(self.path))
        return True

    def valid(self, token: bytes | None) -> bool:
        """True when `token` is one of the accepted tokens; compares against every one of them."""
        if token is None:
            return False
        match = False
        for accepted in self._tokens:
            match |= hmac.compare_digest(token, accepted)
        return match

    def exempt(self, method: str) -> bool:
        """Health checks and reflection, when --auth-exempt-health."""
        return self.exempt_health and method.startswith(EXEMPT_PREFIXES)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or self.exempt(method):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if self.valid(token):
            return handler
        if token is None:
            message = ("missing credentials: send the metadata `authorization: Bearer <token>` with a token from "
                       "the server's --auth-tokens-file")
        else:
            message = "invalid or revoked bearer token"
        log.warning("unauthenticated call refused", method=method, reason="missing" if token is None else "invalid")
        return _refusal(handler, message)


def _refusal(handler: grpc.RpcMethodHandler[Any, Any], message: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED without running it."""

    async def abort(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(abort, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def peer_ip(peer: str) -> IPAddress | None:
    """The IP address in a gRPC peer string (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`); None for other transports."""
    host = peer_host(peer)
    if host.startswith("ipv4:"):
        host = host[5:]
    elif host.startswith("ipv6:"):
        host = urllib.parse.unquote(host[5:]).strip("[]")
    else:
        return None
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def within(address: IPAddress, networks: Sequence[IPNetwork]) -> bool:
    """Whether `address` lies in any of `networks`."""
    return any(address in net for net in networks)


def forwarded_client(metadata: Iterable[tuple[str, str | bytes]] | None, trusted: Sequence[IPNetwork]
                     ) -> IPAddress | None:
    """The client a chain of trusted proxies reports: the right-most `x-forwarded-for` address that is not itself
    a trusted proxy (addresses to its left could be forged by the client)."""
    hops = [h.strip() for text in metadata_values(metadata, FORWARDED_HEADER) for h in text.split(",") if h.strip()]
    for hop in reversed(hops):
        try:
            address = ipaddress.ip_address(hop.strip("[]"))
        except ValueError:
            return None  # garbage in the chain: do not guess
        if not within(address, trusted):
            return address
    return None


class StreamQuota:
    """Concurrent streams per client: by token hash when authentication is on, else by address without the port
    (so one host's many connections share one quota). Behind proxies listed in `trusted`, the address is the client
    that `x-forwarded-for` names; from anyone else the header is ignored."""

    def __init__(self, limit: int, by_token: bool, trusted: Sequence[IPNetwork] = ()) -> None:
        self.limit = limit
        self.by_token = by_token
        self.trusted = list(trusted)
        self.open: Counter[str] = Counter()

    def client_id(self, peer: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """Who is calling, as counted here."""
        if self.by_token:
            token = bearer_token(metadata)
            if token is not None:
                return client_id_of_token(token)
        ip = peer_ip(peer)
        if ip is not None and within(ip, self.trusted):
            client = forwarded_client(metadata, self.trusted)
            if client is not None:
                return f"ipv{client.version}:{client}"
        return peer_host(peer)

    def acquire(self, client: str) -> None:
        """Count one more stream for `client`, or TooManyStreams (limit 0: unlimited)."""
        if self.limit and self.open[client] >= self.limit:
            raise TooManyStreams(f"this client already has {self.open[client]} streams open; at most "
                                 f"{self.limit} are allowed per client (server --max-streams-per-client); "
                                 f"wait for one to end or cancel one")
        self.open[client] += 1

    def release(self, client: str) -> None:
        """One stream of `client` ended."""
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]
