"""The draft's window: on a long context the draft model catches up on the last `window` tokens alone, not on all of
them. Only the speed depends on what the draft sees (every token it proposes is verified by the target), and a
draft's catch-up on a new prompt is what it costs beside decoding, growing with the prompt. Held to the window, the
catch-up is at most `window` tokens whatever the prompt's length, as drafts over a sliding window of the KV cache do
for long contexts (MagicDec, TriForce); on the shipped pair the acceptance stays where it was (docs/benchmarks.md,
"The draft's window").

A slot that holds a window holds it from its first cache position: context position p is cache position
p - offset, as if the context began there. With rotary position embeddings attention sees the same relative
distances either way; with learned absolute ones the window reads as a text's start. The engine sees context
positions only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specrpc import native
from specrpc.models import BatchRow, CausalLM
from specrpc.models.kv_cache import SlotLengths


def _model_attribute(name: str) -> Any:
    """One of the `CausalLM` protocol's attributes, read and set on the wrapped model."""
    return property(lambda self: getattr(self.model, name), lambda self, value: setattr(self.model, name, value))


class DraftWindow:
    """A draft `CausalLM` at context positions whose slots may hold only the last `window` tokens of their context
    (0: all of it, the model as it is). `catch_up_from` and `takes_chunk` decide where a slot starts over on a
    window; every other call maps context positions to the slot's cache positions."""

    def __init__(self, model: CausalLM, window: int) -> None:
        self.model = model
        self.window = window
        self.offset = [0] * model.num_slots  # each slot's first cached context position

    # --- where a catch-up starts

    def _window_start(self, context: int) -> int:
        """The first context position of the window of a context of `context` tokens."""
        return max(0, context - self.window) if self.window else 0

    def _start_over(self, slot: int, at: int) -> None:
        """The slot holds nothing, its first cache position at context position `at`."""
        self.offset[slot] = at
        self.model.truncate(slot, 0)

    def _restart(self, slot: int, context: int) -> int | None:
        """Where the slot starts over for a catch-up on a context of `context` tokens (None: it catches up from where
        its cache ends): the window's start, where the catch-up would be longer than the window or the slot holds
        less than a window's context before its end (a prefix cut into the window)."""
        start = self._window_start(context)
        if self.window and (self.length(slot) < start or self.offset[slot] > start):
            return start
        return None

    def catch_up_from(self, slot: int, context: int) -> int:
        """Where the draft's catch-up on a context of `context` tokens starts (the slot's length after this): where
        its cache ends, or the window's start where the slot starts over there (`_restart`)."""
        restart = self._restart(slot, context)
        if restart is not None:
            self._start_over(slot, restart)
        return self.length(slot)

    def lag(self, slot: int, context: int) -> int:
        """Tokens `catch_up_from` would leave the catch-up to feed (changing nothing)."""
        restart = self._restart(slot, context)
        return context - (self.length(slot) if restart is None else restart)

    def takes_chunk(self, slot: int, start: int, size: int, context: int) -> bool:
        """Whether a prompt chunk at context positions [start, start + size) of a prompt of `context` tokens goes
        into the draft's cache: where the cache has reached the chunk and the chunk reaches into the window, or where
        the window begins in the chunk (the slot then starts over at `start`). A chunk before the window is skipped."""
        if not self.window:
            return self.length(slot) == start
        first = self._window_start(context)
        if start + size <= first:
            return False
        if self.length(slot) == start and self.offset[slot] <= first:
            return True
        if start <= first:
            self._start_over(slot, start)
            return True
        return False

    # --- the CausalLM protocol at context positions

    name = _model_attribute("name")
    vocab_size = _model_attribute("vocab_size")
    max_context = _model_attribute("max_context")
    num_slots = _model_attribute("num_slots")
    device = _model_attribute("device")
    dtype = _model_attribute("dtype")
    lean_forward = _model_attribute("lean_forward")
    chosen = _model_attribute("chosen")
    remembered = _model_attribute("remembered")

    @property
    def cache(self) -> SlotLengths:
        """The model's own (its lengths are cache positions)."""
        return self.model.cache

    def _at(self, slot: int, start: int) -> int:
        """Context position `start` of `slot` as its cache position, for a forward from there: one from before the
        slot's window (a caller rewriting the slot from its start, as calibration does) starts it over there."""
        if start < self.offset[slot]:
            self._start_over(slot, start)
        return start - self.offset[slot]

    def forward(self, ids: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        return self.model.forward(ids, self._at(slot, start), slot, num_logits)

    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        return self.model.forward_batch([BatchRow(r.ids, self._at(r.slot, r.start), r.slot, r.num_logits)
                                         for r in rows])

    def truncate(self, slot: int, length: int) -> None:
        """Cut the slot to `length` context positions; cut before its window, it holds nothing from there on."""
        if length >= self.offset[slot]:
            self.model.truncate(slot, length - self.offset[slot])
        else:
            self._start_over(slot, length)

    def length(self, slot: int) -> int:
        return self.offset[slot] + self.model.length(slot)

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> bool:
        """Context positions [start, length) of `source` into `slot`, where both hold windows from the same
        position, or where `slot` holds nothing yet (it then takes `source`'s window); False otherwise (the draft
        catches up instead)."""
        offset = self.offset[source]
        if self.offset[slot] != offset:
            if self.model.length(slot) or length <= offset:
                return False
            self._start_over(slot, offset)
            start = offset
        return self.model.copy_prefix(source, slot, length - offset, max(0, start - offset))

    def cache_bytes(self) -> int:
        return self.model.cache_bytes()

    def execution(self) -> list[tuple[str, str]]:
        return self.model.execution()

    def recheck(self, slot: int, busy: Callable[[], bool]) -> str:
        return self.model.recheck(slot, busy)

    def serving(self) -> None:
        self.model.serving()

    # --- the lean model's optional fused drafting paths (None where the model has none)

    def feed_greedy(self, ids: torch.Tensor, start: int, slot: int, k: int,
                    transform: native.DraftTransform | None = None) -> torch.Tensor | None:
        """The model's catch-up on ids [F] at `start` and k greedy drafts [k] in one call, or None where it has no
        such path."""
        fused = getattr(self.model, "feed_greedy", None)
        if fused is None:
            return None
        drafted: torch.Tensor | None = fused(ids, self._at(slot, start), slot, k, transform)
        return drafted

    def greedy_draft(self, logits: torch.Tensor, position: int, slot: int, k: int) -> torch.Tensor | None:
        """k greedy tokens [k] from the model's captured k-step loop, or None where it has none."""
        loop = getattr(self.model, "greedy_draft", None)
        if loop is None:
            return None
        tokens: torch.Tensor | None = loop(logits, self._at(slot, position), slot, k)
        return tokens
