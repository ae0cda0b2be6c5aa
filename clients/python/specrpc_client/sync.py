"""Blocking client: Client, streams as Generation, Conversation (Converse) — for scripts, the CLI and threads."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

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
from specrpc_client.errors import SpecrpcError, Unavailable, from_rpc_error
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


class Generation:
    """One Generate/Infill stream (blocking). Iterate it for Chunks; `summary` is set when it ends. `cancel()` may
    be called from another thread: the iteration then stops quietly with `finish_reason` CANCELLED."""

    def __init__(self, open_call: Callable[[int, float | None], Any], method: str, timeout: float | None,
                 retry: RetryPolicy) -> None:
        self.method = method
        self._open = open_call
        self._deadline = Deadline(timeout)
        self._retry = retry
        self._attempts = 1
        self._cancelled = False
        self._iterator: Iterator[Chunk] | None = None
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
        return "".join(c.text for c in self.chunks)

    @property
    def finish_reason(self) -> FinishReason | None:
        if self.summary is not None:
            return self.summary.finish_reason
        return FinishReason.CANCELLED if self._cancelled else None

    @property
    def done(self) -> bool:
        return self.summary is not None or self._cancelled

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_at is None else (self.first_token_at - self.started_at) * 1e3

    def cancel(self) -> None:
        if self.done:
            return
        self._cancelled = True
        self.ended_at = time.perf_counter()
        self._call.cancel()

    def __iter__(self) -> Iterator[Chunk]:
        if self._iterator is None:
            self._iterator = self._iterate()
        return self._iterator

    def result(self) -> Summary | None:
        """Read to the end; the summary (None when cancelled)."""
        for _ in self:
            pass
        return self.summary

    def _iterate(self) -> Iterator[Chunk]:
        started = False
        try:
            while not self._cancelled:
                try:
                    for msg in self._call:
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
                    return
                except grpc.RpcError as exc:
                    code = exc.code()
                    if self._cancelled and code is grpc.StatusCode.CANCELLED:
                        return
                    delay = self._deadline.retry_delay(self._retry, self._attempts) \
                        if code is grpc.StatusCode.UNAVAILABLE and not started else None
                    if delay is None:
                        self.error = from_rpc_error(exc, self.method, self._deadline.timeout, self._attempts)
                        raise self.error from None
                    time.sleep(delay)
                    if self._cancelled:
                        return
                    self._call = self._open(self._attempts, self._deadline.remaining())
                    self._attempts += 1
        finally:
            if not self.done and self.error is None:
                self._cancelled = True
                self._call.cancel()


class Client:
    """Blocking client for specrpc.v1.Generator; the same options as AsyncClient."""

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
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, key: str = "") -> grpc.Channel:
        if key not in self._channels:
            c = self.connection
            target, opts = c.target_for(key), c.channel_options()
            self._channels[key] = (grpc.secure_channel(target, c.credentials, opts) if c.credentials
                                   else grpc.insecure_channel(target, opts))
        return self._channels[key]

    def _stub(self, session_id: str, attempt: int) -> pb_grpc.GeneratorStub:
        return pb_grpc.GeneratorStub(self.channel(self.connection.route(session_id, attempt)))

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout is UNSET else timeout

    def _unary(self, method: str, call: Callable[[pb_grpc.GeneratorStub, float | None], T],
               timeout: float | None) -> T:
        deadline = Deadline(timeout)
        attempts = 0
        while True:
            try:
                return call(self._stub("", attempts), deadline.remaining())
            except grpc.RpcError as exc:
                attempts += 1
                code = exc.code()
                delay = deadline.retry_delay(self.retry, attempts) if code is grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise from_rpc_error(exc, method, timeout, attempts) from None
                time.sleep(delay)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel is connected; Unavailable after `timeout`."""
        try:
            grpc.channel_ready_future(self.channel()).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, f"not connected to {self.connection.target} within "
                              f"{timeout:g} s", "wait_ready") from None

    def model_info(self, *, timeout: Timeout = UNSET) -> ModelInfo:
        md = self.connection.metadata()
        msg = self._unary("GetModelInfo", lambda stub, t: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t,
                                                                            metadata=md), self._timeout(timeout))
        return model_info_from(msg)

    def _stream(self, method: str, request: Any, session_id: str, timeout: float | None) -> Generation:
        md = self.connection.metadata(session_id)

        def open_call(attempt: int, t: float | None) -> Any:
            return getattr(self._stub(session_id, attempt), method)(request, timeout=t, metadata=md)

        return Generation(open_call, method, timeout, self.retry)

    def generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 0, sampling: Sampling | None = None,
                 stop: Sequence[str] = (), speculation: Speculation | None = None, session_id: str = "",
                 truncate_prompt: bool = False, path: str = "", n_indent: int = 0, max_time_ms: int = 0,
                 prefill_only: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                 prediction: str = "", constraint: Constraint | None = None,
                 stream_interval_ms: int | None = None, timeout: Timeout = UNSET) -> Generation:
        """Continue a prompt (the parameters of AsyncClient.generate)."""
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
                timeout: Timeout = UNSET) -> Generation:
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
               stream_interval_ms: int | None = None, timeout: Timeout = UNSET) -> Generation:
        """Fill in the middle between prefix and suffix (the parameters of AsyncClient.infill)."""
        request = _core.infill_request(prefix, suffix, extra_files=extra_files, path=path,
                                       max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                       speculation=speculation, session_id=session_id, typed_line=typed_line,
                                       repo_name=repo_name, truncate=truncate, layout=layout,
                                       editor=_core.EditorFields(n_indent, max_time_ms, prefill_only, logprobs,
                                                                 top_logprobs, prediction, stream_interval_ms),
                                       constraint=constraint)
        return self._stream("Infill", request, session_id, self._timeout(timeout))

    def conversation(self, session_id: str | None = None, **options: Any) -> Conversation:
        """A blocking Converse session (see Conversation); use `with`."""
        return Conversation(self, session_id, **options)


_CLOSE = object()


Event = Chunk | Phrase | ToolCall | TurnSummary


class Conversation:
    """A blocking Converse session: `say(text)` yields the reply's chunks, phrases (phrase mode), tool calls and
    TurnSummary; `tool_result(call, result)` answers a call, `tool_results([(call, result), ...])` several at once
    (one reply); `cancel()` (any thread) stops the reply in flight; `rewind(n)` keeps n spoken characters of the
    last reply. `tools`, `tool_choice`, `parallel_tool_calls` and `stream_interval_ms` as in VoiceSession."""

    def __init__(self, client: Client, session_id: str | None = None, *, system: str = "", phrase_mode: bool = False,
                 sampling: Sampling | None = None, speculation: Speculation | None = None, max_new_tokens: int = 0,
                 stop: Sequence[str] = (), tools: ToolDeclarations = (), tool_choice: ToolChoiceLike | None = None,
                 parallel_tool_calls: bool | None = None, stream_interval_ms: int | None = None,
                 timeout: float | None = None) -> None:
        self.client = client
        self.session_id = session_id or uuid.uuid4().hex
        self._start = _core.session_start(self.session_id, system=system, phrase_mode=phrase_mode,
                                          sampling=sampling, speculation=speculation,
                                          max_new_tokens=max_new_tokens, stop=stop, tools=tools,
                                          tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                          stream_interval_ms=stream_interval_ms)
        self.timeout = timeout
        self.started: SessionStarted | None = None
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses: Any = None
        self._open_turns = 0  # turns sent whose summary has not been read yet

    def _request_iter(self, q: queue.Queue[Any]) -> Iterator[pb.ConverseRequest]:
        while (item := q.get()) is not _CLOSE:
            yield item

    def open(self) -> SessionStarted:
        deadline = Deadline(self.timeout)
        md = self.client.connection.metadata(self.session_id)
        attempts = 0
        while True:
            self._requests = queue.Queue()
            self._requests.put(self._start)
            stub = self.client._stub(self.session_id, attempts)
            self._responses = stub.Converse(self._request_iter(self._requests), timeout=deadline.remaining(),
                                            metadata=md)
            attempts += 1
            try:
                first = next(self._responses)
            except grpc.RpcError as exc:
                code = exc.code()
                delay = deadline.retry_delay(self.client.retry, attempts) \
                    if code is grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise from_rpc_error(exc, "Converse", self.timeout, attempts) from None
                time.sleep(delay)
                continue
            s = first.started
            self.started = SessionStarted(s.session_id, s.resumed, s.history_tokens)
            self.session_id = s.session_id
            return self.started

    def _next(self) -> pb.ConverseResponse:
        try:
            return cast(pb.ConverseResponse, next(self._responses))
        except StopIteration:
            raise SpecrpcError(grpc.StatusCode.CANCELLED, "the Converse stream ended", "Converse") from None
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "Converse", self.timeout) from None

    def say(self, text: str, *, role: str = "", sampling: Sampling | None = None, max_new_tokens: int = 0,
            speculation: Speculation | None = None, constraint: Constraint | None = None,
            tools: ToolDeclarations = (), tool_choice: ToolChoiceLike | None = None,
            tool_call_id: str = "", tool_results: ToolResults = ()) -> Iterator[Event]:
        """Send a turn and yield its events up to and including the TurnSummary (`cancel()` ends it early; a turn
        left unread is cancelled by the server when the next one is sent, and its events are skipped). The other
        options as in VoiceSession.say."""
        self._requests.put(_core.turn_request(text, role=role, sampling=sampling, max_new_tokens=max_new_tokens,
                                              speculation=speculation, constraint=constraint, tools=tools,
                                              tool_choice=tool_choice, tool_call_id=tool_call_id,
                                              tool_results=tool_results))
        self._open_turns += 1
        return self._reply(time.perf_counter())

    def tool_result(self, call: ToolCall | str, result: ToolResultValue, **turn: Any) -> Iterator[Event]:
        """Send a call's result (text as given, anything else as JSON) as a `tool` turn and yield the reply's
        events, as `say` does (`turn`: its options)."""
        return self.say(json_text(result), role="tool", tool_call_id=_core.call_id(call), **turn)

    def tool_results(self, results: ToolResults, **turn: Any) -> Iterator[Event]:
        """Send the results of several calls of the last reply, (the ToolCall or its id, its result) pairs, in one
        `tool` turn and yield the one reply's events, as `say` does (`turn`: its options)."""
        return self.say("", role="tool", tool_results=results, **turn)

    def _reply(self, started: float) -> Iterator[Event]:
        self._skip_open_turns_but_last()
        while True:
            msg = self._next()
            kind = msg.WhichOneof("event")
            if kind == "chunk":
                yield chunk_from(msg.chunk)
            elif kind == "phrase":
                yield phrase_from(msg.phrase, (time.perf_counter() - started) * 1e3)
            elif kind == "tool_call":
                yield tool_call_from(msg.tool_call)
            elif kind == "summary":
                self._open_turns -= 1
                yield turn_summary_from(msg.summary)
                return

    def _skip_open_turns_but_last(self) -> None:
        while self._open_turns > 1:
            if self._next().WhichOneof("event") == "summary":
                self._open_turns -= 1

    def cancel(self) -> None:
        """Stop the reply in flight (barge-in); safe from any thread."""
        self._requests.put(pb.ConverseRequest(cancel=pb.Cancel()))

    def rewind(self, spoken_chars: int) -> Rewound:
        """Keep only the first `spoken_chars` characters of the last reply in the history."""
        self._requests.put(pb.ConverseRequest(rewind=pb.Rewind(spoken_chars=spoken_chars,
                                                               session_id=self.session_id)))
        while True:
            msg = self._next()
            kind = msg.WhichOneof("event")
            if kind == "summary":  # the reply in flight, cancelled by the rewind, or one left unread
                self._open_turns -= 1
            elif kind == "rewound":
                r = msg.rewound
                return Rewound(r.kept_chars, r.kept_tokens, r.history_tokens)

    def close(self) -> None:
        if self._responses is None:
            return
        self._requests.put(_CLOSE)
        self._responses.cancel()

    def __enter__(self) -> Conversation:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
