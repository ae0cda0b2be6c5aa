"""Prefix reuse: a new prompt keeps what its slot's caches already hold of it, and takes a longer cached prefix from
another slot where one holds more (a system prompt many clients send, a file several editors complete in)."""

from __future__ import annotations

from collections.abc import Iterable

from specrpc.engine.generation import Slot
from specrpc.engine.window import DraftWindow
from specrpc.models import CausalLM


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (list comparisons, halving the span where they differ)."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference, if any, lies in [lo, hi)
    if a[:n] == b[:n]:
        return n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def prefix_source(target: CausalLM, slots: Iterable[Slot], index: int, prompt: list[int]) -> tuple[Slot, int] | None:
    """The slot other than `index` whose target cache holds the longest prefix of `prompt`, and its length (its
    draft's may be shorter); None where no other slot holds any."""
    best: tuple[Slot, int] | None = None
    for other in slots:
        if other.index == index:
            continue
        held = min(common_prefix(other.tokens, prompt), target.length(other.index))
        if held > (best[1] if best is not None else 0):
            best = (other, held)
    return best


def reuse_prefix(target: CausalLM, draft: DraftWindow | None, slots: Iterable[Slot], slot: Slot,
                 prompt: list[int]) -> int:
    """Cut `slot`'s caches to the prefix they share with `prompt`, extended by a copy from another slot's cache
    where that one holds more of it. Returns the prompt tokens now in the target's cache: at least the last one is
    recomputed."""
    shared = common_prefix(slot.tokens, prompt)
    keep = min(target.length(slot.index), shared, len(prompt) - 1)
    target.truncate(slot.index, keep)
    draft_keep = 0
    if draft is not None:
        draft_keep = min(draft.length(slot.index), shared)
        draft.truncate(slot.index, draft_keep)
    source = prefix_source(target, slots, slot.index, prompt)
    if source is not None:
        other, held = source
        taken = min(held, len(prompt) - 1)
        if taken > keep and target.copy_prefix(other.index, slot.index, taken, keep):
            keep = taken
        if draft is not None:
            theirs = min(held, draft.length(other.index))
            if theirs > draft_keep:
                draft.copy_prefix(other.index, slot.index, theirs, draft_keep)
    return keep
