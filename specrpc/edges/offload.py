"""Preparing a request off the event loop. Rendering and tokenizing a prompt costs about a second per megabyte on a
small CPU (a tool whose schema holds a 20,000-value enum renders to 290 KB); run on the loop, that second stalls
every stream the edge is delivering. The tokenizer and the chat template's renderer let go of the GIL or are short,
so in a worker thread they leave the loop and the device thread running; the workers run at a lower CPU priority
(nice 10), so on a machine whose cores the forward uses, a large request's preparation waits for the steps rather
than slowing them. Small requests stay on the loop: their preparation costs less than the hop to a thread."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

INLINE_BYTES = 16 * 1024
"""Requests up to this size are prepared on the loop (tens of microseconds to a few milliseconds of tokenizing)."""

PREPARE_NICE = 10
"""How much lower than the device thread's the preparing workers' CPU priority is (Linux thread niceness)."""


def _lower_priority() -> None:
    """Run this worker thread at a lower priority, where the platform lets a thread have its own."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: the process's priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)


_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="specrpc-prepare", initializer=_lower_priority)


async def prepared(build: Callable[[], T], size: int) -> T:
    """`build()` (validation, rendering, tokenizing: no asyncio state) for a request of `size` bytes: inline when
    it is small, else in a low-priority worker thread (with the caller's context variables, as the log's), so the
    loop keeps streaming meanwhile."""
    if size <= INLINE_BYTES:
        return build()
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(context.run, build))
