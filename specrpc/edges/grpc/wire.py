"""Malformed request bytes: INVALID_ARGUMENT instead of grpc.aio's UNKNOWN (plus a logged traceback per message).

A grpc.aio server interceptor swaps each method's request deserializer for one that never raises: bytes that do
not decode become an `Undecodable` marker, which the unary handlers refuse at once and a request stream raises
as `MalformedRequest` inside the handler (mapped like any other invalid request)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc


class MalformedRequest(ValueError):
    """A request message that is not a valid protobuf encoding of its type."""


@dataclass(frozen=True)
class Undecodable:
    """What the tolerant deserializer returns for bytes that do not decode."""

    error: str

    def message(self, method: str) -> str:
        return (f"the request to {method} is not a valid protobuf message of its type ({self.error}); check the "
                f"client's generated stubs against proto/specrpc/v1")


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything a custom deserializer raises
            return Undecodable(str(exc) or type(exc).__name__)

    return decode


async def _checked(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise MalformedRequest(request.message(method))
        yield request


async def _respond(result: Any) -> AsyncIterator[Any]:
    """Responses of an inner streaming handler, whether it is an async generator or a reader-writer coroutine;
    the generator is closed here whatever happens, so its own clean-up runs at once."""
    if inspect.isasyncgen(result):
        try:
            async for response in result:
                yield response
        finally:
            await result.aclose()
    else:
        await result


class DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic only in grpc-stubs
    """Answer undecodable request messages with INVALID_ARGUMENT (async handlers only, as grpc.aio servers have)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        inner: Any = handler  # grpc-stubs types the behaviours as optional sync callables
        options = {"request_deserializer": _tolerant(handler.request_deserializer),
                   "response_serializer": handler.response_serializer}

        async def unary_unary(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
            return await inner.unary_unary(request, context)

        async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
            async for response in _respond(inner.unary_stream(request, context)):
                yield response

        async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
            return await inner.stream_unary(_checked(requests, method), context)

        async def stream_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for response in _respond(inner.stream_stream(_checked(requests, method), context)):
                yield response

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_stream, **options)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(stream_unary, **options)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(unary_stream, **options)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **options)
