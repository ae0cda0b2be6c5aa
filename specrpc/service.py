"""The gRPC edge: proto ⇄ domain types, request validation and status codes. Nothing else lives here."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import structlog
import torch

from specrpc.auth import StreamQuota, TooManyStreams, metadata_values
from specrpc.config import Config, parse_networks
from specrpc.engine import FINISH_LENGTH, FINISH_STOP, MAX_TOP_LOGPROBS
from specrpc.metrics import Metrics
from specrpc.runtime import CheckpointInfo, DecodeParams, ExtraFile, NoInfillSupport, Runtime
from specrpc.sampling import SamplingParams
from specrpc.scheduler import FINISH_CANCELLED, Chunk, Done, Failed
from specrpc.sessions import SlotsExhausted, UnknownSession
from specrpc.text import FINISH_INDENT, FINISH_TIME_LIMIT, PhraseSegmenter
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc
from specrpc.wire import MalformedRequest

log = structlog.get_logger(__name__)

FINISH = {
    FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
    FINISH_STOP: pb.FINISH_REASON_STOP,
    FINISH_CANCELLED: pb.FINISH_REASON_CANCELLED,
    FINISH_INDENT: pb.FINISH_REASON_INDENT,
    FINISH_TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
}
PROPOSERS = {
    pb.PROPOSER_UNSPECIFIED: None,
    pb.PROPOSER_DRAFT_MODEL: "draft",
    pb.PROPOSER_PROMPT_LOOKUP: "lookup",
    pb.PROPOSER_COMBINED: "combined",
}
MAX_SESSION_ID = 128
MAX_N_INDENT = 1024  # characters of indentation; deeper is no editor's indentation
MAX_TIME_MS = 600_000  # ten minutes: a longer budget for one completion is a mistake, not a wish
SESSION_HEADER = "x-session-id"  # request metadata that load balancers hash on (deploy/README.md)


class InvalidRequest(ValueError):
    """A request the client must change: INVALID_ARGUMENT with this message."""


class EngineFailure(RuntimeError):
    """The engine raised while serving this stream: INTERNAL for this stream only."""


class DeviceOutOfMemory(RuntimeError):
    """The device ran out of memory while serving this stream: RESOURCE_EXHAUSTED for this stream only."""


class NotReady(RuntimeError):
    """The models are still loading or warming up: UNAVAILABLE (retry once health reports SERVING)."""


class ShuttingDown(RuntimeError):
    """The server is draining: UNAVAILABLE (retry elsewhere)."""


ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (MalformedRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownSession, grpc.StatusCode.INVALID_ARGUMENT),
    (SlotsExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManyStreams, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeviceOutOfMemory, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoInfillSupport, grpc.StatusCode.FAILED_PRECONDITION),
    (EngineFailure, grpc.StatusCode.INTERNAL),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
]

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation failure: torch's OutOfMemoryError (CUDA and others) or the CPU allocator's error."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code a domain exception maps to (None: not ours, let it be UNKNOWN/INTERNAL)."""
    for kind, code in ERROR_CODES:
        if isinstance(exc, kind):
            return code
    return None


def stream_errors(
    rpc: str,
) -> Callable[[Callable[..., AsyncIterator[T]]], Callable[..., AsyncIterator[T]]]:
    """One place that maps exceptions of a server-streaming handler to status codes and counts requests."""

    def wrap(handler: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
        @functools.wraps(handler)
        async def run(self: GeneratorService, request: Any, context: Context) -> AsyncIterator[T]:
            try:
                client = self._enter(context)
            except Exception as exc:
                refused = status_for(exc) or grpc.StatusCode.INTERNAL
                self.metrics.requests.labels(rpc, refused.name).inc()
                await context.abort(refused, str(exc))
            end = StreamEnd()
            # the bookkeeping runs when gRPC ends the call, not when this generator is closed: a client that goes
            # away while a response is being written leaves the generator suspended until it is garbage-collected
            on_end(context, functools.partial(self._ended, rpc, client, end))
            try:
                async for item in handler(self, request, context):
                    yield item
                end.finished = True
            except asyncio.CancelledError:
                end.code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                mapped = status_for(exc)
                if mapped is None:
                    log.exception("unhandled error", rpc=rpc)
                    mapped = grpc.StatusCode.INTERNAL
                end.code = mapped
                await context.abort(mapped, str(exc))

        return run

    return wrap


@dataclass
class StreamEnd:
    """How a stream ended, as far as its handler knows (OK and not finished: the client went away)."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    finished: bool = False


def session_header(context: Context) -> str:
    """The `x-session-id` request metadata ('' when absent)."""
    values = metadata_values(context.invocation_metadata(), SESSION_HEADER)
    return values[0] if values else ""


def rpc_gone(context: Context) -> asyncio.Event:
    """An event set as soon as gRPC ends the call (client cancel, disconnect, deadline, or the end of the stream),
    to cancel the work the call started without waiting for its generator to be closed."""
    gone = asyncio.Event()
    on_end(context, lambda _context: gone.set())
    return gone


def on_end(context: Context, callback: Callable[[Context], None]) -> None:
    """Call `callback(context)` once gRPC has ended the call, however it ended."""
    context.add_done_callback(callback)  # type: ignore[arg-type]  # grpc-stubs types it as a generic class


def unary_errors(rpc: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """Same as stream_errors for unary handlers."""

    def wrap(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(handler)
        async def run(self: GeneratorService, request: Any, context: Context) -> T:
            code = grpc.StatusCode.OK
            try:
                return await handler(self, request, context)
            except Exception as exc:
                mapped = status_for(exc)
                if mapped is None:
                    log.exception("unhandled error", rpc=rpc)
                code = mapped or grpc.StatusCode.INTERNAL
                await context.abort(code, str(exc))
                raise  # unreachable: abort raises
            finally:
                self.metrics.requests.labels(rpc, code.name).inc()

        return run

    return wrap


class GeneratorService(pb_grpc.GeneratorServicer):
    """specrpc.v1.Generator."""

    def __init__(self, config: Config, metrics: Metrics, runtime: Runtime | None = None) -> None:
        self._runtime = runtime
        self.config = config
        self.limits = config.limits
        self.metrics = metrics
        self._streams = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self.quota = StreamQuota(self.limits.max_streams_per_client, by_token=bool(config.server.auth_tokens_file),
                                 trusted=parse_networks(config.server.trusted_proxies))

    def _enter(self, context: Context) -> str:
        """Admit a Generate/Infill/Converse stream; returns the client it counts against."""
        if self._draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        client = self.quota.client_id(context.peer(), context.invocation_metadata())
        self.quota.acquire(client)
        self._streams += 1
        self._idle.clear()
        return client

    def _leave(self, client: str) -> None:
        self.quota.release(client)
        self._streams -= 1
        if not self._streams:
            self._idle.set()

    def _ended(self, rpc: str, client: str, end: StreamEnd, context: Context) -> None:
        """gRPC has ended a Generate/Infill/Converse call: uncount it and count its final status."""
        self._leave(client)
        code = end.code if end.code != grpc.StatusCode.OK or end.finished else grpc.StatusCode.CANCELLED
        self.metrics.requests.labels(rpc, code.name).inc()

    def refuse_new_streams(self) -> None:
        """From now on new Generate/Infill/Converse calls end UNAVAILABLE at once (the server is draining)."""
        self._draining = True

    async def drained(self) -> None:
        """Return once no Generate/Infill/Converse stream is in flight."""
        await self._idle.wait()

    def attach(self, runtime: Runtime) -> None:
        """Start serving with `runtime` (loaded and warm); until then every call is UNAVAILABLE."""
        self._runtime = runtime

    @property
    def runtime(self) -> Runtime:
        """The loaded runtime, or NotReady while the server starts."""
        if self._runtime is None:
            raise NotReady("the server is starting: models are loading or warming up; retry when the health "
                           "service reports SERVING")
        return self._runtime

    # ---- validation --------------------------------------------------------------------------------------------

    def _sampling(self, msg: pb.SamplingParams | None) -> SamplingParams:
        if msg is None:
            return SamplingParams(temperature=0.0)
        t, p, k = msg.temperature, msg.top_p, msg.top_k
        if not math.isfinite(t) or t < 0 or t > self.limits.max_temperature:
            raise InvalidRequest(f"sampling.temperature must be in [0, {self.limits.max_temperature}] "
                                 f"(0 = greedy; server --max-temperature); got {t}")
        if not math.isfinite(p) or p < 0 or p > 1:
            raise InvalidRequest(f"sampling.top_p must be in (0, 1] (0 or 1 = off); got {p}")
        if k < 0:
            raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = off); got {k}")
        seed = msg.seed if msg.HasField("seed") else None
        return SamplingParams(temperature=float(t), top_p=1.0 if p in (0.0, 1.0) else float(p), top_k=int(k),
                              seed=seed)

    def _decode_params(self, max_new_tokens: int, sampling: pb.SamplingParams | None, stop: list[str],
                       speculation: pb.SpeculationParams | None) -> DecodeParams:
        lim = self.limits
        if max_new_tokens > lim.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens must be <= {lim.max_new_tokens} (server --max-new-tokens); "
                                 f"got {max_new_tokens}")
        if len(stop) > lim.max_stop_strings:
            raise InvalidRequest(f"stop: at most {lim.max_stop_strings} stop strings allowed (--max-stop-strings); "
                                 f"got {len(stop)}")
        for i, s in enumerate(stop):
            if not s:
                raise InvalidRequest(f"stop[{i}] is empty: stop strings must be non-empty; remove it")
            if len(s) > lim.max_stop_chars:
                raise InvalidRequest(f"stop[{i}] has {len(s)} characters; stop strings must be at most "
                                     f"{lim.max_stop_chars} (--max-stop-chars)")
        num_draft: int | None = None
        proposer: str | None = None
        if speculation is not None:
            if speculation.HasField("num_draft_tokens"):
                num_draft = speculation.num_draft_tokens
                cap = self.config.engine.max_draft_tokens
                if num_draft > cap:
                    raise InvalidRequest(f"speculation.num_draft_tokens must be <= {cap} (server "
                                         f"--max-draft-tokens); got {num_draft}")
            if speculation.proposer not in PROPOSERS:
                raise InvalidRequest(f"speculation.proposer {speculation.proposer} is not a Proposer value; use "
                                     f"PROPOSER_DRAFT_MODEL, PROPOSER_PROMPT_LOOKUP or PROPOSER_COMBINED")
            proposer = PROPOSERS[speculation.proposer]
            if proposer is not None and proposer not in self.runtime.engine.proposers:
                raise InvalidRequest(f"speculation.proposer {proposer!r} needs a draft model, and this server runs "
                                     f"without one; use PROPOSER_PROMPT_LOOKUP or leave it unspecified")
        return DecodeParams(
            max_new_tokens=max_new_tokens or lim.default_max_new_tokens,
            sampling=self._sampling(sampling),
            stop=tuple(stop),
            num_draft_tokens=num_draft,
            proposer=proposer,
        )

    def _editor_params(self, request: pb.GenerateRequest | pb.InfillRequest, params: DecodeParams) -> DecodeParams:
        """`params` with the editor fields of a Generate or Infill request (n_indent, max_time_ms, prefill_only,
        logprobs, top_logprobs), validated."""
        n_indent, max_time_ms, top = request.n_indent, request.max_time_ms, request.top_logprobs
        if not 0 <= n_indent <= MAX_N_INDENT:
            raise InvalidRequest(f"n_indent must be in 0..{MAX_N_INDENT} (the indentation, in characters, a new line "
                                 f"needs to go on; 0 = off); got {n_indent}")
        if not 0 <= max_time_ms <= MAX_TIME_MS:
            raise InvalidRequest(f"max_time_ms must be in 0..{MAX_TIME_MS} (milliseconds from the first token, "
                                 f"ended at the next newline; 0 = no budget); got {max_time_ms}")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token); got {top}")
        if top and not request.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: set logprobs = true, or leave top_logprobs 0")
        if request.prefill_only:
            wanted = [name for name, value in (("max_new_tokens", request.max_new_tokens), ("stop", len(request.stop)),
                                               ("n_indent", n_indent), ("max_time_ms", max_time_ms),
                                               ("logprobs", request.logprobs)) if value]
            if wanted:
                raise InvalidRequest(f"prefill_only generates nothing, so {', '.join(wanted)} cannot apply: leave "
                                     f"{'it' if len(wanted) == 1 else 'them'} unset, or set prefill_only = false")
        return replace(params, n_indent=n_indent, max_time_ms=max_time_ms, prefill_only=request.prefill_only,
                       logprobs=request.logprobs, top_logprobs=top)

    def _check_session_id(self, session_id: str, name: str = "session_id", header: str = "") -> str:
        """The request's session id: the field, or the `x-session-id` metadata when the field is empty. Both set
        and different is refused: a load balancer routes by the header and this server caches by the id."""
        if header and session_id and header != session_id:
            raise InvalidRequest(f"{name} {session_id[:MAX_SESSION_ID]!r} differs from the {SESSION_HEADER} "
                                 f"metadata {header[:MAX_SESSION_ID]!r}: send the same id in both (or only one)")
        session_id = session_id or header
        if len(session_id) > MAX_SESSION_ID or not session_id.isprintable():
            raise InvalidRequest(f"{name} must be at most {MAX_SESSION_ID} printable characters; got "
                                 f"{len(session_id)} characters")
        return session_id

    def _fit_prompt(self, ids: list[int], truncate: bool, too_long: str = "shorten it or set truncate_prompt"
                    ) -> list[int]:
        if not ids:
            raise InvalidRequest("the prompt is empty: set prompt or prompt_token_ids")
        room = self.runtime.context_limit - 1
        cap = min(room, self.limits.max_prompt_tokens or room)
        if len(ids) > cap:
            if not truncate:
                raise InvalidRequest(f"the prompt has {len(ids)} tokens but at most {cap} fit (context "
                                     f"{self.runtime.context_limit}, --max-prompt-tokens); {too_long}")
            ids = ids[-cap:]
        return ids

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        if request.prompt:
            ids = self.runtime.file_prompt(request.path, request.prompt)
        else:
            ids = list(request.prompt_token_ids)
            vocab = self.runtime.vocab_size
            bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(f"prompt_token_ids[{bad}] is {ids[bad]}, outside the vocabulary "
                                     f"(0..{vocab - 1})")
        return self._fit_prompt(ids, request.truncate_prompt)

    # ---- streaming -----------------------------------------------------------------------------------------------

    async def _stream(self, prompt: list[int], params: DecodeParams, session_id: str, rpc: str,
                      cancel: asyncio.Event | None = None) -> AsyncIterator[Chunk | Done]:
        """Run one generation and yield its chunks and final Done (accounted in `_account`, even when the client
        goes away before reading it)."""
        last = 0.0
        account = functools.partial(self._account, rpc, session_id)
        async for event in self.runtime.generate(prompt, params, session_id, cancel, account):
            if isinstance(event, Failed):
                if is_out_of_memory(event.error):
                    raise DeviceOutOfMemory(f"the device ran out of memory on this stream ({event.error}); retry "
                                            f"later, with a shorter prompt or fewer tokens") from event.error
                raise EngineFailure(f"the engine failed on this stream: {type(event.error).__name__}: "
                                    f"{event.error}") from event.error
            if isinstance(event, Chunk) and event.token_ids:
                if last:
                    self.metrics.inter_token.observe((event.at - last) / len(event.token_ids))
                last = event.at
            yield event

    def _account(self, rpc: str, session_id: str, done: Done) -> None:
        """Counters, the TTFT histogram and one log line for a finished generation."""
        s = done.stats
        m = self.metrics
        m.prompt_tokens.inc(s.prompt_tokens)
        m.cached_prompt_tokens.inc(s.cached_prompt_tokens)
        m.completion_tokens.inc(s.completion_tokens)
        m.draft_proposed.inc(s.proposed)
        m.draft_accepted.inc(s.accepted)
        m.verify_steps.inc(s.verify_steps)
        if done.first_token_at is not None:
            m.ttft.observe(done.first_token_at - done.arrival)
        fields: dict[str, object] = {
            "rpc": rpc, "session": session_id, "finish": done.finish,
            "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_prompt_tokens,
            "completion_tokens": s.completion_tokens, "proposed": s.proposed, "accepted": s.accepted,
            "verify_steps": s.verify_steps, "mean_accepted_length": round(s.mean_accepted_length, 3),
            "ttft_ms": round(((done.first_token_at or done.at) - done.arrival) * 1e3, 2),
            "total_ms": round((done.at - done.arrival) * 1e3, 2),
        }
        if self.config.server.log_prompts:
            fields["output"] = done.text
        log.info("request", **fields)

    def _summary(self, done: Done, session_id: str) -> pb.GenerationSummary:
        s = done.stats
        first = done.first_token_at
        return pb.GenerationSummary(
            finish_reason=FINISH[done.finish],
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            cached_prompt_tokens=s.cached_prompt_tokens,
            speculation=pb.SpeculationStats(
                draft_tokens_proposed=s.proposed,
                draft_tokens_accepted=s.accepted,
                verify_steps=s.verify_steps,
                mean_accepted_length=s.mean_accepted_length,
                num_draft_tokens=s.last_k,
                acceptance_rate=s.acceptance_rate,
            ),
            timing=pb.Timing(
                ttft_ms=((first or done.at) - done.arrival) * 1e3,
                total_ms=(done.at - done.arrival) * 1e3,
                queue_ms=((done.started_at or done.at) - done.arrival) * 1e3,
            ),
            session_id=session_id,
            stop_sequence=done.stop_sequence,
            tokens_cached=s.tokens_cached,
            suggestion_tokens_accepted=s.suggestion_accepted,
        )

    def _chunk(self, chunk: Chunk) -> pb.TokenChunk:
        """TokenChunk of a Chunk, with its tokens' log-probabilities when the request asked for them."""
        msg = pb.TokenChunk(text=chunk.text, token_ids=chunk.token_ids, accepted_draft_tokens=chunk.accepted)
        if chunk.logprobs:
            text = self.runtime.token_text
            msg.logprobs.extend(
                pb.TokenLogprob(token_id=lp.token_id, text=text(lp.token_id), logprob=lp.logprob,
                                top_logprobs=[pb.TokenAlternative(token_id=a.token_id, text=text(a.token_id),
                                                                  logprob=a.logprob) for a in lp.top])
                for lp in chunk.logprobs)
        return msg

    async def _generate_responses(self, prompt: list[int], params: DecodeParams, session_id: str,
                                  rpc: str, context: Context) -> AsyncIterator[pb.GenerateResponse]:
        async for event in self._stream(prompt, params, session_id, rpc, rpc_gone(context)):
            if isinstance(event, Chunk):
                yield pb.GenerateResponse(chunk=self._chunk(event))
            else:
                yield pb.GenerateResponse(summary=self._summary(event, session_id))

    @stream_errors("Generate")
    async def Generate(self, request: pb.GenerateRequest,
                       context: Context) -> AsyncIterator[pb.GenerateResponse]:
        session_id = self._check_session_id(request.session_id, header=session_header(context))
        params = self._editor_params(request, self._decode_params(
            request.max_new_tokens, request.sampling if request.HasField("sampling") else None, list(request.stop),
            request.speculation if request.HasField("speculation") else None))
        prompt = self._prompt_ids(request)
        async for response in self._generate_responses(prompt, params, session_id, "Generate", context):
            yield response

    @stream_errors("Infill")
    async def Infill(self, request: pb.InfillRequest,
                     context: Context) -> AsyncIterator[pb.GenerateResponse]:
        session_id = self._check_session_id(request.session_id, header=session_header(context))
        if len(request.extra) > self.limits.max_extra_files:
            raise InvalidRequest(f"extra: at most {self.limits.max_extra_files} extra files allowed "
                                 f"(--max-extra-files); got {len(request.extra)}")
        params = self._editor_params(request, self._decode_params(
            request.max_new_tokens, request.sampling if request.HasField("sampling") else None, list(request.stop),
            request.speculation if request.HasField("speculation") else None))
        extra = [ExtraFile(f.path, f.text) for f in request.extra]
        prompt = self.runtime.infill_prompt(request.prefix, request.suffix, extra, request.path)
        prompt = self._fit_prompt(prompt, truncate=False, too_long="send fewer or shorter extra files, or a "
                                  "shorter prefix and suffix")
        async for response in self._generate_responses(prompt, params, session_id, "Infill", context):
            yield response

    @unary_errors("GetModelInfo")
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: Context) -> pb.ModelInfo:
        return self.model_info()

    def model_info(self) -> pb.ModelInfo:
        """Static description plus live slot usage."""
        rt = self.runtime
        ec = self.config.engine
        info = pb.ModelInfo(
            target=describe(rt.target_info),
            device=str(rt.device),
            dtype=str(rt.dtype).removeprefix("torch."),
            max_context=ec.max_context,
            speculation_policy=pb.SpeculationPolicy(
                mode=ec.speculation, max_draft_tokens=ec.max_draft_tokens,
                proposer={v: k for k, v in PROPOSERS.items()}.get(rt.engine.default_proposer,
                                                                   pb.PROPOSER_UNSPECIFIED),
            ),
            kv_slots_total=rt.registry.total,
            kv_slots_in_use=rt.registry.in_use,
            kv_cache_bytes=rt.target.cache_bytes() + (rt.draft.cache_bytes() if rt.draft else 0),
            supports_infill=rt.fim_ids is not None,
            tokenizer_vocab_size=len(rt.tokenizer),
        )
        if rt.draft_info is not None:
            info.draft.CopyFrom(describe(rt.draft_info))
        return info

    # ---- Converse ------------------------------------------------------------------------------------------------

    @stream_errors("Converse")
    async def Converse(self, request_iterator: AsyncIterator[pb.ConverseRequest],
                       context: Context) -> AsyncIterator[pb.ConverseResponse]:
        conversation = Conversation(self, self.runtime, session_header(context))
        on_end(context, lambda _context: conversation.abandon())
        try:
            async for response in conversation.run(request_iterator):
                yield response
        finally:
            await conversation.close()


def describe(info: CheckpointInfo) -> pb.ModelDescription:
    """ModelDescription of a loaded checkpoint."""
    return pb.ModelDescription(
        name=info.name,
        architecture=info.architecture,
        parameters=info.parameters,
        vocab_size=info.vocab_size,
        weight_bytes=info.weight_bytes,
        context_length=info.context_length,
        lean_forward=info.lean,
    )


ROLE_NAMES = {"user": "User", "assistant": "Assistant", "system": "System"}


class Conversation:
    """One Converse stream: a session's turns, cancel (barge-in) and rewind.

    Without a chat template the history is plain text, one `Role: text` line per message, and a reply follows
    `Assistant:` exactly as generated (its leading space included), so each turn's prompt extends the previous
    prompt and reply token for token and the session's KV cache is reused.
    """

    def __init__(self, service: GeneratorService, runtime: Runtime, header_session_id: str = "") -> None:
        self.service = service
        self.runtime = runtime
        self.header_session_id = header_session_id
        self.out: asyncio.Queue[pb.ConverseResponse | BaseException | None] = asyncio.Queue()
        self.session_id = ""
        self.defaults: pb.SessionStart = pb.SessionStart()
        self.messages: list[tuple[str, str]] = []
        self.turn: asyncio.Task[None] | None = None
        self.turn_cancel = asyncio.Event()
        self.turn_index = 0
        self.last_reply = ""
        self.reader: asyncio.Task[None] | None = None
        self.abandoned = False

    def abandon(self) -> None:
        """gRPC has ended the call: stop the reply in flight and reading requests, whether or not this stream's
        generator is ever resumed or closed."""
        self.abandoned = True
        self.turn_cancel.set()
        if self.reader is not None:
            self.reader.cancel()

    async def run(self, requests: AsyncIterator[pb.ConverseRequest]) -> AsyncIterator[pb.ConverseResponse]:
        """Read requests in a task; yield responses as turns produce them."""
        reader = self.reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                item = await self.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reader.cancel()

    async def close(self) -> None:
        """Cancel a reply still in flight and wait until it has let go of the session."""
        await self._wait_turn(cancel=True)

    async def _read(self, requests: AsyncIterator[pb.ConverseRequest]) -> None:
        try:
            async for request in requests:
                await self._handle(request)
            await self._wait_turn(cancel=False)
            await self.out.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.out.put(exc)

    async def _handle(self, request: pb.ConverseRequest) -> None:
        kind = request.WhichOneof("action")
        if kind == "start":
            await self.runtime.registry.wait_for_release(request.start.session_id or self.header_session_id)
            self._start(request.start)
        elif not self.session_id:
            raise InvalidRequest(f"the first Converse message must be `start`; got `{kind}`")
        elif kind == "turn":
            await self._wait_turn(cancel=True)
            if self.abandoned:
                return
            self.turn_cancel = asyncio.Event()
            self.turn = asyncio.create_task(self._run_turn(request.turn, self.turn_cancel))
        elif kind == "cancel":
            self.turn_cancel.set()
        elif kind == "rewind":
            await self._rewind(request.rewind)
        else:
            raise InvalidRequest("empty ConverseRequest: set start, turn, cancel or rewind")

    def _start(self, start: pb.SessionStart) -> None:
        if self.session_id:
            raise InvalidRequest("start: this Converse stream already has a session; open a new stream for another")
        wanted = self.service._check_session_id(start.session_id, "start.session_id", self.header_session_id)
        self.service._decode_params(start.max_new_tokens, start.sampling if start.HasField("sampling") else None,
                                    list(start.stop), start.speculation if start.HasField("speculation") else None)
        registry = self.runtime.registry
        resumed = bool(wanted) and wanted in registry.sessions
        session = registry.open(wanted)
        self.session_id = session.id
        self.defaults = start
        state = session.conversation
        if resumed and state is not None:
            messages, self.turn_index, self.last_reply = state
            self.messages = list(messages)
        elif start.system:
            self.messages = [("system", start.system)]
        self.out.put_nowait(pb.ConverseResponse(started=pb.SessionStarted(
            session_id=session.id, resumed=resumed, history_tokens=len(self._render(False)))))

    def _save(self) -> None:
        """Keep the history on the session (if it still holds a slot) for a later stream to resume."""
        session = self.runtime.registry.sessions.get(self.session_id)
        if session is not None:
            session.conversation = (list(self.messages), self.turn_index, self.last_reply)

    def _render(self, generation_prompt: bool) -> list[int]:
        tok = self.runtime.tokenizer
        if getattr(tok, "chat_template", None):
            out: Any = tok.apply_chat_template([{"role": r, "content": t} for r, t in self.messages],
                                               add_generation_prompt=generation_prompt, tokenize=True)
            ids = out if isinstance(out, list) else out["input_ids"]
            return [int(i) for i in ids]
        text = "".join(f"Assistant:{t}\n" if r == "assistant" else f"{ROLE_NAMES.get(r, r.capitalize())}: {t}\n"
                       for r, t in self.messages)
        if generation_prompt:
            text += "Assistant:"
        return self.runtime.encode(text) if text else []

    async def _wait_turn(self, cancel: bool) -> None:
        """Wait for the reply in flight (cancelled first when `cancel`). asyncio.wait, unlike gather, leaves the
        turn running if this waiter is itself cancelled, so the turn always ends through its own cancel path."""
        if self.turn is not None and not self.turn.done():
            if cancel:
                self.turn_cancel.set()
            await asyncio.wait({self.turn})

    async def _run_turn(self, turn: pb.Turn, cancel: asyncio.Event) -> None:
        try:
            await self._turn(turn, cancel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.out.put(exc)

    async def _turn(self, turn: pb.Turn, cancel: asyncio.Event) -> None:
        d = self.defaults
        sampling = turn.sampling if turn.HasField("sampling") else (d.sampling if d.HasField("sampling") else None)
        speculation = turn.speculation if turn.HasField("speculation") else (
            d.speculation if d.HasField("speculation") else None)
        stops = list(d.stop)
        if not getattr(self.runtime.tokenizer, "chat_template", None):
            stops.append("\nUser:")
        params = self.service._decode_params(turn.max_new_tokens or d.max_new_tokens, sampling, stops, speculation)
        self.messages.append((turn.role or "user", turn.text))
        prompt = self.service._fit_prompt(self._render(True), truncate=True)
        started = time.perf_counter()
        segmenter = PhraseSegmenter() if d.phrase_mode else None
        reply: list[str] = []
        first_phrase = 0.0
        offset = 0
        done: Done | None = None
        async for event in self.service._stream(prompt, params, self.session_id, "Converse", cancel):
            if isinstance(event, Chunk):
                reply.append(event.text)
                await self.out.put(pb.ConverseResponse(chunk=pb.TokenChunk(
                    text=event.text, token_ids=event.token_ids, accepted_draft_tokens=event.accepted)))
                for phrase in segmenter.feed(event.text) if segmenter else []:
                    first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                    await self.out.put(self._phrase(phrase, offset, started))
                    offset += len(phrase)
            else:
                done = event
        if segmenter is not None:
            rest = segmenter.flush()
            if rest:
                first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                await self.out.put(self._phrase(rest, offset, started))
        text = "".join(reply)
        self.messages.append(("assistant", text))
        self.last_reply = text
        if done is not None:
            summary = self.service._summary(done, self.session_id)
            await self.out.put(pb.ConverseResponse(summary=pb.TurnSummary(
                turn_index=self.turn_index, generation=summary, time_to_first_phrase_ms=first_phrase,
                reply_text=text)))
        self.turn_index += 1
        self._save()

    def _phrase(self, text: str, offset: int, started: float) -> pb.ConverseResponse:
        return pb.ConverseResponse(phrase=pb.Phrase(text=text, start_char=offset, end_char=offset + len(text),
                                                    time_ms=(time.perf_counter() - started) * 1e3))

    async def _rewind(self, rewind: pb.Rewind) -> None:
        if rewind.session_id and rewind.session_id != self.session_id:
            raise InvalidRequest(f"rewind.session_id is {rewind.session_id!r}, but this stream's session is "
                                 f"{self.session_id!r}; leave it empty or send this session's id")
        await self._wait_turn(cancel=True)
        if not self.messages or self.messages[-1][0] != "assistant":
            raise InvalidRequest("rewind: nothing to rewind, there is no reply in this session yet")
        kept = self.last_reply[: rewind.spoken_chars]
        self.messages[-1] = ("assistant", kept)
        self.last_reply = kept
        self._save()
        kept_tokens = len(self.runtime.encode_plain(kept)) if kept else 0
        await self.out.put(pb.ConverseResponse(rewound=pb.Rewound(
            kept_chars=len(kept), kept_tokens=kept_tokens, history_tokens=len(self._render(False)))))
