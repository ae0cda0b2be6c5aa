"""The gRPC edge: proto ⇄ domain types and status codes. Checks live in validation.py, admission and accounting in
gateway.py, the Converse state machine in conversation.py; nothing else lives here."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import structlog
import torch

from specrpc.config import Config
from specrpc.edges import validation as validation
from specrpc.edges.auth import StreamQuota, TooManyStreams, metadata_values
from specrpc.edges.conversation import (
    Conversation,
    Event,
    Phrase,
    Started,
    ToolCalled,
    TurnDone,
    TurnInput,
    reply_stops,
    tool_format,
)
from specrpc.edges.gateway import DeviceOutOfMemory, EngineFailure, Gateway, NotReady, ShuttingDown
from specrpc.edges.grpc.wire import MalformedRequest
from specrpc.edges.metrics import Metrics
from specrpc.edges.offload import prepared
from specrpc.edges.validation import SESSION_HEADER, InvalidRequest
from specrpc.engine.constraint import ConstraintSpec, InvalidConstraint
from specrpc.engine.generation import FINISH_LENGTH, FINISH_STOP
from specrpc.engine.sampling import SamplingParams
from specrpc.prompts.fim import ExtraFile, InfillInput, InfillPrompt, NoInfillSupport, PromptTooLong
from specrpc.prompts.rewrite import BadRewrite, RewriteInput, RewritePrompt, changed_lines
from specrpc.prompts.text import FINISH_INDENT, FINISH_TIME_LIMIT
from specrpc.prompts.tools import NO_PARAMETERS, Tool, ToolCall, ToolChoice
from specrpc.serving.runtime import CheckpointInfo, DecodeParams, Runtime
from specrpc.serving.scheduler import FINISH_CANCELLED, Chunk, Done
from specrpc.serving.sessions import SlotsExhausted, UnknownSession
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

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
PROTOCOL = "grpc"  # the metrics' protocol label for this edge
FIM_LAYOUTS = {
    pb.FIM_LAYOUT_UNSPECIFIED: "auto",
    pb.FIM_LAYOUT_PSM: "psm",
    pb.FIM_LAYOUT_SPM: "spm",
    pb.FIM_LAYOUT_TYPED_LINE: "typed_line",
}
FIM_LAYOUT_VALUES = {v: k for k, v in FIM_LAYOUTS.items()}

ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (MalformedRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidConstraint, grpc.StatusCode.INVALID_ARGUMENT),
    (PromptTooLong, grpc.StatusCode.INVALID_ARGUMENT),
    (BadRewrite, grpc.StatusCode.INVALID_ARGUMENT),
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
                client = self.gateway.admit(context.peer(), context.invocation_metadata())
            except Exception as exc:
                refused = status_for(exc) or grpc.StatusCode.INTERNAL
                self.gateway.count(rpc, refused.name, PROTOCOL)
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
                self.gateway.count(rpc, code.name, PROTOCOL)

        return run

    return wrap


class GeneratorService(pb_grpc.GeneratorServicer):
    """specrpc.v1.Generator."""

    def __init__(self, config: Config, metrics: Metrics, runtime: Runtime | None = None,
                 gateway: Gateway | None = None) -> None:
        self.gateway = gateway or Gateway(config, metrics, runtime)
        self.config = config
        self.limits = config.limits
        self.metrics = metrics

    @property
    def quota(self) -> StreamQuota:
        """The per-client stream quota (shared with the HTTP edge)."""
        return self.gateway.quota

    @quota.setter
    def quota(self, quota: StreamQuota) -> None:
        self.gateway.quota = quota

    def _ended(self, rpc: str, client: str, end: StreamEnd, context: Context) -> None:
        """gRPC has ended a Generate/Infill/Converse call: uncount it and count its final status."""
        self.gateway.leave(client)
        code = end.code if end.code != grpc.StatusCode.OK or end.finished else grpc.StatusCode.CANCELLED
        self.gateway.count(rpc, code.name, PROTOCOL)

    def refuse_new_streams(self) -> None:
        """From now on new Generate/Infill/Converse calls end UNAVAILABLE at once (the server is draining)."""
        self.gateway.refuse_new_streams()

    async def drained(self) -> None:
        """Return once no Generate/Infill/Converse stream (nor HTTP generation) is in flight."""
        await self.gateway.drained()

    def attach(self, runtime: Runtime) -> None:
        """Start serving with `runtime` (loaded and warm); until then every call is UNAVAILABLE."""
        self.gateway.attach(runtime)

    @property
    def runtime(self) -> Runtime:
        """The loaded runtime, or NotReady while the server starts."""
        return self.gateway.runtime

    # ---- proto → domain ----------------------------------------------------------------------------------------

    def _sampling(self, msg: pb.SamplingParams | None) -> SamplingParams:
        if msg is None:
            return SamplingParams(temperature=0.0)
        seed = msg.seed if msg.HasField("seed") else None
        return validation.sampling_params(self.limits, msg.temperature, msg.top_p, msg.top_k, seed)

    def _decode_params(self, max_new_tokens: int, sampling: pb.SamplingParams | None, stop: list[str],
                       speculation: pb.SpeculationParams | None) -> DecodeParams:
        num_draft: int | None = None
        proposer: str | None = None
        if speculation is not None:
            if speculation.HasField("num_draft_tokens"):
                num_draft = speculation.num_draft_tokens
            if speculation.proposer not in PROPOSERS:
                raise InvalidRequest(f"speculation.proposer {speculation.proposer} is not a Proposer value; use "
                                     f"PROPOSER_DRAFT_MODEL, PROPOSER_PROMPT_LOOKUP or PROPOSER_COMBINED")
            proposer = PROPOSERS[speculation.proposer]
        proposers = self.runtime.engine.proposers if proposer is not None else ()
        params = validation.decode_params(self.config, proposers, max_new_tokens, self._sampling(sampling), stop,
                                          num_draft, proposer)
        if sampling is None:
            return params
        return validation.sampling_controls(params, self._controls(sampling), self.runtime.vocab_size, "sampling.")

    @staticmethod
    def _controls(msg: pb.SamplingParams) -> validation.Controls:
        """The sampling controls of `msg` (a repetition penalty of 0 is unset: off)."""
        return validation.Controls(
            repetition_penalty=msg.repetition_penalty or 1.0, presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty, penalty_last_n=msg.penalty_last_n,
            logit_bias=tuple(sorted(msg.logit_bias.items())), min_p=msg.min_p, min_keep=msg.min_keep,
            min_tokens=msg.min_tokens, ignore_eos=msg.ignore_eos)

    @staticmethod
    def _constraint(msg: pb.Constraint, name: str = "constraint") -> ConstraintSpec | None:
        """A request's `constraint` (None when unset or `json_object: false`)."""
        kind = msg.WhichOneof("kind")
        if kind is None or (kind == "json_object" and not msg.json_object):
            return None
        if kind == "json_object":
            return validation.constraint("json_object", "", True, f"{name}.json_object")
        text = str(getattr(msg, kind))
        return validation.constraint(kind, text, not msg.lenient, f"{name}.{kind}")

    def _editor_params(self, request: pb.GenerateRequest | pb.InfillRequest, params: DecodeParams) -> DecodeParams:
        """`params` with the editor fields and the constraint of a Generate or Infill request, checked
        (validation.editor_params)."""
        params = replace(params, constraint=self._constraint(request.constraint))
        params = validation.stream_interval(params, request.stream_interval_ms
                                            if request.HasField("stream_interval_ms") else None)
        return validation.editor_params(params, n_indent=request.n_indent, max_time_ms=request.max_time_ms,
                                        prefill_only=request.prefill_only, logprobs=request.logprobs,
                                        top_logprobs=request.top_logprobs, max_new_tokens=request.max_new_tokens,
                                        stop_count=len(request.stop))

    def _prediction(self, text: str, params: DecodeParams) -> DecodeParams:
        """`params` with the request's predicted output, checked (validation.prediction)."""
        return validation.prediction(params, text, self.runtime.encode_plain, self.runtime.context_limit)

    def _fit_prompt(self, ids: list[int], truncate: bool, too_long: str = "shorten it or set truncate_prompt"
                    ) -> list[int]:
        return validation.fit_prompt(ids, self.runtime.context_limit, self.limits, truncate, too_long)

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

    # ---- domain → proto ----------------------------------------------------------------------------------------

    def _summary(self, done: Done, session_id: str, fim: InfillPrompt | None = None) -> pb.GenerationSummary:
        s = done.stats
        first = done.first_token_at
        trimmed = fim.trimmed if fim is not None else None
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
            trimmed_prefix_chars=trimmed.prefix_chars if trimmed else 0,
            trimmed_suffix_chars=trimmed.suffix_chars if trimmed else 0,
            trimmed_extra_files=trimmed.extra_files if trimmed else 0,
            trimmed_prompt_tokens=trimmed.tokens if trimmed else 0,
            fim_layout=FIM_LAYOUT_VALUES[fim.layout] if fim is not None else pb.FIM_LAYOUT_UNSPECIFIED,
            tokens_cached=s.tokens_cached,
            suggestion_tokens_accepted=s.suggestion_accepted,
            accepted_prediction_tokens=s.accepted_prediction_tokens,
            rejected_prediction_tokens=s.rejected_prediction_tokens,
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
                                  rpc: str, context: Context, fim: InfillPrompt | None = None
                                  ) -> AsyncIterator[pb.GenerateResponse]:
        scope = self.gateway.draft_scope(context.invocation_metadata(), session_id)
        async for event in self.gateway.stream(prompt, params, session_id, rpc, rpc_gone(context), scope):
            if isinstance(event, Chunk):
                yield pb.GenerateResponse(chunk=self._chunk(event))
            else:
                yield pb.GenerateResponse(summary=self._summary(event, session_id, fim))

    # ---- handlers ------------------------------------------------------------------------------------------------

    @stream_errors("Generate")
    async def Generate(self, request: pb.GenerateRequest,
                       context: Context) -> AsyncIterator[pb.GenerateResponse]:
        session_id = validation.session_id(request.session_id, header=session_header(context))

        def build() -> tuple[list[int], DecodeParams]:
            params = self._editor_params(request, self._decode_params(
                request.max_new_tokens, request.sampling if request.HasField("sampling") else None,
                list(request.stop), request.speculation if request.HasField("speculation") else None))
            return self._prompt_ids(request), self._prediction(request.prediction, params)

        prompt, params = await prepared(build, request.ByteSize())
        async for response in self._generate_responses(prompt, params, session_id, "Generate", context):
            yield response

    @stream_errors("Infill")
    async def Infill(self, request: pb.InfillRequest,
                     context: Context) -> AsyncIterator[pb.GenerateResponse]:
        session_id = validation.session_id(request.session_id, header=session_header(context))
        validation.extra_files(len(request.extra), self.limits)

        def build() -> tuple[InfillPrompt, DecodeParams]:
            params = self._editor_params(request, self._decode_params(
                request.max_new_tokens, request.sampling if request.HasField("sampling") else None,
                list(request.stop), request.speculation if request.HasField("speculation") else None))
            fim = self.runtime.infill_prompt(self._infill_input(request), request.truncate, params.max_new_tokens)
            return fim, self._prediction(request.prediction,
                                         replace(params, stop_token_ids=params.stop_token_ids | fim.stop_ids))

        fim, params = await prepared(build, request.ByteSize())
        async for response in self._generate_responses(fim.ids, params, session_id, "Infill", context, fim):
            yield response

    def _infill_input(self, request: pb.InfillRequest) -> InfillInput:
        if request.layout not in FIM_LAYOUTS:
            raise InvalidRequest(f"layout {request.layout} is not a FimLayout value; use FIM_LAYOUT_PSM, "
                                 f"FIM_LAYOUT_SPM, FIM_LAYOUT_TYPED_LINE or leave it unspecified")
        return InfillInput(prefix=request.prefix, suffix=request.suffix,
                           extra=tuple(ExtraFile(f.path, f.text) for f in request.extra), path=request.path,
                           repo_name=validation.repo_name(request.repo_name), typed_line=request.typed_line,
                           layout=FIM_LAYOUTS[request.layout])

    @stream_errors("Rewrite")
    async def Rewrite(self, request: pb.RewriteRequest, context: Context) -> AsyncIterator[pb.RewriteResponse]:
        session_id = validation.session_id(request.session_id, header=session_header(context))

        def build() -> tuple[list[int], DecodeParams, RewritePrompt]:
            params = self._decode_params(
                request.max_new_tokens, request.sampling if request.HasField("sampling") else None, [],
                request.speculation if request.HasField("speculation") else None)
            ids, framed = self.runtime.rewrite_prompt(RewriteInput(
                request.path, request.text, request.region_start, request.region_end, request.cursor,
                tuple(request.recent_edits)))
            prompt = self._fit_prompt(ids, False, too_long="send a shorter file, region or fewer edits")
            return prompt, replace(self._prediction(framed.prediction, params), stop=(framed.stop,)), framed

        prompt, params, framed = await prepared(build, request.ByteSize())
        text: list[str] = []
        async for response in self._generate_responses(prompt, params, session_id, "Rewrite", context):
            if response.WhichOneof("event") == "chunk":
                text.append(response.chunk.text)
                yield pb.RewriteResponse(chunk=response.chunk)
                continue
            region = "".join(text).removesuffix("\n")  # the line break before the end marker
            changes = [pb.LineChange(old_start=c.old_start, old_end=c.old_end, new_start=c.new_start,
                                     new_end=c.new_end) for c in changed_lines(framed.region, region)]
            yield pb.RewriteResponse(summary=pb.RewriteSummary(generation=response.summary, region=region,
                                                               changes=changes))

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
            supports_infill=rt.fim is not None,
            tokenizer_vocab_size=len(rt.tokenizer),
        )
        if rt.fim is not None:
            info.fim_template = rt.fim.name
            info.fim_orders.extend(rt.fim.orders)
            info.fim_default_layout = FIM_LAYOUT_VALUES[rt.fim.default_layout]
        if rt.draft_info is not None:
            info.draft.CopyFrom(describe(rt.draft_info))
        info.target_execution.extend(pb.ExecutionPath(tokens=t, path=p) for t, p in rt.target.execution())
        if rt.draft is not None:
            info.draft_execution.extend(pb.ExecutionPath(tokens=t, path=p) for t, p in rt.draft.execution())
        info.deterministic = ec.deterministic
        return info

    # ---- Converse ------------------------------------------------------------------------------------------------

    @stream_errors("Converse")
    async def Converse(self, request_iterator: AsyncIterator[pb.ConverseRequest],
                       context: Context) -> AsyncIterator[pb.ConverseResponse]:
        conversation = Conversation(self.gateway)
        reader = asyncio.create_task(self._read_converse(request_iterator, conversation, session_header(context)))

        def gone(_context: Context) -> None:
            # gRPC has ended the call: stop the reply in flight and reading requests, whether or not this
            # generator is ever resumed or closed
            conversation.abandon()
            reader.cancel()

        on_end(context, gone)
        try:
            while True:
                item = await conversation.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield self._converse_event(item, conversation.session_id)
        finally:
            reader.cancel()
            await conversation.close()

    async def _read_converse(self, requests: AsyncIterator[pb.ConverseRequest], conversation: Conversation,
                             header: str) -> None:
        """Turn each request into a conversation action; errors end the stream through `conversation.out`."""
        defaults = pb.SessionStart()
        try:
            async for request in requests:
                defaults = await self._converse_action(request, conversation, header, defaults)
            await conversation.finish()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await conversation.out.put(exc)

    async def _converse_action(self, request: pb.ConverseRequest, conversation: Conversation, header: str,
                               defaults: pb.SessionStart) -> pb.SessionStart:
        """Apply one request; returns the session's defaults (set by `start`)."""
        kind = request.WhichOneof("action")
        if kind == "start":
            start = request.start
            wanted = validation.session_id(start.session_id, "start.session_id", header)
            self._decode_params(start.max_new_tokens, start.sampling if start.HasField("sampling") else None,
                                list(start.stop), start.speculation if start.HasField("speculation") else None)
            validation.stream_interval(DecodeParams(0), start.stream_interval_ms
                                       if start.HasField("stream_interval_ms") else None, "start.stream_interval_ms")
            tools = tool_list(start.tools)
            choice = tool_choice(start.tool_choice, bool(tools)) if start.HasField("tool_choice") else None
            conversation.parallel = start.parallel_tool_calls if start.HasField("parallel_tool_calls") else True
            validation.tool_constraint(tools, choice or ToolChoice("auto" if tools else "none"),
                                       conversation.parallel, tool_format(self.runtime), "start.tools")
            await conversation.start(wanted, start.system, start.phrase_mode, tools, choice)
            return start
        elif kind == "turn":
            conversation.require_started(kind)
            turn, d = request.turn, defaults
            sampling = turn.sampling if turn.HasField("sampling") else (
                d.sampling if d.HasField("sampling") else None)
            speculation = turn.speculation if turn.HasField("speculation") else (
                d.speculation if d.HasField("speculation") else None)
            params = self._decode_params(turn.max_new_tokens or d.max_new_tokens, sampling,
                                         [*d.stop, *reply_stops(self.runtime)], speculation)
            if d.HasField("stream_interval_ms"):
                params = replace(params, stream_interval_ms=d.stream_interval_ms)
            tools = tool_list(turn.tools)
            message = TurnInput(turn.role, turn.text, turn.tool_call_id, tools,
                                tool_choice(turn.tool_choice, bool(tools or conversation.tools))
                                if turn.HasField("tool_choice") else None,
                                tuple((r.tool_call_id, r.text) for r in turn.tool_results))
            fmt = tool_format(self.runtime)
            calls = validation.tool_constraint(*conversation.turn_tools(message), conversation.parallel, fmt,
                                               "turn.tools" if tools else "start.tools")
            constraint = self._constraint(turn.constraint, "turn.constraint")
            if calls is not None and constraint is not None:
                raise InvalidRequest("turn.constraint and tools (with a tool choice other than none) are exclusive: "
                                     "send one, or set turn.tool_choice to TOOL_CHOICE_MODE_NONE")
            await conversation.turn(message, replace(params, constraint=calls or constraint,
                                                     shown_tokens=fmt.shown if calls else frozenset()))
        elif kind == "cancel":
            conversation.cancel()
        elif kind == "rewind":
            await conversation.rewind(request.rewind.session_id, request.rewind.spoken_chars)
        else:
            raise InvalidRequest("empty ConverseRequest: set start, turn, cancel or rewind")
        return defaults

    def _converse_event(self, event: Event, session_id: str) -> pb.ConverseResponse:
        if isinstance(event, Chunk):
            return pb.ConverseResponse(chunk=self._chunk(event))
        if isinstance(event, Phrase):
            return pb.ConverseResponse(phrase=pb.Phrase(text=event.text, start_char=event.start_char,
                                                        end_char=event.end_char, time_ms=event.time_ms))
        if isinstance(event, Started):
            return pb.ConverseResponse(started=pb.SessionStarted(
                session_id=event.session_id, resumed=event.resumed, history_tokens=event.history_tokens))
        if isinstance(event, ToolCalled):
            return pb.ConverseResponse(tool_call=tool_call_message(event.index, event.call))
        if isinstance(event, TurnDone):
            return pb.ConverseResponse(summary=pb.TurnSummary(
                turn_index=event.turn_index, generation=self._summary(event.done, session_id),
                time_to_first_phrase_ms=event.time_to_first_phrase_ms, reply_text=event.reply_text,
                tool_calls=[tool_call_message(i, c) for i, c in enumerate(event.tool_calls)]))
        return pb.ConverseResponse(rewound=pb.Rewound(kept_chars=event.kept_chars, kept_tokens=event.kept_tokens,
                                                      history_tokens=event.history_tokens))


def tool_list(tools: Sequence[pb.Tool]) -> tuple[Tool, ...]:
    """The declared functions (checked with the choice by validation.tool_constraint)."""
    return tuple(Tool(t.name, t.description, t.parameters_json or NO_PARAMETERS, t.strict)
                 for t in tools)


TOOL_CHOICE_MODES = {pb.TOOL_CHOICE_MODE_AUTO: "auto", pb.TOOL_CHOICE_MODE_NONE: "none",
                     pb.TOOL_CHOICE_MODE_REQUIRED: "required"}


def tool_choice(msg: pb.ToolChoice, have_tools: bool) -> ToolChoice:
    """A ToolChoice message as the domain's (unspecified: auto with tools, none without)."""
    if msg.function:
        return ToolChoice("function", msg.function)
    mode = TOOL_CHOICE_MODES.get(msg.mode, "auto" if have_tools else "none")
    return ToolChoice(mode)  # type: ignore[arg-type]


def tool_call_message(index: int, call: ToolCall) -> pb.ToolCall:
    """A call as the wire's ToolCall."""
    return pb.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments, index=index)


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
