"""The packed weights' memory (`huge_pages.Arena`): aligned, zeroed, alive as long as any tensor in it, and in huge
pages where the kernel grants them."""

from __future__ import annotations

import gc
import itertools
import mmap
from pathlib import Path

import pytest
import torch
from engine_helpers import native_draft_step

from specrpc.models.huge_pages import ALIGN, HUGE_PAGE, Arena, aligned_size

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_an_arena_hands_out_aligned_zeroed_tensors_that_outlive_it() -> None:
    shapes = [((1000, 3), torch.float32), ((7,), torch.uint8), ((3, 5, 16, 4), torch.uint8), ((129,), torch.int32)]
    arena = Arena(aligned_size(shapes))
    assert arena.size % HUGE_PAGE == 0 and arena.size >= aligned_size(shapes)
    tensors = [arena.take(shape, dtype) for shape, dtype in shapes]
    assert tensors[0].data_ptr() % HUGE_PAGE == 0, "the memory starts at a huge page's boundary"
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), "no two overlap"
    assert all(t.shape == shape and t.dtype == dtype and not t.any() for t, (shape, dtype) in
               zip(tensors, shapes, strict=True))
    with pytest.raises(ValueError, match="no room"):
        arena.take((arena.size,), torch.uint8)
    del arena
    gc.collect()
    for i, t in enumerate(tensors):  # the mapping lives on in its tensors
        t.fill_(i + 1)
    assert [int(t.flatten()[-1]) for t in tensors] == [1, 2, 3, 4]


def test_without_the_huge_page_call_an_arena_is_ordinary_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system whose mmap has no MADV_HUGEPAGE (not Linux): the same arena in ordinary pages, none of them huge."""
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    arena = Arena(2 * HUGE_PAGE)
    t = arena.take((2 * HUGE_PAGE // 4,), torch.float32)
    t.fill_(0.5)
    assert float(t.sum()) == HUGE_PAGE // 4
    if not (THP.exists() and "[always]" in THP.read_text()):  # "always" backs any large mapping with them, unasked
        assert arena.huge_bytes() == 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_an_arena_is_in_huge_pages_where_the_kernel_offers_them() -> None:
    arena = Arena(4 * HUGE_PAGE)
    arena.take((4 * HUGE_PAGE,), torch.uint8).fill_(1)
    assert arena.huge_bytes() >= HUGE_PAGE, "a touched arena of 8 MiB holds at least one huge page"


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_the_native_step_packs_every_projection_into_one_arena(int8: bool) -> None:
    step = native_draft_step(int8)
    first = step.arena.memory.data_ptr()
    layers = step.model.layer
    pointers = [getattr(layers[i], name) for i in range(step.model.layers) for name in ("qkv", "o", "up", "down")]
    pointers.append(step.model.head)
    assert all(first <= p < first + step.arena.size for p in pointers)
