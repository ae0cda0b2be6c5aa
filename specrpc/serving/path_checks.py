"""When the device thread's idle spells check the models' paths chosen at load (`CausalLM.recheck`, `--recheck-s`):
every so often at most, and at once in the next spell where a request cut the last check short, so that a re-measure
under way goes on in the next gap instead of a whole interval later."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from specrpc.models import CausalLM, execution_line

log = structlog.get_logger(__name__)


class PathChecks:
    """The scheduler's `on_idle` for `models` (name → model), at most every `every_s` seconds from `start`."""

    def __init__(self, models: dict[str, CausalLM], every_s: float) -> None:
        self.models = models
        self.every_s = every_s
        self.checked_at: float | None = None  # None: not started (the server is not warm yet)
        self.cut = False  # a request stopped the last check short

    def start(self) -> None:
        """The server is warm: the first check comes `every_s` from now."""
        self.checked_at = time.monotonic()

    def __call__(self, busy: Callable[[], bool]) -> list[tuple[str, str]]:
        """Check each model (on slot 0: no request holds a slot while the device is idle, and a check puts back
        what it caches) unless it is too soon; returns (model, why) for each whose paths were chosen again, each
        logged with its new table."""
        now = time.monotonic()
        if self.checked_at is None or (not self.cut and now - self.checked_at < self.every_s):
            return []
        self.checked_at = now
        chosen: list[tuple[str, str]] = []
        for name, model in self.models.items():
            if busy():
                break
            why = model.recheck(0, busy)
            if why:
                chosen.append((name, why))
                log.info("execution chosen again", model=name, why=why, execution=execution_line(model.execution()))
        self.cut = busy()
        return chosen

    def idle(self, busy: Callable[[], bool]) -> float:
        """The scheduler's `on_idle`: the checks due (`__call__`), then the seconds until the next is due, so that a
        server idle for long checks every `every_s` too (a remembered choice is confirmed without waiting for
        traffic). Before the server is warm (the spell right after the warm-up's call can come first), the
        interval: the first check is due one interval after warm; after a check, an interval from its end (a
        re-measure can take longer than the interval)."""
        before = self.checked_at
        self(busy)
        if self.checked_at is None or self.checked_at != before:
            return self.every_s
        return self.every_s - (time.monotonic() - self.checked_at)
