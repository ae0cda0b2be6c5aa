"""asyncio client: AsyncClient, streams as AsyncGeneration, CompletionSession (editors), VoiceSession (voice)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from specrpc_client import _core
from specrpc_client._core import (
    DEFAULT_RETRY,
    UNSET,
    Connection,
    Deadline,
    PemSource,
    RetryPolicy,
    Timeout,
    ToolChoiceLike,
    ToolDeclarations,
    ToolResults,
    ToolResultValue,
)
from specrpc_client._stubs import pb, pb_grpc
from specrpc_client.errors import SpecrpcError, from_rpc_error
from specrpc_client.types import (
    Chunk,
    Constraint,
    ExtraFile,
    FimLayout,
    FinishReason,
    ModelInfo,
    Phrase,
    Rewound,
    RewriteResult,
    Sampling,
    SessionStarted,
    Speculation,
    Summary,
    ToolCall,
    TurnSummary,
    chunk_from,
    ended,
    json_text,
    model_info_from,
    phrase_from,
    tool_call_from,
    turn_summary_from,
)

T = TypeVar("T")
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # (grpc-stubs lacks it)
CallFactory = Callable[[int, float | None], Any]  # (attempt, timeout) -> grpc.aio call


def _cancelled_by_us(flag: bool) -> bool:
    """True when a CancelledError comes from our own call.cancel(), not from cancelling the running task."""
    task = asyncio.current_task()
    return flag and (task is None or task.cancelling() == 0)


class AsyncGeneration:
    """One Generate/Infill stream. Iterate it for Chunks; `summary` is set when it ends.

    The call starts at once; UNAVAILABLE before the first response is retried with backoff. `cancel()` ends the
    stream at once: iteration stops quietly and `finish_reason` is CANCELLED (`summary` stays None, since the
    server's summary is not awaited).
    """

    def __init__(self, open_call: CallFactory, method: str, timeout: float | None, retry: RetryPolicy) -> None:
        self.method = method
        self._open = open_call
        self._deadline = Deadline(timeout)
        self._retry = retry
        self._attempts = 1
        self._cancelled = False
        self._iterator: AsyncIterator[Chunk] | None = None
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.chunks: list[Chunk] = []
        self.summary: Summary | None = None
        self.rewrite: RewriteResult | None = None  # a Rewrite's region and changed lines, once it ends
        self.error: SpecrpcError | None = None
        self._call = open_call(0, timeout)

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(c.text for c in self.chunks)

    @property
    def cancelled(self) -> bool:
        return self._cancelled or (self.summary is not None and self.summary.finish_reason is FinishReason.CANCELLED)

    @property
    def finish_reason(self) -> FinishReason | None:
        """The summary's reason, CANCELLED after `cancel()`, None while running."""
        if self.summary is not None:
            return self.summary.finish_reason
        return FinishReason.CANCELLED if self._cancelled else None

    @property
    def done(self) -> bool:
        return self.summary is not None or self._cancelled

    @property
    def ttft_ms(self) -> float | None:
        """Client-side time to the first token (includes the network)."""
        return None if self.first_token_at is None else (self.first_token_at - self.started_at) * 1e3

    def cancel(self) -> None:
        """Stop now (keystroke, Escape); the server stops within one engine step and keeps the prefix cached."""
        if self.done:
            return
        self._cancelled = True
        self.ended_at = time.perf_counter()
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        if self._iterator is None:
            self._iterator = self._iterate()
        return self._iterator

    async def result(self) -> Summary | None:
        """Read to the end; the summary (None when cancelled)."""
        async for _ in self:
            pass
        return self.summary

    async def _iterate(self) -> AsyncIterator[Chunk]:
        started = False
        try:
            while not self._cancelled:
                try:
                    msg = await self._call.read()
                except asyncio.CancelledError:
                    if _cancelled_by_us(self._cancelled):
                        return
                    raise
                except grpc.aio.AioRpcError as exc:
                    if self._cancelled and exc.code() is grpc.StatusCode.CANCELLED:
                        return
                    delay = None
                    if exc.code() is grpc.StatusCode.UNAVAILABLE and not started:
                        delay = self._deadline.retry_delay(self._retry, self._attempts)
                    if delay is None:
                        self.error = from_rpc_error(exc, self.method, self._deadline.timeout, self._attempts)
                        raise self.error from None
                    await asyncio.sleep(delay)
                    if self._cancelled:
                        return
                    self._call = self._open(self._attempts, self._deadline.remaining())
                    self._attempts += 1
                    continue
                if msg is EOF:
                    return
                started = True
                if msg.HasField("chunk"):
                    chunk = chunk_from(msg.chunk)
                    if self.first_token_at is None and chunk.token_ids:
                        self.first_token_at = time.perf_counter()
                    self.chunks.append(chunk)
                    yield chunk
                else:
                    self.summary, self.rewrite = ended(msg.summary)
                    self.ended_at = time.perf_counter()
        finally:
            if not self.done and self.error is None:  # the consumer stopped early: stop the server too
                self._cancelled = True
                self._call.cancel()


class AsyncClient:
    """asyncio client for specrpc.v1.Generator.

    target: "host:port", "ipv4:a:p,b:p" (client-side round_robin), "dns:///name:port", or a list of "host:port".
    token: sent as `authorization: Bearer <token>`. tls / root_certificates / client_cert + client_key: TLS and
    mutual TLS (PEM paths or bytes); server_name overrides the name checked against the server certificate.
    timeout: default deadline in seconds for unary and generation calls (None: none); each call can override it.
    retry: backoff on UNAVAILABLE before the first response. session_affinity: with several endpoints, calls that
    carry a session id stick to one endpoint (its KV cache lives there); the rest are balanced round-robin.
    """

    def __init__(self, target: str | Sequence[str] = _core.DEFAULT_TARGET, *, token: str | None = None,
                 tls: bool = False, root_certificates: PemSource = None, client_cert: PemSource = None,
                 client_key: PemSource = None, server_name: str | None = None, timeout: float | None = None,
                 retry: RetryPolicy = DEFAULT_RETRY, session_affinity: bool = True,
                 options: Sequence[tuple[str, str | int]] = ()) -> None:
        self.connection = Connection.build(target, token=token, tls=tls, root_certificates=root_certificates,
                                           client_cert=client_cert, client_key=client_key, server_name=server_name,
                                           retry=retry, session_affinity=session_affinity, options=options)
        self.timeout = timeout
        self.retry = retry
        self._channels: dict[str, grpc.aio.Channel] = {}

    # ---- plumbing ------------------------------------------------------------------------------------------------

    def channel(self, key: str = "") -> grpc.aio.Channel:
        """The channel for a route key ('' = the balanced one), created on first use."""
        if key not in self._channels:
            c = self.connection
            target, opts = c.target_for(key), c.channel_options()
            self._channels[key] = (grpc.aio.secure_channel(target, c.credentials, opts) if c.credentials
                                   else grpc.aio.insecure_channel(target, opts))
        return self._channels[key]

    def _stub(self, session_id: str, attempt: int) -> Any:
        """The stub for a call's route (Any: grpc-stubs types generated stubs for the sync API only)."""
        return pb_grpc.GeneratorStub(self.channel(self.connection.route(session_id, attempt)))

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout is UNSET else timeout

    async def _unary(self, method: str, call: Callable[[Any, float | None], Awaitable[T]],
                     timeout: float | None, session_id: str = "") -> T:
        deadline = Deadline(timeout)
        attempts = 0
        while True:
            try:
                return await call(self._stub(session_id, attempts), deadline.remaining())
            except grpc.aio.AioRpcError as exc:
                attempts += 1
                delay = deadline.retry_delay(self.retry, attempts) \
                    if exc.code() is grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise from_rpc_error(exc, method, timeout, attempts) from None
                await asyncio.sleep(delay)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the (balanced) channel is connected; Unavailable after `timeout`."""
        from specrpc_client.errors import Unavailable

        try:
            await asyncio.wait_for(self.channel().channel_ready(), timeout)
        except TimeoutError:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, f"not connected to {self.connection.target} within "
                              f"{timeout:g} s", "wait_ready") from None

    # ---- calls ---------------------------------------------------------------------------------------------------

    async def model_info(self, *, timeout: Timeout = UNSET) -> ModelInfo:
        """What the server has loaded."""
        md = self.connection.metadata()
        msg: pb.ModelInfo = await self._unary("GetModelInfo", lambda stub, t: stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=t, metadata=md), self._timeout(timeout))
        return model_info_from(msg)

    def _stream(self, method: str, request: Any, session_id: str, timeout: float | None) -> AsyncGeneration:
        md = self.connection.metadata(session_id)

        def open_call(attempt: int, t: float | None) -> Any:
            return getattr(self._stub(session_id, attempt), method)(request, timeout=t, metadata=md)

        return AsyncGeneration(open_call, method, timeout, self.retry)

    def generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 0, sampling: Sampling | None = None,
                 stop: Sequence[str] = (), speculation: Speculation | None = None, session_id: str = "",
                 truncate_prompt: bool = False, path: str = "", n_indent: int = 0, max_time_ms: int = 0,
                 prefill_only: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                 prediction: str = "", constraint: Constraint | None = None,
                 stream_interval_ms: int | None = None, timeout: Timeout = UNSET) -> AsyncGeneration:
        """Continue a prompt (text or token ids; `path`: the file the text opens); the stream starts now. Call
        inside a running event loop. Editor fields: `n_indent` ends before a new line indented less than that many
        characters, `max_time_ms` ends at the next newline once that budget from the first token is spent,
        `prefill_only` only caches the prompt in the session (the result is a summary alone), `logprobs` (with
        `top_logprobs` alternatives, at most 20) puts each token's log-probability on its chunk. `prediction`: the
        output as predicted (for example the region being rewritten): the server drafts from it, the output is the
        same without it, and the summary counts its accepted and rejected tokens (Infill takes it too).
        `constraint`: what the output must match, for example `Constraint(json_schema={...})` (Infill takes it
        too); a bad schema or grammar is InvalidArgument. `stream_interval_ms`: how often at most the server hands
        tokens over, 0..1000 (0: each step's at once, for a client that times every token; unset: the server's)."""
        request = _core.generate_request(prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                         speculation=speculation, session_id=session_id,
                                         truncate_prompt=truncate_prompt, path=path,
                                         editor=_core.EditorFields(n_indent, max_time_ms, prefill_only, logprobs,
                                                                   top_logprobs, prediction, stream_interval_ms),
                                         constraint=constraint)
        return self._stream("Generate", request, session_id, self._timeout(timeout))

    def rewrite(self, path: str, text: str, region_start: int, region_end: int, cursor: int, *,
                recent_edits: Sequence[str] = (), max_new_tokens: int = 0, sampling: Sampling | None = None,
                speculation: Speculation | None = None, session_id: str = "",
                timeout: Timeout = UNSET) -> AsyncGeneration:
        """Next-edit prediction: the region [region_start, region_end) of `text` (characters) rewritten as the user
        will edit it next, given the cursor and `recent_edits` (unified diffs, oldest first). Chunks stream the
        rewritten region; when it ends, `rewrite` holds the region whole and its changed lines."""
        request = _core.rewrite_request(path, text, region_start, region_end, cursor, recent_edits=recent_edits,
                                        max_new_tokens=max_new_tokens, sampling=sampling, speculation=speculation,
                                        session_id=session_id)
        return self._stream("Rewrite", request, session_id, self._timeout(timeout))

    def infill(self, prefix: str, suffix: str = "", *, extra_files: Sequence[ExtraFile | tuple[str, str]] = (),
               path: str = "", max_new_tokens: int = 0, sampling: Sampling | None = None, stop: Sequence[str] = (),
               speculation: Speculation | None = None, session_id: str = "", typed_line: str = "",
               repo_name: str = "", truncate: bool = False, layout: FimLayout | str = FimLayout.UNSPECIFIED,
               n_indent: int = 0, max_time_ms: int = 0, prefill_only: bool = False, logprobs: bool = False,
               top_logprobs: int = 0, prediction: str = "", constraint: Constraint | None = None,
               stream_interval_ms: int | None = None, timeout: Timeout = UNSET) -> AsyncGeneration:
        """Fill in the middle between prefix and suffix (extra_files: other files as context; typed_line: the
        current line's text before the cursor when sent apart from prefix; repo_name: the repository, for families
        with a repository token; truncate: trim the prompt to fit the context instead of failing; layout: a
        FimLayout or 'psm', 'spm', 'typed_line' — unset is the server's choice)."""
        request = _core.infill_request(prefix, suffix, extra_files=extra_files, path=path,
                                       max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                       speculation=speculation, session_id=session_id, typed_line=typed_line,
                                       repo_name=repo_name, truncate=truncate, layout=layout,
                                       editor=_core.EditorFields(n_indent, max_time_ms, prefill_only, logprobs,
                                                                 top_logprobs, prediction, stream_interval_ms),
                                       constraint=constraint)
        return self._stream("Infill", request, session_id, self._timeout(timeout))

    def completion_session(self, session_id: str | None = None, **defaults: Any) -> CompletionSession:
        """An editor buffer's session (see CompletionSession)."""
        return CompletionSession(self, session_id, **defaults)

    def voice_session(self, session_id: str | None = None, **options: Any) -> VoiceSession:
        """A Converse session for a voice backend (see VoiceSession); use `async with`."""
        return VoiceSession(self, session_id, **options)


class CompletionSession:
    """Completions for one editor buffer: every request cancels the one before (cancel-on-keystroke), and all share
    one session id, so the server reuses the cached prompt prefix (`summary.cached_prompt_tokens`).

    defaults: max_new_tokens, sampling, stop, speculation, constraint, timeout (any option of `generate` that
    `infill` takes too), applied to each request unless overridden.
    """

    def __init__(self, client: AsyncClient, session_id: str | None = None, **defaults: Any) -> None:
        self.client = client
        self.session_id = session_id or uuid.uuid4().hex
        self.defaults = defaults
        self.current: AsyncGeneration | None = None

    def complete(self, prefix: str, **overrides: Any) -> AsyncGeneration:
        """Cancel the request in flight and continue `prefix`."""
        self.cancel()
        self.current = self.client.generate(prefix, session_id=self.session_id, **{**self.defaults, **overrides})
        return self.current

    def infill(self, prefix: str, suffix: str = "", extra_files: Sequence[ExtraFile | tuple[str, str]] = (),
               **overrides: Any) -> AsyncGeneration:
        """Cancel the request in flight and fill in between prefix and suffix."""
        self.cancel()
        self.current = self.client.infill(prefix, suffix, extra_files=extra_files, session_id=self.session_id,
                                          **{**self.defaults, **overrides})
        return self.current

    def cancel(self) -> None:
        """Cancel the request in flight, if any (for example on Escape)."""
        if self.current is not None:
            self.current.cancel()

    async def __aenter__(self) -> CompletionSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


_BARGED = object()
Event = Chunk | Phrase | ToolCall | TurnSummary


class Reply:
    """One reply of a VoiceSession. Iterate it for Phrases (what text-to-speech should say, in order; the iteration
    ends at the reply's end or at a barge-in); `events()` gives chunks, phrases, tool calls and the TurnSummary.
    A tool call's text is in none of the chunks or phrases: it arrives as a ToolCall once complete
    (`tool_calls`)."""

    def __init__(self) -> None:
        self.started_at = time.perf_counter()
        self.chunks: list[Chunk] = []
        self.phrases: list[Phrase] = []
        self.tool_calls: list[ToolCall] = []
        self.summary: TurnSummary | None = None
        self.barged = False
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._finished: asyncio.Future[TurnSummary] = asyncio.get_running_loop().create_future()

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def time_to_first_phrase_ms(self) -> float | None:
        """Client-side: from `say()` to the first phrase's arrival."""
        return self.phrases[0].received_ms if self.phrases else None

    def _put(self, msg: pb.ConverseResponse) -> None:
        kind = msg.WhichOneof("event")
        event: Event
        if kind == "chunk":
            event = chunk_from(msg.chunk)
            self.chunks.append(event)
        elif kind == "phrase":
            event = phrase_from(msg.phrase, (time.perf_counter() - self.started_at) * 1e3)
            self.phrases.append(event)
        elif kind == "tool_call":
            event = tool_call_from(msg.tool_call)
            self.tool_calls.append(event)
        else:
            event = self.summary = turn_summary_from(msg.summary)
            if not self._finished.done():
                self._finished.set_result(event)
        self._queue.put_nowait(event)

    def _fail(self, exc: BaseException) -> None:
        if not self._finished.done():
            self._finished.set_exception(exc)
            self._finished.exception()  # mark retrieved: a reply nobody awaits must not warn
        self._queue.put_nowait(exc)

    def _barge(self) -> None:
        self.barged = True
        self._queue.put_nowait(_BARGED)

    async def events(self) -> AsyncIterator[Event]:
        """Chunks, phrases and tool calls as they arrive, then the TurnSummary."""
        while True:
            event = await self._queue.get()
            if event is _BARGED:
                continue
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, TurnSummary):
                return

    async def __aiter__(self) -> AsyncIterator[Phrase]:
        while not self.barged:
            event = await self._queue.get()
            if event is _BARGED or isinstance(event, TurnSummary):
                return
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, Phrase):
                yield event

    async def done(self) -> TurnSummary:
        """Wait for the reply's end (also after a barge-in); its TurnSummary."""
        return await asyncio.shield(self._finished)


class VoiceSession:
    """A Converse stream in phrase mode for a voice backend.

        async with client.voice_session(system="Be brief.") as voice:
            async for phrase in voice.say("What's the weather like?"):
                tts.speak(phrase.text)              # phrases arrive as they complete
            await voice.barge_in()                  # the user spoke: stop the reply in flight
            await voice.rewind(spoken_chars=42)     # keep only what was actually spoken in the history

    session_id: reuse one to resume a session's history (default: a new random id, sent as `x-session-id`).
    timeout: a deadline for the whole stream (default None: a voice session is long-lived).
    tools: functions the replies may call (Tool, or OpenAI function declarations); tool_choice: 'auto' (the
    default with tools), 'none', 'required', a function's name or a ToolChoice; parallel_tool_calls: whether a
    reply may make several calls (unset: yes). A reply's calls are in `reply.tool_calls` (and its events); answer
    a call with `tool_result(call, result)`, several with `tool_results([(call, result), ...])` (one reply for all).
    stream_interval_ms: how often at most the server hands a reply's tokens over (0: each step's at once, for word
    by word speech; unset: the server's --stream-interval-ms).
    """

    def __init__(self, client: AsyncClient, session_id: str | None = None, *, system: str = "",
                 phrase_mode: bool = True, sampling: Sampling | None = None, speculation: Speculation | None = None,
                 max_new_tokens: int = 0, stop: Sequence[str] = (), tools: ToolDeclarations = (),
                 tool_choice: ToolChoiceLike | None = None, parallel_tool_calls: bool | None = None,
                 stream_interval_ms: int | None = None, timeout: float | None = None) -> None:
        self.client = client
        self.session_id = session_id or uuid.uuid4().hex
        self._start = _core.session_start(self.session_id, system=system, phrase_mode=phrase_mode,
                                          sampling=sampling, speculation=speculation,
                                          max_new_tokens=max_new_tokens, stop=stop, tools=tools,
                                          tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                          stream_interval_ms=stream_interval_ms)
        self.timeout = timeout
        self.started: SessionStarted | None = None
        self._call: Any = None
        self._requests: asyncio.Queue[pb.ConverseRequest | None] = asyncio.Queue()
        self._replies: collections.deque[Reply] = collections.deque()
        self._rewinds: collections.deque[asyncio.Future[Rewound]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def _request_stream(self, queue: asyncio.Queue[pb.ConverseRequest | None]) -> AsyncIterator[
            pb.ConverseRequest]:
        while (request := await queue.get()) is not None:
            yield request

    async def open(self) -> SessionStarted:
        """Open the stream (retrying UNAVAILABLE until the server answers) and wait for SessionStarted."""
        deadline = Deadline(self.timeout)
        md = self.client.connection.metadata(self.session_id)
        attempts = 0
        while True:
            self._requests = asyncio.Queue()
            self._requests.put_nowait(self._start)
            stub = self.client._stub(self.session_id, attempts)
            self._call = stub.Converse(self._request_stream(self._requests), timeout=deadline.remaining(),
                                       metadata=md)
            attempts += 1
            try:
                first = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                delay = deadline.retry_delay(self.client.retry, attempts) \
                    if exc.code() is grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise from_rpc_error(exc, "Converse", self.timeout, attempts) from None
                await asyncio.sleep(delay)
                continue
            if first is EOF or first.WhichOneof("event") != "started":
                raise SpecrpcError(grpc.StatusCode.INTERNAL, "the server did not acknowledge SessionStart",
                                   "Converse")
            s = first.started
            self.started = SessionStarted(s.session_id, s.resumed, s.history_tokens)
            self.session_id = s.session_id
            self._reader = asyncio.create_task(self._read())
            return self.started

    async def _read(self) -> None:
        try:
            while (msg := await self._call.read()) is not EOF:
                kind = msg.WhichOneof("event")
                if kind == "rewound":
                    r = msg.rewound
                    fut = self._rewinds.popleft()
                    if not fut.done():
                        fut.set_result(Rewound(r.kept_chars, r.kept_tokens, r.history_tokens))
                elif self._replies:
                    self._replies[0]._put(msg)
                    if kind == "summary":
                        self._replies.popleft()
            raise SpecrpcError(grpc.StatusCode.CANCELLED, "the Converse stream ended", "Converse")
        except asyncio.CancelledError:
            self._fail(SpecrpcError(grpc.StatusCode.CANCELLED, "the session was closed", "Converse"))
            raise
        except grpc.aio.AioRpcError as exc:
            self._fail(from_rpc_error(exc, "Converse", self.timeout))
        except SpecrpcError as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        while self._replies:
            self._replies.popleft()._fail(exc)
        while self._rewinds:
            fut = self._rewinds.popleft()
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()

    def _send(self, request: pb.ConverseRequest) -> None:
        if self._call is None:
            raise RuntimeError("open the VoiceSession first (`async with` or `await session.open()`)")
        if self._error is not None:
            raise self._error
        self._requests.put_nowait(request)

    @property
    def in_flight(self) -> Reply | None:
        """The reply still being generated, if any."""
        return self._replies[-1] if self._replies else None

    def say(self, text: str, *, role: str = "", sampling: Sampling | None = None, max_new_tokens: int = 0,
            speculation: Speculation | None = None, constraint: Constraint | None = None,
            tools: ToolDeclarations = (), tool_choice: ToolChoiceLike | None = None,
            tool_call_id: str = "", tool_results: ToolResults = ()) -> Reply:
        """Send a turn; iterate the Reply for its phrases. A reply still in flight is cancelled (barged in).
        `constraint`: what this reply must match (not with tools in use); `tools` / `tool_choice`: this reply's,
        instead of the session's; role "tool" with `tool_call_id`: a call's result (see `tool_result`);
        `tool_results`: several calls' results, with empty text (see `tool_results`)."""
        request = _core.turn_request(text, role=role, sampling=sampling, max_new_tokens=max_new_tokens,
                                     speculation=speculation, constraint=constraint, tools=tools,
                                     tool_choice=tool_choice, tool_call_id=tool_call_id, tool_results=tool_results)
        previous = self.in_flight
        if previous is not None:
            previous._barge()
        self._send(request)
        reply = Reply()
        self._replies.append(reply)
        return reply

    def tool_result(self, call: ToolCall | str, result: ToolResultValue, **turn: Any) -> Reply:
        """Send a call's result (text as given, anything else as JSON) as a `tool` turn; the Reply continues the
        conversation. `call`: the ToolCall or its id; `turn`: the options of `say` (tool_choice, max_new_tokens,
        ...)."""
        return self.say(json_text(result), role="tool", tool_call_id=_core.call_id(call), **turn)

    def tool_results(self, results: ToolResults, **turn: Any) -> Reply:
        """Send the results of several calls of the last reply, (the ToolCall or its id, its result) pairs, in one
        `tool` turn: they enter the history in order and one Reply follows (as OpenAI's API takes them). `turn`:
        the options of `say`."""
        return self.say("", role="tool", tool_results=results, **turn)

    async def barge_in(self) -> TurnSummary | None:
        """Stop the reply in flight (within one engine step); its summary, or None when nothing was in flight.
        The part already generated stays in the history: `rewind` to what was actually spoken."""
        reply = self.in_flight
        if reply is None:
            return None
        reply._barge()
        self._send(pb.ConverseRequest(cancel=pb.Cancel()))
        return await reply.done()

    async def rewind(self, spoken_chars: int) -> Rewound:
        """Keep only the first `spoken_chars` characters (code points) of the last reply in the history."""
        fut: asyncio.Future[Rewound] = asyncio.get_running_loop().create_future()
        if self.in_flight is not None:  # the server cancels the reply in flight first
            self.in_flight._barge()
        self._send(pb.ConverseRequest(rewind=pb.Rewind(spoken_chars=spoken_chars, session_id=self.session_id)))
        self._rewinds.append(fut)
        return await fut

    async def close(self) -> None:
        """Cancel what is in flight and close the stream (the server keeps the session until its TTL)."""
        if self._call is None:
            return
        if self._error is None:
            if self.in_flight is not None:
                self.in_flight._barge()
                self._requests.put_nowait(pb.ConverseRequest(cancel=pb.Cancel()))
            self._requests.put_nowait(None)
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> VoiceSession:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
