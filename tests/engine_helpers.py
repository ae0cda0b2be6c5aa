"""Helpers for tests that drive the engine directly."""

from __future__ import annotations

from specrpc.engine import Engine, GenerationRequest, Slot


def decode(engine: Engine, slot: Slot, request: GenerationRequest) -> list[int]:
    """Every token `request` generates on `slot`, stepping the engine until it finishes."""
    gen = engine.start(slot, request)
    out: list[int] = []
    while not gen.finished:
        out += gen.step().token_ids
    return out
