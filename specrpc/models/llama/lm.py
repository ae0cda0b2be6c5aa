"""`LlamaLM`: a Llama-family checkpoint's weights (`checkpoint`), its preallocated per-slot KV cache, and the backend
each forward's shape takes: CUDA graphs (`backends.cuda_graphs`), the native C++ step (`backends.native`), or the
eager torch forward (`backends.eager`), chosen and tuned at load."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specrpc.models.backends import cuda_graphs, eager, native
from specrpc.models.backends.memo import Memo
from specrpc.models.backends.timing import Drift, Interrupted, interleaved_times, interruptible, timing_ids
from specrpc.models.batch import BatchRow, check_rows
from specrpc.models.kv_cache import KVCache
from specrpc.models.llama.checkpoint import load_llama_weights
from specrpc.models.llama.config import LlamaArgs
from specrpc.models.llama.weights import LlamaWeights, map_linears, with_int8_decode, with_packed_decode
from specrpc.native import DraftTransform

log = logging.getLogger(__name__)

ROWS_PIECE = 2
"""Token counts a piece of the native-against-torch comparison takes (`LlamaLM._row_phases`): up to 0.53 s for the
shipped float32 target on a 2-core AMD EPYC Zen 3 (15 and 16 tokens), so that a re-measure between requests
(`LlamaLM.recheck`) gets through gaps that short."""
ROW_COUNTS = (*range(1, 11), 12, 16, 24, 32, 48, native.MAX_TOKENS)
"""The token counts the native-against-torch comparison times (`LlamaLM._compare_rows`): each count of a decode step
and of a verify of up to 9 drafts, then wider ones each standing for the counts since the one before it (batches of
several streams' verifies, prompt chunks beside decoding streams): comparing every count up to `MAX_TOKENS` made the
shipped pair's start-up 24 s on a 2-core AMD EPYC Zen 4, these counts 5.7 s (5.2 s comparing up to 16 tokens)."""
RECALL_CHECKS = 3
"""One-token checks a remembered choice gets at load (`LlamaLM._recall`): the first forwards after the weights are
packed took 50 ms instead of 4 on a 2-core AMD EPYC Zen 3 (six of them), and a neighbour's burst only adds time."""


@dataclasses.dataclass
class RowsFound:
    """The native-against-torch comparison so far (`LlamaLM._compare_rows`): the most tokens the native step won
    up to, the index in `ROW_COUNTS` of the next count to compare (past its end once it is over), and the ratios
    measured."""

    rows: int = 0
    next: int = 0
    ratios: dict[int, float] = dataclasses.field(default_factory=dict)


def padded_sizes(graph_tokens: int, largest: int) -> tuple[int, ...]:
    """The `buckets` for a model whose forwards of up to `graph_tokens` tokens replay CUDA graphs: token counts past
    what the graphs cover (in `cuda_graphs.CHUNKS` pieces) up to `largest` (a prefill chunk)."""
    return eager.bucket_sizes(cuda_graphs.CHUNKS * graph_tokens + 1, largest)


class LlamaLM:
    """CausalLM over the lean Llama-family forward with a preallocated per-slot KV cache."""

    lean_forward = True

    def __init__(
        self,
        name: str,
        weights: LlamaWeights,
        *,
        num_slots: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
        graph_tokens: int = 0,
        buckets: tuple[int, ...] = (),
        draft_loop_steps: int = 0,
    ) -> None:
        """`graph_tokens`, `draft_loop_steps` (CUDA only): forwards of up to that many tokens, and greedy draft loops
        of up to that many forwards, replay CUDA graphs. `buckets`: eager forwards asking for their last logits are
        padded to the smallest of these token counts that fits (each one run once here, so no count is met first
        in a request)."""
        a = weights.args
        self.name = name
        self.weights = weights
        self.vocab_size = int(weights.embed.shape[0])
        self.max_context = max_context
        self.num_slots = num_slots
        self.device = device
        self.dtype = dtype
        self.cache = KVCache(
            num_layers=a.layers,
            num_slots=num_slots,
            kv_heads=a.kv_heads,
            capacity=max_context,
            head_dim=a.head_dim,
            device=device,
            dtype=dtype,
        )
        self.graphs: cuda_graphs.GraphedForward | None = None
        self.native: native.NativeStep | None = None  # forwards of up to `native_rows` tokens, when `use_native` can
        self.native_rows = 1
        self.native_chunks: bool | None = None  # forwards past MAX_TOKENS in native chunks (`_compare_chunks`)
        self.deterministic = False  # every forward through the native step's per-token products (`use_native`)
        self.drift = Drift()  # when the native step's paths are measured again (`recheck`)
        self._remeasure: list[Callable[[int], None]] = []  # a re-measure's phases still to run (`recheck`)
        self._remeasure_why = ""
        self._serving: list[tuple[str, str]] | None = None  # what `execution` says while `recheck` times settings
        self.memo: Memo | None = None  # where `use_native` finds and keeps its choice for the next start
        self.chosen = ""  # how `use_native` chose: measured, or remembered (`_recall`)
        self.remembered: bool | None = None  # whether `use_native` took an earlier start's choice (None: no memo)
        self._packed_decode: bool | None = None  # what `tune_decode` chose in `use_native` (None: not run)
        self.draft_loop: cuda_graphs.GraphedDraftLoop | None = None
        self.buckets = buckets
        t0 = time.perf_counter()
        if device.type == "cuda":
            if graph_tokens > 0:
                self.graphs = cuda_graphs.GraphedForward(weights, self.cache.slot_k, self.cache.slot_v, graph_tokens)
            if draft_loop_steps > 0:
                self.draft_loop = cuda_graphs.GraphedDraftLoop(weights, self.cache.slot_k, self.cache.slot_v,
                                                               draft_loop_steps)
        for size in buckets:  # meet every padded shape once now (slot 0, left empty)
            self.forward(torch.zeros(min(size, max_context), dtype=torch.long, device=device), 0, 0)
            self.truncate(0, 0)
        if self.graphs is not None or self.draft_loop is not None or buckets:
            log.info("%s: CUDA graphs (%d forwards, %d draft loops) and %d padded sizes %s ready in %.2f s", name,
                     len(self.graphs.graphs) if self.graphs else 0,
                     len(self.draft_loop.graphs) if self.draft_loop else 0, len(buckets), list(buckets),
                     time.perf_counter() - t0)

    @classmethod
    def load(
        cls,
        path: Path,
        cfg: dict[str, Any],
        *,
        num_slots: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
        int8_decode: bool = False,
        graph_tokens: int = 0,
        buckets: tuple[int, ...] = (),
        draft_loop_steps: int = 0,
        int8_weights: bool = False,
        bf16_weights: bool = False,
        native_decode: bool = False,
        deterministic: bool = False,
        remember: bool = False,
    ) -> LlamaLM:
        """Build from a checkpoint directory and its parsed config.json; each slot holds `max_context` positions.
        `int8_decode`: decode-sized products through int8 weight copies (CPU; for a draft, not a target).
        `int8_weights`, `bf16_weights`: every projection and the head as int8 / bf16 alone, no float copy (CPU).
        `graph_tokens`, `buckets`, `draft_loop_steps`: see `__init__` (0 / empty: off). `native_decode`: forwards of
        a few tokens through the native step where it can run them (`use_native`). `deterministic`: every forward
        through the native step, whatever its length or batchmates (ValueError where the native step cannot run).
        `remember`: the native step's choice kept on this machine for the next start of the same model loaded the same
        way, and taken from the last one after a check (`Memo`)."""
        args = LlamaArgs.from_config(cfg)
        weights = load_llama_weights(path, args, capacity=max_context, device=device, dtype=dtype, int8=int8_weights,
                                     bf16=bf16_weights)
        if int8_decode and not (int8_weights or bf16_weights):
            weights = with_int8_decode(weights)
        lm = cls(path.name, weights, num_slots=num_slots, max_context=max_context, device=device, dtype=dtype,
                 graph_tokens=graph_tokens, buckets=buckets, draft_loop_steps=draft_loop_steps)
        if remember and (native_decode or deterministic) and native.supported(weights, device, dtype) is None:
            lm.memo = Memo.for_model(path, {
                "device": str(device), "dtype": str(dtype), "slots": num_slots, "context": max_context,
                "int8_decode": int8_decode, "int8_weights": int8_weights, "bf16_weights": bf16_weights,
                "deterministic": deterministic})
            lm.remembered = None if lm.memo is None else False
        lm.choose_paths(native_decode, deterministic)
        return lm

    def choose_paths(self, native_decode: bool = True, deterministic: bool = False) -> None:
        """Pick the forward's paths at load: every forward through the native step (`deterministic`), else the native
        step where it runs and is faster (`native_decode`, `use_native`, which tunes the torch forward's one-token
        path itself), else the faster of torch's one-token paths (`tune_decode`)."""
        if deterministic:
            self.use_native(deterministic=True)
        elif not (native_decode and self.use_native()) and self.decode_tunable():
            self.tune_decode()

    def decode_tunable(self) -> bool:
        """Whether one-token products have two torch paths to choose between (`tune_decode`): MKL's gemv on the
        plain copy and oneDNN's packed one."""
        head = self.weights.head
        return head.packed is not None and head.wt is not None and head.q8 is None and not head.bf16_only

    def use_native(self, deterministic: bool = False) -> bool:
        """Build the native step (specrpc/native) if it supports this model here, pick its fastest weight prefetch
        (`NativeStep.calibrate_prefetch`), and run forwards of up to `native_rows` tokens through it: the most before
        the torch forward (its one-token path tuned first, `tune_decode`) is as fast, measured from one token up,
        0 where torch wins a one-token step; forwards longer than the native step takes run in its chunks where those
        are faster than torch (`_compare_chunks`). Torch keeps the oneDNN copy, so where the native step takes any
        forward the float [K, N] copy is dropped where one exists. Returns whether the native step was built (why not is
        logged). `deterministic`: every forward through the native step (ValueError where it cannot run): each token
        goes through the same products whatever shares its forward, so a stream's logits never depend on its draft
        length, its batchmates or how its prompt was split (batch-invariant, at the native step's speed for every
        shape); only the logits of more than `MAX_TOKENS` prompt positions at once still take the torch forward.
        Where `memo` holds an earlier start's choice that checks out (`_recall`), that is taken instead of measuring;
        a choice measured here is kept there (`_keep`)."""
        why = native.supported(self.weights, self.device, self.dtype)
        if why is not None:
            if deterministic:
                raise ValueError(f"--deterministic runs every forward through the native step, which cannot run "
                                 f"{self.name} here ({why})")
            log.info("%s: native decode off (%s)", self.name, why)
            return False
        self.native = native.NativeStep(self.weights, self.cache)
        if self._recall(deterministic):
            return True
        for phase in self._native_phases(rows=False):
            phase(0)
        if deterministic or self.rows_fixed():
            # --deterministic, or int8 weights alone (--weights int8): every decode and verify through the native
            # step, so greedy speculation equals greedy decoding exactly (at int8, the torch kernel rounds
            # differently)
            self.native_rows = native.MAX_TOKENS
            self.deterministic = deterministic
            log.info("%s: native decode on, every forward (%s)", self.name,
                     "deterministic" if deterministic else "int8 weights alone")
        else:
            self.native_rows = 0  # the torch forward alone while its own one-token path is tuned
            if self.decode_tunable():
                self._packed_decode = self.tune_decode()
            for phase in self._row_phases():
                phase(0)
            if self.native_rows > 0:
                self._drop_float_copy()
        if not deterministic:
            self._compare_chunks(0)
        self.drift.settled(self._one_token_s(0))
        self._keep()
        self.chosen = self.chosen or "measured"
        return True

    def _drop_plain_copy(self) -> None:
        """Where oneDNN's copy serves one-token products too, the plain copy would serve nothing: freed (half the
        weight memory)."""
        self.weights = map_linears(self.weights, lambda p: dataclasses.replace(p, wt=None))

    def _drop_float_copy(self) -> None:
        """Where the native step takes forwards, the float [K, N] copy serves none: freed (oneDNN's stays)."""
        self.weights = map_linears(self.weights, lambda p: p if p.packed is None or p.bf16_only
                                   else dataclasses.replace(p, wt=None, packed_rows=1))

    def serving(self) -> None:
        """The server is warm: from here on the native step's prefetch for each shape (one token, several) is chosen
        among the load's finalists by the forwards served (`NativeStep.serve`), as after every re-measure."""
        if self.native is not None:
            self.native.serve()

    def _keep(self) -> None:
        """The native step's choice and the one-token forward's time through it, kept for the next start (`memo`)."""
        if self.memo is not None and self.native is not None:
            self.memo.keep({"choices": dataclasses.asdict(self.native.choices()), "native_rows": self.native_rows,
                            "native_chunks": self.native_chunks, "packed_decode": self._packed_decode,
                            "one_token_s": self.drift.reference_s})

    def _recall(self, deterministic: bool) -> bool:
        """Take the choice an earlier start kept (`memo`) where a one-token forward through it takes what it took
        then (within `Drift`'s tolerance, on one of `RECALL_CHECKS` checks), with a whole re-measure left for the
        first idle checks (`recheck`); False, nothing changed, where there is none or it is off (measure)."""
        entry = self.memo.recall() if self.memo is not None else None
        step = self.native
        if entry is None or step is None:
            return False
        try:
            choices = native.Choices(**{**entry["choices"], "passes": tuple(entry["choices"]["passes"])})
            rows, packed, then = int(entry["native_rows"]), entry["packed_decode"], float(entry["one_token_s"])
            chunks = entry["native_chunks"]
        except (KeyError, TypeError, ValueError):
            return False
        if len(choices.passes) != len(step.passes) or then <= 0.0 or chunks not in (None, True, False):
            return False
        weights, before = self.weights, step.choices()
        step.choose(choices)
        self.native_rows, self.native_chunks, self.deterministic = rows, chunks, deterministic
        if packed is not None and self.decode_tunable():
            self.weights = with_packed_decode(self.weights, bool(packed))
        for _ in range(RECALL_CHECKS):  # a burst, or the first forwards after packing, only adds time: a slower
            now = self._one_token_s(0)  # check is tried again, a faster one is news
            if self.drift.within(now, then) or now < then:
                break
        if not self.drift.within(now, then):
            self.chosen = (f"measured: the paths an earlier start chose took {now * 1e3:.2f} ms a one-token forward, "
                           f"{then * 1e3:.2f} ms then")
            self.weights, self.native_rows, self.native_chunks, self.deterministic = weights, 1, None, False
            step.choose(before)
            return False
        if packed and self.decode_tunable():  # as `tune_decode` leaves it
            self._drop_plain_copy()
        if rows > 0 and not self.rows_fixed():
            self._drop_float_copy()
        self._packed_decode = packed
        self.drift.settled(now)
        self.remembered = True
        # The one-token check cannot see another width a noisy start chose badly: the whole choice is measured again
        # in the first idle checks (`recheck`: in phases a request stops) and the memo rewritten with it.
        self._remeasure = self._native_phases(rows=not self.rows_fixed(), chunks=not deterministic)
        self._remeasure_why = "the choice remembered from an earlier start, measured again as a whole"
        self.chosen = (f"remembered from an earlier start: a one-token forward {now * 1e3:.2f} ms, {then * 1e3:.2f} ms "
                       f"then")
        return True

    def rows_fixed(self) -> bool:
        """Whether every forward the native step can take runs through it whatever torch's time: under
        `deterministic`, and with int8 weights alone (no float copy for torch)."""
        return self.deterministic or all(p.wt is None and p.packed is None for p in self.weights.linears())

    def _native_phases(self, rows: bool, chunks: bool = False) -> list[Callable[[int], None]]:
        """The measurements that choose how the native step runs, in order, each taking the slot it may write to
        (empty, or `KVCache.borrowed`) and logging its table in one line: its weight prefetch at each shape
        (`NativeStep.calibrate_prefetch`), the tokens a pass over the weights takes at each width
        (`calibrate_passes`), AMX tiles (`calibrate_amx`), the threads each shape takes (`calibrate_threads`), and
        with `rows` which forwards it takes (`_row_phases`), with `chunks` whether longer ones run in its chunks
        (`_compare_chunks`).
        Each leaves the settings it timed at their chosen values, so that the step serves between any two, and
        each takes about half a second at most (the shipped float32 target's longest, on a 2-core AMD EPYC Zen 3:
        0.53 s, `tools/recheck_cost.py`), so that a re-measure between requests gets through the gaps between them
        (`recheck`)."""
        step = self.native
        assert step is not None

        def prefetch(slot: int, count: int) -> None:
            table = step.calibrate_prefetch(slot, counts=(count,))
            if table:
                log.info("%s: native prefetch for a forward of %d: %s (ms, lower quartiles: %s)", self.name,
                         count, step.prefetch_label(count),
                         ", ".join(f"{setting} {t * 1e3:.2f}" for setting, t in table[count].items()))

        def passes(slot: int, count: int) -> None:
            table = step.calibrate_passes(slot, widths=(count,))
            if table:
                log.info("%s: native tokens a pass over the weights takes at most, for a forward of %d: %s (ms by "
                         "cap, 0 = auto: %s)", self.name, count, int(step.passes[count]) or "auto",
                         ", ".join(f"{cap} {t * 1e3:.2f}" for cap, t in table[count].items()))

        def threads(slot: int, count: int) -> None:
            table = step.calibrate_threads(slot, counts=(count,))
            if table:
                log.info("%s: native threads for a forward of %d: %d (ms by threads: %s)", self.name, count,
                         step.threads(count), ", ".join(f"{n} {t * 1e3:.2f}" for n, t in table[count].items()))

        def amx(slot: int) -> None:
            table = step.calibrate_amx(slot)
            if table:
                log.info("%s: int8 products on AMX tiles %s (ms VNNI / AMX by tokens: %s)", self.name,
                         f"from {step.model.amx_from} tokens" if step.model.amx_from else "never", ", ".join(
                             f"{count} {vnni * 1e3:.2f}/{tiles * 1e3:.2f}" for count, (vnni, tiles) in table.items()))

        return [*(functools.partial(prefetch, count=count) for count in (1, native.VERIFY_TOKENS)),
                *(functools.partial(passes, count=count) for count in native.PASS_TOKENS), amx,
                *(functools.partial(threads, count=count) for count in (1, native.VERIFY_TOKENS, native.WIDE_TOKENS)),
                *(self._row_phases() if rows else []), *([self._compare_chunks] if chunks else [])]

    def _row_phases(self) -> list[Callable[[int], None]]:
        """`native_rows` measured (`_compare_rows`) in pieces of `ROWS_PIECE` token counts, so that a measurement
        between requests gets through in the gaps between them, and set (and logged) by the last piece."""
        found = RowsFound()
        pieces: list[Callable[[int], None]] = [
            functools.partial(self._compare_rows, found=found, upto=upto)
            for upto in range(ROWS_PIECE, len(ROW_COUNTS) + ROWS_PIECE, ROWS_PIECE)]

        def chosen(slot: int) -> None:
            self.native_rows = found.rows
            log.info("%s: native decode on, up to %d tokens a forward (native/torch time by tokens: %s)", self.name,
                     found.rows, ", ".join(f"{count} {r:.2f}" for count, r in found.ratios.items()) or "not measured")

        return [*pieces, chosen]

    def _one_token_s(self, slot: int, context: int = native.CONTEXT, repeats: int = 7) -> float:
        """Seconds of a one-token forward at `context` positions of `slot` (empty, or `KVCache.borrowed`) through
        the paths chosen, the lower quartile of `repeats` (`interleaved_times`); 0 where the cache has no room.
        Leaves the slot empty."""
        context = min(context, self.max_context - 1)
        if context < 1:
            return 0.0
        ids = timing_ids(context + 1, self.vocab_size, self.device)  # [context + 1]
        self.forward(ids[:context], 0, slot)

        def one() -> None:
            self.truncate(slot, context)
            self.forward(ids[context:], context, slot)

        try:
            return interleaved_times([one], repeats)[0]
        finally:
            self.truncate(slot, 0)

    def recheck(self, slot: int, busy: Callable[[], bool]) -> str:
        """Between requests: time a one-token forward through the paths chosen at load, on `slot` borrowed (what it
        caches is put back), and where it has drifted from its time right after the choice (`Drift`), or the choice
        was remembered from an earlier start (`_recall`), measure the native step's settings and the shapes it runs
        again, as `use_native` does at load (but for torch's own one-token path: a dropped float copy is not
        rebuilt). Stops as soon as `busy()` says a request waits
        (`interruptible`), the settings the phase under way was timing put back; the next call goes on from that
        phase, so a re-measure gets through in gaps shorter than itself. Returns why the choice was made again (the
        drift) once it is complete, empty otherwise."""
        step = self.native
        if step is None:
            return ""
        with self.cache.borrowed(slot, native.SCRATCH_POSITIONS), interruptible(busy):
            before = step.choices(), self.native_rows
            try:
                self._serving = self._execution()
                if not self._remeasure:
                    if not self.drift.drifted(self._one_token_s(slot)):
                        return ""
                    self._remeasure = self._native_phases(rows=not self.rows_fixed(), chunks=not self.deterministic)
                    self._remeasure_why = (f"one-token forwards took {self.drift.last_s * 1e3:.2f} ms, "
                                           f"{self.drift.reference_s * 1e3:.2f} ms after the paths were chosen")
                while self._remeasure:
                    before = step.choices(), self.native_rows
                    self._remeasure[0](slot)
                    self._remeasure.pop(0)
                    self._serving = self._execution()
                step.serve()
            except Interrupted:
                step.choose(before[0])
                self.native_rows = before[1]
                return ""
            finally:
                self._serving = None
            self.drift.settled(0.0)  # the next check's time, where a request stops this one
            with contextlib.suppress(Interrupted):
                self.drift.settled(self._one_token_s(slot))
                self._keep()
        return self._remeasure_why

    def _compare_rows(self, slot: int, found: RowsFound, upto: int, context: int = native.CONTEXT, repeats: int = 5,
                      one_token_repeats: int = 11) -> None:
        """The native step against the torch forward, forwards of the token counts `ROW_COUNTS[found.next:upto]`, on
        `slot` (left empty), into `found`: the most tokens a forward runs through the native step (a decode step, a
        verify, a batch, a prompt chunk beside decoding streams) before torch is as fast (the native step reads each
        weight once for all its tokens, but torch's products multiply many tokens faster), and the ratios (native /
        torch time by token count). Each count interleaved (`interleaved_times`; more rounds at one token, the shape
        most forwards have); the comparison ends at the first count where torch is not slower twice in a row, so 0
        where torch wins a one-token step; a count between two compared ones goes native where the larger one did.
        Only the counts the cache has room for are compared (none: 1, unmeasured). `native_rows` is left as it was."""
        most = native.MAX_TOKENS
        context = max(1, min(context, self.max_context - most - 1))
        counts = [c for c in ROW_COUNTS if context + c <= self.max_context]
        if not counts:
            found.rows, found.next = 1, len(ROW_COUNTS)
        if found.next >= min(upto, len(counts)):
            return
        serving = self.native_rows
        ids = timing_ids(context + most, self.vocab_size, self.device)  # [context + most]
        self.native_rows = 0
        self.forward(ids[:context], 0, slot)

        def forward(count: int, rows: int) -> Callable[[], object]:
            def run() -> None:
                self.truncate(slot, context)
                self.native_rows = rows
                self.forward(ids[context : context + count], context, slot, num_logits=count)
            return run

        try:
            for at in range(found.next, min(upto, len(counts))):
                count = counts[at]
                for _ in range(2):  # torch as fast: measured again before it ends the range, as a burst can
                    on, off = interleaved_times([forward(count, most), forward(count, 0)],
                                                one_token_repeats if count == 1 else repeats)
                    found.ratios[count] = on / off
                    if on < off:
                        break
                found.next = at + 1 if on < off else len(ROW_COUNTS)
                if on >= off:
                    break
                found.rows = count
        finally:
            self.native_rows = serving
            self.truncate(slot, 0)

    def tune_decode(self, context: int = native.CONTEXT, repeats: int = 5) -> bool:
        """Time one-token steps through MKL's gemv and through oneDNN (alternating, after a warm-up of each) and
        keep the faster (when oneDNN wins, the plain copy is dropped); returns whether oneDNN won. Uses slot 0, which
        is left empty. Call once, at load."""
        context = min(context, self.max_context - 1)  # a small cache still fits context + 1 positions
        if context < 1:
            return False
        variants = [with_packed_decode(self.weights, on) for on in (False, True)]
        ids = timing_ids(context + 1, self.vocab_size, self.device)  # [context + 1]
        self.forward(ids[:context], 0, 0)
        times: list[list[float]] = [[], []]
        for i in range(2 * (repeats + 1)):
            self.weights = variants[i % 2]
            self.truncate(0, context)
            t0 = time.perf_counter()
            self.forward(ids[context:], context, 0)
            if i >= 2:
                times[i % 2].append(time.perf_counter() - t0)
        packed = statistics.median(times[1]) < statistics.median(times[0])
        self.weights = variants[int(packed)]
        if packed:
            self._drop_plain_copy()
        self.truncate(0, 0)
        return packed

    def chunks_native(self) -> bool:
        """Whether forwards longer than the native step takes (`MAX_TOKENS`) run in native chunks rather than through
        torch: always under `deterministic`; else as measured (`_compare_chunks`), and where that found no room in
        the cache, with int8 weights (half torch's time on dequantized weights)."""
        step = self.native
        if step is None:
            return False
        if self.deterministic:
            return True
        return step.int8 if self.native_chunks is None else self.native_chunks

    def _compare_chunks(self, slot: int, context: int = native.CONTEXT, repeats: int = 4) -> None:
        """Native chunks against the torch forward on a prompt of `CHUNK_TOKENS` tokens after `context` positions of
        `slot` (left empty), interleaved (`interleaved_times`), and the faster kept for every forward longer than
        `MAX_TOKENS` (`native_chunks`; logged in one line); left as it was where the cache has no room. No warm-up
        call: a forward this long reads every weight more than once. On the shipped float32 target (a 2-core AMD
        EPYC Zen 4) native chunks took 0.81-0.89x torch's time from 65 to 355 tokens, after 32 to 1,100 positions."""
        count = native.CHUNK_TOKENS
        if self.native is None or context + count > self.max_context:
            return
        ids = timing_ids(context + count, self.vocab_size, self.device)  # [context + count]
        serving = self.native_chunks
        self.forward(ids[:context], 0, slot)

        def forward(chunks: bool) -> Callable[[], object]:
            def run() -> None:
                self.truncate(slot, context)
                self.native_chunks = chunks
                self.forward(ids[context:], context, slot)
            return run

        try:
            chunked, whole = interleaved_times([forward(True), forward(False)], repeats, warm=0)
        finally:
            self.native_chunks = serving
            self.truncate(slot, 0)
        self.native_chunks = chunked < whole
        log.info("%s: forwards of more than %d tokens %s (ms for %d tokens after %d: native chunks %.2f, torch "
                 "%.2f)", self.name, native.MAX_TOKENS, "in native chunks" if self.native_chunks else "through torch",
                 count, context, chunked * 1e3, whole * 1e3)

    def forward(self, ids: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 of `slot` → float32 logits [num_logits, V] of the last positions."""
        count = ids.shape[0]
        if not 1 <= num_logits <= count:
            raise ValueError(f"num_logits must be in 1..{count}, got {num_logits}")
        self.cache.begin_write(slot, start, count)
        # the native step's calls write into buffers outside autograd (no inference mode to enter: entering and
        # leaving it were about 5 % of a lone int8 step's host time, right after a forward has flushed the caches)
        if self.graphs is not None and self.graphs.covers(count, num_logits):
            with torch.inference_mode():
                logits = self.graphs.forward(ids, start, slot, num_logits)
        elif self.native is not None and count <= self.native_rows:
            logits = self.native.run(ids, start, slot, num_logits)  # [num_logits, V]
        elif count > native.MAX_TOKENS and self.chunks_native() and num_logits <= native.MAX_TOKENS:
            # a prompt in native chunks, where they were measured faster (`_compare_chunks`) or --deterministic
            # wants every token computed as decoding does
            assert self.native is not None
            logits = self.native.run_chunks(ids, start, slot, num_logits)  # [num_logits, V]
        else:
            with torch.inference_mode():
                logits = eager.run(self.weights, self.cache, ids, start, slot, num_logits, self.buckets)
        self.cache.commit(slot, start + count)
        return logits

    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """Several slots in one forward → per row float32 logits [num_logits, V]. One row takes `forward` (CUDA
        graphs, padded sizes); more rows run natively where that step takes them, else eagerly, their tokens
        concatenated for every matrix product."""
        check_rows(rows)
        if len(rows) == 1:
            r = rows[0]
            return [self.forward(r.ids, r.start, r.slot, r.num_logits)]
        for r in rows:
            self.cache.begin_write(r.slot, r.start, r.ids.shape[0])
        step = self.native
        total = sum(r.ids.shape[0] for r in rows)
        if step is not None and (total <= self.native_rows or (total > native.MAX_TOKENS and self.chunks_native()
                                                               and all(r.num_logits <= native.MAX_TOKENS
                                                                       for r in rows))):
            logits = step.run_rows(rows)  # each row's tokens through the products they take alone
        else:
            with torch.inference_mode():
                logits = eager.run_rows(self.weights, self.cache, rows)  # [num_logits, V] per row
        for r in rows:
            self.cache.commit(r.slot, r.start + r.ids.shape[0])
        return logits

    def greedy_draft(self, logits: torch.Tensor, position: int, slot: int, k: int) -> torch.Tensor | None:
        """k greedy draft tokens [k] on the device: the argmax of `logits` [1, V] (the catch-up's) at `position` and
        k-1 more, as one graph replay (CUDA) or one native call (CPU); None where neither runs them (draft step by
        step)."""
        if self.draft_loop is None or not 1 <= k - 1 <= self.draft_loop.max_steps:
            first = logits[0].argmax().view(1)  # [1]
            rest = self.feed_greedy(first, position, slot, k - 1) if k >= 2 else None  # [k - 1]
            return None if rest is None else torch.cat([first, rest])
        self.cache.begin_write(slot, position, k - 1)
        with torch.inference_mode():
            tokens = self.draft_loop.run(logits[0].argmax().view(1), position, slot, k - 1)  # [k]
        self.cache.commit(slot, position + k - 1)
        return tokens

    def feed_greedy(self, ids: torch.Tensor, start: int, slot: int, k: int,
                    transform: DraftTransform | None = None) -> torch.Tensor | None:
        """ids [F] at positions start.. of `slot`, then k greedy tokens [k] (the argmax after the feed, and k-1 more
        one-token forwards; of the logits as `transform` leaves them, where given), in one native call; None where
        the native step does not take it (draft otherwise)."""
        if self.native is None or k < 1 or ids.shape[0] > self.native_rows:
            return None
        count = ids.shape[0] + k - 1
        self.cache.begin_write(slot, start, count)
        tokens = self.native.greedy(ids, start, slot, k - 1, transform)  # [k]
        self.cache.commit(slot, start + count)
        return tokens

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to `length` positions."""
        self.cache.truncate(slot, length)

    def length(self, slot: int) -> int:
        """Valid positions in `slot`."""
        return self.cache.length(slot)

    def copy_prefix(self, source: int, slot: int, length: int, start: int = 0) -> bool:
        """`slot` takes positions [start, length) of `source` (`KVCache.copy_prefix`)."""
        self.cache.copy_prefix(source, slot, length, start)
        return True

    def cache_bytes(self) -> int:
        """Bytes of the preallocated K/V tensors."""
        return self.cache.nbytes()

    def execution(self) -> list[tuple[str, str]]:
        """Which path runs forwards of each length (as `forward` chooses), as (tokens a forward, path) rows; while a
        check between requests times other settings (`recheck`, on the device thread), the ones it will serve with
        (GetModelInfo asks from another thread)."""
        return self._serving if self._serving is not None else self._execution()

    def _execution(self) -> list[tuple[str, str]]:
        """`execution` from the settings in force now."""
        head = self.weights.head
        torch_path = "torch" + (" int8" if head.q8 is not None and head.wt is None and head.packed is None
                                else " bf16" if head.bf16_only else "")
        if self.graphs is not None:
            return [(f"1-{self.graphs.max_tokens}", "CUDA graphs"), (f"{self.graphs.max_tokens + 1}+", torch_path)]
        step, rows = self.native, self.native_rows
        if step is None or rows == 0:
            return [("any", torch_path)]
        out = [("1", f"native, prefetch {step.prefetch_label(1)}{step.threads_note(1)}")]
        amx_from = step.model.amx_from if 1 < step.model.amx_from <= rows else 0
        if rows > 1 and amx_from:  # the int8 products of these forwards on AMX tiles (the same bits as VNNI)
            if amx_from > 2:
                out += self._spans(2, amx_from - 1, f"native, prefetch {step.prefetch_label(2)}")
            out += self._spans(amx_from, rows, f"native, prefetch {step.prefetch_label(2)}, AMX")
        elif rows > 1:
            out += self._spans(2, rows, f"native, prefetch {step.prefetch_label(2)}")
        chunks = self.chunks_native()
        if chunks and rows < native.MAX_TOKENS:  # torch between what the native step takes and its chunks
            out += [(f"{rows + 1}-{native.MAX_TOKENS}" if rows + 1 < native.MAX_TOKENS else f"{rows + 1}", torch_path)]
            rows = native.MAX_TOKENS
        longer = ("native in chunks" + (", AMX" if 0 < step.model.amx_from <= native.MAX_TOKENS else "")
                  + step.threads_note(native.MAX_TOKENS) if chunks else torch_path)
        out.append((f"{rows + 1}+", longer))
        return out

    def _spans(self, lo: int, hi: int, path: str) -> list[tuple[str, str]]:
        """`execution` rows for native forwards of lo..hi tokens on `path`, each with the threads its forwards take
        where fewer than all (`NativeStep.threads_note`): one row, or one a thread shape (`native.thread_shape`) where
        the shapes in the range take different counts."""
        step = self.native
        assert step is not None
        wide = native.WIDE_TOKENS
        split = lo < wide <= hi and step.threads_note(lo) != step.threads_note(wide)
        spans = [(lo, wide - 1), (wide, hi)] if split else [(lo, hi)]
        return [(f"{a}-{b}" if b > a else f"{a}", path + step.threads_note(a)) for a, b in spans]

