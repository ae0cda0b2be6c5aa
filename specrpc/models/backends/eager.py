"""The eager torch forward as a backend: one slot's forward (`run`, a forward asking only its last logits padded to
a bucket size, so that no shape is met first in a request) and several slots' in one (`run_rows`)."""

from __future__ import annotations

import torch

from specrpc.models.batch import BatchRow
from specrpc.models.kv_cache import KVCache
from specrpc.models.llama.forward import llama_forward, llama_forward_batch
from specrpc.models.llama.weights import LlamaWeights


def bucket_sizes(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from the first one >= `smallest` up to `largest`, and `largest` itself: the token counts eager
    forwards are padded to, so that every shape a request can meet was met at load."""
    if largest < smallest:
        return ()
    sizes = [1 << max(0, smallest - 1).bit_length()]
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    return tuple(sorted({*(s for s in sizes if s < largest), largest}))


def bucket_for(count: int, sizes: tuple[int, ...], room: int) -> int:
    """The smallest size >= `count` that fits in `room` positions; `count` itself when none does."""
    return next((s for s in sizes if count <= s <= room), count)



def run(w: LlamaWeights, cache: KVCache, ids: torch.Tensor, start: int, slot: int, num_logits: int,
        buckets: tuple[int, ...]) -> torch.Tensor:
    """ids [T] at positions start..start+T-1 of `slot` → float32 logits [num_logits, V] of the last positions; asking
    one, the ids are padded with zeros to the smallest of `buckets` that fits (`bucket_for`), whose K/V lie past the
    slot's length, where nothing reads them."""
    count = ids.shape[0]
    size = bucket_for(count, buckets, cache.capacity - start) if num_logits == 1 else count
    padded = ids if size == count else torch.cat([ids, ids.new_zeros(size - count)])  # [size]
    return llama_forward(w, cache.slot_k[slot], cache.slot_v[slot], padded, start, num_logits, count)


def run_rows(w: LlamaWeights, cache: KVCache, rows: list[BatchRow]) -> list[torch.Tensor]:
    """Several slots in one forward (`llama_forward_batch`) → per row float32 logits [num_logits, V]."""
    return llama_forward_batch(w, cache.k, cache.v, rows)
