"""What both edges (gRPC, HTTP) share per request, below them: the runtime once loaded, admission (draining, the
per-client stream quota, counted across both protocols) and running one generation with its metrics and log line."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Iterable
from dataclasses import replace

import structlog
import torch

from specrpc.config import Config, parse_networks
from specrpc.edges.auth import StreamQuota, bearer_token, client_id_of_token
from specrpc.edges.metrics import Metrics
from specrpc.engine.constraint import InvalidConstraint
from specrpc.serving.runtime import DecodeParams, Runtime
from specrpc.serving.scheduler import Chunk, Done, Failed

log = structlog.get_logger(__name__)


class EngineFailure(RuntimeError):
    """The engine raised while serving this stream: INTERNAL (HTTP 500) for this stream only."""


class DeviceOutOfMemory(RuntimeError):
    """The device ran out of memory while serving this stream: RESOURCE_EXHAUSTED (HTTP 503) for this stream only."""


class NotReady(RuntimeError):
    """The models are still loading or warming up: UNAVAILABLE / HTTP 503 (retry once health reports ready)."""


class ShuttingDown(RuntimeError):
    """The server is draining: UNAVAILABLE / HTTP 503 (retry elsewhere)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation failure: torch's OutOfMemoryError (CUDA and others) or the CPU allocator's error."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


class Gateway:
    """One per server, shared by the gRPC service and the HTTP API."""

    def __init__(self, config: Config, metrics: Metrics, runtime: Runtime | None = None) -> None:
        self.config = config
        self.limits = config.limits
        self.metrics = metrics
        self._runtime = runtime
        self.streams = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self.quota = StreamQuota(self.limits.max_streams_per_client, by_token=bool(config.server.auth_tokens_file),
                                 trusted=parse_networks(config.server.trusted_proxies))

    # ---- runtime -----------------------------------------------------------------------------------------------

    def attach(self, runtime: Runtime) -> None:
        """Start serving with `runtime` (loaded and warm); until then every generation is refused as NotReady."""
        self._runtime = runtime

    @property
    def ready(self) -> bool:
        """The models are loaded and warm, and the server is not draining."""
        return self._runtime is not None and not self.draining

    @property
    def runtime(self) -> Runtime:
        """The loaded runtime, or NotReady while the server starts."""
        if self._runtime is None:
            raise NotReady("the server is starting: models are loading or warming up; retry when the health "
                           "service reports SERVING (HTTP: /health answers 200)")
        return self._runtime

    # ---- admission ---------------------------------------------------------------------------------------------

    def admit(self, peer: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """Admit a generation stream from `peer` (gRPC peer form, e.g. `ipv4:1.2.3.4:5`); returns the client it counts
        against. ShuttingDown while draining, TooManyStreams over --max-streams-per-client. Pair with `leave`."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        client = self.quota.client_id(peer, metadata)
        self.quota.acquire(client)
        self.streams += 1
        self._idle.clear()
        return client

    def leave(self, client: str) -> None:
        """A stream admitted for `client` has ended."""
        self.quota.release(client)
        self.streams -= 1
        if not self.streams:
            self._idle.set()

    def refuse_new_streams(self) -> None:
        """From now on new generation calls are refused as ShuttingDown (the server is draining)."""
        self.draining = True

    async def drained(self) -> None:
        """Return once no generation stream is in flight."""
        await self._idle.wait()

    def count(self, rpc: str, code: str, protocol: str) -> None:
        """Count a finished request by its method, final status (gRPC code name) and protocol."""
        self.metrics.requests.labels(rpc, code, protocol).inc()

    # ---- generation --------------------------------------------------------------------------------------------

    def draft_scope(self, metadata: Iterable[tuple[str, str | bytes]] | None, session_id: str) -> str | None:
        """Whose earlier outputs may draft for a request (the suffix source): its auth token's clients' with auth
        tokens (one tenant's text never drafts for another's), else every client's where the operator shares them
        (--shared-suffix-drafts), else its session's own (None: no session, nothing to draft from)."""
        if self.quota.by_token:
            token = bearer_token(metadata)
            return client_id_of_token(token) if token is not None else None
        if self.config.server.shared_suffix_drafts:
            return "shared"
        return f"session:{session_id}" if session_id else None

    async def stream(self, prompt: list[int], params: DecodeParams, session_id: str, rpc: str,
                     cancel: asyncio.Event | None = None, scope: str | None = None) -> AsyncGenerator[Chunk | Done]:
        """Run one generation and yield its chunks and final Done (accounted in `_account`, even when the client
        goes away before reading it); `scope`: whose earlier outputs draft for it (`draft_scope`). A failed
        generation raises DeviceOutOfMemory, InvalidConstraint (its grammar went past the parser's limits) or
        EngineFailure."""
        last = 0.0
        account = functools.partial(self._account, rpc, session_id)
        async for event in self.runtime.generate(prompt, params, session_id, cancel, account, scope):
            if isinstance(event, Failed):
                if isinstance(event.error, InvalidConstraint):  # the request's grammar outgrew the parser's limits
                    raise event.error
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

    async def stream_choices(self, prompt: list[int], params: DecodeParams, n: int, session_id: str, rpc: str,
                             cancel: asyncio.Event, scope: str | None = None
                             ) -> AsyncGenerator[tuple[int, Chunk | Done]]:
        """`n` independent choices of one prompt, each event with its choice's index: the prompt is prefilled once
        (a prefill-only generation, in the session's slot when one is named), then the choices run together, each
        in a slot of its own that copies the prompt's KV prefix from there. Choice i samples with seed + i when a
        seed is given; `scope` as for `stream`. Yields the prefill's Done first as index -1 (its figures: the prompt
        computed once)."""
        prefill = replace(params, prefill_only=True, constraint=None, logprobs=False, top_logprobs=0, n_indent=0,
                          max_time_ms=0, prediction=())
        async for event in self.stream(prompt, prefill, session_id, rpc, cancel, scope):
            if isinstance(event, Done):
                yield -1, event
        queue: asyncio.Queue[tuple[int, Chunk | Done] | BaseException] = asyncio.Queue()

        async def run(i: int) -> None:
            seed = params.sampling.seed
            sampling = params.sampling if seed is None else replace(params.sampling, seed=(seed + i) % 2**63)
            try:
                async for event in self.stream(prompt, replace(params, sampling=sampling), "", rpc, cancel, scope):
                    queue.put_nowait((i, event))
            except Exception as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(run(i)) for i in range(n)]
        try:
            for _ in range(n):
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if isinstance(item[1], Done):
                        break
        finally:
            cancel.set()  # whatever ended this early ends every choice
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

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
