"""One thread owns the device: each device step advances every active generation by one step, together in one
batched engine step (`Engine.step`, `--batching on`) or one after the other (round-robin, `--batching off`),
and hands events back to the asyncio loop (a deque per job, woken with `call_soon_threadsafe` from a waker thread as
the next forward starts, a job's reader at most once per `--stream-interval-ms`). Cancellation is checked between
steps, and between the streams' deliveries of a batched step."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from specrpc.engine.constraint import InvalidConstraint
from specrpc.engine.engine import Engine
from specrpc.engine.generation import Generation, GenerationRequest, GenerationStats, Slot, StepResult, TokenLogprob
from specrpc.prompts.text import IncrementalDetokenizer, LineGuard, StopMatcher

log = structlog.get_logger(__name__)

T = TypeVar("T")

FINISH_CANCELLED = "cancelled"


@dataclass(frozen=True)
class Chunk:
    """Text and tokens committed by one step."""

    text: str
    token_ids: list[int]
    accepted: int
    at: float
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for them

    def joined(self, later: Chunk) -> Chunk:
        """This chunk and the one after it as one (both waited for the same wake-up of the reader)."""
        return Chunk(self.text + later.text, self.token_ids + later.token_ids, self.accepted + later.accepted,
                     later.at, self.logprobs + later.logprobs)


@dataclass(frozen=True)
class Done:
    """The end of a job: why, its figures, and the stop string that ended it (if any)."""

    finish: str
    stats: GenerationStats
    stop_sequence: str
    text: str
    at: float
    arrival: float
    first_token_at: float | None
    started_at: float | None = None  # when the device thread took the job up (queue time = started_at - arrival)


@dataclass(frozen=True)
class Failed:
    """The engine raised for this job only."""

    error: BaseException


Event = Chunk | Done | Failed


@dataclass
class Job:
    """One generation in flight, from the event loop's side: its events in order, and a cancel flag.

    The device thread appends events to `inbox` and wakes the loop once per burst it has not yet seen (a deque
    append is thread-safe), so a step costs one `call_soon_threadsafe` at most and no asyncio.Queue hops; chunks
    that wait for the same wake-up reach the reader as one."""

    slot: Slot
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    loop: asyncio.AbstractEventLoop
    guard: LineGuard = field(default_factory=LineGuard)  # n_indent and the time budget (editor completions)
    max_time_s: float = 0.0  # time budget from the first token, ended at the next newline; 0: none
    interval_s: float | None = None  # the request's stream interval (`post`); None: the scheduler's
    inbox: deque[Event] = field(default_factory=deque)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    text: list[str] = field(default_factory=list)
    generation: Generation | None = None
    on_done: Callable[[], None] | None = None
    on_final: Callable[[Done], None] | None = None  # on the loop, with the Done event, even if nobody reads it
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    started_at: float | None = None
    done_posted: bool = False  # device thread only: the final event has been handed to the loop
    wake_at: float = 0.0  # device thread: when the pending wake-up is due (perf_counter seconds)
    _wake_pending: bool = field(default=False, init=False)  # a wake-up is on its way to the loop
    _waiter: asyncio.Future[None] | None = field(default=None, init=False)  # the reader waiting in `get`

    def cancel(self) -> None:
        """Ask the device thread to stop this job before its next step."""
        self.cancelled.set()

    async def get(self) -> Event:
        """On the loop: the next event, in the order the device thread produced them (chunks waiting together as
        one)."""
        while not self.inbox:
            self._waiter = self.loop.create_future()
            await self._waiter
        event = self.inbox.popleft()
        while isinstance(event, Chunk) and self.inbox and isinstance(later := self.inbox[0], Chunk):
            self.inbox.popleft()
            event = event.joined(later)
        return event

    def post(self, event: Chunk, wakes: list[Job], interval_s: float = 0.0) -> None:
        """From the device thread: deliver a chunk to the loop. The loop is not woken here: a job whose reader has no
        wake-up pending joins `wakes`, to be woken (`Waker`) at once after its first chunk, else `interval_s` after
        its last wake-up at the earliest; chunks posted until then wait for that wake-up."""
        self.inbox.append(event)
        if not self._wake_pending:
            self._wake_pending = True
            now = time.perf_counter()
            self.wake_at = max(now, self.wake_at + interval_s) if self.wake_at else now
            wakes.append(self)

    def _wake(self) -> None:
        self._wake_pending = False  # before the reader runs: a chunk appended after this schedules a new wake-up
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self, event: Done | Failed) -> None:
        """From the device thread, once the engine no longer touches the slot: release it, then deliver the final
        event, in one loop callback, so that a client holding the summary never sees its slot still in use."""
        self._call(self._complete, event)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (process exit): nobody is listening any more
            log.debug("event loop closed; event dropped", slot=self.slot.index)

    def _complete(self, event: Done | Failed) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done()
        self.inbox.append(event)  # after every chunk: the device thread appended those before finishing
        if isinstance(event, Done) and self.on_final is not None:
            self.on_final(event)
        self._wake()


def wake_all(jobs: list[Job]) -> None:
    """From the waker thread: wake the readers of `jobs` (posted with `wakes`) with one loop callback per event
    loop; each `call_soon_threadsafe` writes the loop's wake-up socket, and eight of them per step cost the device
    thread more than a millisecond (the GIL goes to the loop's thread at each)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
    for job in jobs:
        by_loop.setdefault(job.loop, []).append(job)
    for group in by_loop.values():
        group[0]._call(_wake_each, group)


def _wake_each(jobs: list[Job]) -> None:
    """On the loop: wake each job's reader."""
    for job in jobs:
        job._wake()


class Waker:
    """A thread that wakes readers (`wake_all`) for the device thread, each when its `wake_at` is due. Handing it a
    step's jobs keeps the interpreter (a queue put); its `call_soon_threadsafe` lets go of the interpreter at the
    loop's wake-up socket, and the loop then holds it for its work on the chunks (0.7 ms a step at 8 streams on a
    2-core AMD EPYC). Done on the device thread, that work ran before the forward began, the device thread waiting
    for the interpreter; done here as the forward starts, it runs while the forward, which holds no interpreter,
    computes."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Job] | None] = queue.SimpleQueue()
        self._due: list[tuple[float, int, Job]] = []  # waker thread only: a heap by wake_at
        self._order = itertools.count()
        self.thread = threading.Thread(target=self._run, name="specrpc-waker", daemon=True)

    def wake(self, jobs: list[Job]) -> None:
        """Wake the readers of `jobs`, each at its `wake_at` (in order of hand-over), from the waker thread."""
        self._queue.put(jobs)

    def stop(self) -> None:
        """Wake what was handed over, then end the thread."""
        self._queue.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            wait = max(0.0, self._due[0][0] - time.perf_counter()) if self._due else None
            try:
                jobs = self._queue.get(timeout=wait)
            except queue.Empty:
                jobs = []
            if jobs is None:
                wake_all([job for _, _, job in sorted(self._due)])
                return
            for job in jobs:
                heapq.heappush(self._due, (job.wake_at, next(self._order), job))
            now, due = time.perf_counter(), []
            while self._due and self._due[0][0] <= now:
                due.append(heapq.heappop(self._due)[2])
            if due:
                wake_all(due)


class Scheduler:
    """Every active job one step per device step, batched or round-robin, on a dedicated thread."""

    def __init__(self, engine: Engine, on_step: Callable[[Job, StepResult, float], None] | None = None,
                 batching: bool = True, stream_interval_s: float = 0.0,
                 on_idle: Callable[[Callable[[], bool]], float | None] | None = None,
                 idle_after_s: float = 1.0) -> None:
        """`batching`: one batched engine step for all jobs (`--batching on`), else round-robin.
        `stream_interval_s`: a job's reader is woken at most this often (its first chunk at once), unless the job
        brings its own (`Job.interval_s`). `on_idle(busy)`: run on the device thread once the device has had nothing
        to do for `idle_after_s`, once per such spell (work done since makes another) unless it returns the seconds
        after which it wants to run again in the same spell; it should give way as soon as `busy()` says a job or a
        call waits."""
        self.engine = engine
        self.batching = batching
        self.stream_interval_s = stream_interval_s
        self.on_step = on_step
        self.on_idle = on_idle
        self.idle_after_s = idle_after_s
        self._idle_at: float | None = None  # when `on_idle` runs if no work comes first (None: not before work)
        self._jobs: list[Job] = []
        self._incoming: list[Job] = []
        self._wakes: list[Job] = []  # device thread: jobs posted to by the last batched step, not yet woken
        self._waker = Waker()
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="specrpc-device", daemon=True)

    def start(self) -> None:
        """Start the device thread (and its waker)."""
        self._waker.thread.start()
        self._thread.start()

    def stop(self) -> None:
        """Cancel every job and every call not yet run, and join the device thread."""
        with self._wake:
            self._stop = True
            for job in self._jobs + self._incoming:
                job.cancel()
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._waker.stop()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the device thread before its next step (calibration, benchmarks): torch work stays on one
        thread, so the process keeps one OpenMP team (see `specrpc.openmp`)."""
        future: Future[T] = Future()
        with self._wake:
            if self._stop or not self._thread.is_alive():
                raise RuntimeError("the scheduler is not running")
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    @property
    def active(self) -> int:
        """Jobs in flight (including those not started yet)."""
        return len(self._jobs) + len(self._incoming)

    def submit(self, job: Job) -> None:
        """Queue a job; the device thread starts it at its next turn."""
        with self._wake:
            if self._stop:
                raise RuntimeError("the scheduler is stopped")
            self._incoming.append(job)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            if not self.batching or not self._jobs:  # no batched step comes to wake them
                self._wake_posted()
            with self._wake:
                work = None if self._wait() else self._take_work()
            if work is None:  # the device idle long enough
                self._run_idle()
                continue
            calls, jobs = work
            if calls is None:
                return
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # the caller's to handle; the device thread goes on
                        future.set_exception(exc)
            if self.batching:
                self._step_together(jobs)
                continue
            for job in jobs:
                self._reap_cancelled()
                if job.done_posted:
                    continue
                final = self._advance(job)
                if final is not None:
                    self._finish(job, final)

    def _wait(self) -> bool:
        """(Holding `_wake`.) Wait for work; True where the device stayed idle until `on_idle` is due instead."""
        while not self._stop and not self._jobs and not self._incoming and not self._calls:
            if self._idle_at is None:
                self._wake.wait()
                continue
            left = self._idle_at - time.monotonic()
            if left <= 0:
                self._idle_at = None
                return True
            self._wake.wait(left)
        if self.on_idle is not None:
            self._idle_at = time.monotonic() + self.idle_after_s
        return False

    def _run_idle(self) -> None:
        """`on_idle`, giving way to any job or call that comes (its failure logged: the thread goes on)."""
        assert self.on_idle is not None
        try:
            again = self.on_idle(lambda: bool(self._incoming or self._calls or self._stop))
        except Exception:
            log.exception("idle task failed")
            return
        if again is not None:  # a later call in this spell (work coming first sets its own time)
            self._idle_at = time.monotonic() + max(0.0, again)

    def _take_work(self) -> tuple[list[tuple[Callable[[], Any], Future[Any]]] | None, list[Job]]:
        """(Holding `_wake`.) The calls to run and the jobs to step; calls None once stopped with nothing left."""
        calls, self._calls = self._calls, []
        if self._stop:  # calls are not run once stopping (jobs still get their final events)
            for _, future in calls:
                future.cancel()
            calls = []
            if not self._jobs and not self._incoming:
                return None, []
        self._jobs.extend(self._incoming)
        self._incoming.clear()
        return calls, list(self._jobs)

    def _step_together(self, jobs: list[Job]) -> None:
        """One batched engine step for every job still running, then each one's events (cancelled jobs reaped before
        the step and between deliveries)."""
        self._reap_cancelled()
        ready: list[Job] = []
        for job in jobs:
            if job.done_posted:
                continue
            try:
                started = self._begin(job)
            except Exception as exc:
                self._finish(job, self._fail(job, exc))
                continue
            if not started:
                self._finish(job, self._done(job, FINISH_CANCELLED, ""))
                continue
            ready.append(job)
        if not ready:
            self._wake_posted()
            return
        t0 = time.perf_counter()
        try:
            results = self.engine.step([job.generation for job in ready if job.generation is not None],
                                       on_device=self._wake_posted)
        except Exception as exc:  # outside any one stream's share: every stream of the step fails, the thread goes on
            results = [exc] * len(ready)
        seconds = time.perf_counter() - t0
        wakes = self._wakes  # woken as the next step's forward starts, or by `_run` once no job is left
        for job, result in zip(ready, results, strict=True):
            if job.done_posted:
                continue
            try:
                if isinstance(result, Exception):
                    raise result
                final = self._deliver(job, result, seconds, wakes)
            except Exception as exc:
                final = self._fail(job, exc)
            if final is not None:
                self._finish(job, final)
            self._reap_cancelled()

    def _wake_posted(self) -> None:
        """Wake the readers of what the last batched step posted, through the waker thread (`Waker`). The next step
        calls this as its first forward starts: the device thread lets go of the interpreter there, and the event
        loop's work on those chunks runs beside the forward instead of before it."""
        wakes, self._wakes = self._wakes, []
        if wakes:
            self._waker.wake(wakes)

    def _finish(self, job: Job, final: Done | Failed) -> None:
        with self._wake:
            self._jobs.remove(job)
        job.done_posted = True
        job.finish(final)

    def _reap_cancelled(self) -> None:
        """End every cancelled job now, before the next step of any job: a cancelled stream's slot is free within
        one engine step, not after a whole round of the other streams' steps (a client that cancels and asks again
        at once, as editors do on each keystroke, would otherwise find every slot still held)."""
        for job in [j for j in self._jobs if j.cancelled.is_set() and not j.done_posted]:
            self._finish(job, self._done(job, FINISH_CANCELLED, ""))

    def _advance(self, job: Job) -> Done | Failed | None:
        """One step of `job` alone; its final event once it has ended."""
        try:
            if not self._begin(job):
                return self._done(job, FINISH_CANCELLED, "")
            assert job.generation is not None
            t0 = time.perf_counter()
            result = self.engine.step_one(job.generation)
            wakes: list[Job] = []
            final = self._deliver(job, result, time.perf_counter() - t0, wakes)
            if wakes:
                self._waker.wake(wakes)
            return final
        except Exception as exc:  # the failure belongs to this stream only
            return self._fail(job, exc)

    def _begin(self, job: Job) -> bool:
        """Start `job`'s generation on its first turn; False when it was cancelled (it must not step)."""
        if job.generation is None:
            job.started_at = time.perf_counter()
            job.generation = self.engine.start(job.slot, job.request)
        return not job.cancelled.is_set()

    def _fail(self, job: Job, exc: Exception) -> Failed:
        """The failure belongs to this stream only: forget its slot's (maybe half-written) cache. Called while
        handling `exc` (logged with its traceback, but for a grammar that outgrew the parser: the request's fault)."""
        if isinstance(exc, InvalidConstraint):
            log.warning("constraint outgrew the parser", slot=job.slot.index, error=str(exc))
        else:
            log.exception("engine step failed", slot=job.slot.index)
        self.engine.reset_slot(job.slot)
        return Failed(exc)

    def _deliver(self, job: Job, result: StepResult, seconds: float, wakes: list[Job]) -> Done | Failed | None:
        """Hand one step's tokens to the loop (detokenized, through stop strings and the line guard; its reader to
        be woken through `wakes` by the caller); the final event once the job has ended."""
        if self.on_step is not None:
            self.on_step(job, result, seconds)
        if not result.token_ids and result.finish is None:
            return None
        delta = job.detokenizer.push(result.token_ids)
        finish = result.finish
        if finish is not None:
            delta += job.detokenizer.flush()
        safe, stopped = job.stops.feed(delta)
        if finish is not None and not stopped:
            safe += job.stops.flush()
            stopped = job.stops.matched is not None
        now = time.perf_counter()
        if job.first_token_at is None and result.token_ids:
            job.first_token_at = now
        out_of_time = (job.max_time_s > 0 and job.first_token_at is not None
                       and now - job.first_token_at > job.max_time_s)
        safe, limited = job.guard.feed(safe, out_of_time)
        if limited is None and (stopped or finish is not None):
            safe += job.guard.flush()
        job.text.append(safe)
        if safe or result.token_ids:  # a prefill-only request ends without any
            job.post(Chunk(safe, result.token_ids, result.accepted, now, result.logprobs), wakes,
                     self.stream_interval_s if job.interval_s is None else job.interval_s)
        if limited is not None:
            return self._done(job, limited, "")
        if stopped:
            return self._done(job, "stop", job.stops.matched or "")
        if finish is not None:
            return self._done(job, finish, "")
        return None

    def _done(self, job: Job, finish: str, stop_sequence: str) -> Done:
        if job.generation is not None and job.request.prediction is not None:
            job.generation.count_prediction()  # once, whatever ended the request
        # a job cancelled before its first step has no generation: its prompt still counts, as a superseded one's
        stats = (job.generation.stats if job.generation is not None
                 else GenerationStats(prompt_tokens=len(job.request.prompt_ids)))
        return Done(finish, stats, stop_sequence, "".join(job.text), time.perf_counter(), job.arrival,
                    job.first_token_at, job.started_at)
