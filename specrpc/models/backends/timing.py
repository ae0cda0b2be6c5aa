"""Timing at load, made to survive noisy neighbours: the paths compared run in turn, round after round (A B C, B C A,
C A B, …), and each keeps the lower quartile of its rounds. Someone else's work only ever adds time to a call, and on
a shared 2-core machine it stalled more than half of them at times (a one-token forward of a tiny model: 0.09 ms
alone, 190 ms in 9 of 10 calls while three neighbours ran tests), which moves a median but not the lower quartile."""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

_busy: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("busy", default=None)


class Interrupted(Exception):
    """Timing stopped before its end: the device has work to do (`interruptible`)."""


@contextlib.contextmanager
def interruptible(busy: Callable[[], bool]) -> Iterator[None]:
    """Within it, `interleaved_samples` raises `Interrupted` before any round once `busy()` says the device has
    other work: timing done between requests (`LlamaLM.recheck`) gives way to the next one within a round."""
    token = _busy.set(busy)
    try:
        yield
    finally:
        _busy.reset(token)


def timing_ids(count: int, vocab: int, device: torch.device | None = None) -> torch.Tensor:
    """`count` token ids [count] for the forwards a timing runs: spread over the vocabulary, the same each time."""
    return (torch.arange(count, device=device) * 7919) % vocab  # [count]


def interleaved_samples(runs: Sequence[Callable[[], object]], repeats: int, warm: int = 1) -> list[list[float]]:
    """Seconds of each call of each of `runs` over `repeats` rounds: each round calls every run once, the order
    rotated by one each round (no run always follows the same other), each timed call after `warm` untimed ones of
    the same run (its weights in the caches as during a run of such steps); a first round is untimed. Inside
    `interruptible`, `Interrupted` before a round once the device is wanted."""
    times: list[list[float]] = [[] for _ in runs]
    busy = _busy.get()
    for r in range(repeats + 1):
        if busy is not None and busy():
            raise Interrupted
        for j in range(len(runs)):
            i = (j + r) % len(runs)
            for _ in range(warm):
                runs[i]()
            t0 = time.perf_counter()
            runs[i]()
            if r:
                times[i].append(time.perf_counter() - t0)
    return times


def interleaved_times(runs: Sequence[Callable[[], object]], repeats: int, warm: int = 1) -> list[float]:
    """Seconds for one call of each of `runs`, the lower quartile over `repeats` rounds (at least 2) of
    `interleaved_samples`."""
    return [statistics.quantiles(t, n=4)[0] for t in interleaved_samples(runs, repeats, warm)]


@dataclass
class Drift:
    """When the paths a model chose at load are measured again: a one-token forward through them, timed between
    requests as at load (`LlamaLM.recheck`), against its time right after the choice. Beyond `tolerance` either way
    on `confirm` checks in a row (a neighbour's load came or went, the clock changed, or a burst at load left the
    choice wrong), the choice is made again; one check off alone is a burst, and changes nothing."""

    tolerance: float = 1.25
    confirm: int = 2
    reference_s: float = 0.0  # the one-token forward's seconds right after the paths were chosen
    last_s: float = 0.0  # and at the last check
    strikes: int = 0  # checks off by more than `tolerance` in a row

    def drifted(self, seconds: float) -> bool:
        """Whether the paths should be measured again, after a check that took `seconds`."""
        self.last_s = seconds
        if self.reference_s <= 0.0:
            self.settled(seconds)
            return False
        self.strikes = 0 if self.within(seconds, self.reference_s) else self.strikes + 1
        return self.strikes >= self.confirm

    def within(self, seconds: float, reference_s: float) -> bool:
        """Whether `seconds` is within `tolerance` of `reference_s`, either way."""
        return 1.0 / self.tolerance <= seconds / reference_s <= self.tolerance

    def settled(self, seconds: float) -> None:
        """The paths were (re)chosen, and a one-token forward through them takes `seconds`."""
        self.reference_s = seconds
        self.strikes = 0
