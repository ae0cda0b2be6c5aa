"""Exceptions: one class per status code a caller handles differently, all under SpecrpcError."""

from __future__ import annotations

import grpc


class SpecrpcError(Exception):
    """A failed call: `code` is the gRPC status, `details` the server's message, `method` the RPC."""

    def __init__(self, code: grpc.StatusCode, details: str, method: str = "") -> None:
        self.code = code
        self.details = details
        self.method = method
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{code.name}: {details}")


class Unavailable(SpecrpcError, ConnectionError):
    """The server could not be reached (after the retries the RetryPolicy allows)."""


class DeadlineExceeded(SpecrpcError, TimeoutError):
    """The call's deadline (`timeout`) passed before it finished."""


class InvalidArgument(SpecrpcError, ValueError):
    """The request must change (the message says how)."""


class ResourceExhausted(SpecrpcError):
    """Every KV slot is busy, or the server ran out of memory: retry later."""


class FailedPrecondition(SpecrpcError):
    """The server cannot do this at all (for example Infill without fill-in-the-middle tokens)."""


class Unauthenticated(SpecrpcError, PermissionError):
    """Missing or wrong bearer token."""


class PermissionDenied(SpecrpcError, PermissionError):
    """The token is valid but not allowed this call."""


class Cancelled(SpecrpcError):
    """The call was cancelled (by the server or another party)."""


CLASSES: dict[grpc.StatusCode, type[SpecrpcError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(exc: grpc.RpcError, method: str, timeout: float | None = None,
                   attempts: int = 1) -> SpecrpcError:
    """The SpecrpcError for a grpc error (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        details = f"no answer within the {timeout:g} s deadline (timeout={timeout:g}); {details}".rstrip("; ")
    if code is grpc.StatusCode.UNAVAILABLE and attempts > 1:
        details = f"{details} (after {attempts} attempts)"
    return CLASSES.get(code, SpecrpcError)(code, details, method)
