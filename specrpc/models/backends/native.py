"""Forwards of a few tokens (decode steps, verifies, catch-ups) of a lean Llama-family model through the native step
(specrpc/native/decode.cpp)."""

from __future__ import annotations

import array
import ctypes
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from specrpc import native
from specrpc.models import huge_pages
from specrpc.models.backends.timing import interleaved_times, timing_ids
from specrpc.models.batch import BatchRow
from specrpc.models.kv_cache import KVCache
from specrpc.models.llama.weights import Linear, LlamaWeights

log = logging.getLogger(__name__)


def supported(w: LlamaWeights, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the native step cannot run this model here (None: it can)."""
    a = w.args
    if device.type != "cpu" or dtype != torch.float32:
        return "float32 on the CPU only"
    if a.layer_norm or not a.gated or a.act != "silu":
        return "RMSNorm with a gated SiLU MLP only"
    if a.head_dim % 2 or a.head_dim > 1024 or a.heads % a.kv_heads:
        return f"head_dim {a.head_dim}, heads {a.heads}/{a.kv_heads}"
    if not (all(p.wt is not None for p in w.linears()) or int8_weights(w)):
        return "float32 or int8 weights only (not bf16 weights)"
    if native.library() is None:
        return "the native library could not be built"
    return None


def int8_weights(w: LlamaWeights) -> bool:
    """Whether every projection has an int8 copy (`--weights int8`, or a draft's int8 decode copies): the native
    step then reads those, a quarter of the bytes, as the torch forward's int8 kernel does."""
    return all(p.q8 is not None and p.q8_scale is not None for p in w.linears())


PANEL = 16
"""Output rows per panel of a packed weight: one 16-lane vector (decode.cpp's LANES)."""


def panels_shape(n: int, k: int) -> tuple[int, int, int]:
    """The shape `pack_panels` gives a weight [n, k]."""
    return -(-n // PANEL), k, PANEL


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] → [ceil(N / 16), K, 16], rows padded with zeros: panel b holds rows 16 b .. 16 b + 15 column by
    column, the layout decode.cpp's products read (one column of a panel is one vector). Written into `out` (of
    `panels_shape`) where given."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -n % PANEL))  # [N', K]
    packed = padded.view(-1, PANEL, k).transpose(1, 2)  # [N'/16, K, 16]
    return packed.contiguous() if out is None else out.copy_(packed)


def int8_groups_shape(n: int, k: int, group: int, block: int) -> tuple[int, int, int, int]:
    """The shape `pack_int8_groups` gives an int8 weight [n, k]."""
    return -(-n // PANEL), -(-k // block) * block // group, PANEL, group


def pack_int8_groups(weight: torch.Tensor, group: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 weight [N, K] → uint8 [ceil(N / 16), K' / group, 16, group] holding weight + 128, K' = K padded to a
    multiple of `block` (padding: weight 0): panel b holds rows 16 b .. 16 b + 15 in groups of `group` columns, the
    layout of decode.cpp's VNNI products (one group of a panel is one vector: 4 unsigned bytes per lane, multiplied by
    4 int8 activations; a block of columns shares an activation scale). Written into `out` (of `int8_groups_shape`)
    where given."""
    n, k = weight.shape
    shifted = torch.nn.functional.pad(weight.to(torch.int16) + 128, (0, -k % block, 0, -n % PANEL), value=128)
    packed = shifted.to(torch.uint8).view(-1, PANEL, shifted.shape[1] // group, group).transpose(1, 2)
    return packed.contiguous() if out is None else out.copy_(packed)


MAX_TOKENS = 64
"""Tokens one native forward takes at most (its work buffers' rows, decode.cpp's limit): several streams' verifies in
one batch, a prompt chunk beside decoding streams, an int8 or deterministic prompt's chunks. The shipped float32
target on a 2-core AMD EPYC Zen 4, native against torch (interleaved, one process): one row of 16 / 32 / 64 tokens
0.58 / 0.68 / 0.78x the time, 8 streams' 3-token verifies 0.59x, 7 decoding streams beside a 44-token prompt chunk
0.71x; a 512-token int8 prompt in chunks of 64 took 0.78-0.82x its time in chunks of 16."""

SKIP_ATTENTION = 1
"""`NativeStep.run_parts`: the forward without attention (decode.cpp's `Skip`)."""
SKIP_PRODUCTS = 2
"""`NativeStep.run_parts`: the forward without its matrix products."""

CONTEXT = 32
"""Positions of a slot a timing fills before the forwards it times (the calibrations here, `LlamaLM`'s at load and
between requests): few, so that attention weighs little beside the products compared."""

CHUNK_TOKENS = 2 * MAX_TOKENS
"""The prompt shape `LlamaLM` times native chunks against the torch forward on (two whole chunks after `CONTEXT`)."""

SCRATCH_POSITIONS = CONTEXT + CHUNK_TOKENS
"""The most positions of a slot a timing writes: what a check between requests borrows (`KVCache.borrowed`)."""

STREAM_BYTES = 32 << 20
"""Weights above this size stream past the CPU's caches until `calibrate_prefetch` has measured the modes (about a
2-core AMD EPYC's last-level cache, where a target this size would evict the draft's weights on every step)."""

PREFETCH_AHEAD = 2048
"""Bytes ahead of the column a product reads that its prefetches ask for until `calibrate_prefetch` has measured the
distances (`PREFETCH_DISTANCES`), and what the mode "none" leaves in the struct."""

PREFETCH_DISTANCES = (256, PREFETCH_AHEAD, 8192, 32768)
"""The distances `calibrate_prefetch` times with each prefetching mode. No distance wins everywhere: on a 2-core Intel
Xeon (one thread, the shipped target) 8192 was up to 20 % slower than 2048; on a 2-core AMD EPYC (Zen 3) it made the
int8 target's one-token step 7 % faster and 256 the float32 one's 4-6 %; on a Zen 4, whose virtualised L3 holds less
than the int8 target's 25 MB, a verify of 5 tokens (two panels a pass, few streams to keep in flight) took 0.77 ms
at 32768 against 0.81-0.95 at the others and 0.47 at one token, and calibration chose it in 3 of 3 starts
(`Model.prefetch_ahead`)."""


def long_ids(tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` as the contiguous int64 the native calls read (themselves where they are: the engine's own; a
    conversion op is a few microseconds each after a forward has flushed the caches)."""
    return tokens if tokens.dtype == torch.long and tokens.is_contiguous() else tokens.to(torch.long).contiguous()


def setting_label(mode: str, ahead: int) -> str:
    """A prefetch setting as logs and tables name it: the mode, with its distance where it prefetches."""
    return mode if mode == "none" else f"{mode} {ahead} B ahead"


def prefetch_settings() -> list[tuple[str, int]]:
    """(mode, distance) of every way a forward can prefetch its weights: each `native.PREFETCH` mode, each
    prefetching one at every distance of `PREFETCH_DISTANCES` ("none" at the default, which it ignores)."""
    return [(mode, ahead) for mode in native.PREFETCH
            for ahead in ((PREFETCH_AHEAD,) if mode == "none" else PREFETCH_DISTANCES)]


VERIFY_TOKENS = 5
"""The verify shape `calibrate_prefetch` times beside a one-token step: 4 drafts and the token before them."""

PASS_TOKENS = (3, VERIFY_TOKENS, 9, 16)
"""The forward shapes `calibrate_passes` times, each standing for the token counts from the one before it up to it
(the widest up to `MAX_TOKENS`)."""

PASS_CAPS = (0, 6, 4)
"""The most tokens one pass over a product's weights may take, as `calibrate_passes` tries them: 0 is decode.cpp's own
choice (up to 8, the fewest passes: best where reading the weights bounds a product, as the f32 target that exceeds a
2-core AMD EPYC's L3: 16 tokens 1.15-1.17x slower at a cap of 4 or 6), 6 and 4 take more panels at a time (best where
the weights sit in the caches and the multiplies bound it, as that machine's int8 draft: 16 tokens 0.91x)."""

AMX_TOKENS = (2, 3, VERIFY_TOKENS, 9, 16)
"""The forward shapes `calibrate_amx` times with int8 products on AMX tiles and on VNNI: verifies of 1, 2, 4 and 8
drafts, and the tiles' full 16 tokens (a wider forward takes them 16 tokens at a time)."""


def within_torch(threads: int) -> int:
    """`threads` (0: all) as a forward takes them: at most torch's."""
    return min(threads, torch.get_num_threads()) if threads else torch.get_num_threads()


def thread_counts(threads: int) -> list[int]:
    """The threads a forward may take, as `calibrate_threads` tries them: all `threads`, then halved down to one."""
    counts = [max(1, threads)]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


SERVED_ROUNDS = 40
"""Forwards of its shape each finalist serves before the fastest is kept (`ServedPick`)."""


def shape_of(count: int) -> int:
    """The shape whose prefetch a forward of `count` tokens takes: 1 (decode steps, a draft's steps) or
    `VERIFY_TOKENS` (verifies, batches, chunks)."""
    return 1 if count == 1 else VERIFY_TOKENS


WIDE_TOKENS = 16
"""The forward shape `calibrate_threads` times for wide forwards (prompt chunks, wide batches: this many tokens and
more) apart from verifies: where a 5-token verify is faster on fewer threads (two vCPUs sharing a core, or a noisy
neighbour at load), a 64-token chunk, bound by its multiplies, may still want every thread, and a prefill on half of
them would double the time to a first token."""


def thread_shape(count: int) -> int:
    """The shape whose threads a forward of `count` tokens takes: 1, `VERIFY_TOKENS` (2 .. `WIDE_TOKENS` - 1) or
    `WIDE_TOKENS` (that many and more)."""
    return 1 if count == 1 else VERIFY_TOKENS if count < WIDE_TOKENS else WIDE_TOKENS


THREAD_SHAPES = {1: "one token", VERIFY_TOKENS: f"2-{WIDE_TOKENS - 1} tokens", WIDE_TOKENS: f"{WIDE_TOKENS}+ tokens"}
"""Each `thread_shape` as logs name the forwards it stands for."""


Setting = TypeVar("Setting")


@dataclasses.dataclass
class ServedPick(Generic[Setting]):
    """A setting of one shape of forwards (one token: decode steps, drafts; several: verifies, batches), its prefetch
    or its threads, chosen among the settings fastest at load (for the prefetch, each mode at its fastest distance;
    for the threads, the count load chose and all of torch's) by the forwards served: they take the
    `finalists` in turn (each sees the same mix of lengths, contexts and what ran before them) until each has served
    `rounds`, and the one whose forwards took least (median) is kept. Load times each shape back to back at 32
    positions; served, the other model's forwards and the host's work come between, at a few hundred positions. The
    shipped int8 target on a 2-core AMD EPYC (Zen 4) took non-temporal or temporal prefetches 32768 B ahead for its
    verifies in 7 of 7 server starts; served, "outer" 32768 B ahead took 0.82-0.84x their median verify and decoded
    1.11-1.15x as fast (12 code prompts, k = 3 and adaptive, the two choices alternating request by request in one
    process, two processes). Its one-token steps, fixed request by request, decoded 0.82x as fast with the
    non-temporal or temporal 2048 B ahead that starts chose as with outer 32768 B ahead."""

    finalists: list[Setting]
    rounds: int = SERVED_ROUNDS
    seconds: list[list[float]] = dataclasses.field(init=False)  # by finalist, each forward's
    served: int = 0  # forwards timed so far

    def __post_init__(self) -> None:
        self.seconds = [[] for _ in self.finalists]

    def setting(self) -> Setting:
        """The finalist the shape's next forward takes."""
        return self.finalists[self.served % len(self.finalists)]

    def observe(self, seconds: float) -> Setting | None:
        """The forward `setting` named took `seconds`: the fastest finalist once each has served `rounds`, else
        None."""
        self.seconds[self.served % len(self.finalists)].append(seconds)
        self.served += 1
        if self.served < self.rounds * len(self.finalists):
            return None
        return self.finalists[min(range(len(self.finalists)), key=lambda i: statistics.median(self.seconds[i]))]


def decided(picks: dict[int, ServedPick[Setting]], shape: int, seconds: float
            ) -> tuple[ServedPick[Setting], Setting] | None:
    """A forward of `shape` took `seconds`: where `picks` has a pick choosing it, that pick learns it; once the pick
    has its choice, it leaves `picks`, and the pick and its choice are returned (None otherwise)."""
    pick = picks.get(shape)
    if pick is None:
        return None
    chosen = pick.observe(seconds)
    if chosen is None:
        return None
    del picks[shape]
    return pick, chosen


@dataclasses.dataclass(frozen=True)
class Choices:
    """What a `NativeStep`'s calibrations chose (`NativeStep.choices`): put back (`NativeStep.choose`) where a
    measurement stopped half way, so that no setting it was timing stays behind."""

    prefetch_one: str
    ahead_one: int
    prefetch_many: str
    ahead_many: int
    passes: tuple[int, ...]
    amx_from: int
    threads_one: int = 0  # 0: all of torch's threads
    threads_many: int = 0
    threads_wide: int = 0


class NativeStep:
    """The model's weights packed in panels (`pack_panels`), its KV cache and work buffers, bound to the native
    step; `run` runs up to `MAX_TOKENS` tokens."""

    def __init__(self, w: LlamaWeights, cache: KVCache) -> None:
        """Weights above `STREAM_BYTES` are read with non-temporal prefetches until `calibrate_prefetch` measures
        which mode is fastest here (`prefetch_one`, `prefetch_many`)."""
        a = w.args
        lib = native.library()
        assert lib is not None
        self._fn = lib.specrpc_forward
        self._row = lib.specrpc_forward_row
        self._greedy = lib.specrpc_greedy
        group = lib.specrpc_int8_group()  # int8 weights: 4 (int8 activations, VNNI) or 1 (widened to float)
        block = lib.specrpc_int8_block()  # activation columns per scale (VNNI)
        keep: list[torch.Tensor] = []  # every tensor the struct points into, alive as long as self

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().to(torch.float32).contiguous()
            keep.append(t)
            return native.pointer(t)

        self.int8 = int8_weights(w)
        projections: list[torch.Tensor] = []  # what a step reads in full
        out_rows: list[int] = []  # each projection's N

        def shape(p: Linear) -> tuple[tuple[int, ...], torch.dtype]:
            """The shape and dtype of p's weight packed (`rows`)."""
            if self.int8:
                assert p.q8 is not None
                n, k = p.q8.shape
                if group > 1:
                    return int8_groups_shape(n, k, group, block), torch.uint8
                return panels_shape(n, k), torch.int8
            assert p.wt is not None
            k, n = p.wt.shape
            return panels_shape(n, k), torch.float32

        # the packed weights in one arena of huge pages, which a forward reads in full (`huge_pages`)
        linears = [p for layer in w.layers for p in (layer.qkv, layer.o, layer.up, layer.down)] + [w.head]
        arena = huge_pages.Arena(huge_pages.aligned_size([shape(p) for p in linears]))

        def rows(p: Linear) -> tuple[int | None, int | None]:
            """The weight packed in panels (`pack_panels`: float, or int8) and its per-row scales [N] (None for
            float)."""
            if self.int8:
                assert p.q8 is not None and p.q8_scale is not None
                weight, scale = p.q8, ptr(p.q8_scale)  # [N, K] int8
            else:
                assert p.wt is not None
                weight, scale = p.wt.t().to(torch.float32), None  # [N, K]
            # [N/16, K, 16] (float, or int8 widened) or uint8 [N/16, K/4, 16, 4] (VNNI)
            out = arena.take(*shape(p))
            packed = (pack_int8_groups(weight, group, block, out) if self.int8 and group > 1
                      else pack_panels(weight, out))
            keep.append(packed)
            projections.append(packed)
            out_rows.append(weight.shape[0])
            return int(packed.data_ptr()), scale

        layers = (native.Layer * a.layers)()
        for i, layer in enumerate(w.layers):
            layers[i] = native.Layer(
                ptr(layer.attn_norm.weight), *rows(layer.qkv), ptr(layer.qkv.bias), ptr(layer.qk_norm),
                *rows(layer.o), ptr(layer.o.bias), ptr(layer.mlp_norm.weight), *rows(layer.up), ptr(layer.up.bias),
                *rows(layer.down), ptr(layer.down.bias), layer.window or 0)
        head, head_scale = rows(w.head)
        self.vocab = out_rows[-1]  # the head's rows
        self.arena = arena  # the packed weights' memory
        log.info("native weights: %.1f MB packed, %.1f MB of them in huge pages", arena.size / 1e6,
                 arena.huge_bytes() / 1e6)
        guess = "non-temporal" if sum(t.nbytes for t in projections) > STREAM_BYTES else "none"
        self.prefetch_one = guess  # the `native.PREFETCH` mode of one-token forwards (decode steps, greedy drafts)
        self.prefetch_many = guess  # and of forwards of more tokens (verifies, batches, chunks)
        self.ahead_one = self.ahead_many = PREFETCH_AHEAD  # their prefetch distances, bytes
        # by `thread_shape`, the threads its forwards take (0: all of torch's)
        self.threads_chosen: dict[int, int] = dict.fromkeys(THREAD_SHAPES, 0)
        # by shape (1: one token, VERIFY_TOKENS: several), each mode's fastest at load, fastest first; and the
        # forwards served choosing among them (`serve`)
        self.finalists: dict[int, list[tuple[str, int]]] = {}
        self.picks: dict[int, ServedPick[tuple[str, int]]] = {}
        self.thread_picks: dict[int, ServedPick[int]] = {}  # by shape, the served choosing its threads (`serve`)
        capacity = cache.k.shape[3]  # [L, S, H, C, D]
        buffers = {"x": a.hidden, "h": a.hidden, "qkv": (a.heads + 2 * a.kv_heads) * a.head_dim,
                   "att": a.heads * a.head_dim, "up": 2 * a.ffn, "scores": a.heads * capacity}
        work = {name: torch.zeros(MAX_TOKENS, size) for name, size in buffers.items()}  # [T, size]
        keep += list(work.values())
        kq = -max(a.hidden, a.heads * a.head_dim, a.ffn) // block * -block  # the widest product's columns, padded
        quantized = {"xq": torch.zeros(MAX_TOKENS, kq, dtype=torch.int8),  # int8 activations (VNNI products)
                     "xs": torch.zeros(MAX_TOKENS, kq // block), "xsum": torch.zeros(MAX_TOKENS, kq // block,
                                                                                  dtype=torch.int32)}
        keep += list(quantized.values())
        keep += [cache.k, cache.v]  # the KV cache, written in place: alive as long as the struct, as the rest
        self.model = native.Model(
            d=a.hidden, hq=a.heads, hkv=a.kv_heads, dh=a.head_dim, ffn=a.ffn, vocab=self.vocab, layers=a.layers,
            slots=cache.k.shape[1], capacity=capacity, max_tokens=MAX_TOKENS, prefetch=native.PREFETCH[guess],
            eps=a.eps, embed=ptr(w.embed), norm=ptr(w.norm.weight), head=head, head_scale=head_scale, cos=ptr(w.cos),
            sin=ptr(w.sin), layer=layers,
            k_cache=native.pointer(cache.k), v_cache=native.pointer(cache.v),
            **{name: native.pointer(t) for name, t in work.items()},
            **{name: int(t.data_ptr()) for name, t in quantized.items()}, kq=kq, prefetch_ahead=PREFETCH_AHEAD)
        self.passes = torch.zeros(MAX_TOKENS + 1, dtype=torch.int64)  # [MAX_TOKENS + 1] `calibrate_passes`' caps
        self.model.pass_tokens = self.passes.data_ptr()
        self._layers = layers
        self._keep = keep
        self._model_ref = ctypes.byref(self.model)
        self._scratch = torch.empty(self.vocab)  # [V] a greedy draft's logits, each step's in turn
        self._shaped = torch.empty(self.vocab)  # [V] and as a draft's logits transform leaves them

    def _setting(self, count: int) -> tuple[str, int]:
        """The prefetch mode and distance of a forward of `count` tokens (as chosen; `_prefetch` may be trying
        another)."""
        return (self.prefetch_one, self.ahead_one) if count == 1 else (self.prefetch_many, self.ahead_many)

    def _prefetch(self, count: int) -> None:
        """The prefetch mode and distance for a forward of `count` tokens into the struct (a hint: results are the
        same bits): the chosen one, or where the forwards served are choosing (`picks`) the finalist in turn."""
        pick = self.picks.get(shape_of(count))
        mode, ahead = pick.setting() if pick is not None else self._setting(count)
        self.model.prefetch = native.PREFETCH[mode]
        self.model.prefetch_ahead = ahead

    def _native(self, count: int, call: Callable[..., int], *args: object) -> int:
        """`call(model, *args)`, a native forward of `count` tokens (for a greedy draft, its one-token steps), under
        that shape's prefetch (`_prefetch`); where the forwards served are choosing its settings, the forward's time
        goes to them once the call succeeded (`_served_took`). Returns the call's status (0: done)."""
        self._prefetch(count)
        t0 = time.perf_counter()
        rc = call(self._model_ref, *args)
        if rc == 0 and (self.picks or self.thread_picks):
            self._served_took(count, time.perf_counter() - t0)
        return rc

    def serve(self) -> None:
        """From now on, each shape's forwards choose their prefetch among the finalists of the last
        `calibrate_prefetch` (`ServedPick`; none where it left fewer than two), and where load chose fewer threads
        than all of torch's for a shape, between those and all (load times each count back to back; served, the
        other model's forwards come between, and an idle OpenMP worker waits differently)."""
        self.picks = {shape: ServedPick(list(f)) for shape, f in self.finalists.items() if len(f) > 1}
        self.thread_picks = {shape: ServedPick([chosen, 0]) for shape, chosen in self.threads_chosen.items() if chosen}

    def _served_took(self, count: int, seconds: float) -> None:
        """A forward of `count` tokens took `seconds`: where the forwards served are choosing its shape's prefetch
        (`shape_of`) or threads (`thread_shape`), the pick learns it, and once its finalists have all served their
        rounds the fastest is the choice (logged)."""
        prefetch = decided(self.picks, shape_of(count), seconds)
        if prefetch is not None:
            pick, chosen = prefetch
            if count == 1:
                self.prefetch_one, self.ahead_one = chosen
            else:
                self.prefetch_many, self.ahead_many = chosen
            log.info("native prefetch for forwards of %s, chosen by %d served: %s (ms, medians: %s)",
                     "one token" if count == 1 else "several tokens", pick.served, setting_label(*chosen),
                     ", ".join(f"{setting_label(*f)} {statistics.median(t) * 1e3:.3f}"
                               for f, t in zip(pick.finalists, pick.seconds, strict=True)))
        threads = decided(self.thread_picks, thread_shape(count), seconds)
        if threads is not None:
            counts, n = threads
            self._set_threads(count, n)
            log.info("native threads for forwards of %s, chosen by %d served: %d (ms, medians: %s)",
                     THREAD_SHAPES[thread_shape(count)], counts.served, within_torch(n),
                     ", ".join(f"{within_torch(f)} {statistics.median(t) * 1e3:.3f}"
                               for f, t in zip(counts.finalists, counts.seconds, strict=True)))

    def threads(self, count: int) -> int:
        """The threads a forward of `count` tokens takes (a greedy draft: its one-token steps'): as chosen
        (`calibrate_threads`), or where the forwards served are choosing (`thread_picks`) each count in turn; within
        torch's."""
        pick = self.thread_picks.get(thread_shape(count))
        return within_torch(pick.setting() if pick is not None else self._given_threads(count))

    def _given_threads(self, count: int) -> int:
        """The threads chosen for forwards of `count` tokens (`thread_shape`; 0: all of torch's)."""
        return self.threads_chosen[thread_shape(count)]

    def threads_note(self, count: int) -> str:
        """", on N threads" where forwards of `count` tokens were given fewer than all of torch's (as chosen, not
        the count a served choice is trying), else empty."""
        n = within_torch(self._given_threads(count))
        return f", on {n} thread{'s' if n > 1 else ''}" if n < torch.get_num_threads() else ""

    def prefetch_label(self, count: int) -> str:
        """How a forward of `count` tokens prefetches: its mode, with its distance where it prefetches."""
        return setting_label(*self._setting(count))

    def prefetch_everywhere(self, mode: str, ahead: int) -> None:
        """Every forward, whatever its tokens, prefetching in `mode` `ahead` bytes ahead (a setting being timed)."""
        self.picks = {}
        self.prefetch_one = self.prefetch_many = mode
        self.ahead_one = self.ahead_many = ahead

    def choices(self) -> Choices:
        """The settings the calibrations chose (or the guesses where none has run)."""
        return Choices(self.prefetch_one, self.ahead_one, self.prefetch_many, self.ahead_many,
                       tuple(int(n) for n in self.passes.tolist()), int(self.model.amx_from), self.threads_chosen[1],
                       self.threads_chosen[VERIFY_TOKENS], self.threads_chosen[WIDE_TOKENS])

    def choose(self, c: Choices) -> None:
        """Put back settings `choices` returned."""
        self.prefetch_one, self.ahead_one, self.prefetch_many, self.ahead_many = (
            c.prefetch_one, c.ahead_one, c.prefetch_many, c.ahead_many)
        self.passes[:] = torch.tensor(c.passes, dtype=torch.int64)
        self.model.amx_from = c.amx_from
        self.threads_chosen = {1: c.threads_one, VERIFY_TOKENS: c.threads_many, WIDE_TOKENS: c.threads_wide}

    def _times(self, slot: int, context: int, counts: Sequence[int], settings: Sequence[Setting],
               apply: Callable[[int, Setting], None], repeats: int) -> dict[int, list[float]]:
        """What every calibration here measures: `context` (>= 1) positions of `slot` filled, then by each of
        `counts`, the seconds of a forward of that many tokens after them under each of `settings` (`apply(count,
        setting)` puts one in force), interleaved (`interleaved_times`, lower quartiles). Writes K/V at positions
        below context + the widest count of `slot`, which the caller holds empty; leaves the last setting timed in
        force."""
        ids = timing_ids(context + max(counts), self.vocab)  # [context + widest]
        self.run_chunks(ids[:context], 0, slot)
        times: dict[int, list[float]] = {}
        for count in counts:
            def step(setting: Setting, count: int = count) -> Callable[[], None]:
                def run() -> None:
                    apply(count, setting)
                    self.run(ids[context : context + count], context, slot, count)
                return run

            times[count] = interleaved_times([step(setting) for setting in settings], repeats)
        return times

    def calibrate_prefetch(self, slot: int = 0, context: int = CONTEXT, repeats: int = 5,
                           counts: tuple[int, ...] = (1, VERIFY_TOKENS)) -> dict[int, dict[str, float]]:
        """Time every prefetch mode (`native.PREFETCH`), each prefetching one at every distance of
        `PREFETCH_DISTANCES`, on this model at one token (a decode step) and at `VERIFY_TOKENS` (a verify), or at
        those of `counts`, interleaved (`interleaved_times`, lower quartiles), and keep the fastest at each
        (`prefetch_one`, `ahead_one`, `prefetch_many`, `ahead_many`): whether to read the weights past the caches,
        and how far ahead, depends on the CPU's caches and prefetchers and the model, and no byte count knows them.
        Writes K/V at positions below context + `VERIFY_TOKENS` of `slot`, which the caller holds empty. `repeats`
        rounds of the 13 settings (a start-up cost on a 2-core AMD EPYC, Zen 4: 1.09-1.22 s for the shipped
        float32 target, 0.20-0.29 s at int8; without "outer" 0.71-0.87 s and 0.14-0.17 s).
        Returns those seconds per shape and setting (`setting_label`; empty where the cache has no room to measure,
        the guess kept)."""
        context = min(context, self.model.capacity - VERIFY_TOKENS)
        if context < 1:
            return {}
        self.picks = {}  # every forward below in the setting being timed, on the threads chosen
        self.thread_picks = {}
        settings = prefetch_settings()
        table: dict[int, dict[str, float]] = {}
        best = {1: (self.prefetch_one, self.ahead_one), VERIFY_TOKENS: (self.prefetch_many, self.ahead_many)}
        for count, times in self._times(slot, context, counts, settings,
                                        lambda _, setting: self.prefetch_everywhere(*setting), repeats).items():
            table[count] = {setting_label(mode, ahead): t for (mode, ahead), t in zip(settings, times, strict=True)}
            best[count] = settings[min(range(len(settings)), key=times.__getitem__)]
            if count in (1, VERIFY_TOKENS):  # each mode at its fastest distance, the fastest first
                fastest: dict[str, tuple[float, tuple[str, int]]] = {}
                for setting, t in zip(settings, times, strict=True):
                    if setting[0] not in fastest or t < fastest[setting[0]][0]:
                        fastest[setting[0]] = (t, setting)
                self.finalists[count] = [setting for _, setting in sorted(fastest.values())]
        (self.prefetch_one, self.ahead_one), (self.prefetch_many, self.ahead_many) = best[1], best[VERIFY_TOKENS]
        return table

    def calibrate_passes(self, slot: int = 0, context: int = CONTEXT, repeats: int = 7,
                         widths: tuple[int, ...] = PASS_TOKENS) -> dict[int, dict[int, float]]:
        """Time forwards of each of `PASS_TOKENS` tokens (or those of `widths`) with each of `PASS_CAPS` tokens at
        most a pass over a product's weights, interleaved (`interleaved_times`, lower quartiles), and keep the
        fastest cap for the token counts each width stands for (`passes`): which is fastest depends on whether the
        weights or the multiplies bound the product on this CPU, and the results are the same bits at any cap (each
        output sums over its columns in order whatever the tile). Writes K/V at positions below context + the widest
        width of `slot`, which the caller holds empty. Returns the seconds by width and cap (empty where the cache has
        no room)."""
        context = min(context, self.model.capacity - max(widths))
        if context < 1:
            return {}

        def cap_at(count: int, cap: int) -> None:
            self.passes[count] = cap

        table: dict[int, dict[int, float]] = {}
        for count, times in self._times(slot, context, widths, PASS_CAPS, cap_at, repeats).items():
            table[count] = dict(zip(PASS_CAPS, times, strict=True))
            low = max((n for n in PASS_TOKENS if n < count), default=0) + 1  # the counts this width stands for
            high = MAX_TOKENS if count == PASS_TOKENS[-1] else count
            self.passes[low : high + 1] = min(table[count], key=table[count].__getitem__)
        return table

    def calibrate_threads(self, slot: int = 0, context: int = CONTEXT, repeats: int = 9,
                          counts: tuple[int, ...] = (1, VERIFY_TOKENS, WIDE_TOKENS)) -> dict[int, dict[int, float]]:
        """Time forwards of one token (decode steps, a draft's steps), of `VERIFY_TOKENS` (verifies, narrow batches)
        and of `WIDE_TOKENS` (prompt chunks, wide batches), or of `counts`, on each of `thread_counts` threads,
        interleaved (`interleaved_times`, lower quartiles), and keep the fastest for each shape (`thread_shape`,
        `threads_chosen`): where two vCPUs share a core, or a small model's products are too short to pay for the
        barriers between them, fewer threads can win; the results are the same bits on any (each output and each
        query is computed the same way whichever thread takes it). Writes K/V at positions below context + the widest
        of `counts` of `slot`, which the caller holds empty. Returns the seconds by shape and threads (empty where
        there is one thread, or no room)."""
        candidates = thread_counts(torch.get_num_threads())
        self.thread_picks = {}  # every forward below on the count being timed
        context = min(context, self.model.capacity - max(counts))
        if len(candidates) < 2 or context < 1:
            return {}
        table: dict[int, dict[int, float]] = {}
        for count, times in self._times(slot, context, counts, candidates, self._set_threads, repeats).items():
            table[count] = dict(zip(candidates, times, strict=True))
            fastest = min(table[count], key=table[count].__getitem__)
            self._set_threads(count, 0 if fastest == candidates[0] else fastest)
        return table

    def _set_threads(self, count: int, threads: int) -> None:
        """Forwards of `count` tokens' shape (`thread_shape`) on `threads` threads (0: all of torch's)."""
        self.threads_chosen[thread_shape(count)] = threads

    def calibrate_amx(self, slot: int = 0, context: int = CONTEXT, repeats: int = 9) -> dict[int, tuple[float, float]]:
        """Where int8 products may run on AMX tiles (`native.amx_available`: same bits as VNNI, a speed choice only),
        time forwards of each of `AMX_TOKENS` tokens with them on VNNI and on the tiles, interleaved
        (`interleaved_times`, lower quartiles), and run on the tiles from the fewest tokens where they win at that
        width and every wider one measured (`model.amx_from`; 0, never, where they lose at the widest). VNNI takes a
        token's products one at a time, so a verify of a few tokens costs nearly that many one-token steps of
        multiplies; the tiles take 16 tokens at once. Writes K/V at positions below context + 16 of `slot`, which the
        caller holds empty. Returns (VNNI, AMX) seconds per width, empty where not measured."""
        context = min(context, self.model.capacity - AMX_TOKENS[-1])
        if not self.int8 or context < 1 or not native.amx_available():
            return {}
        def tiles_at(count: int, tiles: bool) -> None:
            self.model.amx_from = count if tiles else 0

        table = {count: (vnni, amx) for count, (vnni, amx) in
                 self._times(slot, context, AMX_TOKENS, (False, True), tiles_at, repeats).items()}
        self.model.amx_from = 0
        for count in reversed(AMX_TOKENS):
            vnni, amx = table[count]
            if amx >= vnni:
                break
            self.model.amx_from = count
        return table

    def run(self, tokens: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        """tokens [T] int64 (T <= MAX_TOKENS) at positions start.. of `slot` (their K/V written there) → float32
        logits [num_logits, V] of the last ones (one row: its positions are made in the native call, no index
        tensors)."""
        return self._run_row(tokens, start, slot, num_logits, 0)

    def _run_row(self, tokens: torch.Tensor, start: int, slot: int, num_logits: int, skip: int) -> torch.Tensor:
        """`run` with the parts `skip` names left out (0: none)."""
        count = tokens.shape[0]
        ids = long_ids(tokens)  # [T]
        logits = torch.empty(num_logits, self.vocab)  # [num_logits, V]
        if self._native(count, self._row, ids.data_ptr(), count, start, slot, num_logits, logits.data_ptr(),
                        self.threads(count), skip) != 0:
            raise ValueError(self._out_of_range(count, 1))
        return logits

    def _out_of_range(self, count: int, rows: int) -> str:
        return (f"native forward: {count} tokens in {rows} rows: out of range (ids in 0..{self.vocab - 1}, at most "
                f"{MAX_TOKENS} tokens, positions within the cache)")

    def run_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """Several rows (distinct slots, MAX_TOKENS tokens in all at most) in one native forward, each token through
        the same products as alone: per row float32 logits [num_logits, V] of its last tokens (slices of one
        tensor)."""
        # the ids, positions, slots and wanted rows as one int64 array from Python lists, no torch op: a handful of
        # tokens a row, and right after a forward has flushed the caches each torch op costs several microseconds
        # (the index tensors, their concatenation and torch.split were a seventh of an 8-stream step's host time)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        wanted: list[int] = []
        for r in rows:
            row = r.ids.tolist()
            end = len(ids) + len(row)
            ids += row
            positions += range(r.start, r.start + len(row))
            slots += [r.slot] * len(row)
            wanted += range(end - r.num_logits, end)
        count = len(ids)
        index = array.array("q", ids + positions + slots + wanted)  # [4 parts], int64
        at = index.buffer_info()[0]
        logits = torch.empty(len(wanted), self.vocab)  # [R, V]
        if self._native(count, self._fn, at, at + 8 * count, at + 16 * count, count, at + 24 * count, len(wanted),
                        logits.data_ptr(), self.threads(count)) != 0:
            raise ValueError(self._out_of_range(count, len(rows)))
        out: list[torch.Tensor] = []
        first = 0
        for r in rows:
            out.append(logits[first : first + r.num_logits])
            first += r.num_logits
        return out

    def run_chunks(self, tokens: torch.Tensor, start: int, slot: int, num_logits: int = 1) -> torch.Tensor:
        """`run` for any number of tokens (num_logits <= MAX_TOKENS): chunks of MAX_TOKENS, the last one holding the
        last MAX_TOKENS (or all) tokens so that its logits cover num_logits."""
        count = tokens.shape[0]
        last = count - min(count, MAX_TOKENS)
        for lo in range(0, last, MAX_TOKENS):
            self.run(tokens[lo : min(lo + MAX_TOKENS, last)], start + lo, slot)
        return self.run(tokens[last:], start + last, slot, num_logits)

    def run_rows(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """`run_batch` for rows of any total length (each num_logits <= MAX_TOKENS): rows packed into native calls of
        at most MAX_TOKENS tokens in order, a longer row in chunks of its own (`run_chunks`). Each token goes through
        the same products whatever shares its call, so the logits are those of the rows run alone."""
        out: list[torch.Tensor] = []
        pack: list[BatchRow] = []
        packed = 0  # tokens in `pack`
        for r in rows:
            count = r.ids.shape[0]
            if pack and (packed + count > MAX_TOKENS or count > MAX_TOKENS):
                out += self.run_batch(pack)
                pack, packed = [], 0
            if count > MAX_TOKENS:
                out.append(self.run_chunks(r.ids, r.start, r.slot, r.num_logits))
            else:
                pack.append(r)
                packed += count
        if pack:
            out += self.run_batch(pack)
        return out

    def run_parts(self, tokens: torch.Tensor, start: int, slot: int, skip: int) -> None:
        """`run` of tokens [T] at positions start.. of `slot` with the parts `skip` names left out (`SKIP_ATTENTION`,
        `SKIP_PRODUCTS`, both): for timing where a forward's time goes (`specrpc bench floor`); no logits (they would
        be meaningless), and the K/V written there are meaningless too where the products are left out."""
        self._run_row(tokens, start, slot, 1, skip)

    def greedy(self, feed: torch.Tensor, start: int, slot: int, steps: int,
               transform: native.DraftTransform | None = None) -> torch.Tensor:
        """Feed tokens [F] int64 (F <= MAX_TOKENS) at positions start.. of `slot`, then `steps` one-token forwards
        each fed the argmax of the one before (their K/V written there too): the argmaxes int64 [steps + 1], after
        the feed and after each step, one call for the whole draft; of the logits as `transform` leaves them at each
        position where it is given (its scratch row is set here)."""
        ids = long_ids(feed)  # [F]
        out = torch.empty(steps + 1, dtype=torch.long)  # [steps + 1]
        shaped = None
        if transform is not None:
            transform.scratch = self._shaped.data_ptr()
            shaped = ctypes.byref(transform)
        # a draft is one-token steps after its feed: the one-token prefetch (a pick times the whole call)
        if self._native(1, self._greedy, ids.data_ptr(), ids.shape[0], start, slot, steps, out.data_ptr(),
                        self._scratch.data_ptr(), self.threads(1), shaped) != 0:
            raise ValueError(f"native greedy draft: {ids.shape[0]} tokens fed at position {start} of slot {slot}, "
                             f"then {steps} steps: out of range")
        return out
