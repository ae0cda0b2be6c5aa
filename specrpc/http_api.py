"""The HTTP edge, beside gRPC in the same process and event loop: the OpenAI API (chat completions, completions with
`suffix` for fill-in-the-middle, models) and llama.cpp's server API (`/infill`, `/completion`, `/health`), so the
clients people already run (the `openai` SDK, Continue, Pipecat, LiveKit Agents, llama.vim, llama.vscode) work
unmodified on the same runtime, sessions and KV caches.

Framework: Starlette under uvicorn. Starlette is the small, well-kept ASGI toolkit FastAPI is built on; this edge
needs routing, requests and raw ASGI responses, not FastAPI's schema generation or dependency injection, and its
request shapes are checked by hand anyway (so every error names the field and what to change, in OpenAI's error
shape). uvicorn is the reference ASGI server; it runs on the asyncio loop that already serves gRPC, so both edges
share one runtime object without threads or locks.

Same guarantees as gRPC: bearer tokens (`Authorization: Bearer`, --auth-tokens-file), TLS from --tls-cert/--tls-key
(and --tls-client-ca), --max-message-bytes as the body limit, --max-prompt-tokens, --max-streams-per-client (one quota
across both protocols), the same metrics (protocol="http") and log lines. A client that disconnects mid-request
cancels its generation before the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from specrpc import validation
from specrpc.auth import TokenAuth, TooManyStreams, bearer_token
from specrpc.config import Config
from specrpc.conversation import chat_prompt, reply_stops
from specrpc.engine import FINISH_LENGTH, FINISH_STOP
from specrpc.gateway import DeviceOutOfMemory, EngineFailure, Gateway, NotReady, ShuttingDown
from specrpc.runtime import DecodeParams, ExtraFile, NoInfillSupport
from specrpc.sampling import SamplingParams
from specrpc.scheduler import FINISH_CANCELLED, Chunk, Done
from specrpc.sessions import SlotsExhausted, UnknownSession
from specrpc.validation import SESSION_HEADER, InvalidRequest

log = structlog.get_logger(__name__)

PROTOCOL = "http"  # the metrics' protocol label for this edge
JSON_TYPE = "application/json"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

OPENAI_FINISH = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CANCELLED: "cancelled"}
LLAMA_STOP_TYPE = {FINISH_LENGTH: "limit", FINISH_CANCELLED: "none"}  # FINISH_STOP: "word" or "eos"

IGNORED_OPENAI = ("model", "n", "frequency_penalty", "presence_penalty", "logit_bias", "response_format", "tools",
                  "tool_choice", "parallel_tool_calls", "service_tier", "store", "metadata", "echo", "best_of",
                  "modalities", "reasoning_effort")
"""OpenAI fields accepted and ignored (n and best_of must be 1; see the README's HTTP section)."""
IGNORED_LLAMA = ("cache_prompt", "samplers", "t_max_prompt_ms", "id_slot", "lora", "min_p", "typical_p",
                 "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "dry_multiplier",
                 "xtc_probability", "timings_per_token", "return_tokens", "post_sampling_probs")
"""llama.cpp fields accepted and ignored: the prompt is always cached (per session or by longest prefix)."""


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


class Body:
    """A JSON object's fields, read with type and range checks that name the field on failure."""

    def __init__(self, data: Any, where: str = "") -> None:
        if not isinstance(data, dict):
            raise bad(where or "body", f"{where or 'the request body'} must be a JSON object")
        self.data = data
        self.where = where

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
        return value

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

    def stops(self, key: str = "stop") -> list[str]:
        """`stop`: a string or a list of strings."""
        value = self.data.get(key)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad(key, f"{key} must be a string or a list of strings")
        return items


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
        return Body(json.loads(data))
    except (ValueError, RecursionError) as exc:
        raise bad("body", f"the request body is not valid JSON ({exc}); send a JSON object") from None


# ---- domain parameters ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EditorOptions:
    """llama.cpp / OpenAI fields that map onto the editor features of DecodeParams (n_indent, max_time_ms,
    prefill_only, logprobs, top_logprobs). Collected here, in one place, and applied by `apply_editor_options`."""

    n_indent: int = 0
    max_time_ms: int = 0
    prefill_only: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def apply_editor_options(params: DecodeParams, options: EditorOptions) -> DecodeParams:
    """DecodeParams with the editor options. PENDING: the runtime does not take n_indent, max_time_ms, logprobs or
    top_logprobs yet (they are accepted and ignored, see the README); prefill-only is served as a one-token
    generation whose text is dropped."""
    if options.prefill_only:
        return DecodeParams(max_new_tokens=1, sampling=SamplingParams(temperature=0.0), stop=(),
                            num_draft_tokens=0, proposer=None)
    return params


@dataclass
class Sampling:
    """What both API families give: their sampling and budget fields, defaults applied."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


def decode(api: HttpApi, s: Sampling, max_tokens_name: str, extra_stops: Sequence[str] = ()) -> DecodeParams:
    """Checked DecodeParams (validation.py: the same checks and limits as gRPC)."""
    sampling = validation.sampling_params(api.config.limits, s.temperature, s.top_p, s.top_k, s.seed, prefix="")
    return validation.decode_params(api.config, (), s.max_tokens, sampling, [*s.stop, *extra_stops],
                                    max_tokens_name=max_tokens_name)


def openai_sampling(body: Body, max_tokens_default: int, limit: int) -> tuple[Sampling, str]:
    """OpenAI's sampling fields (temperature and top_p default to 1, as OpenAI's do) and the budget's field name."""
    name = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    for key in ("n", "best_of"):
        if body.has(key) and body.integer(key, 1, -(2**63), 2**63) != 1:
            raise bad(key, f"{key} must be 1 (one choice per request); send several requests for more")
    seed = body.integer("seed", 0, -(2**63), 2**64 - 1) if body.has("seed") else None
    return Sampling(
        max_tokens=body.integer(name, max_tokens_default, 1, limit) if body.has(name) else max_tokens_default,
        temperature=body.number("temperature", 1.0),
        top_p=body.number("top_p", 1.0),
        seed=None if seed is None else seed % 2**63,
        stop=body.stops(),
    ), name


def openai_editor_options(body: Body, chat: bool) -> EditorOptions:
    """`logprobs` (chat: true/false with `top_logprobs`; completions: an int 0..20)."""
    if chat:
        return EditorOptions(logprobs=body.flag("logprobs"), top_logprobs=body.integer("top_logprobs", 0, 0, 20))
    n = body.integer("logprobs", 0, 0, 20)
    return EditorOptions(logprobs=n > 0 or body.has("logprobs"), top_logprobs=n)


# ---- the application -----------------------------------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[Response]]


class HttpApi:
    """The routes, over one gateway (runtime, admission, accounting) shared with the gRPC service."""

    def __init__(self, config: Config, gateway: Gateway, auth: TokenAuth | None) -> None:
        self.config = config
        self.gateway = gateway
        self.auth = auth
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._endpoint("ChatCompletions", self.chat), methods=["POST"]),
            Route("/v1/completions", self._endpoint("Completions", self.completions), methods=["POST"]),
            Route("/v1/models", self._endpoint("Models", self.models), methods=["GET"]),
            Route("/health", self._endpoint("Health", self.health, exempt=True), methods=["GET"]),
            Route("/infill", self._endpoint("LlamaInfill", self.llama_infill), methods=["POST"]),
            Route("/completion", self._endpoint("LlamaCompletion", self.llama_completion), methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    @staticmethod
    async def _not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(NOT_FOUND, f"no route {request.url.path}; use /v1/chat/completions, "
                                                  f"/v1/completions, /v1/models, /infill, /completion or /health"),
                            status_code=404)

    @staticmethod
    async def _not_allowed(request: Request, exc: Exception) -> Response:
        kind = ErrorKind(405, "invalid_request_error", "method_not_allowed", "INVALID_ARGUMENT")
        return JSONResponse(error_body(kind, f"{request.method} is not allowed on {request.url.path}"),
                            status_code=405)

    def _endpoint(self, rpc: str, handler: Handler, exempt: bool = False) -> Handler:
        """Authentication, error mapping and the requests counter around a handler. A generation's answer is a
        GenerationResponse, which counts itself when it ends."""

        async def run(request: Request) -> Response:
            try:
                if self.auth is not None and not (exempt and self.auth.exempt_health):
                    self._authenticate(request)
                response = await handler(request)
            except Exception as exc:
                kind = kind_of(exc)
                if kind is INTERNAL:
                    log.exception("unhandled error", rpc=rpc, protocol=PROTOCOL)
                elif kind.status == 401:
                    log.warning("unauthenticated call refused", method=request.url.path, protocol=PROTOCOL)
                self.gateway.count(rpc, kind.grpc_code, PROTOCOL)
                return error_response(exc)
            if not isinstance(response, GenerationResponse):
                self.gateway.count(rpc, "OK" if response.status_code < 400 else "UNAVAILABLE", PROTOCOL)
            return response

        return run

    def _authenticate(self, request: Request) -> None:
        assert self.auth is not None
        token = bearer_token(request.headers.items())
        if token is None:
            raise HttpError(UNAUTHENTICATED, "missing credentials: send the header `Authorization: Bearer <token>` "
                                             "with a token from the server's --auth-tokens-file")
        if not self.auth.valid(token):
            raise HttpError(UNAUTHENTICATED, "invalid or revoked bearer token")

    # ---- small endpoints ---------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """llama.cpp's /health: 200 {"status": "ok"} once the models are loaded and warm, else 503."""
        if self.gateway.ready:
            return JSONResponse({"status": "ok"})
        exc = ShuttingDown("the server is shutting down") if self.gateway.draining else NotReady(
            "the server is starting: models are loading or warming up")
        return error_response(exc)

    async def models(self, request: Request) -> Response:
        """The one served model (the target; the draft only speeds it up)."""
        rt = self.gateway.runtime
        return JSONResponse({"object": "list", "data": [{
            "id": rt.target_info.name, "object": "model", "created": 0, "owned_by": "specrpc",
            "meta": {"n_ctx": rt.context_limit, "n_vocab": rt.vocab_size, "draft": rt.draft_info.name
                     if rt.draft_info else None}}]})

    # ---- sessions ----------------------------------------------------------------------------------------------

    def _session(self, request: Request, body: Body, use_user: bool) -> str:
        """The session: the `x-session-id` header, else (OpenAI endpoints, unless --no-http-user-session) `user`;
        both present and different is a 400, as over gRPC."""
        header = request.headers.get(SESSION_HEADER, "")
        user = body.text("user") if use_user and self.config.server.http_user_session else ""
        return validation.session_id(user, "user", header, header_name=f"{SESSION_HEADER} header")

    # ---- OpenAI --------------------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await read_json(request, self.config.limits.max_message_bytes)
        session = self._session(request, body, use_user=True)
        messages: list[tuple[str, str]] = []
        for i, item in enumerate(body.items("messages")):
            message = Body(item, f"messages[{i}]")
            role = message.text("role")
            if role == "developer":
                role = "system"
            messages.append((role, message_text(message)))
        if not messages:
            raise bad("messages", "messages must be a non-empty list of {role, content}")
        sampling, budget = openai_sampling(body, self.config.limits.default_max_new_tokens,
                                           self.config.limits.max_new_tokens)
        options = openai_editor_options(body, chat=True)
        prompt = chat_prompt(self.gateway, messages)
        params = apply_editor_options(decode(self, sampling, budget, reply_stops(self.gateway.runtime)), options)
        stream, usage = stream_flags(body)
        reply = OpenAIReply(chat=True, model=self.gateway.runtime.target_info.name, include_usage=usage)
        return self._generation(request, "ChatCompletions", prompt, params, session, reply, stream)

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.config.limits.max_message_bytes)
        session = self._session(request, body, use_user=True)
        prompt_field = body.data.get("prompt")
        if isinstance(prompt_field, list) and len(prompt_field) == 1 and isinstance(prompt_field[0], str):
            prompt_field = prompt_field[0]
        rt = self.gateway.runtime
        if isinstance(prompt_field, str):
            text = prompt_field
        else:
            raise bad("prompt", "prompt must be a string (or a list of one string)")
        sampling, budget = openai_sampling(body, 16, self.config.limits.max_new_tokens)  # OpenAI's default: 16
        options = openai_editor_options(body, chat=False)
        if body.has("suffix"):
            ids = rt.infill_prompt(text, body.text("suffix"), [], "")
            ids = validation.fit_prompt(ids, rt.context_limit, self.config.limits, truncate=False,
                                        too_long="send a shorter prompt and suffix", empty="set prompt")
        else:
            ids = validation.fit_prompt(rt.encode(text), rt.context_limit, self.config.limits, truncate=False,
                                        too_long="send a shorter prompt", empty="set prompt")
        params = apply_editor_options(decode(self, sampling, budget), options)
        stream, usage = stream_flags(body)
        reply = OpenAIReply(chat=False, model=rt.target_info.name, include_usage=usage)
        return self._generation(request, "Completions", ids, params, session, reply, stream)

    # ---- llama.cpp -------------------------------------------------------------------------------------------------

    async def llama_infill(self, request: Request) -> Response:
        """llama.cpp's /infill, as llama.vim and llama.vscode call it."""
        body = await read_json(request, self.config.limits.max_message_bytes)
        session = self._session(request, body, use_user=False)
        rt = self.gateway.runtime
        extra_items = body.items("input_extra")
        validation.extra_files(len(extra_items), self.config.limits, "input_extra")
        extra = []
        for i, item in enumerate(extra_items):
            chunk = Body(item, f"input_extra[{i}]")
            extra.append(ExtraFile(chunk.text("filename"), chunk.text("text")))
        typed_line = body.text("prompt")
        ids = infill_ids(self, body.text("input_prefix"), body.text("input_suffix"), extra, typed_line)
        ids = validation.fit_prompt(ids, rt.context_limit, self.config.limits, truncate=False,
                                    too_long="send fewer or shorter input_extra chunks, or a shorter input_prefix "
                                             "and input_suffix", empty="set input_prefix or input_suffix")
        return self._llama(request, body, "LlamaInfill", ids, session)

    async def llama_completion(self, request: Request) -> Response:
        """llama.cpp's /completion: a plain prompt, the same reply shape as /infill."""
        body = await read_json(request, self.config.limits.max_message_bytes)
        session = self._session(request, body, use_user=False)
        rt = self.gateway.runtime
        ids = validation.fit_prompt(rt.encode(body.text("prompt")), rt.context_limit, self.config.limits,
                                    truncate=False, too_long="send a shorter prompt", empty="set prompt")
        return self._llama(request, body, "LlamaCompletion", ids, session)

    def _llama(self, request: Request, body: Body, rpc: str, ids: list[int], session: str) -> Response:
        limits = self.config.limits
        n_predict = body.integer("n_predict", -1, -1, 2**31 - 1)
        if n_predict > limits.max_new_tokens:
            raise bad("n_predict", f"n_predict must be <= {limits.max_new_tokens} (server --max-new-tokens); "
                                   f"got {n_predict}")
        seed = body.integer("seed", -1, -1, 2**64 - 1)
        sampling = Sampling(
            max_tokens=max(n_predict, 0),  # -1: the server default
            temperature=body.number("temperature", 0.8),  # llama.cpp's defaults
            top_p=body.number("top_p", 0.95),
            top_k=body.integer("top_k", 40, 0, 2**31 - 1),
            seed=None if seed in (-1, 0xFFFFFFFF) else seed % 2**63,
            stop=body.stops(),
        )
        n_probs = body.integer("n_probs", 0, 0, 20)
        options = EditorOptions(n_indent=body.integer("n_indent", 0, 0, 2**31 - 1),
                                max_time_ms=body.integer("t_max_predict_ms", 0, 0, 2**31 - 1),
                                prefill_only=n_predict == 0, logprobs=n_probs > 0, top_logprobs=n_probs)
        params = apply_editor_options(decode(self, sampling, "n_predict"), options)
        fields = [str(f) for f in body.items("response_fields")]
        reply = LlamaReply(model=self.gateway.runtime.target_info.name, fields=fields, options=options,
                           sampling=sampling, prompt_ids=len(ids))
        return self._generation(request, rpc, ids, params, session, reply, body.flag("stream"))

    # ---- running a generation ------------------------------------------------------------------------------------

    def _generation(self, request: Request, rpc: str, prompt: list[int], params: DecodeParams, session: str,
                    reply: Reply, stream: bool) -> GenerationResponse:
        client = self.gateway.admit(peer_of(request.scope), request.headers.items())
        return GenerationResponse(self, rpc, client, prompt, params, session, reply, stream)


def stream_flags(body: Body) -> tuple[bool, bool]:
    """`stream` and `stream_options.include_usage`."""
    stream = body.flag("stream")
    options = Body(body.data.get("stream_options") or {}, "stream_options")
    return stream, options.flag("include_usage")


def message_text(message: Body) -> str:
    """A message's text: `content` as a string, or a list of text parts."""
    content = message.data.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            piece = Body(part, f"{message.where}.content[{j}]")
            if piece.text("type", "text") != "text":
                raise bad(piece.name("type"), f"{piece.name('type')}: only text parts are supported")
            parts.append(piece.text("text"))
        return "".join(parts)
    raise bad(message.name("content"), f"{message.name('content')} must be a string or a list of text parts")


def infill_ids(api: HttpApi, prefix: str, suffix: str, extra: Sequence[ExtraFile], typed_line: str) -> list[int]:
    """The fill-in-the-middle prompt: the same runtime function as gRPC Infill, and llama.cpp's `prompt` (the
    current line up to the cursor) after the middle token. PENDING: the FIM template module (SPM order, repo name,
    truncation of extra files) replaces this once it lands."""
    rt = api.gateway.runtime
    ids = rt.infill_prompt(prefix, suffix, extra, "")
    return ids + rt.encode_plain(typed_line) if typed_line else ids


def peer_of(scope: Scope) -> str:
    """The client address in gRPC's peer form (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`), so quotas match across edges."""
    client = scope.get("client")
    if not client:
        return "unknown"
    host, port = client[0], client[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


# ---- replies ---------------------------------------------------------------------------------------------------------


class Reply:
    """How one API family shapes a generation's events."""

    def start(self) -> list[dict[str, Any]]:
        """Streamed events before the first chunk."""
        return []

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        """Streamed events for a chunk of text."""
        raise NotImplementedError

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        """The final streamed events, or (not streaming) the one whole reply."""
        raise NotImplementedError

    done_marker = False  # whether the stream ends with `data: [DONE]`


@dataclass
class OpenAIReply(Reply):
    """chat.completion(.chunk) or text_completion."""

    chat: bool
    model: str
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    done_marker = True

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "specrpc", "choices": choices}

    def _choice(self, text: str | None, finish: str | None, stream: bool, role: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if stream:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def start(self) -> list[dict[str, Any]]:
        return [self._envelope([self._choice("", None, True, role=True)], True)] if self.chat else []

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        return [self._envelope([self._choice(text, None, True)], True)] if text else []

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        finish = OPENAI_FINISH.get(done.finish, done.finish)
        if not stream:
            return [{**self._envelope([self._choice(text, finish, False)], False), "usage": usage(done)}]
        events = [self._envelope([self._choice(None if self.chat else "", finish, True)], True)]
        if self.include_usage:
            events.append({**self._envelope([], True), "usage": usage(done)})
        return events


def usage(done: Done) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens found in the session's (or a free slot's) KV cache."""
    s = done.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens}}


@dataclass
class LlamaReply(Reply):
    """llama.cpp's /completion and /infill shape: partial `{content, stop: false}` events, then the final object
    with `stop: true`, `timings`, `tokens_cached`, `truncated`; `response_fields` flattens the final object to the
    listed `a/b` paths, keyed by the path (as llama.cpp's json_get_nested_values does)."""

    model: str
    fields: list[str]
    options: EditorOptions
    sampling: Sampling
    prompt_ids: int
    predicted: int = 0

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        self.predicted += len(chunk.token_ids)
        if self.options.prefill_only or not text:
            return []
        return [{"index": 0, "content": text, "tokens": chunk.token_ids, "stop": False, "id_slot": -1,
                 "tokens_predicted": self.predicted, "tokens_evaluated": self.prompt_ids}]

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        s = done.stats
        predicted = 0 if self.options.prefill_only else s.completion_tokens
        content = "" if self.options.prefill_only else ("" if stream else text)
        started = done.started_at or done.arrival
        first = done.first_token_at or done.at
        prompt_n = s.prompt_tokens - s.cached_prompt_tokens
        prompt_ms = (first - started) * 1e3
        predicted_ms = (done.at - first) * 1e3
        stop_type = LLAMA_STOP_TYPE.get(done.finish) or ("word" if done.stop_sequence else "eos")
        final: dict[str, Any] = {
            "index": 0, "content": content, "tokens": [], "id_slot": -1, "stop": True, "model": self.model,
            "tokens_predicted": predicted, "tokens_evaluated": s.prompt_tokens,
            "generation_settings": {
                "n_predict": self.sampling.max_tokens or -1, "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k, "top_p": self.sampling.top_p, "seed": self.sampling.seed,
                "n_indent": self.options.n_indent, "t_max_predict_ms": self.options.max_time_ms,
                "stop": self.sampling.stop},
            "prompt": "", "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": done.stop_sequence, "tokens_cached": s.prompt_tokens + predicted,
            "timings": {
                "cache_n": s.cached_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                "predicted_per_second": predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            },
        }
        return [flatten(final, self.fields) if self.fields else final]


def flatten(obj: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: each `a/b` path that exists, keyed by the path itself; others left out."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = obj
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


# ---- the response that runs a generation ----------------------------------------------------------------------------


class GenerationResponse(Response):
    """Runs a generation while answering: SSE events as chunks arrive (`stream`), or one JSON object at the end. It
    watches the connection and cancels the generation when the client goes away, so the slot is freed before the next
    engine step. Errors before the first byte is sent are answered in OpenAI's error shape."""

    def __init__(self, api: HttpApi, rpc: str, client: str, prompt: list[int], params: DecodeParams, session: str,
                 reply: Reply, stream: bool) -> None:
        super().__init__(status_code=200)
        self.api = api
        self.rpc = rpc
        self.client = client
        self.prompt = prompt
        self.params = params
        self.session = session
        self.reply = reply
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch_disconnect(receive, gone))
        code = "OK"
        try:
            code = await self._answer(send, gone)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            watcher.cancel()
            gone.set()  # whatever ended this response ends its generation
            self.api.gateway.leave(self.client)
            self.api.gateway.count(self.rpc, code, PROTOCOL)

    async def _answer(self, send: Send, gone: asyncio.Event) -> str:
        events = self.api.gateway.stream(self.prompt, self.params, self.session, self.rpc, gone)
        text: list[str] = []
        started = False
        try:
            async for event in events:
                if isinstance(event, Chunk):
                    text.append(event.text)
                    if self.stream:
                        pieces = ([] if started else self.reply.start()) + self.reply.chunk(event.text, event)
                        if not started:
                            await self._start(send, "text/event-stream", SSE_HEADERS)
                            started = True
                        await self._send_events(send, pieces)
                    else:
                        self.reply.chunk(event.text, event)
                    continue
                final = self.reply.end(event, "".join(text), self.stream)
                if not self.stream:
                    await self._start(send, JSON_TYPE)
                    await send({"type": "http.response.body", "body": json.dumps(final[0]).encode()})
                    return "OK" if event.finish != FINISH_CANCELLED or not gone.is_set() else "CANCELLED"
                if not started:
                    await self._start(send, "text/event-stream", SSE_HEADERS)
                    started = True
                    final = self.reply.start() + final
                await self._send_events(send, final)
                if self.reply.done_marker:
                    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return "CANCELLED" if gone.is_set() and event.finish == FINISH_CANCELLED else "OK"
        except Exception as exc:
            kind = kind_of(exc)
            if kind is INTERNAL:
                log.exception("unhandled error", rpc=self.rpc, protocol=PROTOCOL)
            if not started:
                response = error_response(exc)
                await response(self._scope_stub(), _no_receive, send)
            else:  # headers are gone: report in the stream, as OpenAI does
                await self._send_events(send, [error_body(kind, str(exc))])
                await send({"type": "http.response.body", "body": b""})
            return kind.grpc_code
        finally:
            await events.aclose()
        return "CANCELLED"

    async def _start(self, send: Send, media_type: str, headers: dict[str, str] | None = None) -> None:
        raw = [(b"content-type", media_type.encode())]
        raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw})

    async def _send_events(self, send: Send, events: list[dict[str, Any]]) -> None:
        if events:
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            await send({"type": "http.response.body", "body": body, "more_body": True})

    @staticmethod
    def _scope_stub() -> Scope:
        return {"type": "http"}


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects (the body has been read already, so the next message is that)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


# ---- serving ---------------------------------------------------------------------------------------------------------


class HttpServer:
    """uvicorn serving the API on the running event loop (no signal handlers of its own: `specrpc serve` owns
    SIGTERM and drains both edges)."""

    def __init__(self, config: Config, api: HttpApi) -> None:
        s = config.server
        options: dict[str, Any] = {}
        if s.tls_cert:
            options = {"ssl_certfile": s.tls_cert, "ssl_keyfile": s.tls_key}
            if s.tls_client_ca:
                options |= {"ssl_ca_certs": s.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        self.config = uvicorn.Config(api.app, host=s.host, port=s.http_port, log_config=None, access_log=False,
                                     lifespan="off", timeout_graceful_shutdown=int(s.grace_s) or 1,
                                     h11_max_incomplete_event_size=64 * 1024, **options)
        self.server = uvicorn.Server(self.config)
        self.sockets: list[socket.socket] = []

    async def start(self) -> int:
        """Bind (OSError when the port is taken) and start serving; returns the bound port."""
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        host = self.config.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, self.config.port), family=family)
        try:
            await self.server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        self.sockets = [sock]
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Close the listener and the connections (after the gateway has drained)."""
        self.server.should_exit = True
        await self.server.shutdown(self.sockets)
