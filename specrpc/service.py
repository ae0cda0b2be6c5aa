"""The gRPC edge: proto ⇄ domain types, request validation and status codes. Nothing else lives here."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
import torch

from specrpc.config import Config
from specrpc.engine import FINISH_LENGTH, FINISH_STOP
from specrpc.metrics import Metrics
from specrpc.runtime import CheckpointInfo, DecodeParams, ExtraFile, NoInfillSupport, Runtime
from specrpc.sampling import SamplingParams
from specrpc.scheduler import FINISH_CANCELLED, Chunk, Done, Failed
from specrpc.sessions import Session, SlotsExhausted, UnknownSession
from specrpc.text import PhraseSegmenter
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

FINISH = {
    FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
    FINISH_STOP: pb.FINISH_REASON_STOP,
    FINISH_CANCELLED: pb.FINISH_REASON_CANCELLED,
}
PROPOSERS = {
    pb.PROPOSER_UNSPECIFIED: None,
    pb.PROPOSER_DRAFT_MODEL: "draft",
    pb.PROPOSER_PROMPT_LOOKUP: "lookup",
    pb.PROPOSER_COMBINED: "combined",
}
MAX_SESSION_ID = 128


class InvalidRequest(ValueError):
    """A request the client must change: INVALID_ARGUMENT with this message."""


class EngineFailure(RuntimeError):
    """The engine raised while serving this stream: INTERNAL for this stream only."""


ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownSession, grpc.StatusCode.INVALID_ARGUMENT),
    (SlotsExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoInfillSupport, grpc.StatusCode.FAILED_PRECONDITION),
    (EngineFailure, grpc.StatusCode.INTERNAL),
]

T = TypeVar("T")


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
        async def run(self: GeneratorService, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
            code = grpc.StatusCode.OK
            try:
                async for item in handler(self, request, context):
                    yield item
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                mapped = status_for(exc)
                if mapped is None:
                    log.exception("unhandled error", rpc=rpc)
                    mapped = grpc.StatusCode.INTERNAL
                code = mapped
                await context.abort(mapped, str(exc))
            finally:
                self.metrics.requests.labels(rpc, code.name).inc()

        return run

    return wrap


def unary_errors(rpc: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """Same as stream_errors for unary handlers."""

    def wrap(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(handler)
        async def run(self: GeneratorService, request: Any, context: grpc.aio.ServicerContext) -> T:
            code = grpc.StatusCode.OK
            try:
                return await handler(self, request, context)
            except Exception as exc:
                code = status_for(exc) or grpc.StatusCode.INTERNAL
                await context.abort(code, str(exc))
                raise  # unreachable: abort raises
            finally:
                self.metrics.requests.labels(rpc, code.name).inc()

        return run

    return wrap


@dataclass
class TurnState:
    """Converse bookkeeping for the reply in flight."""

    task: asyncio.Task[None] | None = None
    cancel: asyncio.Event = field(default_factory=asyncio.Event)


class GeneratorService(pb_grpc.GeneratorServicer):
    """specrpc.v1.Generator."""

    def __init__(self, runtime: Runtime, config: Config, metrics: Metrics) -> None:
        self.runtime = runtime
        self.config = config
        self.limits = config.limits
        self.metrics = metrics

    # ---- validation --------------------------------------------------------------------------------------------

    def _sampling(self, msg: pb.SamplingParams | None) -> SamplingParams:
        if msg is None:
            return SamplingParams(temperature=0.0)
        t, p, k = msg.temperature, msg.top_p, msg.top_k
        if not math.isfinite(t) or t < 0 or t > self.limits.max_temperature:
            raise InvalidRequest(f"sampling.temperature must be in [0, {self.limits.max_temperature}] "
                                 f"(0 = greedy); got {t}")
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
            raise InvalidRequest(f"at most {lim.max_stop_strings} stop strings allowed (--max-stop-strings); "
                                 f"got {len(stop)}")
        for s in stop:
            if not s:
                raise InvalidRequest("stop strings must not be empty")
            if len(s) > lim.max_stop_chars:
                raise InvalidRequest(f"stop strings must be at most {lim.max_stop_chars} characters "
                                     f"(--max-stop-chars); got one of {len(s)}")
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
                raise InvalidRequest(f"unknown speculation.proposer {speculation.proposer}")
            proposer = PROPOSERS[speculation.proposer]
            if proposer is not None and proposer not in self.runtime.engine.proposers:
                raise InvalidRequest(f"proposer {proposer!r} needs a draft model, and this server runs without "
                                     f"one; use PROPOSER_PROMPT_LOOKUP or leave it unspecified")
        return DecodeParams(
            max_new_tokens=max_new_tokens or lim.default_max_new_tokens,
            sampling=self._sampling(sampling),
            stop=tuple(stop),
            num_draft_tokens=num_draft,
            proposer=proposer,
        )

    def _check_session_id(self, session_id: str) -> None:
        if len(session_id) > MAX_SESSION_ID or not session_id.isprintable():
            raise InvalidRequest(f"session_id must be at most {MAX_SESSION_ID} printable characters")

    def _fit_prompt(self, ids: list[int], truncate: bool) -> list[int]:
        if not ids:
            raise InvalidRequest("the prompt is empty: set prompt or prompt_token_ids")
        room = self.runtime.context_limit - 1
        cap = min(room, self.limits.max_prompt_tokens or room)
        if len(ids) > cap:
            if not truncate:
                raise InvalidRequest(f"the prompt has {len(ids)} tokens but at most {cap} fit (context "
                                     f"{self.runtime.context_limit}, --max-prompt-tokens); shorten it or set "
                                     f"truncate_prompt")
            ids = ids[-cap:]
        return ids

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        if request.prompt:
            ids = self.runtime.encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
            vocab = self.runtime.target.vocab_size
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                raise InvalidRequest(f"prompt_token_ids contains {bad}, outside the vocabulary (0..{vocab - 1})")
        return self._fit_prompt(ids, request.truncate_prompt)

    # ---- streaming -----------------------------------------------------------------------------------------------

    async def _stream(self, prompt: list[int], params: DecodeParams, session_id: str, rpc: str,
                      session: Session | None = None) -> AsyncIterator[Chunk | Done]:
        """Run one generation and yield its chunks and final Done; records metrics and one log line."""
        last = 0.0
        async for event in self.runtime.generate(prompt, params, session_id, session):
            if isinstance(event, Failed):
                raise EngineFailure(f"the engine failed on this stream: {type(event.error).__name__}: "
                                    f"{event.error}") from event.error
            if isinstance(event, Chunk):
                if event.token_ids:
                    if last:
                        self.metrics.inter_token.observe((event.at - last) / len(event.token_ids))
                    last = event.at
                yield event
                continue
            s = event.stats
            m = self.metrics
            m.prompt_tokens.inc(s.prompt_tokens)
            m.cached_prompt_tokens.inc(s.cached_prompt_tokens)
            m.completion_tokens.inc(s.completion_tokens)
            m.draft_proposed.inc(s.proposed)
            m.draft_accepted.inc(s.accepted)
            m.verify_steps.inc(s.verify_steps)
            m.ttft.observe((event.first_token_at or event.at) - event.arrival)
            fields: dict[str, object] = {
                "rpc": rpc, "session": session.id if session else session_id, "finish": event.finish,
                "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_prompt_tokens,
                "completion_tokens": s.completion_tokens, "proposed": s.proposed, "accepted": s.accepted,
                "verify_steps": s.verify_steps, "mean_accepted_length": round(s.mean_accepted_length, 3),
                "ttft_ms": round(((event.first_token_at or event.at) - event.arrival) * 1e3, 2),
                "total_ms": round((event.at - event.arrival) * 1e3, 2),
            }
            if self.config.server.log_prompts:
                fields["output"] = event.text
            log.info("request", **fields)
            yield event

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
            ),
            session_id=session_id,
            stop_sequence=done.stop_sequence,
        )

    async def _generate_responses(self, prompt: list[int], params: DecodeParams, session_id: str,
                                  rpc: str) -> AsyncIterator[pb.GenerateResponse]:
        async for event in self._stream(prompt, params, session_id, rpc):
            if isinstance(event, Chunk):
                yield pb.GenerateResponse(chunk=pb.TokenChunk(text=event.text, token_ids=event.token_ids,
                                                              accepted_draft_tokens=event.accepted))
            else:
                yield pb.GenerateResponse(summary=self._summary(event, session_id))

    @stream_errors("Generate")
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        self._check_session_id(request.session_id)
        params = self._decode_params(request.max_new_tokens, request.sampling if request.HasField("sampling")
                                     else None, list(request.stop),
                                     request.speculation if request.HasField("speculation") else None)
        prompt = self._prompt_ids(request)
        async for response in self._generate_responses(prompt, params, request.session_id, "Generate"):
            yield response

    @stream_errors("Infill")
    async def Infill(self, request: pb.InfillRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        self._check_session_id(request.session_id)
        if len(request.extra) > self.limits.max_extra_files:
            raise InvalidRequest(f"at most {self.limits.max_extra_files} extra files allowed (--max-extra-files); "
                                 f"got {len(request.extra)}")
        params = self._decode_params(request.max_new_tokens, request.sampling if request.HasField("sampling")
                                     else None, list(request.stop),
                                     request.speculation if request.HasField("speculation") else None)
        extra = [ExtraFile(f.path, f.text) for f in request.extra]
        prompt = self.runtime.infill_prompt(request.prefix, request.suffix, extra, request.path)
        prompt = self._fit_prompt(prompt, truncate=False)
        async for response in self._generate_responses(prompt, params, request.session_id, "Infill"):
            yield response

    @unary_errors("GetModelInfo")
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
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

    async def Converse(self, request_iterator: AsyncIterator[pb.ConverseRequest],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ConverseResponse]:
        code = grpc.StatusCode.OK
        conversation = Conversation(self)
        try:
            async for response in conversation.run(request_iterator):
                yield response
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            mapped = status_for(exc)
            if mapped is None:
                log.exception("unhandled error", rpc="Converse")
            code = mapped or grpc.StatusCode.INTERNAL
            await context.abort(code, str(exc))
        finally:
            await conversation.close()
            self.metrics.requests.labels("Converse", code.name).inc()


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
    """One Converse stream: a session's turns, cancel (barge-in) and rewind."""

    def __init__(self, service: GeneratorService) -> None:
        self.service = service
        self.runtime = service.runtime
        self.out: asyncio.Queue[pb.ConverseResponse | BaseException | None] = asyncio.Queue()
        self.session: Session | None = None
        self.defaults: pb.SessionStart = pb.SessionStart()
        self.messages: list[tuple[str, str]] = []
        self.turn: asyncio.Task[None] | None = None
        self.turn_cancel = asyncio.Event()
        self.turn_index = 0
        self.last_reply = ""

    async def run(self, requests: AsyncIterator[pb.ConverseRequest]) -> AsyncIterator[pb.ConverseResponse]:
        """Read requests in a task; yield responses as turns produce them."""
        reader = asyncio.create_task(self._read(requests))
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
        """Cancel a reply still in flight."""
        if self.turn is not None and not self.turn.done():
            self.turn_cancel.set()
            await asyncio.gather(self.turn, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.ConverseRequest]) -> None:
        try:
            async for request in requests:
                await self._handle(request)
            if self.turn is not None:
                await asyncio.gather(self.turn, return_exceptions=True)
            await self.out.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.out.put(exc)

    async def _handle(self, request: pb.ConverseRequest) -> None:
        kind = request.WhichOneof("action")
        if kind == "start":
            self._start(request.start)
        elif self.session is None:
            raise InvalidRequest(f"the first Converse message must be `start`; got `{kind}`")
        elif kind == "turn":
            await self._wait_turn(cancel=True)
            self.turn_cancel = asyncio.Event()
            self.turn = asyncio.create_task(self._run_turn(request.turn))
        elif kind == "cancel":
            self.turn_cancel.set()
        elif kind == "rewind":
            await self._rewind(request.rewind)
        else:
            raise InvalidRequest("empty ConverseRequest: set start, turn, cancel or rewind")

    def _start(self, start: pb.SessionStart) -> None:
        if self.session is not None:
            raise InvalidRequest("this Converse stream already has a session; open a new stream for another")
        self.service._check_session_id(start.session_id)
        self.service._decode_params(start.max_new_tokens, start.sampling if start.HasField("sampling") else None,
                                    list(start.stop), start.speculation if start.HasField("speculation") else None)
        registry = self.runtime.registry
        resumed = bool(start.session_id) and start.session_id in registry.sessions
        self.session = registry.open(start.session_id)
        self.defaults = start
        state = self.session.conversation
        if resumed and state is not None:
            self.messages, self.turn_index, self.last_reply = state
        elif start.system:
            self.messages = [("system", start.system)]
        self.out.put_nowait(pb.ConverseResponse(started=pb.SessionStarted(
            session_id=self.session.id, resumed=resumed, history_tokens=len(self._render(False)))))

    def _render(self, generation_prompt: bool) -> list[int]:
        tok = self.runtime.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": r, "content": t} for r, t in self.messages],
                                          add_generation_prompt=generation_prompt, tokenize=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])
        text = "".join(f"{ROLE_NAMES.get(r, r.capitalize())}: {t}\n" for r, t in self.messages)
        if generation_prompt:
            text += "Assistant:"
        return self.runtime.encode(text) if text else []

    async def _wait_turn(self, cancel: bool) -> None:
        if self.turn is not None and not self.turn.done():
            if cancel:
                self.turn_cancel.set()
            await asyncio.gather(self.turn, return_exceptions=True)

    async def _run_turn(self, turn: pb.Turn) -> None:
        assert self.session is not None
        try:
            await self._turn(turn, self.session)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.out.put(exc)

    async def _turn(self, turn: pb.Turn, session: Session) -> None:
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
        stream = self.service._stream(prompt, params, "", "Converse", session)
        done: Done | None = None
        cancel_wait = asyncio.create_task(self.turn_cancel.wait())
        try:
            iterator = stream.__aiter__()
            while True:
                next_item = asyncio.ensure_future(iterator.__anext__())
                finished, _ = await asyncio.wait({next_item, cancel_wait}, return_when=asyncio.FIRST_COMPLETED)
                if cancel_wait in finished and session.job is not None:
                    session.job.cancel()
                try:
                    event = await next_item
                except StopAsyncIteration:
                    break
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
        finally:
            cancel_wait.cancel()
        if segmenter is not None:
            rest = segmenter.flush()
            if rest:
                first_phrase = first_phrase or (time.perf_counter() - started) * 1e3
                await self.out.put(self._phrase(rest, offset, started))
        text = "".join(reply)
        self.messages.append(("assistant", text))
        self.last_reply = text
        session.conversation = (self.messages, self.turn_index + 1, text)
        if done is not None:
            summary = self.service._summary(done, session.id)
            await self.out.put(pb.ConverseResponse(summary=pb.TurnSummary(
                turn_index=self.turn_index, generation=summary, time_to_first_phrase_ms=first_phrase,
                reply_text=text)))
        self.turn_index += 1

    def _phrase(self, text: str, offset: int, started: float) -> pb.ConverseResponse:
        return pb.ConverseResponse(phrase=pb.Phrase(text=text, start_char=offset, end_char=offset + len(text),
                                                    time_ms=(time.perf_counter() - started) * 1e3))

    async def _rewind(self, rewind: pb.Rewind) -> None:
        assert self.session is not None
        if rewind.session_id and rewind.session_id != self.session.id:
            raise InvalidRequest(f"rewind names session {rewind.session_id!r}, but this stream's session is "
                                 f"{self.session.id!r}")
        await self._wait_turn(cancel=True)
        if not self.messages or self.messages[-1][0] != "assistant":
            raise InvalidRequest("nothing to rewind: no reply in this session yet")
        kept = self.last_reply[: rewind.spoken_chars]
        self.messages[-1] = ("assistant", kept)
        self.last_reply = kept
        self.session.conversation = (self.messages, self.turn_index, kept)
        kept_tokens = len(self.runtime.encode_plain(kept)) if kept else 0
        await self.out.put(pb.ConverseResponse(rewound=pb.Rewound(
            kept_chars=len(kept), kept_tokens=kept_tokens, history_tokens=len(self._render(False)))))
