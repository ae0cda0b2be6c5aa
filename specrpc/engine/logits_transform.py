"""The per-position logits transform: logit_bias, repetition / frequency / presence penalties and end-of-text bans,
applied alike to the draft's logits and the target's at every position of a drafted path (before temperature,
min-p, top-k and top-p, which `sampling.logits_to_probs` applies; after a grammar's mask).

A penalty depends on the tokens before its position, so along a path of k drafted tokens each of the k+1 verified
positions has its own counts: the committed window's counts plus the drafted tokens before it (less what slid out
of a last-N window). The target's k+1 rows are built at once (`LogitsTransform.along`, on the counted tokens
only); the draft, which samples one position at a time, keeps a running copy (`Cursor`). Both apply the same
element-wise operations (`_penalized`) with the same integer counts, so q and p are transformed identically and
rejection sampling on them stays exact. On the CPU, where the native library is built, one pass in C does a verify's
k+1 rows and the cursor's row alike, counts included (`native_rows`, specrpc/native/transform.cpp): the same float32
operations in the same order, so the same bits as the torch path, which serves where there is no library."""

from __future__ import annotations

import ctypes
import time
from array import array
from collections.abc import Collection

import torch

from specrpc import native
from specrpc.engine.sampling import SamplingParams

Counted = tuple["array[int]", "array[int]"]
"""The committed window's tokens and their counts (int64), as the native pass takes them."""


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
        self._controls: dict[int, native.Controls] = {}  # by vocabulary size, for the native pass
        self._counts: dict[int, int] = {}  # counts of context[_lo:_hi]
        self._lo = self._hi = 0
        self.work_s = 0.0

    def window_start(self, length: int) -> int:
        """First context position the penalties count when the context has `length` tokens."""
        last_n = self.params.penalty_last_n
        if last_n == 0:
            return self.prompt_len
        return 0 if last_n < 0 else max(0, length - last_n)

    def along(self, logits: torch.Tensor, context: list[int], drafted: list[int]) -> torch.Tensor:
        """Logits [k+1, V] at the positions after `context` + drafted[:i] (row i), transformed; float32. Penalties
        touch only the tokens some row has counted (the window's and the drafted ones): they are gathered into
        [k+1, S] and changed there, by the same element-wise operations `apply` runs on [n, V], so the values equal
        the draft's cursor's (a verify costs a few small operations, not a dozen over the whole vocabulary)."""
        t0 = time.perf_counter()
        k = len(drafted)
        assert logits.shape[0] == k + 1, "one row per drafted token, and one after them"
        lib = native.library() if logits.device.type == "cpu" else None
        if lib is not None:
            out = self.native_rows(lib, logits, self.counted(context), context, drafted, 0)  # [k+1, V]
        else:
            out = self._along_torch(logits, context, drafted)  # [k+1, V]
        self.work_s += time.perf_counter() - t0
        return out

    def _along_torch(self, logits: torch.Tensor, context: list[int], drafted: list[int]) -> torch.Tensor:
        """`along` in torch ops: logits [k+1, V] → float32 [k+1, V]."""
        k = len(drafted)
        out = self._biased(logits)  # [k+1, V]
        if self.params.penalized:
            window = self._window(context)
            ids = sorted(window.keys() | set(drafted))  # the tokens any row counts
            if ids:
                column = {t: j for j, t in enumerate(ids)}
                counts = torch.tensor([window.get(t, 0) for t in ids], dtype=torch.float32,
                                      device=out.device).expand(k + 1, -1)  # [k+1, S] the window's, every row
                if k:  # token i-1 counts from row i on; what slides out of a last-N window stops counting there
                    n, rows, cols, signs = len(context), [], [], []
                    for i in range(1, k + 1):
                        rows.append(i)
                        cols.append(column[drafted[i - 1]])
                        signs.append(1.0)
                        for pos in range(self.window_start(n + i - 1), self.window_start(n + i)):
                            rows.append(i)
                            cols.append(column[context[pos] if pos < n else drafted[pos - n]])
                            signs.append(-1.0)
                    steps = torch.zeros(k + 1, len(ids), dtype=torch.float32, device=out.device)  # [k+1, S]
                    steps.index_put_((torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)),
                                     torch.tensor(signs, device=out.device), accumulate=True)
                    counts = counts + steps.cumsum(dim=0)  # [k+1, S]
                index = torch.tensor(ids, device=out.device)  # [S]
                out[:, index] = self._penalized(out[:, index], counts)  # [k+1, S]
        generated = len(context) - self.prompt_len
        self._ban(out, list(range(generated, generated + k + 1)))
        return out

    def native_rows(self, lib: ctypes.CDLL, logits: torch.Tensor, counted: Counted, context: list[int],
                    drafted: list[int], first: int) -> torch.Tensor:
        """Logits [R, V] (CPU) at the positions first .. first+R-1 along `drafted` after `context` (row r after
        drafted[:first + r]), transformed in one native pass: float32 [R, V], the bits `along` computes in torch.
        `counted`: the window's counts at `context` (`counted`). Python only lists what each position adds and
        drops; the counts, the bias, the penalties and the bans are C's."""
        x = logits.float().contiguous()  # [R, V]
        rows, vocab = x.shape
        out = torch.empty_like(x)  # [R, V]
        steps = first + rows - 1  # drafted tokens before the last row
        drafts, gone, gone_end = array("q", drafted[:steps]), array("q"), array("q", [0])
        if self.params.penalized:  # what slides out of a last-N window at each position
            n = len(context)
            for i in range(1, steps + 1):
                for pos in range(self.window_start(n + i - 1), self.window_start(n + i)):
                    gone.append(context[pos] if pos < n else drafted[pos - n])
                gone_end.append(len(gone))
        generated = len(context) - self.prompt_len + first
        banned = rows if self.params.ignore_eos else min(rows, max(0, self.params.min_tokens - generated))
        ids, counts = counted
        if lib.specrpc_transform(ctypes.byref(self._native_controls(vocab)), x.data_ptr(), out.data_ptr(), rows, vocab,
                                 first, _address(ids), _address(counts), len(ids), _address(drafts), _address(gone),
                                 _address(gone_end), banned):
            raise IndexError(f"logits transform: a counted token is outside the logits' vocabulary of {vocab}")
        return out

    def greedy_draft(self, context: list[int], vocab: int, k: int) -> native.DraftTransform | None:
        """The transform of k greedy drafts after `context` for the native fused draft (decode.cpp's `pick`: this
        module's native pass at each drafted position, the same values as `Cursor.apply`), or None where that draft
        cannot take it: no native library, or a last-N window short enough to slide over the drafted tokens. The
        returned structure keeps the arrays it points into alive. Its time is the draft's: `work_s` counts only
        building it."""
        lib = native.library()
        n = len(context)
        if lib is None or self.window_start(n + k - 1) > n:
            return None
        t0 = time.perf_counter()
        ids, counts = self.counted(context)
        gone, gone_end = array("q"), array("q", [0])
        if self.params.penalized:  # what slides out of a last-N window at each drafted position (committed tokens)
            for i in range(1, k):
                gone.extend(context[pos] for pos in range(self.window_start(n + i - 1), self.window_start(n + i)))
                gone_end.append(len(gone))
        else:
            gone_end.extend([0] * (k - 1))
        generated = n - self.prompt_len
        banned = k if self.params.ignore_eos else max(0, self.params.min_tokens - generated)
        controls = self._native_controls(vocab)
        spec = native.DraftTransform(ctypes.addressof(controls), _address(ids), _address(counts), len(ids),
                                     _address(gone), _address(gone_end), banned, None)
        spec.keep = (controls, ids, counts, gone, gone_end)
        self.work_s += time.perf_counter() - t0
        return spec

    def counted(self, context: list[int]) -> Counted:
        """The committed window's tokens and counts at `context` for `native_rows` (none without penalties)."""
        if not self.params.penalized:
            return array("q"), array("q")
        window = self._window(context)
        return array("q", window.keys()), array("q", window.values())

    def _native_controls(self, vocab: int) -> native.Controls:
        """transform.cpp's Controls for logits of `vocab` (made once), pointing into the CPU constants."""
        controls = self._controls.get(vocab)
        if controls is None:
            p = self.params
            bias_ids, bias_values, ends = self._constants(vocab, torch.device("cpu"))
            on = {"repetition": p.repetition_penalty != 1.0, "frequency": p.frequency_penalty != 0.0,
                  "presence": p.presence_penalty != 0.0}
            controls = self._controls[vocab] = native.Controls(
                bias_ids.data_ptr(), bias_values.data_ptr(), bias_ids.numel(), ends.data_ptr(), ends.numel(),
                sum(bit for name, bit in native.PENALTIES.items() if on[name]), p.repetition_penalty,
                p.frequency_penalty, p.presence_penalty)
        return controls

    def cursor(self, context: list[int], vocab: int, device: torch.device) -> Cursor:
        """A running transform for drafting one token at a time after `context`."""
        t0 = time.perf_counter()
        lib = native.library() if device.type == "cpu" else None
        if lib is not None:
            counted = self.counted(context)
            self.work_s += time.perf_counter() - t0
            return Cursor(self, list(context), None, (lib, counted))
        base = None
        if self.params.penalized:
            window = self._window(context)
            base = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V]
            if window:
                base[torch.tensor(list(window), device=device)] = torch.tensor(list(window.values()),
                                                                               dtype=torch.float32, device=device)
        self.work_s += time.perf_counter() - t0
        return Cursor(self, list(context), base, None)

    def _window(self, context: list[int]) -> dict[int, int]:
        """Counts of the committed window (token → count, zeros dropped), brought up to `context` from the last
        call's: each step adds the tokens it committed and drops what slid out."""
        lo, hi = self.window_start(len(context)), len(context)
        if hi < self._hi or lo < self._lo:  # not a later context of the same stream: count afresh
            self._counts, self._lo, self._hi = {}, lo, lo
        counts = self._counts
        for token in context[max(self._hi, lo) : hi]:
            counts[token] = counts.get(token, 0) + 1
        for token in context[self._lo : min(lo, self._hi)]:
            counts[token] -= 1
            if not counts[token]:
                del counts[token]
        self._lo, self._hi = lo, hi
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
        out = self._biased(logits)  # [n, V]
        if counts is not None:
            out = self._penalized(out, counts)
        self._ban(out, generated)
        return out

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `logits` [n, V] with logit_bias added."""
        out = logits.float().clone()  # [n, V]
        bias_ids, bias_values, _ = self._constants(out.shape[-1], out.device)
        if bias_ids.numel():
            out[:, bias_ids] += bias_values
        return out

    def _penalized(self, values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`values` [n, S] with the penalties by `counts` [n, S] (S: the whole vocabulary, or the tokens counted)."""
        p = self.params
        seen = counts > 0  # [n, S]
        if p.repetition_penalty != 1.0:
            values = torch.where(seen, torch.where(values > 0, values / p.repetition_penalty,
                                                   values * p.repetition_penalty), values)
        if p.frequency_penalty != 0.0:
            values = values - p.frequency_penalty * counts
        if p.presence_penalty != 0.0:
            values = values - p.presence_penalty * seen.float()
        return values

    def _ban(self, out: torch.Tensor, generated: list[int]) -> None:
        """End-of-text banned in place on rows of `out` [n, V] before min_tokens (or on all with ignore_eos)."""
        ends = self._constants(out.shape[-1], out.device)[2]
        if not ends.numel():
            return
        if self.params.ignore_eos:
            out[:, ends] = float("-inf")
            return
        banned = [i for i, g in enumerate(generated) if g < self.params.min_tokens]
        if banned:
            out[torch.tensor(banned, device=out.device).unsqueeze(1), ends] = float("-inf")


class Cursor:
    """The transform at the next drafted position; `advance` moves it past a drafted token (a device tensor [1],
    so a GPU's drafting loop does not sync for it). On the CPU with the native library (`counted`) each position is
    one native pass from the window's counts and the tokens drafted so far; else running counts [V] in torch
    (`counts`; None without penalties)."""

    def __init__(self, transform: LogitsTransform, context: list[int], counts: torch.Tensor | None,
                 counted: tuple[ctypes.CDLL, Counted] | None) -> None:
        self.transform = transform
        self.context = context
        self.counts = counts  # [V]
        self.counted = counted  # the native library and the window's counts at `context`
        self.drafted: list[torch.Tensor] = []
        self.ids: list[int] = []  # the drafted tokens on the host (native pass only)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] at this position, transformed (as row len(drafted) of `LogitsTransform.along`)."""
        t0 = time.perf_counter()
        if self.counted is not None:
            lib, counted = self.counted
            out = self.transform.native_rows(lib, logits, counted, self.context, self.ids, len(self.ids))
        else:
            counts = None if self.counts is None else self.counts.unsqueeze(0)  # [1, V]
            generated = len(self.context) - self.transform.prompt_len + len(self.drafted)
            out = self.transform.apply(logits, counts, [generated])  # [1, V]
        self.transform.work_s += time.perf_counter() - t0
        return out

    def advance(self, token: torch.Tensor) -> None:
        """Count the drafted `token` [1] (and let what slides out of a last-N window go)."""
        n, i = len(self.context), len(self.drafted)
        self.drafted.append(token)
        if self.counted is not None:
            self.ids.append(int(token))
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


def _address(values: array[int]) -> int:
    """The address of an array's items, for ctypes (the array outlives the call)."""
    return values.buffer_info()[0]
