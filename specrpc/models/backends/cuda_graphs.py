"""CUDA graphs for the short forwards of decoding: a draft step (1 token), a verify step (k+1 tokens), and a greedy
draft's whole k-step loop (one replay per proposal).

A small model's decode step on a GPU is bound by launching its ~15 kernels per layer, not by the GPU; replaying a
captured graph launches them all at once. `llama_forward_static` has shapes that depend only on the token count, so
one graph per (slot, tokens, logits) serves every position. All of them (tokens 1..max, logits 1 or all) are captured
when the model is built: a capture in the middle of a request would stall it for milliseconds and teach the
speculation policy that verifying is dear. A forward of a shape met for the first time also stalls on the GPU
(kernels load lazily), so short forwards that ask only their last logits replay graphs piece by piece; longer ones
(prefill chunks) run eagerly, padded to a few sizes met at load (`LlamaLM.buckets`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specrpc.models.llama.forward import greedy_draft_static, llama_forward_static
from specrpc.models.llama.weights import LlamaWeights

CHUNKS = 4
"""Forwards of up to CHUNKS × max_tokens tokens that ask only the last logits replay graphs in pieces."""


def capture(run: Callable[[], torch.Tensor], device: torch.device, pool: Any
            ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `run` once on a side stream (lazy cuBLAS / attention initialisation must not happen inside a capture),
    then capture it into a graph drawing on `pool`; returns the graph and the tensor its replays write."""
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [T] int64, static input
    pos: torch.Tensor  # [T] int64, static input
    logits: torch.Tensor  # [num_logits, V] float32, static output


class GraphedForward:
    """Replays `llama_forward_static` from CUDA graphs for forwards of at most `max_tokens` tokens."""

    def __init__(self, weights: LlamaWeights, slot_k: list[torch.Tensor], slot_v: list[torch.Tensor],
                 max_tokens: int) -> None:
        """Capture every (slot, tokens <= max_tokens, logits 1 or all); writes only stale K/V (empty slots)."""
        self.weights = weights
        self.slot_k, self.slot_v = slot_k, slot_v  # per slot [L, H_kv, C, D], preallocated
        self.max_tokens = max_tokens
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        zeros = torch.zeros(max_tokens, dtype=torch.long, device=weights.embed.device)  # [max_tokens]
        with torch.inference_mode():
            for slot in range(len(slot_k)):
                for count in range(1, max_tokens + 1):
                    for num_logits in sorted({1, count}):
                        self.graphs[slot, count, num_logits] = self._capture(zeros[:count], 0, slot, num_logits)

    def covers(self, count: int, num_logits: int) -> bool:
        """Whether a forward of `count` tokens asking `num_logits` logits replays graphs: up to max_tokens, or a
        few times that when only the last logits are asked (a draft catching up, a short prompt), in pieces."""
        if num_logits == 1:
            return count <= CHUNKS * self.max_tokens
        return count <= self.max_tokens and num_logits == count

    def forward(self, ids: torch.Tensor, start: int, slot: int, num_logits: int) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 of `slot` → logits [num_logits, V] float32 (`covers` must hold)."""
        step = self.max_tokens
        for lo in range(0, ids.shape[0] - step, step):  # all pieces but the last; their logits are not needed
            self._replay(ids[lo : lo + step], start + lo, slot, 1)
        lo = (ids.shape[0] - 1) // step * step
        return self._replay(ids[lo:], start + lo, slot, num_logits).clone()  # the next replay overwrites it

    def _replay(self, ids: torch.Tensor, start: int, slot: int, num_logits: int) -> torch.Tensor:
        """One graph's replay; returns its static output."""
        count = ids.shape[0]
        g = self.graphs[slot, count, num_logits]
        g.ids.copy_(ids, non_blocking=True)
        g.pos.copy_(self.weights.positions[start : start + count], non_blocking=True)
        g.graph.replay()
        return g.logits

    def _capture(self, ids: torch.Tensor, start: int, slot: int, num_logits: int) -> _Graph:
        """The graph of one forward shape (warmed up first, see `capture`); it reads its inputs from the static
        copies made here."""
        w, k, v = self.weights, self.slot_k[slot], self.slot_v[slot]
        static_ids = ids.clone()  # [T]
        static_pos = w.positions[start : start + ids.shape[0]].clone()  # [T]
        graph, logits = capture(lambda: llama_forward_static(w, k, v, static_ids, static_pos, num_logits),
                                static_ids.device, self.pool)  # logits [num_logits, V]
        return _Graph(graph, static_ids, static_pos, logits)


@dataclass(frozen=True)
class _LoopGraph:
    graph: torch.cuda.CUDAGraph
    first: torch.Tensor  # [1] int64, static input: the first drafted token
    base: torch.Tensor  # [1] int64, static input: its position
    tokens: torch.Tensor  # [steps + 1] int64, static output


class GraphedDraftLoop:
    """A greedy draft's k-step loop (`greedy_draft_static`) as one graph replay per proposal: one launch instead of
    one per token per layer, and no host sync until the proposal's tokens are read."""

    def __init__(self, weights: LlamaWeights, slot_k: list[torch.Tensor], slot_v: list[torch.Tensor],
                 max_steps: int) -> None:
        """Capture every (slot, 1..max_steps forwards); writes only stale K/V (empty slots)."""
        self.weights = weights
        self.slot_k, self.slot_v = slot_k, slot_v
        self.max_steps = max_steps
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _LoopGraph] = {}
        with torch.inference_mode():
            for slot in range(len(slot_k)):
                for steps in range(1, max_steps + 1):
                    self.graphs[slot, steps] = self._capture(slot, steps)

    def run(self, first: torch.Tensor, position: int, slot: int, steps: int) -> torch.Tensor:
        """Tokens [steps + 1]: `first` [1] at `position` and the `steps` greedy tokens after it (a copy)."""
        g = self.graphs[slot, steps]
        g.first.copy_(first, non_blocking=True)
        g.base.copy_(self.weights.positions[position : position + 1], non_blocking=True)
        g.graph.replay()
        return g.tokens.clone()

    def _capture(self, slot: int, steps: int) -> _LoopGraph:
        w, k, v = self.weights, self.slot_k[slot], self.slot_v[slot]
        first = torch.zeros(1, dtype=torch.long, device=w.embed.device)  # [1]
        base = torch.zeros(1, dtype=torch.long, device=w.embed.device)  # [1]
        graph, tokens = capture(lambda: greedy_draft_static(w, k, v, first, base, steps), first.device,
                                self.pool)  # tokens [steps + 1]
        return _LoopGraph(graph, first, base, tokens)
