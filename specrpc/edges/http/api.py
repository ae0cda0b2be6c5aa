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

import json
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from specrpc.config import Config
from specrpc.edges import validation as validation
from specrpc.edges.auth import TokenAuth, bearer_token
from specrpc.edges.conversation import chat_prompt, reply_stops, tool_format
from specrpc.edges.gateway import Gateway, NotReady, ShuttingDown
from specrpc.edges.history import Message
from specrpc.edges.http.replies import ChoicesReply, LlamaReply, OpenAIReply, Reply, RewriteReply
from specrpc.edges.http.wire import (
    INTERNAL,
    NOT_FOUND,
    PROTOCOL,
    UNAUTHENTICATED,
    Body,
    ErrorKind,
    GenerationResponse,
    HttpError,
    NoDelayProtocol,
    bad,
    error_body,
    error_response,
    kind_of,
    read_json,
    unicode_text,
)
from specrpc.edges.offload import prepared
from specrpc.edges.validation import SESSION_HEADER
from specrpc.engine.constraint import ConstraintSpec
from specrpc.prompts.fim import ExtraFile, InfillInput, Trimmed
from specrpc.prompts.rewrite import RewriteInput
from specrpc.prompts.tools import NO_PARAMETERS, Tool, ToolCall, ToolCallParser, ToolChoice
from specrpc.serving.runtime import DecodeParams

log = structlog.get_logger(__name__)


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


LLAMA_NAMES = {"max_time_ms": "t_max_predict_ms", "logprobs": "n_probs", "top_logprobs": "n_probs",
               "prefill_only": "n_predict 0"}
"""How llama.cpp spells the editor fields, for error messages."""


def apply_editor_options(params: DecodeParams, options: EditorOptions, names: dict[str, str] | None = None
                         ) -> DecodeParams:
    """DecodeParams with the editor options, checked as over gRPC (validation.editor_params). A prefill-only
    request (llama.cpp's `n_predict: 0`) drops the others: llama.vim's cache warm-up sends `t_max_predict_ms` too."""
    if options.prefill_only:
        return validation.editor_params(params, n_indent=0, max_time_ms=0, prefill_only=True, logprobs=False,
                                        top_logprobs=0, max_new_tokens=0, stop_count=0, names=names)
    return validation.editor_params(params, n_indent=options.n_indent, max_time_ms=options.max_time_ms,
                                    prefill_only=False, logprobs=options.logprobs, top_logprobs=options.top_logprobs,
                                    max_new_tokens=0, stop_count=0, names=names)


@dataclass
class Sampling:
    """What both API families give: their sampling and budget fields, defaults applied."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    controls: validation.Controls = field(default_factory=validation.Controls)
    n: int = 1  # choices


def decode(api: HttpApi, s: Sampling, max_tokens_name: str, extra_stops: Sequence[str] = (),
           names: dict[str, str] | None = None) -> DecodeParams:
    """Checked DecodeParams (validation.py: the same checks and limits as gRPC)."""
    sampling = validation.sampling_params(api.config.limits, s.temperature, s.top_p, s.top_k, s.seed, prefix="")
    params = validation.decode_params(api.config, (), s.max_tokens, sampling, [*s.stop, *extra_stops],
                                      max_tokens_name=max_tokens_name)
    return validation.sampling_controls(params, s.controls, api.gateway.runtime.vocab_size, names=names)


LLAMA_SAMPLING_NAMES = {"repetition_penalty": "repeat_penalty", "penalty_last_n": "repeat_last_n"}
"""How llama.cpp spells the sampling controls, for error messages."""


def openai_sampling(body: Body, max_tokens_default: int, limit: int, max_choices: int) -> tuple[Sampling, str]:
    """OpenAI's sampling fields (temperature and top_p default to 1, as OpenAI's do; `n` up to --max-choices;
    vLLM's repetition_penalty, min_p, min_tokens and ignore_eos too) and the budget's field name."""
    name = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    n = body.integer("n", 1, 1, max_choices) if body.has("n") else 1
    if body.has("best_of") and body.integer("best_of", 1, -(2**63), 2**63) != n:
        raise bad("best_of", "best_of must equal n (each choice is returned; none is picked by log-probability)")
    seed = body.integer("seed", 0, -(2**63), 2**64 - 1) if body.has("seed") else None
    controls = validation.Controls(
        presence_penalty=body.number("presence_penalty", 0.0), frequency_penalty=body.number("frequency_penalty", 0.0),
        repetition_penalty=body.number("repetition_penalty", 1.0), logit_bias=body.bias(),
        min_p=body.number("min_p", 0.0), min_tokens=body.integer("min_tokens", 0, 0, 2**31 - 1),
        ignore_eos=body.flag("ignore_eos"), stop_token_ids=body.stop_token_ids())
    return Sampling(
        max_tokens=body.integer(name, max_tokens_default, 1, limit) if body.has(name) else max_tokens_default,
        temperature=body.number("temperature", 1.0),
        top_p=body.number("top_p", 1.0),
        seed=None if seed is None else seed % 2**63,
        stop=body.stops(token_ids=True),
        controls=controls,
        n=n,
    ), name


def openai_editor_options(body: Body, chat: bool) -> EditorOptions:
    """`logprobs` (chat: true/false with `top_logprobs`; completions: an int 0..20)."""
    if chat:
        return EditorOptions(logprobs=body.flag("logprobs"),
                             top_logprobs=body.integer("top_logprobs", 0, 0, 2**31 - 1))
    n = body.integer("logprobs", 0, 0, 2**31 - 1)
    return EditorOptions(logprobs=n > 0 or body.has("logprobs"), top_logprobs=n)


SPECULATIVE = ("speculative.n_max", "speculative.n_min")
"""llama.cpp's per-request speculation fields, in its spelling (a dot inside the key), on every generation route."""
STREAM_INTERVAL = "stream_interval_ms"
"""The per-request stream interval on every generation route, spelled as gRPC's field (no API family has one)."""


def speculative(body: Body, params: DecodeParams, config: Config) -> DecodeParams:
    """llama.cpp's `speculative.n_max` (the most draft tokens a step verifies; 0: target-only, as gRPC's
    num_draft_tokens 0) and `speculative.n_min` (a step whose draft would be shorter decodes plainly), checked
    against the server's --max-draft-tokens (validation.draft_lengths)."""
    most_name, least_name = SPECULATIVE
    most = body.integer(most_name, 0, -(2**63), 2**63) if body.has(most_name) else None
    least = body.integer(least_name, 0, -(2**63), 2**63)
    return validation.draft_lengths(params, config, most, least, SPECULATIVE)


def streamed(body: Body, params: DecodeParams) -> DecodeParams:
    """`stream_interval_ms`, as gRPC's: how often at most a stream's tokens are handed over (0: each step's at once;
    unset: the server's --stream-interval-ms), checked (validation.stream_interval)."""
    value = body.integer(STREAM_INTERVAL, 0, -(2**63), 2**63) if body.has(STREAM_INTERVAL) else None
    return validation.stream_interval(params, value, body.name(STREAM_INTERVAL))


def response_format(body: Body) -> ConstraintSpec | None:
    """OpenAI's `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}` (any JSON object) or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`; unset: free text."""
    if not body.has("response_format"):
        return None
    fmt = Body(body.data["response_format"], "response_format")
    kind = fmt.text("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return validation.constraint("json_object", "", True, fmt.name("type"))
    if kind != "json_schema":
        raise bad(fmt.name("type"), f"{fmt.name('type')} must be text, json_object or json_schema; got {kind!r}")
    spec = Body(fmt.data.get("json_schema"), fmt.name("json_schema"))
    schema = spec.data.get("schema")
    if not isinstance(schema, dict):
        raise bad(spec.name("schema"), f"{spec.name('schema')} must be a JSON Schema object")
    return validation.constraint("json_schema", json.dumps(schema), spec.flag("strict", False), spec.name("schema"))


def llama_constraint(body: Body) -> ConstraintSpec | None:
    """llama.cpp's `json_schema` (an object) or `grammar` (GBNF, or Lark); not both."""
    if body.has("json_schema") and body.has("grammar"):
        raise bad("grammar", "json_schema and grammar are exclusive: send one")
    if body.has("json_schema"):
        schema = body.data["json_schema"]
        if not isinstance(schema, dict):
            raise bad("json_schema", "json_schema must be a JSON Schema object")
        return validation.constraint("json_schema", json.dumps(schema), True, "json_schema")
    if body.has("grammar") and body.text("grammar"):
        return validation.constraint("grammar", body.text("grammar"), True, "grammar")
    return None


def chat_tools(body: Body) -> tuple[tuple[Tool, ...], ToolChoice, bool]:
    """OpenAI's `tools` (functions), `tool_choice` (`auto`, `none`, `required` or `{"type": "function",
    "function": {"name": …}}`; default auto with tools, none without) and `parallel_tool_calls` (default true)."""
    tools = []
    for i, item in enumerate(body.items("tools")):
        tool = Body(item, f"tools[{i}]")
        if tool.text("type", "function") != "function":
            raise bad(tool.name("type"), f"{tool.name('type')} must be function")
        fn = Body(tool.data.get("function"), tool.name("function"))
        parameters = fn.data["parameters"] if fn.has("parameters") else json.loads(NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad(fn.name("parameters"), f"{fn.name('parameters')} must be a JSON Schema object")
        try:
            schema = json.dumps(parameters)
        except (RecursionError, ValueError):
            raise bad(fn.name("parameters"), f"{fn.name('parameters')} is nested too deeply to read") from None
        tools.append(Tool(fn.text("name"), fn.text("description"), schema, fn.flag("strict")))
    choice = ToolChoice("auto" if tools else "none")
    if body.has("tool_choice"):
        value = body.data["tool_choice"]
        if value in ("auto", "none", "required"):
            choice = ToolChoice(value)
        elif isinstance(value, dict):
            named = Body(value, "tool_choice")
            if named.text("type", "function") != "function":
                raise bad("tool_choice.type", "tool_choice.type must be function")
            choice = ToolChoice("function", Body(named.data.get("function"), "tool_choice.function").text("name"))
        else:
            raise bad("tool_choice", 'tool_choice must be "auto", "none", "required" or {"type": "function", '
                                     '"function": {"name": …}}')
    return tuple(tools), choice, body.flag("parallel_tool_calls", True)


def chat_message(message: Body) -> Message:
    """One chat message: its role (`developer` read as system), text, an assistant's `tool_calls` and a tool
    result's `tool_call_id`."""
    role = message.text("role")
    calls = []
    for j, item in enumerate(message.items("tool_calls")):
        call = Body(item, message.name(f"tool_calls[{j}]"))
        fn = Body(call.data.get("function"), call.name("function"))
        arguments = fn.data.get("arguments", "{}")
        calls.append(ToolCall(call.text("id"), fn.text("name"),
                              unicode_text(arguments, fn.name("arguments")) if isinstance(arguments, str)
                              else json.dumps(arguments)))
    return Message("system" if role == "developer" else role, message_text(message), tuple(calls),
                   message.text("tool_call_id"))


# ---- the application -----------------------------------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Run:
    """A generation a route prepared (off the loop when the request is large: offload.py), ready to admit and run."""

    rpc: str
    prompt: list[int]
    params: DecodeParams
    session: str
    reply: Reply
    stream: bool
    n: int = 1


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
            Route("/v1/rewrite", self._endpoint("Rewrite", self.rewrite), methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    @staticmethod
    async def _not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(NOT_FOUND, f"no route {request.url.path}; use /v1/chat/completions, "
                                                  f"/v1/completions, /v1/models, /v1/rewrite, /infill, /completion "
                                                  f"or /health"),
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
        return self._generation(request, await prepared(lambda: self._chat(request, body), body.size))

    def _chat(self, request: Request, body: Body) -> Run:
        session = self._session(request, body, use_user=True)
        messages = [chat_message(Body(item, f"messages[{i}]")) for i, item in enumerate(body.items("messages"))]
        if not messages:
            raise bad("messages", "messages must be a non-empty list of {role, content}")
        sampling, budget = openai_sampling(body, self.config.limits.default_max_new_tokens,
                                           self.config.limits.max_new_tokens, self.config.limits.max_choices)
        options = openai_editor_options(body, chat=True)
        rt = self.gateway.runtime
        tools, choice, parallel = chat_tools(body)
        fmt = tool_format(rt)
        calls = validation.tool_constraint(tools, choice, parallel, fmt)
        if calls is not None and sampling.n > 1:
            raise bad("n", "n above 1 with tools (tool_choice other than none) is not served: send n = 1, or "
                           "set tool_choice to none")
        if calls is not None and body.has("response_format") and response_format(body) is not None:
            raise bad("response_format", "response_format and tools (with tool_choice other than none) are "
                                         "exclusive: send one, or set tool_choice to none")
        prompt = chat_prompt(self.gateway, messages, tools)
        params = apply_editor_options(decode(self, sampling, budget, reply_stops(rt)), options)
        params = streamed(body, speculative(body, replace(params, constraint=calls or response_format(body),
                                                          shown_tokens=fmt.shown if calls else frozenset()),
                                            self.config))
        params = validation.prediction(params, prediction_text(body), rt.encode_plain, rt.context_limit)
        stream, usage = stream_flags(body)
        reply = OpenAIReply(chat=True, model=rt.target_info.name, include_usage=usage, text=rt.token_text,
                            tools=ToolCallParser(fmt) if calls is not None else None)
        return Run("ChatCompletions", prompt, params, session, reply, stream, sampling.n)

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.config.limits.max_message_bytes)
        return self._generation(request, await prepared(lambda: self._completions(request, body), body.size))

    def _completions(self, request: Request, body: Body) -> Run:
        session = self._session(request, body, use_user=True)
        prompt_field = body.data.get("prompt")
        if isinstance(prompt_field, list) and len(prompt_field) == 1 and isinstance(prompt_field[0], str):
            prompt_field = prompt_field[0]
        rt = self.gateway.runtime
        if isinstance(prompt_field, str):
            text = unicode_text(prompt_field, "prompt")
        else:
            raise bad("prompt", "prompt must be a string (or a list of one string)")
        sampling, budget = openai_sampling(body, 16, self.config.limits.max_new_tokens,  # OpenAI's default: 16
                                           self.config.limits.max_choices)
        options = openai_editor_options(body, chat=False)
        params = streamed(body, speculative(body, replace(apply_editor_options(decode(self, sampling, budget), options),
                                                          constraint=response_format(body)), self.config))
        params = validation.prediction(params, prediction_text(body), rt.encode_plain, rt.context_limit)
        if body.has("suffix"):  # fill-in-the-middle, as gRPC Infill: the model family's template
            fim = rt.infill_prompt(InfillInput(prefix=text, suffix=body.text("suffix")))
            ids, params = fim.ids, replace(params, stop_token_ids=params.stop_token_ids | fim.stop_ids)
        else:
            ids = validation.fit_prompt(rt.encode(text), rt.context_limit, self.config.limits, truncate=False,
                                        too_long="send a shorter prompt", empty="set prompt")
        stream, usage = stream_flags(body)
        reply = OpenAIReply(chat=False, model=rt.target_info.name, include_usage=usage, text=rt.token_text)
        return Run("Completions", ids, params, session, reply, stream, sampling.n)

    # ---- next-edit rewrites ----------------------------------------------------------------------------------------

    async def rewrite(self, request: Request) -> Response:
        """gRPC Rewrite over HTTP: `path`, `text`, `region_start`, `region_end`, `cursor` (characters),
        `recent_edits` (unified diffs, oldest first), `max_tokens`, `temperature` (default 0: greedy), `top_p`,
        `seed`, `stream`; the region is the prediction (docs/editors.md)."""
        body = await read_json(request, self.config.limits.max_message_bytes)
        return self._generation(request, await prepared(lambda: self._rewrite(request, body), body.size))

    def _rewrite(self, request: Request, body: Body) -> Run:
        session = self._session(request, body, use_user=False)
        rt, limits = self.gateway.runtime, self.config.limits
        edits = body.items("recent_edits")
        bad_edit = next((i for i, edit in enumerate(edits) if not isinstance(edit, str)), None)
        if bad_edit is not None:
            raise bad(f"recent_edits[{bad_edit}]", f"recent_edits[{bad_edit}] must be a string (a unified diff)")
        start, end, cursor = (body.integer(key, 0, 0, 2**31 - 1) for key in ("region_start", "region_end", "cursor"))
        ids, framed = rt.rewrite_prompt(RewriteInput(body.text("path"), body.text("text"), start, end, cursor,
                                                     tuple(edits)))
        ids = validation.fit_prompt(ids, rt.context_limit, limits, truncate=False,
                                    too_long="send a shorter file, region or fewer edits", empty="set text")
        seed = body.integer("seed", 0, 0, 2**64 - 1) if body.has("seed") else None
        sampling = Sampling(max_tokens=body.integer("max_tokens", 0, 0, limits.max_new_tokens),
                            temperature=body.number("temperature", 0.0), top_p=body.number("top_p", 1.0),
                            seed=None if seed is None else seed % 2**63)
        params = validation.prediction(decode(self, sampling, "max_tokens"), framed.prediction, rt.encode_plain,
                                       rt.context_limit)
        params = replace(params, stop=(framed.stop,))
        return Run("Rewrite", ids, params, session, RewriteReply(framed.region), body.flag("stream"))

    # ---- llama.cpp -------------------------------------------------------------------------------------------------

    async def llama_infill(self, request: Request) -> Response:
        """llama.cpp's /infill, as llama.vim and llama.vscode call it."""
        body = await read_json(request, self.config.limits.max_message_bytes)
        return self._generation(request, await prepared(lambda: self._llama_infill(request, body), body.size))

    def _llama_infill(self, request: Request, body: Body) -> Run:
        session = self._session(request, body, use_user=False)
        rt = self.gateway.runtime
        extra_items = body.items("input_extra")
        validation.extra_files(len(extra_items), self.config.limits, "input_extra")
        extra = []
        for i, item in enumerate(extra_items):
            chunk = Body(item, f"input_extra[{i}]")
            extra.append(ExtraFile(chunk.text("filename"), chunk.text("text")))
        params, reply = self._llama_params(body)
        # llama.cpp's `prompt` is the current line up to the cursor; like llama.cpp, trim the context to fit
        infill = InfillInput(prefix=body.text("input_prefix"), suffix=body.text("input_suffix"), extra=tuple(extra),
                             typed_line=body.text("prompt"))
        fim = rt.infill_prompt(infill, truncate=True, max_new_tokens=params.max_new_tokens)
        reply.prompt_ids, reply.truncated = len(fim.ids), fim.trimmed != Trimmed()
        params = replace(params, stop_token_ids=params.stop_token_ids | fim.stop_ids)
        return Run("LlamaInfill", fim.ids, params, session, reply, body.flag("stream"))

    async def llama_completion(self, request: Request) -> Response:
        """llama.cpp's /completion: a plain prompt, the same reply shape as /infill."""
        body = await read_json(request, self.config.limits.max_message_bytes)
        return self._generation(request, await prepared(lambda: self._llama_completion(request, body), body.size))

    def _llama_completion(self, request: Request, body: Body) -> Run:
        session = self._session(request, body, use_user=False)
        rt = self.gateway.runtime
        ids = validation.fit_prompt(rt.encode(body.text("prompt")), rt.context_limit, self.config.limits,
                                    truncate=False, too_long="send a shorter prompt", empty="set prompt")
        params, reply = self._llama_params(body)
        reply.prompt_ids = len(ids)
        return Run("LlamaCompletion", ids, params, session, reply, body.flag("stream"))

    def _llama_params(self, body: Body) -> tuple[DecodeParams, LlamaReply]:
        """llama.cpp's generation fields (its defaults where absent), and the reply they shape."""
        limits = self.config.limits
        n_predict = body.integer("n_predict", -1, -1, 2**31 - 1)
        if n_predict > limits.max_new_tokens:
            raise bad("n_predict", f"n_predict must be <= {limits.max_new_tokens} (server --max-new-tokens); "
                                   f"got {n_predict}")
        seed = body.integer("seed", -1, -1, 2**64 - 1)
        last_n = body.integer("repeat_last_n", 64, -1, 2**31 - 1)  # llama.cpp's default window: 64 tokens
        penalties = last_n != 0  # llama.cpp: a window of 0 turns the penalties off
        controls = validation.Controls(
            repetition_penalty=body.number("repeat_penalty", 1.0) if penalties else 1.0,
            presence_penalty=body.number("presence_penalty", 0.0) if penalties else 0.0,
            frequency_penalty=body.number("frequency_penalty", 0.0) if penalties else 0.0,
            penalty_last_n=last_n, min_p=body.number("min_p", 0.0), min_keep=body.integer("min_keep", 0, 0, 2**31 - 1),
            ignore_eos=body.flag("ignore_eos"))
        sampling = Sampling(
            max_tokens=max(n_predict, 0),  # -1: the server default
            temperature=body.number("temperature", 0.8),  # llama.cpp's defaults
            top_p=body.number("top_p", 0.95),
            top_k=body.integer("top_k", 40, 0, 2**31 - 1),
            seed=None if seed in (-1, 0xFFFFFFFF) else seed % 2**63,
            stop=body.stops(),
            controls=controls,
        )
        n_probs = body.integer("n_probs", 0, 0, 2**31 - 1)
        options = EditorOptions(n_indent=body.integer("n_indent", 0, 0, 2**31 - 1),
                                max_time_ms=body.integer("t_max_predict_ms", 0, 0, 2**31 - 1),
                                prefill_only=n_predict == 0, logprobs=n_probs > 0, top_logprobs=n_probs)
        params = replace(apply_editor_options(decode(self, sampling, "n_predict", names=LLAMA_SAMPLING_NAMES), options,
                                              LLAMA_NAMES), constraint=llama_constraint(body))
        params = streamed(body, speculative(body, params, self.config))
        fields = [str(f) for f in body.items("response_fields")]
        settings = {"n_predict": n_predict, "temperature": sampling.temperature, "top_k": sampling.top_k,
                    "top_p": sampling.top_p, "seed": sampling.seed, "n_indent": options.n_indent,
                    "t_max_predict_ms": options.max_time_ms, "stop": sampling.stop,
                    "repeat_penalty": controls.repetition_penalty, "repeat_last_n": last_n,
                    "presence_penalty": controls.presence_penalty, "frequency_penalty": controls.frequency_penalty,
                    "min_p": controls.min_p, "min_keep": controls.min_keep, "ignore_eos": controls.ignore_eos,
                    "speculative.n_max": self.config.engine.max_draft_tokens if params.max_draft_tokens is None
                    else params.max_draft_tokens, "speculative.n_min": params.min_draft_tokens}
        reply = LlamaReply(model=self.gateway.runtime.target_info.name, fields=fields,
                           prefill_only=options.prefill_only, settings=settings, prompt_ids=0,
                           text=self.gateway.runtime.token_text)
        return params, reply

    # ---- running a generation ------------------------------------------------------------------------------------

    def _generation(self, request: Request, run: Run) -> GenerationResponse:
        """The response running the generation (`n` choices of an OpenAI reply when n > 1), on the loop: admission
        counts streams."""
        choices = ChoicesReply.of(run.reply, run.n) if run.n > 1 and isinstance(run.reply, OpenAIReply) else None
        client = self.gateway.admit(peer_of(request.scope), request.headers.items())
        scope = self.gateway.draft_scope(request.headers.items(), run.session)
        return GenerationResponse(self.gateway, run.rpc, client, run.prompt, run.params, run.session, run.reply,
                                  run.stream, scope, choices)


def stream_flags(body: Body) -> tuple[bool, bool]:
    """`stream` and `stream_options.include_usage`."""
    stream = body.flag("stream")
    options = Body(body.data.get("stream_options") or {}, "stream_options")
    return stream, options.flag("include_usage")


def prediction_text(body: Body) -> str:
    """OpenAI's Predicted Outputs: `prediction` {"type": "content", "content": a string or a list of text parts};
    '' when absent."""
    if not body.has("prediction"):
        return ""
    prediction = Body(body.data["prediction"], "prediction")
    kind = prediction.text("type")
    if kind != "content":
        raise bad("prediction.type", f'prediction.type must be "content" (the one kind of prediction); got {kind!r}')
    if not prediction.has("content"):
        raise bad("prediction.content", "prediction.content is required: the output you predict, a string or a "
                                        "list of text parts")
    return message_text(prediction)


def message_text(message: Body) -> str:
    """A message's text: `content` as a string, or a list of text parts."""
    content = message.data.get("content")
    if content is None or isinstance(content, str):
        return unicode_text(content, message.name("content")) if content else ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            piece = Body(part, f"{message.where}.content[{j}]")
            if piece.text("type", "text") != "text":
                raise bad(piece.name("type"), f"{piece.name('type')}: only text parts are supported")
            parts.append(piece.text("text"))
        return "".join(parts)
    raise bad(message.name("content"), f"{message.name('content')} must be a string or a list of text parts")


def peer_of(scope: Scope) -> str:
    """The client address in gRPC's peer form (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`), so quotas match across edges."""
    client = scope.get("client")
    if not client:
        return "unknown"
    host, port = client[0], client[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


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
                                     http=NoDelayProtocol, h11_max_incomplete_event_size=64 * 1024, **options)
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
