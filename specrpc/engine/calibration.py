"""Start-up measurements of what steps cost on this device: one target decode step, verifies of 2..k+1 tokens and
drafts of 1..k tokens as speculation runs them (`calibrate`), and batched forwards by width (`calibrate_batches`).
The policies start from these, and every lone and batched step refines them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from specrpc.engine.policy import BatchCosts, CostModel
from specrpc.engine.proposers import feed
from specrpc.models import BatchRow, CausalLM


class Shapes:
    """The shapes a speculative step runs, on one slot filled with `context` positions of a fixed text: a target
    forward of 1..max_k+1 tokens and a greedy draft of 1..max_k tokens, each timed from that context."""

    def __init__(self, target: CausalLM, draft: CausalLM | None, max_k: int, prefill_chunk: int, capacity: int,
                 slot: int, context: int) -> None:
        self.target, self.draft, self.max_k, self.slot = target, draft, max_k, slot
        self.context = max(1, min(context, capacity - max_k - 2))
        self.ids = [(i * 7919) % min(target.vocab_size, 256) for i in range(self.context + max_k + 2)]
        feed(target, slot, self.ids[: self.context], 0, prefill_chunk)
        if draft is not None:
            feed(draft, slot, self.ids[: self.context], 0, prefill_chunk)

    def timed(self, width: int) -> float:
        """Seconds of a target forward of `width` tokens at the context."""
        self.target.truncate(self.slot, self.context)
        batch = torch.tensor(self.ids[self.context : self.context + width], dtype=torch.long,
                             device=self.target.device)  # [width]
        t0 = time.perf_counter()
        self.target.forward(batch, self.context, self.slot, num_logits=width).float().sum().item()
        return time.perf_counter() - t0

    def drafted(self, k: int) -> float:
        """Seconds of k greedy draft steps as a speculative step runs them, right after the target's verify: the
        first over the steady catch-up (the last draft token and the target's), each next one fed the argmax before
        it. The first step finds the draft's weights evicted by the target's, the rest find them cached, so a draft
        of k tokens costs more than k times each of a long one's (`CostModel.observe_draft`)."""
        model = self.draft
        assert model is not None
        model.truncate(self.slot, self.context)
        batch = torch.tensor(self.ids[self.context : self.context + 2], dtype=torch.long,
                             device=model.device)  # [2]
        t0 = time.perf_counter()
        token = model.forward(batch, self.context, self.slot, num_logits=1)[-1].argmax()  # []
        for i in range(1, k):
            token = model.forward(token.view(1), self.context + 1 + i, self.slot, num_logits=1)[-1].argmax()
        token.item()
        return time.perf_counter() - t0

    def round(self) -> tuple[float, dict[str, float]]:
        """Every shape once: the width-1 step's seconds (the mean of one before and one after the rest) and each
        verify's ("v2".."v{k+1}") and draft's ("d1".."d{k}") seconds."""
        before = self.timed(1)
        times: dict[str, float] = {}
        for width in range(2, self.max_k + 2):
            times[f"v{width}"] = self.timed(width)
            if self.draft is not None:
                times[f"d{width - 1}"] = self.drafted(width - 1)
        return (before + self.timed(1)) / 2, times

    def empty(self) -> None:
        """The slot left empty in both models."""
        self.target.truncate(self.slot, 0)
        if self.draft is not None:
            self.draft.truncate(self.slot, 0)


def calibrate(target: CausalLM, draft: CausalLM | None, max_k: int, prefill_chunk: int, capacity: int,
              slot: int = 0, context: int = 256, repeats: int = 9, budget_s: float = 3.0,
              max_repeats: int = 40, settle: float = 0.01) -> tuple[CostModel, int]:
    """Measure one target decode step, verifying k+1 = 2..max_k+1 tokens and drafting k = 1..max_k tokens (each
    right after the verify of k+1, as a speculative step drafts); this is also
    the warm-up (a first, unmeasured round meets every shape). At `context` positions (within the capacity): a
    verify's extra cost over a decode step grows with the context its k+1 queries attend to, and the costs of
    the k the policy does not use are never re-measured, so a short calibration context would leave long drafts
    looking cheaper than the ones measured online.

    The policy needs ratios (c, V(k)), and on a shared machine a slow spell stretches every time measured
    during it: so each round times the width-1 step before and after its verify and draft steps and keeps
    each step's ratio to their mean, and the costs are medians of those ratios over at least `repeats` rounds,
    more (up to `max_repeats`, within `budget_s`) until no median ratio moves by more than `settle` from one
    round to the next. The seconds are the median width-1 step times the median ratios. Returns the costs and
    the rounds measured."""
    shapes = Shapes(target, draft, max_k, prefill_chunk, capacity, slot, context)
    units: list[float] = []
    ratios: dict[str, list[float]] = {}
    previous: dict[str, float] = {}
    t_start = time.perf_counter()
    for round_ in range(max_repeats + 1):
        unit, times = shapes.round()
        if round_ == 0:
            continue  # warm-up: first-time shapes
        units.append(unit)
        for name, seconds in times.items():
            ratios.setdefault(name, []).append(seconds / unit)
        medians = {name: statistics.median(values) for name, values in ratios.items()}
        settled = all(abs(m - previous.get(name, 0.0)) <= settle * m for name, m in medians.items())
        previous = medians
        if round_ >= repeats and (settled or time.perf_counter() - t_start > budget_s):
            break
    shapes.empty()
    step = statistics.median(units)
    costs = CostModel(target_step_s=step)
    costs.verify_s[1] = step
    for width in range(2, max_k + 2):
        costs.verify_s[width] = step * previous[f"v{width}"]
    costs.draft_s = {k: step * previous[f"d{k}"] for k in range(1, max_k + 1) if f"d{k}" in previous}
    costs.draft_step_s = costs.c * step if costs.draft_s else step
    if draft is not None:  # a catch-up's cost per token: the draft fed the context again (warm now)
        t0 = time.perf_counter()
        feed(draft, slot, shapes.ids[: shapes.context], 0, prefill_chunk)
        costs.draft_prefill_s = (time.perf_counter() - t0) / shapes.context
        draft.truncate(slot, 0)
    return costs, len(units)


def warm_up(target: CausalLM, draft: CausalLM | None, max_k: int, prefill_chunk: int, capacity: int,
            enough: Callable[[float], bool], slot: int = 0, context: int = 256, checks: int = 3) -> float:
    """Every shape `calibrate` measures, met once before a request meets it (the warm-up a start that takes
    remembered costs still needs), then rounds of them (up to `checks`: the first forwards after a warm-up, or a
    burst, only add time) until the width-1 step, timed as `calibrate` times it, is `enough`: the lowest such
    time, in seconds."""
    shapes = Shapes(target, draft, max_k, prefill_chunk, capacity, slot, context)
    shapes.round()
    best = float("inf")
    for _ in range(checks):
        best = min(best, shapes.round()[0])
        if enough(best):
            break
    shapes.empty()
    return best


def calibrate_batches(target: CausalLM, draft: CausalLM | None, max_k: int, prefill_chunk: int, slots: list[int],
                      context: int = 64, repeats: int = 3) -> BatchCosts:
    """Measure batched target forwards over 1, 2, 4, … of `slots` (distinct, empty; left empty) with 1, k/2+1
    and k+1 tokens per row, and batched draft forwards of one token per row: the costs the policy starts from in
    a batched step (refined online from every one)."""
    widths = [w for w in (1, 2, 4, 8, 16, 32) if w <= len(slots)]
    per_row = sorted({1, max_k // 2 + 1, max_k + 1})
    ids = [(i * 7919) % min(target.vocab_size, 256) for i in range(context + max_k + 2)]
    costs = BatchCosts()
    models = [target] if draft is None else [target, draft]
    for model in models:
        for slot in slots[: widths[-1]]:
            model.truncate(slot, 0)
            feed(model, slot, ids[:context], 0, prefill_chunk)
    for width in widths:
        for tokens in per_row if max_k else [1]:
            times: list[float] = []
            for _ in range(repeats):
                rows = [BatchRow(torch.tensor(ids[context : context + tokens], dtype=torch.long,
                                              device=target.device), context, s, tokens)
                        for s in slots[:width]]
                t0 = time.perf_counter()
                out = target.forward_batch(rows)
                out[-1].sum().item()
                times.append(time.perf_counter() - t0)
            costs.target_s[width * tokens] = statistics.median(times)
        if draft is not None and max_k:
            times = []
            for _ in range(repeats):
                rows = [BatchRow(torch.tensor(ids[context : context + 1], dtype=torch.long,
                                              device=draft.device), context, s, 1) for s in slots[:width]]
                t0 = time.perf_counter()
                draft.forward_batch(rows)[-1].sum().item()
                times.append(time.perf_counter() - t0)
            costs.draft_s[width] = statistics.median(times)
    for model in models:
        for slot in slots[: widths[-1]]:
            model.truncate(slot, 0)
    return costs
