"""Preparing a request off the event loop. Rendering and tokenizing a prompt costs about a second per megabyte on a
small CPU (a tool whose schema holds a 20,000-value enum renders to 290 KB); run on the loop, that second stalls
every stream the edge is delivering. The tokenizer and the chat template's renderer let go of the GIL or are short,
so in a worker thread they leave the loop and the device thread running. Small requests stay on the loop: their
preparation costs less than the hop to a thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INLINE_BYTES = 16 * 1024
"""Requests up to this size are prepared on the loop (tens of microseconds to a few milliseconds of tokenizing)."""


async def prepared(build: Callable[[], T], size: int) -> T:
    """`build()` (validation, rendering, tokenizing: no asyncio state) for a request of `size` bytes: inline when
    it is small, else in a worker thread, so the loop keeps streaming meanwhile."""
    if size <= INLINE_BYTES:
        return build()
    return await asyncio.to_thread(build)
