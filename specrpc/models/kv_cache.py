"""Preallocated per-slot K/V tensors plus one integer length per slot (gpt-fast `KVCache`, with slots).

Positions [0, length) of a slot are valid; everything at or past the length is stale and never attended to, so a
rollback (draft tokens rejected) or a prefix reuse is only a change of the length: no copy, no reallocation.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch


class SlotLengths(ABC):
    """Per-slot valid lengths and the rules every cache enforces: no gaps, nothing past capacity."""

    def __init__(self, num_slots: int, capacity: int) -> None:
        if num_slots < 1 or capacity < 1:
            raise ValueError(f"need at least one slot and one position, got {num_slots} slots × {capacity}")
        self.num_slots = num_slots
        self.capacity = capacity
        self.lengths = [0] * num_slots

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range: this cache has {self.num_slots} slots")

    def length(self, slot: int) -> int:
        """Number of valid positions in `slot`."""
        self._check_slot(slot)
        return self.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to `length` positions (0 <= length <= current length)."""
        self._check_slot(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} to {length}: it holds {self.lengths[slot]} positions")
        self.lengths[slot] = length

    def begin_write(self, slot: int, start: int, count: int) -> None:
        """Check a write of `count` positions at `start` and drop everything from `start` on (prefix reuse)."""
        self._check_slot(slot)
        if count < 1:
            raise ValueError("a forward needs at least one token")
        if not 0 <= start <= self.lengths[slot]:
            raise ValueError(
                f"write at position {start} would leave a gap: slot {slot} holds {self.lengths[slot]} positions"
            )
        if start + count > self.capacity:
            raise ValueError(
                f"positions {start}..{start + count - 1} exceed the cache capacity of {self.capacity}; "
                "shorten the context or build the model with a larger capacity"
            )
        self.truncate(slot, start)

    def commit(self, slot: int, length: int) -> None:
        """Mark positions [0, length) of `slot` valid after a successful write."""
        self.lengths[slot] = length

    def check_copy(self, source: int, slot: int, length: int, start: int) -> None:
        """Check a copy of positions [start, length) of `source` into `slot`, which keeps its own [0, start)."""
        self._check_slot(source)
        self._check_slot(slot)
        if source == slot or not 0 <= start <= min(length, self.lengths[slot]) or length > self.lengths[source]:
            raise ValueError(f"cannot copy positions {start}..{length - 1} of slot {source} (it holds "
                             f"{self.lengths[source]}) into slot {slot} (it holds {self.lengths[slot]})")

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every preallocated K/V tensor (their data_ptr never changes)."""

    def nbytes(self) -> int:
        """Bytes held by the preallocated K/V tensors."""
        return sum(t.nbytes for t in self.tensors())


class KVCache(SlotLengths):
    """K and V for every layer and slot, allocated once: `k`, `v` are [layers, slots, kv_heads, capacity, head_dim]."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(num_slots, capacity)
        shape = (num_layers, num_slots, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, S, H, C, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [L, S, H, C, D]
        self.slot_k = [self.k[:, s] for s in range(num_slots)]  # views [L, H, C, D], made once
        self.slot_v = [self.v[:, s] for s in range(num_slots)]  # views [L, H, C, D]

    def tensors(self) -> list[torch.Tensor]:
        """K and V: 2 · layers · slots · kv_heads · capacity · head_dim elements in all."""
        return [self.k, self.v]

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> None:
        """Positions [start, length) of `source` into `slot`, which keeps its own [0, start) and then holds `length`
        positions: a prompt another slot has cached, taken in one copy of its K/V instead of a prefill."""
        self.check_copy(source, slot, length, start)
        self.k[:, slot, :, start:length] = self.k[:, source, :, start:length]  # [L, H, length - start, D]
        self.v[:, slot, :, start:length] = self.v[:, source, :, start:length]
        self.lengths[slot] = length

    @contextlib.contextmanager
    def borrowed(self, slot: int, positions: int) -> Iterator[None]:
        """`slot` for scratch writes to its first `positions` positions (timing between requests): on leaving, those
        positions' K/V and the slot's length are as they were, so a prompt cached there still serves a prefix."""
        self._check_slot(slot)
        n = min(positions, self.capacity)
        length = self.lengths[slot]
        k = self.k[:, slot, :, :n].clone()  # [L, H, n, D]
        v = self.v[:, slot, :, :n].clone()
        try:
            yield
        finally:
            self.k[:, slot, :, :n] = k
            self.v[:, slot, :, :n] = v
            self.lengths[slot] = length
