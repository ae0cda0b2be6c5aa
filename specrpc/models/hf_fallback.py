"""CausalLM over any transformers `AutoModelForCausalLM`, with one preallocated `StaticCache` per slot.

In transformers 5.24 a StaticCache layer tracks its own fill level (`cumulative_length`) and ignores positions passed
in, so the length of a slot is that counter and a rollback is `StaticCache.crop(-n)`. The causal mask is built from
the counter (query offset) over the whole preallocated length, so entries left past the length after a rollback are
hidden, then overwritten by the next write.

A batched forward (`forward_batch`) runs its rows one after the other: each slot is its own StaticCache object,
which a transformers forward takes one at a time, so stacking slots would mean copying every row's cache in and
out. The engine's batching is then a loop here (correct, not faster); the lean forward batches for real.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from specrpc.models.batch import BatchRow, check_rows
from specrpc.models.kv_cache import SlotLengths


class StaticSlotCache(SlotLengths):
    """One transformers StaticCache per slot; truncating a slot crops its cache."""

    def __init__(self, config: PreTrainedConfig, num_slots: int, capacity: int) -> None:
        super().__init__(num_slots, capacity)
        self.caches = [StaticCache(config=config, max_cache_len=capacity) for _ in range(num_slots)]
        if not all(c.is_croppable for c in self.caches):
            raise ValueError(
                "this model's cache cannot be rolled back (sliding window shorter than the capacity, or recurrent "
                "layers); speculative decoding needs rollback"
            )

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to `length` positions."""
        removed = self.length(slot) - length
        super().truncate(slot, length)
        if removed:
            self.caches[slot].crop(-removed)  # static layers take the count to remove as a negative number

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> bool:
        """Positions [start, length) of `source` into `slot`, which keeps its own [0, start) and then holds `length`
        positions (`KVCache.copy_prefix`); False, nothing changed, where a layer is not a plain static one (a
        sliding window keeps its own positions)."""
        self.check_copy(source, slot, length, start)
        theirs, mine = self._static_layers(source), self._static_layers(slot)
        if theirs is None or mine is None:
            return False
        self.truncate(slot, start)
        with torch.inference_mode():  # the layers' tensors were made under it, by the forwards
            for a, b in zip(theirs, mine, strict=True):
                assert a.keys is not None and a.values is not None and b.keys is not None and b.values is not None
                b.keys[:, :, start:length] = a.keys[:, :, start:length]  # [1, H, length - start, D]
                b.values[:, :, start:length] = a.values[:, :, start:length]
                b.cumulative_length.add_(length - start)  # the layer's own fill level, as its `update` advances it
        self.commit(slot, length)
        return True

    def _static_layers(self, slot: int) -> list[StaticLayer] | None:
        """`slot`'s layers where every one is a plain, allocated StaticLayer (not a subclass: a sliding window layer
        is one, and keeps its own positions); else None."""
        layers = [layer for layer in self.caches[slot].layers  # isinstance: the type mypy narrows to
                  if isinstance(layer, StaticLayer) and type(layer) is StaticLayer and layer.is_initialized]
        return layers if len(layers) == len(self.caches[slot].layers) else None

    def tensors(self) -> list[torch.Tensor]:
        """Every slot's K and V per layer (allocated at model construction)."""
        out: list[torch.Tensor] = []
        for cache in self.caches:
            for layer in cache.layers:
                if isinstance(layer, StaticLayer) and layer.keys is not None and layer.values is not None:
                    out += [layer.keys, layer.values]  # each [1, H, C, D]
        return out


class HFCausalLM:
    """CausalLM over a transformers model; every slot is allocated at construction."""

    lean_forward = False
    chosen = ""
    remembered: bool | None = None

    def __init__(self, name: str, model: PreTrainedModel, *, num_slots: int, max_context: int) -> None:
        self.name = name
        self.model = model
        embed = cast(torch.Tensor, model.get_input_embeddings().weight)  # [V, d]
        self.vocab_size = int(embed.shape[0])
        self.max_context = max_context
        self.num_slots = num_slots
        self.device = model.device
        self.dtype = model.dtype
        self.cache = StaticSlotCache(model.config, num_slots, max_context)
        self._positions = torch.arange(max_context, device=self.device)  # [C]
        for slot in range(num_slots):  # StaticCache allocates lazily: do it now, not on the first request
            self.forward(torch.zeros(1, dtype=torch.int64, device=self.device), 0, slot)
            self.truncate(slot, 0)

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        num_slots: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> HFCausalLM:
        """Load with AutoModelForCausalLM (local files only, eval mode); slots hold `max_context` positions."""
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        model.to(device)  # type: ignore[arg-type]  # transformers types `to` as Module.to unbound
        return cls(path.name, model, num_slots=num_slots, max_context=max_context)

    def forward(self, ids: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 of `slot` → float32 logits [num_logits, V] of the last positions."""
        count = ids.shape[0]
        if not 1 <= num_logits <= count:
            raise ValueError(f"num_logits must be in 1..{count}, got {num_logits}")
        self.cache.begin_write(slot, start, count)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids[None],  # [1, T]
                position_ids=self._positions[start : start + count][None],  # [1, T]
                cache=self.cache.caches[slot],
                use_cache=True,
                logits_to_keep=num_logits,
            )
        self.cache.commit(slot, start + count)
        logits: torch.Tensor = out.logits[0].float()  # [num_logits, V]
        return logits

    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """Each row's `forward`, in order (see the module docstring) → per row float32 logits [num_logits, V]."""
        check_rows(rows)
        return [self.forward(r.ids, r.start, r.slot, r.num_logits) for r in rows]

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to `length` positions."""
        self.cache.truncate(slot, length)

    def length(self, slot: int) -> int:
        """Valid positions in `slot`."""
        return self.cache.length(slot)

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> bool:
        """`slot` takes positions [start, length) of `source` (`StaticSlotCache.copy_prefix`); False where this
        model's cache layers cannot be copied (the prompt is prefilled instead)."""
        return self.cache.copy_prefix(source, slot, length, start)

    def cache_bytes(self) -> int:
        """Bytes of the preallocated K/V tensors."""
        return self.cache.nbytes()

    def execution(self) -> list[tuple[str, str]]:
        """Every forward through transformers."""
        return [("any", "transformers")]

    def recheck(self, slot: int, busy: Callable[[], bool]) -> str:
        """Nothing to choose between: every forward takes transformers."""
        return ""

    def serving(self) -> None:
        """Nothing to choose: every forward takes transformers."""
