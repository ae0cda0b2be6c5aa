"""The per-position logits transform: logit_bias, repetition / frequency / presence penalties and end-of-text bans,
applied alike to the draft's logits and the target's at every position of a drafted path (before temperature,
min-p, top-k and top-p, which `sampling.logits_to_probs` applies; after a grammar's mask).

A penalty depends on the tokens before its position, so along a path of k drafted tokens each of the k+1 verified
positions has its own counts: the committed window's counts plus the drafted tokens before it (less what slid out
of a last-N window). The target's k+1 rows are built at once (`LogitsTransform.along`: a cumulative sum of one-hot
steps); the draft, which samples one position at a time, keeps a running copy (`Cursor`). Both end in
`LogitsTransform.apply` with the same integer counts, so q and p are transformed identically and rejection sampling
on them stays exact."""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from specrpc.engine.sampling import SamplingParams


class LogitsTransform:
    """One generation's transform: its parameters, its end-of-text ids and where its generated tokens start;
    counts of the committed window are kept up to date as the context grows (committed tokens never go away).
    `work_s` counts the host seconds spent transforming, along a verify and while drafting: `specrpc bench
    controls` reports its share of a step."""

    def __init__(self, params: SamplingParams, end_ids: Collection[int], prompt_len: int) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self._ends = sorted(end_ids)
        self._bias_ids = [t for t, _ in params.logit_bias]
        self._bias_values = [b for _, b in params.logit_bias]
        self._tensors: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._counts: torch.Tensor | None = None  # [V] counts of context[_lo:_hi]
        self._lo = self._hi = 0
        self.work_s = 0.0

    def window_start(self, length: int) -> int:
        """First context position the penalties count when the context has `length` tokens."""
        last_n = self.params.penalty_last_n
        if last_n == 0:
            return self.prompt_len
        return 0 if last_n < 0 else max(0, length - last_n)

    def along(self, logits: torch.Tensor, context: list[int], drafted: list[int]) -> torch.Tensor:
        """Logits [k+1, V] at the positions after `context` + drafted[:i] (row i), transformed; float32."""
        t0 = time.perf_counter()
        k = len(drafted)
        assert logits.shape[0] == k + 1, "one row per drafted token, and one after them"
        vocab, device = logits.shape[-1], logits.device
        counts: torch.Tensor | None = None
        if self.params.penalized:
            base = self._window_counts(context, vocab, device)  # [V]
            if k:
                seq, n = context + drafted, len(context)
                rows, ids, signs = list(range(1, k + 1)), list(drafted), [1.0] * k  # token i counts from row i+1
                for i in range(1, k + 1):
                    lo_before, lo = self.window_start(n + i - 1), self.window_start(n + i)
                    rows += [i] * (lo - lo_before)
                    ids += seq[lo_before:lo]  # what slid out of a last-N window
                    signs += [-1.0] * (lo - lo_before)
                steps = torch.zeros(k + 1, vocab, dtype=torch.float32, device=device)  # [k+1, V]
                steps.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                                 torch.tensor(signs, device=device), accumulate=True)
                counts = base + steps.cumsum(dim=0)  # [k+1, V]
            else:
                counts = base.unsqueeze(0)  # [1, V]
        generated = len(context) - self.prompt_len
        out = self.apply(logits, counts, list(range(generated, generated + k + 1)))  # [k+1, V]
        self.work_s += time.perf_counter() - t0
        return out

    def cursor(self, context: list[int], vocab: int, device: torch.device) -> Cursor:
        """A running transform for drafting one token at a time after `context`."""
        t0 = time.perf_counter()
        base = self._window_counts(context, vocab, device).clone() if self.params.penalized else None
        self.work_s += time.perf_counter() - t0
        return Cursor(self, list(context), base)

    def _window_counts(self, context: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """Counts [V] float32 of the committed window, brought up to `context` from the last call's."""
        lo, hi = self.window_start(len(context)), len(context)
        counts = self._counts
        if counts is None or counts.shape[-1] != vocab or counts.device != device or hi < self._hi or lo < self._lo:
            counts, self._lo, self._hi = torch.zeros(vocab, dtype=torch.float32, device=device), lo, lo
        added, removed = context[max(self._hi, lo) : hi], context[self._lo : min(lo, self._hi)]
        if added or removed:
            ids = torch.tensor(added + removed, dtype=torch.long, device=device)  # [a+r]
            signs = torch.tensor([1.0] * len(added) + [-1.0] * len(removed), device=device)  # [a+r]
            counts = counts.index_add(0, ids, signs)
        self._counts, self._lo, self._hi = counts, lo, hi
        return counts

    def _constants(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bias ids [B], bias values [B] and end-of-text ids [E] on `device` (made once), within `vocab`."""
        key = (device, vocab)
        cached = self._tensors.get(key)
        if cached is None:
            ids = [(t, b) for t, b in zip(self._bias_ids, self._bias_values, strict=True) if t < vocab]
            cached = self._tensors[key] = (torch.tensor([t for t, _ in ids], dtype=torch.long, device=device),
                                           torch.tensor([b for _, b in ids], dtype=torch.float32, device=device),
                                           torch.tensor([t for t in self._ends if t < vocab], dtype=torch.long,
                                                        device=device))
        return cached

    def apply(self, logits: torch.Tensor, counts: torch.Tensor | None, generated: list[int]) -> torch.Tensor:
        """Logits [n, V] → float32 [n, V]: logit_bias, then the penalties by `counts` [n, V] (row i's window), then
        end-of-text banned on rows whose `generated` (tokens generated before them) is under min_tokens, or on
        every row with ignore_eos."""
        p = self.params
        out = logits.float().clone()  # [n, V]
        bias_ids, bias_values, ends = self._constants(out.shape[-1], out.device)
        if bias_ids.numel():
            out[:, bias_ids] += bias_values
        if counts is not None:
            seen = counts > 0  # [n, V]
            if p.repetition_penalty != 1.0:
                out = torch.where(seen, torch.where(out > 0, out / p.repetition_penalty,
                                                    out * p.repetition_penalty), out)
            if p.frequency_penalty != 0.0:
                out = out - p.frequency_penalty * counts
            if p.presence_penalty != 0.0:
                out = out - p.presence_penalty * seen.float()
        if ends.numel():
            if p.ignore_eos:
                out[:, ends] = float("-inf")
            else:
                banned = [i for i, g in enumerate(generated) if g < p.min_tokens]
                if banned:
                    out[torch.tensor(banned, device=out.device).unsqueeze(1), ends] = float("-inf")
        return out


class Cursor:
    """The transform at the next drafted position; `advance` moves it past a drafted token (a device tensor [1],
    so a GPU's drafting loop does not sync for it)."""

    def __init__(self, transform: LogitsTransform, context: list[int], counts: torch.Tensor | None) -> None:
        self.transform = transform
        self.context = context
        self.counts = counts  # [V]
        self.drafted: list[torch.Tensor] = []

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] at this position, transformed (as row len(drafted) of `LogitsTransform.along`)."""
        t0 = time.perf_counter()
        counts = None if self.counts is None else self.counts.unsqueeze(0)  # [1, V]
        generated = len(self.context) - self.transform.prompt_len + len(self.drafted)
        out = self.transform.apply(logits, counts, [generated])  # [1, V]
        self.transform.work_s += time.perf_counter() - t0
        return out

    def advance(self, token: torch.Tensor) -> None:
        """Count the drafted `token` [1] (and let what slides out of a last-N window go)."""
        n, i = len(self.context), len(self.drafted)
        self.drafted.append(token)
        if self.counts is None:
            return
        t0 = time.perf_counter()
        self.counts.index_add_(0, token.view(1), torch.ones(1, device=self.counts.device))
        lo_before, lo = self.transform.window_start(n + i), self.transform.window_start(n + i + 1)
        for pos in range(lo_before, lo):
            gone = (torch.tensor([self.context[pos]], device=self.counts.device) if pos < n
                    else self.drafted[pos - n].view(1))  # [1]
            self.counts.index_add_(0, gone, torch.full((1,), -1.0, device=self.counts.device))
        self.transform.work_s += time.perf_counter() - t0
