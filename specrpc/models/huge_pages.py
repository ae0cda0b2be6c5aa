"""Host memory for what a CPU forward reads in full on every step, the packed weights: one arena, in huge pages.

A forward streams every weight byte. In 4 KiB pages the int8 target's 25 MB span 6,200 pages, twice what a Zen 4's
L2 TLB holds, and the hardware prefetchers stop at each page's end; in 2 MiB pages they span 13. The shipped int8
target on a 2-core AMD EPYC Zen 4, its projections packed into one arena in huge pages against each in a tensor of
its own (torch's allocations), the two alternating forward by forward in one process (300 positions; three
processes): 0.93-0.94x the time at one token and 0.93-0.97x at four; float32 (one process) 0.97-0.99x. The same arena
in 4 KiB pages took 0.94-0.99x: most of the gain is one contiguous arena, the rest its pages.

`Arena` maps anonymous memory of its own, aligned to `HUGE_PAGE`, and asks Linux for huge pages there
(madvise(MADV_HUGEPAGE): granted where /sys/kernel/mm/transparent_hugepage/enabled says "madvise" or "always"). Where
the kernel declines, or on a system without the call, the memory is ordinary pages: the same bytes, the same results.
"""

from __future__ import annotations

import contextlib
import mmap
import re

import torch

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 (and the alignment an arena's memory starts at)."""

ALIGN = 64
"""Bytes each tensor an arena hands out is aligned to: a cache line, as the native step's vector loads expect."""


class Arena:
    """`size` bytes of zeroed memory, in huge pages where the kernel grants them, handed out in order by `take`."""

    def __init__(self, size: int) -> None:
        self.size = _round_up(max(size, 1), HUGE_PAGE)  # whole huge pages: a partial one is never granted
        # one huge page more than asked, so that the memory can start at a huge page's boundary
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if advice is not None:
            with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
                self._map.madvise(advice)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
        start = -whole.data_ptr() % HUGE_PAGE
        self.memory = whole[start : start + self.size]  # [size] uint8: the bytes handed out
        self._used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor of `shape` and `dtype` in the arena's next free bytes (aligned to `ALIGN`)."""
        start, end = _span(self._used, shape, dtype)
        if end > self.size:
            raise ValueError(f"arena of {self.size} bytes: no room for {end - start} more after {start}")
        self._used = end
        return self.memory[start:end].view(dtype).view(shape)

    def huge_bytes(self) -> int:
        """Bytes of this arena the kernel backs with huge pages now (Linux's /proc/self/smaps; 0 where it cannot
        tell): what a start-up log reports."""
        first = self.memory.data_ptr()
        try:
            with open("/proc/self/smaps") as fh:
                inside = False
                for line in fh:
                    span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                    if span:
                        inside = int(span.group(1), 16) <= first < int(span.group(2), 16)
                    elif inside and line.startswith("AnonHugePages:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


def aligned_size(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes an arena needs to hand out tensors of these shapes and dtypes in turn (each aligned to `ALIGN`)."""
    total = 0
    for shape, dtype in shapes:
        _, total = _span(total, shape, dtype)
    return total


def _span(used: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """[start, end): the bytes a tensor of `shape` and `dtype` takes after `used` bytes handed out (`ALIGN`ed)."""
    start = _round_up(used, ALIGN)
    return start, start + torch.Size(shape).numel() * dtype.itemsize


def _round_up(n: int, to: int) -> int:
    """n rounded up to a multiple of `to`."""
    return -(-n // to) * to
