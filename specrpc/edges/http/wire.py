"""The HTTP edge's plumbing, beside its routes: OpenAI-shaped errors, reading JSON bodies with checks that name the
field, the ASGI response that runs a generation (SSE or one object) and cancels it when the client goes away, and
the connection protocol that sends each write at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specrpc.edges.auth import TooManyStreams
from specrpc.edges.gateway import DeviceOutOfMemory, EngineFailure, Gateway, NotReady, ShuttingDown
from specrpc.edges.http.replies import ChoicesReply, Reply
from specrpc.edges.offload import prepared
from specrpc.edges.validation import InvalidRequest
from specrpc.engine.constraint import InvalidConstraint
from specrpc.prompts.fim import NoInfillSupport, PromptTooLong
from specrpc.prompts.rewrite import BadRewrite
from specrpc.serving.runtime import DecodeParams
from specrpc.serving.scheduler import FINISH_CANCELLED, Chunk, Done
from specrpc.serving.sessions import SlotsExhausted, UnknownSession

log = structlog.get_logger(__name__)

PROTOCOL = "http"  # the metrics' protocol label for this edge
JSON_TYPE = "application/json"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


# ---- errors ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorKind:
    """How a domain error is answered over HTTP, and counted (as the gRPC code name the metrics use)."""

    status: int
    type: str
    code: str
    grpc_code: str


ERRORS: list[tuple[type[BaseException], ErrorKind]] = [
    (InvalidRequest, ErrorKind(400, "invalid_request_error", "invalid_value", "INVALID_ARGUMENT")),
    (InvalidConstraint, ErrorKind(400, "invalid_request_error", "invalid_schema", "INVALID_ARGUMENT")),
    (PromptTooLong, ErrorKind(400, "invalid_request_error", "prompt_too_long", "INVALID_ARGUMENT")),
    (BadRewrite, ErrorKind(400, "invalid_request_error", "invalid_value", "INVALID_ARGUMENT")),
    (UnknownSession, ErrorKind(400, "invalid_request_error", "unknown_session", "INVALID_ARGUMENT")),
    (NoInfillSupport, ErrorKind(400, "invalid_request_error", "infill_unsupported", "FAILED_PRECONDITION")),
    (SlotsExhausted, ErrorKind(429, "rate_limit_error", "kv_slots_exhausted", "RESOURCE_EXHAUSTED")),
    (TooManyStreams, ErrorKind(429, "rate_limit_error", "too_many_streams", "RESOURCE_EXHAUSTED")),
    (DeviceOutOfMemory, ErrorKind(503, "server_error", "device_out_of_memory", "RESOURCE_EXHAUSTED")),
    (torch.OutOfMemoryError, ErrorKind(503, "server_error", "device_out_of_memory", "RESOURCE_EXHAUSTED")),
    (NotReady, ErrorKind(503, "server_error", "loading", "UNAVAILABLE")),
    (ShuttingDown, ErrorKind(503, "server_error", "shutting_down", "UNAVAILABLE")),
    (EngineFailure, ErrorKind(500, "server_error", "engine_failure", "INTERNAL")),
]
INTERNAL = ErrorKind(500, "server_error", "internal_error", "INTERNAL")


class HttpError(Exception):
    """An error raised by the edge itself (not the domain): its status, OpenAI type and code, and the field."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param


UNAUTHENTICATED = ErrorKind(401, "authentication_error", "invalid_api_key", "UNAUTHENTICATED")
TOO_LARGE = ErrorKind(413, "invalid_request_error", "request_too_large", "INVALID_ARGUMENT")
BAD_REQUEST = ErrorKind(400, "invalid_request_error", "invalid_value", "INVALID_ARGUMENT")
NOT_FOUND = ErrorKind(404, "invalid_request_error", "not_found", "NOT_FOUND")


def kind_of(exc: BaseException) -> ErrorKind:
    """How `exc` is answered."""
    if isinstance(exc, HttpError):
        return exc.kind
    return next((kind for cls, kind in ERRORS if isinstance(exc, cls)), INTERNAL)


def error_body(kind: ErrorKind, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind.type, "param": param, "code": kind.code}}


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON error answer to `exc`."""
    kind = kind_of(exc)
    message = str(exc) if kind is not INTERNAL else "internal error; see the server log"
    param = exc.param if isinstance(exc, HttpError) else None
    return JSONResponse(error_body(kind, message, param), status_code=kind.status)


# ---- reading requests ------------------------------------------------------------------------------------------------


def bad(param: str, message: str) -> HttpError:
    """A 400 naming the field."""
    return HttpError(BAD_REQUEST, message, param)


def unicode_text(value: str, name: str) -> str:
    """`value`, or a 400 naming field `name` when it holds a lone surrogate (JSON's "\ud800", or its raw bytes),
    which no tokenizer takes."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise bad(name, f"{name} is not valid Unicode text (a lone surrogate)") from None
    return value


class Body:
    """A JSON object's fields, read with type and range checks that name the field on failure."""

    def __init__(self, data: Any, where: str = "", size: int = 0) -> None:
        if not isinstance(data, dict):
            raise bad(where or "body", f"{where or 'the request body'} must be a JSON object")
        self.data = data
        self.where = where
        self.size = size  # bytes of the request body it was read from (0: a nested object)

    def name(self, key: str) -> str:
        """The field's path as errors name it."""
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        """Present and not null."""
        return self.data.get(key) is not None

    def text(self, key: str, default: str = "") -> str:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad(self.name(key), f"{self.name(key)} must be a string; got {type(value).__name__}")
        return unicode_text(value, self.name(key))

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad(self.name(key), f"{self.name(key)} must be true or false; got {value!r}")
        return value

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        value = self.data.get(key, default)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(self.name(key), f"{self.name(key)} must be an integer; got {value!r}")
        if not lo <= value <= hi:
            raise bad(self.name(key), f"{self.name(key)} must be in [{lo}, {hi}]; got {value}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.data.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise bad(self.name(key), f"{self.name(key)} must be a finite number; got {value!r}")
        return float(value)

    def items(self, key: str) -> list[Any]:
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise bad(self.name(key), f"{self.name(key)} must be a list; got {type(value).__name__}")
        return value

    def stops(self, key: str = "stop", token_ids: bool = False) -> list[str]:
        """`stop`: a string or a list of strings (with `token_ids`, a list of integers is the stop token ids,
        `stop_token_ids`, and gives no strings)."""
        value = self.data.get(key)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if token_ids and isinstance(items, list) and items and all(is_integer(s) for s in items):
            return []
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            more = " or a list of token ids (integers)" if token_ids else ""
            raise bad(key, f"{key} must be a string or a list of strings{more}")
        return items

    def stop_token_ids(self, key: str = "stop") -> tuple[int, ...]:
        """`stop` given as a list of integers: token ids that end the reply (as vLLM's stop_token_ids)."""
        value = self.data.get(key)
        if isinstance(value, list) and value and all(is_integer(s) for s in value):
            return tuple(int(s) for s in value)
        return ()

    def bias(self, key: str = "logit_bias") -> tuple[tuple[int, float], ...]:
        """OpenAI's `logit_bias`: an object from token ids (as strings) to numbers."""
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise bad(key, f"{key} must be an object mapping token ids to biases in [-100, 100]")
        out: list[tuple[int, float]] = []
        for token, bias in value.items():
            if len(token) > 20 or not token.strip().lstrip("-").isdigit():
                raise bad(key, f"{key}: {token[:32]!r} is not a token id (an integer)")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
                raise bad(key, f"{key}[{token[:32]}] must be a number in [-100, 100]; got {bias!r}"[:200])
            out.append((int(token), float(bias)))
        return tuple(out)


def is_integer(value: Any) -> bool:
    """A JSON integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)


async def read_json(request: Request, limit: int) -> Body:
    """The request body as a JSON object, refused with 413 past `limit` bytes (--max-message-bytes)."""
    declared = request.headers.get("content-length")
    too_large = HttpError(TOO_LARGE, f"the request body is larger than {limit} bytes (server --max-message-bytes); "
                                     f"send a shorter prompt or fewer extra files")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise too_large
    try:
        return Body(await prepared(lambda: json.loads(data), len(data)), size=len(data))  # a megabyte: ~10 ms
    except (ValueError, RecursionError) as exc:
        raise bad("body", f"the request body is not valid JSON ({exc}); send a JSON object") from None


# ---- the response that runs a generation ----------------------------------------------------------------------------


class GenerationResponse(Response):
    """Runs a generation while answering: SSE events as chunks arrive (`stream`), or one JSON object at the end. It
    watches the connection and cancels the generation when the client goes away, so the slot is freed before the next
    engine step. Errors before the first byte is sent are answered in OpenAI's error shape, later ones as a last
    `data: {"error": …}` event. The admitted stream is released and the request counted when it ends."""

    def __init__(self, gateway: Gateway, rpc: str, client: str, prompt: list[int], params: DecodeParams,
                 session: str, reply: Reply, stream: bool, scope: str | None = None,
                 choices: ChoicesReply | None = None) -> None:
        """`choices`: several choices of the prompt (OpenAI `n` > 1), answered by it instead of `reply`."""
        super().__init__(status_code=200)
        self.choices = choices
        self.gateway = gateway
        self.rpc = rpc
        self.client = client
        self.prompt = prompt
        self.params = params
        self.session = session
        self.reply = reply
        self.stream = stream
        self.scope = scope  # whose earlier outputs draft for it (Gateway.draft_scope)
        self.opened = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch_disconnect(receive, gone))
        code = "CANCELLED"
        try:
            code = await self._answer(send, gone)
        finally:
            watcher.cancel()
            gone.set()  # whatever ended this response ends its generation
            self.gateway.leave(self.client)
            self.gateway.count(self.rpc, code, PROTOCOL)

    async def _answer(self, send: Send, gone: asyncio.Event) -> str:
        """Stream or collect the generation; returns the final status as a gRPC code name."""
        if self.choices is not None:
            return await self._answer_choices(self.choices, send, gone)
        events = self.gateway.stream(self.prompt, self.params, self.session, self.rpc, gone, self.scope)
        text: list[str] = []
        try:
            async for event in events:
                if isinstance(event, Chunk):
                    text.append(event.text)
                    pieces = self.reply.chunk(event.text, event)
                    if self.stream and pieces:
                        await self._events(send, await self._open(send) + pieces)
                    continue
                final = self.reply.end(event, "".join(text), self.stream)
                if self.stream:
                    await self._events(send, await self._open(send) + final, last=True)
                else:
                    await self._start(send, 200, JSON_TYPE)
                    await send({"type": "http.response.body", "body": json.dumps(final[0]).encode()})
                return "CANCELLED" if event.finish == FINISH_CANCELLED and gone.is_set() else "OK"
        except Exception as exc:
            return await self._failed(send, exc)
        finally:
            await events.aclose()
        return "CANCELLED"  # unreachable: a generation ends with Done or raises

    async def _answer_choices(self, choices: ChoicesReply, send: Send, gone: asyncio.Event) -> str:
        """`_answer` for several choices: their events as they come, each with its index; the usage (or the whole
        reply) once every choice has ended."""
        events = self.gateway.stream_choices(self.prompt, self.params, len(choices.replies), self.session, self.rpc,
                                             gone, self.scope)
        cancelled = False
        try:
            async for index, event in events:
                if index < 0:
                    assert isinstance(event, Done)
                    choices.prefill = event
                    continue
                if isinstance(event, Chunk):
                    pieces = choices.chunk(index, event.text, event)
                    if self.stream and pieces:
                        await self._events(send, await self._open(send) + pieces)
                    continue
                cancelled |= event.finish == FINISH_CANCELLED
                pieces = choices.end(index, event, self.stream)
                if self.stream and pieces:
                    await self._events(send, await self._open(send) + pieces)
            final = choices.whole(self.stream)
            if self.stream:
                await self._events(send, await self._open(send) + final, last=True)
            else:
                await self._start(send, 200, JSON_TYPE)
                await send({"type": "http.response.body", "body": json.dumps(final[0]).encode()})
            return "CANCELLED" if cancelled and gone.is_set() else "OK"
        except Exception as exc:
            return await self._failed(send, exc)
        finally:
            await events.aclose()

    async def _failed(self, send: Send, exc: Exception) -> str:
        """Answer `exc`: an error object before the stream opened, else a last error event; its gRPC code name."""
        kind = kind_of(exc)
        if kind is INTERNAL:
            log.exception("unhandled error", rpc=self.rpc, protocol=PROTOCOL)
        message = str(exc) if kind is not INTERNAL else "internal error; see the server log"
        if self.opened:
            await self._events(send, [error_body(kind, message)], last=True)
        else:
            await self._start(send, kind.status, JSON_TYPE)
            await send({"type": "http.response.body", "body": json.dumps(error_body(kind, message)).encode()})
        return kind.grpc_code

    async def _open(self, send: Send) -> list[dict[str, Any]]:
        """Start the event stream once; returns the reply's opening events the first time."""
        if self.opened:
            return []
        self.opened = True
        await self._start(send, 200, "text/event-stream", SSE_HEADERS)
        return self.reply.start()

    @staticmethod
    async def _start(send: Send, status: int, media_type: str, headers: dict[str, str] | None = None) -> None:
        raw = [(b"content-type", media_type.encode())]
        raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})

    async def _events(self, send: Send, events: list[dict[str, Any]], last: bool = False) -> None:
        """SSE events in one write; `last` ends the stream (after `data: [DONE]` where the API has it)."""
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        if last and self.reply.done_marker:
            body += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": not last})


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects (the body has been read already, so the next message is that)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


class NoDelayProtocol(H11Protocol):
    """uvicorn's h11 connection protocol with TCP_NODELAY on every connection. asyncio turns Nagle off only for
    sockets whose `proto` is IPPROTO_TCP, and the listening socket from `socket.create_server` (so every accepted
    one) has proto 0: with Nagle on, the first SSE event, written right after the response headers, waited for the
    client's delayed ACK, ~40 ms on every request of a kept-alive connection (measured: first event after 47–57 ms
    instead of 9–15)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)  # type: ignore[arg-type]
