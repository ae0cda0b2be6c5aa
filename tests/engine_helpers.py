"""Helpers for tests that drive the engine directly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest, Slot
from specrpc.models.backends.native import NativeStep


def decode(engine: Engine, slot: Slot, request: GenerationRequest) -> list[int]:
    """Every token `request` generates on `slot`, stepping the engine until it finishes."""
    gen = engine.start(slot, request)
    out: list[int] = []
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    return out


def decode_together(engine: Engine, runs: list[tuple[Slot, GenerationRequest, int]]
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """Every request on its slot, advanced together by `Engine.step`; a request joins at the step its `int`
    says. Returns each request's tokens, and per step the tokens each running request got (-1: not running)."""
    gens = [engine.start(slot, request) for slot, request, _ in runs]
    out: list[list[int]] = [[] for _ in runs]
    steps: list[list[int]] = []
    step = 0
    while not all(g.finished for g in gens):
        running = [i for i, (g, (_, _, join)) in enumerate(zip(gens, runs, strict=True))
                   if join <= step and not g.finished]
        got = [-1] * len(runs)
        for i, result in zip(running, engine.step([gens[i] for i in running]), strict=True):
            assert not isinstance(result, Exception), result
            out[i] += result.token_ids
            got[i] = len(result.token_ids)
        steps.append(got)
        step += 1
    return out, steps


def requires_native(wanted: bool = True) -> None:
    """Skip a test that needs the native decode step where this machine cannot build it (no C++ compiler): the
    torch forward then serves every step, which the other tests cover."""
    from specrpc import native

    if wanted and native.library() is None:
        pytest.skip("the native decode step could not be built here (no C++ compiler)")


def native_draft_step(int8: bool) -> NativeStep:
    """The shipped draft's native step at float32 or int8 weights (one slot, 64 positions); the test skipped where
    this machine has no native step or, for int8, no int8 kernel."""
    from specrpc.config import ASSETS
    from specrpc.models import load_model
    from specrpc.models.llama import LlamaLM, int8_available

    requires_native()
    cpu = torch.device("cpu")
    if int8 and not int8_available(cpu):
        pytest.skip("no int8 kernel")
    lm = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=64,
                    int8_weights=int8, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    return lm.native


def counted_calls(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[int]:
    """A list that grows by one at every call of the method `owner.name` (patched for the test, still run)."""
    calls: list[int] = []
    method = getattr(owner, name)

    def counted(self: object, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
