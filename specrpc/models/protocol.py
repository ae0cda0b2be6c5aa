"""The CausalLM protocol every model the engine runs implements (lean Llama-family forward, transformers
fallback)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import torch

from specrpc.models.batch import BatchRow
from specrpc.models.kv_cache import SlotLengths


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM with `num_slots` preallocated KV slots; one thread drives it."""

    name: str  # directory name
    vocab_size: int  # embedding rows (may exceed the tokenizer's vocabulary: padded rows)
    max_context: int  # positions per slot this instance was built for (KV capacity, verify reserve included)
    num_slots: int
    device: torch.device
    dtype: torch.dtype
    lean_forward: bool  # specrpc's own forward (CUDA graphs possible), not the transformers fallback
    chosen: str  # how its paths were chosen at load (measured, or remembered from an earlier start); "": no choice
    remembered: bool | None  # paths taken from an earlier start's (True), measured and kept (False), not kept (None)

    @property
    def cache(self) -> SlotLengths:
        """Owner of the per-slot lengths; `tensors()` lists the preallocated K/V tensors."""
        ...

    def forward(self, ids: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        """ids [T] int64 at positions start..start+T-1 of `slot`; writes their K/V into the slot; attends to the slot's
        positions [0, start) plus the new tokens causally; sets the slot length to start+T; returns float32 logits
        [num_logits, V] for the LAST num_logits positions (prefill asks 1, verify asks k+1). Needs
        start <= length(slot) and start+T <= max_context (ValueError otherwise); start < length overwrites."""
        ...

    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """Several slots in one call, each row as `forward` would run it alone (its own tokens at its own positions
        of its own slot, each slot at most once) → per row float32 logits [num_logits, V]."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """Rollback / prefix reuse: set the slot length (must be <= current)."""
        ...

    def length(self, slot: int) -> int:
        """Valid positions in `slot`."""
        ...

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> bool:
        """Positions [start, length) of `source` into `slot` (start <= length(slot), length <= length(source)), which
        then holds `length` positions; False where this model cannot copy between slots (the prompt is then
        prefilled)."""
        ...

    def cache_bytes(self) -> int:
        """Bytes of the preallocated K/V tensors."""
        ...

    def execution(self) -> list[tuple[str, str]]:
        """Which path runs forwards of each length, as (tokens a forward, path) rows in length order: what the
        start-up log prints and GetModelInfo reports."""
        ...

    def recheck(self, slot: int, busy: Callable[[], bool]) -> str:
        """Between requests (the device idle): check that the paths chosen at load still run as fast as then, on
        `slot` (whatever it caches is left as it was), and where they do not, choose again (stopping once `busy()`);
        why the choice was made again, empty where it was not (`execution` then says what it is)."""
        ...

    def serving(self) -> None:
        """The server is warm (its start-up measurements done): what is left to choose by the forwards served is
        chosen so from now on."""
        ...


def execution_line(rows: Iterable[tuple[str, str]]) -> str:
    """`CausalLM.execution()`'s (tokens a forward, path) rows in one line, as the logs and the bench give them
    ("1: native, prefetch none; 2-16: …")."""
    return "; ".join(f"{tokens}: {path}" for tokens, path in rows)
