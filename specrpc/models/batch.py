"""A batched forward's rows: several KV slots in one model call, each row with its own new tokens (ragged) at its
own positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchRow:
    """New tokens ids [T] at positions start..start+T-1 of `slot`, and how many of the last positions' logits to
    return (prefill asks 1, verify k+1)."""

    ids: torch.Tensor  # [T] int64
    start: int
    slot: int
    num_logits: int = 1


def check_rows(rows: list[BatchRow]) -> None:
    """ValueError unless there is at least one row, each slot at most once, and each row asks 1..T logits."""
    if not rows:
        raise ValueError("a batched forward needs at least one row")
    slots = [r.slot for r in rows]
    if len(set(slots)) != len(slots):
        raise ValueError(f"a batched forward takes each slot once, got slots {slots}")
    for r in rows:
        if not 1 <= r.num_logits <= r.ids.shape[0]:
            raise ValueError(f"num_logits must be in 1..{r.ids.shape[0]} (slot {r.slot}), got {r.num_logits}")
