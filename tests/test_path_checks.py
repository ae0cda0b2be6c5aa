"""When idle spells check the models' paths chosen at load (`PathChecks`, `--recheck-s`): not before the server is
warm, at most every interval, and at once after a request cut a check short, so that a re-measure under way goes on
in the next gap."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from specrpc.config import build_config
from specrpc.serving.path_checks import PathChecks


class Model:
    """A model's side of a check: what each `recheck` returns, and whether a request comes during it."""

    def __init__(self, answers: list[str], request_comes: list[bool]) -> None:
        self.answers, self.request_comes = answers, request_comes
        self.slots: list[int] = []
        self.requests = 0

    def recheck(self, slot: int, busy: Callable[[], bool]) -> str:
        self.slots.append(slot)
        if self.request_comes.pop(0):
            self.requests += 1
        return self.answers.pop(0)

    def execution(self) -> list[tuple[str, str]]:
        return [("1", "native, prefetch none"), ("2+", "torch")]


def test_checks_wait_for_the_interval_but_resume_at_once_after_a_request_cut_one_short() -> None:
    target = Model(["", "one-token forwards took 3.00 ms, 1.50 ms after the paths were chosen", ""],
                   [True, False, False])
    draft = Model(["", ""], [False, False])
    requests = [0]

    def busy() -> bool:  # a request waits once the target's first check saw one come, until the step takes it
        return target.requests > requests[0]

    checks = PathChecks({"target": target, "draft": draft}, every_s=3600.0)  # type: ignore[dict-item]
    assert checks(busy) == [] and target.slots == [], "nothing before the server is warm"
    checks.start()
    assert checks(busy) == [] and target.slots == [], "nothing before the interval"
    checks.every_s = 0.0
    assert checks(busy) == [] and target.slots == [0] and draft.slots == [], "the request stops the round"
    requests[0] = target.requests  # the request was served; the next idle spell comes
    checks.every_s = 3600.0
    chosen = checks(busy)
    assert chosen == [("target", "one-token forwards took 3.00 ms, 1.50 ms after the paths were chosen")]
    assert target.slots == [0, 0] and draft.slots == [0], "resumed at once, the interval notwithstanding"
    assert checks(busy) == [] and target.slots == [0, 0], "then the interval again"
    checks.checked_at = time.monotonic() - 3601.0
    assert checks(busy) == [] and target.slots == [0, 0, 0] and draft.slots == [0, 0]


def test_the_interval_defaults_to_a_minute_and_is_validated() -> None:
    assert build_config(None, env={}).engine.recheck_s == 60.0
    assert build_config(None, env={"SPECRPC_RECHECK_S": "0"}).engine.recheck_s == 0.0
    with pytest.raises(ValueError, match="--recheck-s must be >= 0"):
        build_config(None, env={"SPECRPC_RECHECK_S": "-1"})


def test_an_idle_server_is_checked_again_when_the_interval_is_up() -> None:
    """As the scheduler's `on_idle`, the checks ask to run again when the next is due (so a server idle for long is
    checked every interval); before the server is warm, nothing checked and the interval asked."""
    model = Model(["", ""], [False, False])
    checks = PathChecks({"target": model}, every_s=30.0)  # type: ignore[dict-item]
    assert checks.idle(lambda: False) == 30.0 and model.slots == []
    checks.start()
    assert 29.0 < checks.idle(lambda: False) <= 30.0 and model.slots == [], "not due yet: when it is"
    checks.checked_at = time.monotonic() - 31.0
    assert 29.0 < checks.idle(lambda: False) <= 30.0 and model.slots == [0], "checked, the next in 30 s"
