"""`specrpc bench floor`: what this CPU gets from each forward path, beside what it can read.

Decoding a small model on a CPU is bound by reading its weights, so the floor of a step is the model's weight bytes
÷ the read bandwidth of wherever those bytes live: a cache that holds them, else memory. This bench measures both
on the machine it runs on:

- the read bandwidth, GB/s, on torch's threads: the native reader (bandwidth.cpp: each thread its own share of a
  float32 buffer, wide loads prefetched as the native step's, the rate that bounds the step) where the library is
  built, else a torch sum; for a buffer of half of each cache level from L2 up (sizes from sysfs), one well above the
  last-level cache (memory), and one of each model's weight bytes as its fastest one-token path reads them (where
  that many bytes actually come from on this machine: a shared, virtualised L3 holds less than sysfs says); a buffer
  smaller than 64 MiB is read many times a call;
- for each model of the pair at each `--weights` precision, each path the loader chooses among on this machine (the
  native step in each prefetch mode and distance `NativeStep.calibrate_prefetch` times, at int8 with its products on
  AMX tiles too where the CPU has them; the torch forward, with MKL's one-row product and with oneDNN's where both
  exist), timed at the shapes the engine runs (a one-token decode step, verifies of 2 to k_max + 1 tokens, batched
  steps of several streams), all paths of a shape interleaved round after round, the median of `--repeats`;
- each path's effective weight rate: the projections' bytes it reads at that precision (the head included, the
  embedding's one row per token not) ÷ its step time. The step's time also covers reading K/V and activations and
  computing, so the weights themselves are read at least this fast; a rate above the bandwidth of the level that
  holds them means they came from a faster one;
- the multiply rate, multiply-adds a second on torch's threads, of each instruction the products multiply with
  (multiply.cpp: 16-lane fused multiply-adds for float products, VNNI's vpdpbusd for int8 ones), from registers;
- each model's floor at each one-stream shape: its fastest path against the larger of two bounds, its weight bytes ÷
  the rate of its own buffer and its projections' multiply-adds ÷ the rate of its instruction (× floor near 1 or
  above: the step is as fast as the machine can make it; far above: time spent elsewhere). A verify of several
  tokens reads the weights once but multiplies every token: where the multiplies bound it, no kernel makes it cost
  one one-token step, and the floor in one-token steps says what it can cost at least;
- where each model's one-stream forwards spend their time, on its fastest native path: the whole forward beside the
  same forward without attention, without its products and without either (`NativeStep.run_parts`), interleaved;
  the products and attention each cost the whole less the forward without them, the rest is the forward without
  either. A verify's attention grows with `--context` (its queries × the positions they attend) where its products
  do not, so a long context shows what a verify costs beyond its multiplies.

Prints Markdown; writes floor.json and floor.md."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specrpc import native as native_lib
from specrpc.bench.common import machine_line, pair_line, write_results
from specrpc.config import EngineConfig
from specrpc.models import BatchRow
from specrpc.models.backends import eager, native
from specrpc.models.backends.timing import interleaved_samples, timing_ids
from specrpc.models.kv_cache import KVCache
from specrpc.models.llama import LEAN_MODEL_TYPES, Linear, LlamaArgs, LlamaLM, LlamaWeights
from specrpc.models.llama.checkpoint import load_llama_weights
from specrpc.models.llama.weights import bf16_available, int8_available, with_int8_decode, with_packed_decode

CPU = torch.device("cpu")
PRECISIONS = ("dtype", "int8", "bf16")
"""`--weights` values, as `specrpc serve` takes them (dtype: float32 on the CPU)."""
SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
"""Where Linux describes cpu0's caches: index*/level, type, size, shared_cpu_list."""
READ_PER_CALL = 64 << 20
"""Bytes one timed call of the bandwidth sum reads at least: a cache-sized buffer is read that many times over."""
MULTIPLIES = {"float": "16-lane fused multiply-adds (float products)",
              "int8": "int8 products' integer multiply-adds ({})"}
"""The instructions whose rate is measured (`multiply_rates`), by `Route.multiplies` (int8: named by `INT8_DOTS`)."""
INT8_DOTS = {1: "AVX-512 VNNI's vpdpbusd", 2: "AVX2's vpmaddubsw sequence", 3: "AVX-VNNI's vpdpbusd"}
"""What the build's int8 products multiply with, by `specrpc_int8_dot`."""
MULTIPLY_ROUNDS = 2_000_000
"""Rounds of one timed call of the multiply loop (multiply.cpp): a few milliseconds."""


@dataclass(frozen=True)
class CacheLevel:
    """One data or unified cache level of cpu0: bytes of one instance and how many CPUs share it."""

    level: int
    size: int
    shared_by: int

    def capacity(self, threads: int) -> int:
        """Bytes `threads` threads hold in this level together (one instance per `shared_by` CPUs)."""
        return self.size * max(1, math.ceil(threads / self.shared_by))


def parse_size(text: str) -> int:
    """sysfs's cache size ("2048K", "32M", "1G" or bytes) in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def count_cpus(cpu_list: str) -> int:
    """CPUs in a sysfs CPU list ("0-3,8,10-11")."""
    total = 0
    for part in cpu_list.strip().split(","):
        lo, _, hi = part.partition("-")
        total += int(hi or lo) - int(lo) + 1
    return total


def cache_levels() -> list[CacheLevel]:
    """cpu0's data and unified caches from L2 up, by level (empty where sysfs does not describe them)."""
    found: dict[int, CacheLevel] = {}
    for index in sorted(SYS_CACHE.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
            shared = count_cpus((index / "shared_cpu_list").read_text())
        except (OSError, ValueError):
            continue
        if level >= 2 and kind in ("Data", "Unified"):
            found[level] = CacheLevel(level, size, shared)
    return [found[level] for level in sorted(found)]


def mib(nbytes: float) -> str:
    """Bytes as MiB, one decimal."""
    return f"{nbytes / (1 << 20):.1f} MiB"


def buffers(levels: list[CacheLevel], memory_mib: int) -> list[tuple[str, int]]:
    """(label, bytes) of each buffer the bandwidth is read from: half of each cache level, and memory's
    (`memory_mib`, 0: four times the largest cache, at least 256 MiB)."""
    out = [(f"L{c.level}", c.size // 2) for c in levels]
    largest = max((c.size for c in levels), default=0)
    out.append(("memory", (memory_mib << 20) or max(4 * largest, 256 << 20)))
    return out


READERS = {"native": "the native reader (bandwidth.cpp: each thread its own share of the buffer, wide loads "
                     "prefetched as the native step's)",
           "torch": "a torch sum (the native library is not built here)"}
"""What read the buffers, by `read_rates`'s reader name."""


def read_rates(sizes: list[tuple[str, int]], repeats: int) -> tuple[list[dict[str, Any]], str]:
    """GB/s of reading a float32 buffer of each size on torch's threads, all sizes interleaved round after round, the
    median of `repeats`; and which reader read them (`READERS`): the native kernel where the library is built (the
    threads split the buffer), else a torch sum. A buffer smaller than `READ_PER_CALL` is read that many bytes over
    in one call, so the call's own cost stays small beside the reading: `passes` times by the native kernel, as the
    rows of a view repeating it (stride 0) by torch (the threads split the rows, each reading the whole buffer from
    its own caches). Every timed read follows an untimed one that brings its buffer into the caches."""
    lib = native_lib.library()
    runs: list[Callable[[], object]] = []
    read: list[int] = []
    for _, nbytes in sizes:
        n = nbytes // 4
        passes = max(1, -(-READ_PER_CALL // (4 * n)))
        buffer = torch.ones(n)  # [n]
        if lib is not None:
            runs.append(partial(native_lib.read_sum, lib, buffer, passes))
        else:
            view = buffer.as_strided((passes, n), (0, 1))  # [passes, n]: one buffer, read `passes` times
            runs.append(partial(torch.sum, view, dim=1))
        read.append(4 * n * passes)
    samples = interleaved_samples(runs, repeats)
    rates = [{"buffer": label, "bytes": nbytes, "gb_s": r / statistics.median(s) / 1e9}
             for (label, nbytes), r, s in zip(sizes, read, samples, strict=True)]
    return rates, "torch" if lib is None else "native"


def multiply_rates(repeats: int) -> dict[str, float]:
    """Multiply-adds a second (GMAC/s) of each instruction of `MULTIPLIES` this build's products use, on torch's
    threads from registers (multiply.cpp), interleaved round after round, the median of `repeats`: empty without the
    native library, no int8 where the int8 products widen their weights to float (AVX-512 without VNNI)."""
    lib = native_lib.library()
    if lib is None:
        return {}
    kinds = ["float", *(["int8"] if lib.specrpc_int8_group() > 1 else [])]
    done = {k: native_lib.multiply(lib, k, MULTIPLY_ROUNDS) for k in kinds}  # untimed first calls; the work a call
    samples = interleaved_samples([partial(native_lib.multiply, lib, k, MULTIPLY_ROUNDS) for k in kinds], repeats)
    return {k: done[k] / statistics.median(s) / 1e9 for k, s in zip(kinds, samples, strict=True)}


def multiply_adds(w: LlamaWeights) -> int:
    """Multiply-adds of one token through every projection and the head (N × K each)."""
    total = 0
    for p in w.linears():
        stored = p.q8 if p.q8 is not None else p.wt if p.wt is not None else p.packed
        assert stored is not None
        total += stored.numel()
    return total


@dataclass(frozen=True)
class Shape:
    """A forward the engine runs: `rows` streams of `tokens` tokens each (a decode step: 1 × 1; a verify of k
    drafts: 1 × (k + 1); a batched step: several rows)."""

    rows: int
    tokens: int

    @property
    def label(self) -> str:
        """"5" for one stream of 5 tokens, "4×5" for four."""
        return str(self.tokens) if self.rows == 1 else f"{self.rows}×{self.tokens}"


def parse_shapes(tokens: str, batched: str) -> list[Shape]:
    """`--tokens` (one stream) and `--batched` ("ROWSxTOKENS", comma-separated) as shapes; ValueError naming the
    option on a bad one."""
    out = [Shape(1, int(t)) for t in tokens.split(",") if t]
    for item in (b for b in batched.replace("×", "x").split(",") if b):
        rows, _, each = item.partition("x")
        if not each:
            raise ValueError(f"--batched: {item!r} is not ROWSxTOKENS (e.g. 4x5)")
        out.append(Shape(int(rows), int(each)))
    if not out or any(s.rows < 1 or not 1 <= s.tokens <= native.MAX_TOKENS for s in out):
        raise ValueError(f"--tokens / --batched: at least one shape, each with 1..{native.MAX_TOKENS} tokens a row")
    return out


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor's elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


def torch_reads(p: Linear, rows: int) -> int:
    """Weight bytes the torch forward's product (`weights.linear`) reads for `rows` rows: its dispatch, in its
    order."""
    if p.bf16_only:
        return tensor_bytes(p.packed)
    if p.q8 is not None and (rows <= p.q8_rows or (p.wt is None and p.packed is None)):
        return tensor_bytes(p.q8) + tensor_bytes(p.q8_scale)
    if p.packed is not None and rows >= p.packed_rows:
        return tensor_bytes(p.packed)
    return tensor_bytes(p.wt)


def native_reads(p: Linear, int8: bool) -> int:
    """Weight bytes the native step reads of a projection: the int8 weight and its float32 row scales, or the
    float32 weight (its panels' padding left out)."""
    if not int8:
        return tensor_bytes(p.wt)
    assert p.q8 is not None
    return tensor_bytes(p.q8) + 4 * p.q8.shape[0]  # [N, K] int8, [N] float32


@dataclass(frozen=True)
class Route:
    """One path a forward can take: how rows run through it, the weights it reads, and the most tokens it is timed
    at (past them it is another route's twin)."""

    name: str
    forward: Callable[[list[BatchRow]], object]
    weights: LlamaWeights
    native_int8: bool | None  # the native step reading int8 (True) or float32 (False) weights; None: torch
    multiplies: str | None  # the instruction its products multiply with (`MULTIPLIES`); None: not measured (AMX tiles,
    # torch's int8 and bf16 kernels)
    most_tokens: int = sys.maxsize
    parts: Callable[[int, list[BatchRow]], object] | None = None  # the native step with parts left out (`PARTS`)

    def reads(self, tokens: int) -> int:
        """Weight bytes a forward of `tokens` tokens in all reads (each projection once)."""
        linears = self.weights.linears()
        if self.native_int8 is None:
            return sum(torch_reads(p, tokens) for p in linears)
        return sum(native_reads(p, self.native_int8) for p in linears)


def native_setting(step: native.NativeStep, mode: str, ahead: int, amx: bool) -> None:
    """Every forward of `step` prefetching in `mode` `ahead` bytes ahead, its int8 products on AMX tiles or not."""
    step.prefetch_everywhere(mode, ahead)
    step.model.amx_from = 1 if amx else 0


def native_forward(step: native.NativeStep, mode: str, ahead: int, amx: bool, rows: list[BatchRow]) -> None:
    """`rows` through the native step in that setting (`native_setting`)."""
    native_setting(step, mode, ahead, amx)
    if len(rows) == 1:
        r = rows[0]
        step.run(r.ids, r.start, r.slot, r.num_logits)
    else:
        step.run_rows(rows)


def native_parts(step: native.NativeStep, mode: str, ahead: int, amx: bool, skip: int, rows: list[BatchRow]) -> None:
    """One row through the native step as `native_forward` runs it, with the parts `skip` names left out."""
    native_setting(step, mode, ahead, amx)
    r = rows[0]
    step.run_parts(r.ids, r.start, r.slot, skip)


PARTS = {"without attention": native.SKIP_ATTENTION, "without products": native.SKIP_PRODUCTS,
         "without either": native.SKIP_ATTENTION | native.SKIP_PRODUCTS}
"""The native forwards `parts` times beside the whole one: what each part costs is the whole's time less the time
without it; what is left without either (norms, rotary, the activations' quantization, the waits between loops) is
the rest."""


def eager_forward(w: LlamaWeights, cache: KVCache, rows: list[BatchRow]) -> None:
    """`rows` through the torch forward on weights `w`."""
    if len(rows) == 1:
        r = rows[0]
        eager.run(w, cache, r.ids, r.start, r.slot, r.num_logits, ())
    else:
        eager.run_rows(w, cache, rows)


def torch_name(w: LlamaWeights) -> str:
    """The torch forward's name by what its products read."""
    head = w.head
    if head.bf16_only:
        return "torch bf16"
    if head.q8 is not None and head.wt is None and head.packed is None:
        return "torch int8"
    if head.q8 is not None:
        return f"torch, int8 copies to {head.q8_rows} rows"
    return "torch"


def routes(lm: LlamaLM) -> tuple[list[Route], str]:
    """The paths `lm`'s forwards can take on this machine, and whether the native step is among them ("on", else
    why not): the native step in each prefetch setting (`native.prefetch_settings`); the torch forward, as MKL's
    one-row product and oneDNN's where the loader chooses between them (`LlamaLM.tune_decode`: they differ at one
    token only). At int8 where AMX can run (`native.amx_available`), the native step with its products on the tiles
    too, in each prefetch setting."""
    w = lm.weights
    out: list[Route] = []
    why = native.supported(w, CPU, torch.float32)
    if why is None:
        step = native.NativeStep(w, lm.cache)
        lib = native_lib.library()
        dot = lib is not None and lib.specrpc_int8_group() > 1  # int8 products multiply int8 activations
        for amx in (False, True) if step.int8 and native_lib.amx_available() else (False,):
            kind = None if amx else "int8" if step.int8 and dot else "float"
            for mode, ahead in native.prefetch_settings():
                out.append(Route(f"native{' int8' if step.int8 else ''}{' AMX' if amx else ''}, prefetch "
                                 f"{native.setting_label(mode, ahead)}",
                                 partial(native_forward, step, mode, ahead, amx), w, step.int8, kind,
                                 parts=partial(native_parts, step, mode, ahead, amx)))
    if lm.decode_tunable():
        onednn, mkl = with_packed_decode(w, True), with_packed_decode(w, False)
        out.append(Route("torch, oneDNN", partial(eager_forward, onednn, lm.cache), onednn, None, "float"))
        out.append(Route("torch, MKL one-row", partial(eager_forward, mkl, lm.cache), mkl, None, "float",
                         most_tokens=1))
    else:
        name = torch_name(w)
        out.append(Route(name, partial(eager_forward, w, lm.cache), w, None, "float" if name == "torch" else None))
    return out, why or "on"


def load(path: str, role: str, precision: str, draft_int8: bool, slots: int, capacity: int) -> LlamaLM:
    """`path`'s weights at `precision` as `specrpc serve --weights` stores them (the draft at dtype with its int8
    decode copies when `draft_int8`, as served) in a model of `slots` slots, no backend chosen (each is timed);
    ValueError naming the option where this machine or model cannot."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") not in LEAN_MODEL_TYPES:
        raise ValueError(f"--{role} {path}: the floor bench times the lean forward's paths, which model_type "
                         f"{cfg.get('model_type')!r} does not take")
    if precision == "int8" and not int8_available(CPU):
        raise ValueError("--weights int8: this torch has no CPU int8 kernel; leave int8 out")
    if precision == "bf16" and not bf16_available(CPU):
        raise ValueError("--weights bf16: oneDNN computes no bf16 on this CPU; leave bf16 out")
    weights = load_llama_weights(Path(path), LlamaArgs.from_config(cfg), capacity=capacity, device=CPU,
                                 dtype=torch.float32, int8=precision == "int8", bf16=precision == "bf16")
    if role == "draft" and draft_int8 and precision == "dtype" and int8_available(CPU):
        weights = with_int8_decode(weights)
    return LlamaLM(role, weights, num_slots=slots, max_context=capacity, device=CPU, dtype=torch.float32)


def measure_model(lm: LlamaLM, shapes: list[Shape], context: int, repeats: int) -> dict[str, Any]:
    """Every route of `lm` at every shape, all routes of a shape interleaved (`interleaved_samples`) after a prompt
    of `context` tokens in each slot: per route and shape the median and lower-quartile ms, the weight bytes read and
    the effective rate (GB/s); per route the instruction its products multiply with; the model's multiply-adds a
    token."""
    found, native_state = routes(lm)
    most = max(s.tokens for s in shapes)
    ids = timing_ids(context + most, lm.vocab_size)  # [context + most]
    paths: dict[str, dict[str, Any]] = {r.name: {} for r in found}
    with torch.inference_mode():
        for slot in range(lm.num_slots):
            eager.run(lm.weights, lm.cache, ids[:context], 0, slot, 1, ())
        for shape in shapes:
            live = [r for r in found if shape.rows * shape.tokens <= r.most_tokens]
            rows = [BatchRow(ids[context : context + shape.tokens], context, slot, shape.tokens)
                    for slot in range(shape.rows)]
            samples = interleaved_samples([partial(r.forward, rows) for r in live], repeats)
            for r, seconds in zip(live, samples, strict=True):
                median = statistics.median(seconds)
                nbytes = r.reads(shape.rows * shape.tokens)
                paths[r.name][shape.label] = {"ms": median * 1e3,
                                              "lower_quartile_ms": statistics.quantiles(seconds, n=4)[0] * 1e3,
                                              "bytes": nbytes, "gb_s": nbytes / median / 1e9}
        parts = measure_parts(found, paths, shapes, ids, context, repeats)
    return {"native": native_state, "paths": paths, "multiplies": {r.name: r.multiplies for r in found},
            "multiply_adds": multiply_adds(lm.weights), "parts": parts}


def measure_parts(found: list[Route], paths: dict[str, dict[str, Any]], shapes: list[Shape], ids: torch.Tensor,
                  context: int, repeats: int) -> dict[str, Any]:
    """Where the native route fastest at the first shape spends its one-stream forwards' time: at each one-stream
    shape, the whole forward and those `PARTS` leaves parts out of, interleaved (`interleaved_samples`), medians in
    ms; {} where the native step is not among the routes."""
    native_routes = [r for r in found if r.parts is not None]
    if not native_routes:
        return {}
    first = shapes[0].label
    best = min(native_routes, key=lambda r: paths[r.name].get(first, {}).get("ms", math.inf))
    out: dict[str, Any] = {"path": best.name, "shapes": {}}
    parted = best.parts
    assert parted is not None
    for shape in (s for s in shapes if s.rows == 1):
        rows = [BatchRow(ids[context : context + shape.tokens], context, 0, shape.tokens)]
        runs = [partial(best.forward, rows)] + [partial(parted, skip, rows) for skip in PARTS.values()]
        times = [statistics.median(t) * 1e3 for t in interleaved_samples(runs, repeats)]
        whole, without = times[0], dict(zip(PARTS, times[1:], strict=True))
        out["shapes"][shape.label] = {"ms": whole, **{f"{name} ms": t for name, t in without.items()},
                                      "products_ms": whole - without["without products"],
                                      "attention_ms": whole - without["without attention"],
                                      "rest_ms": without["without either"]}
    return out


def fastest(paths: dict[str, dict[str, Any]], label: str) -> str:
    """The route fastest at shape `label`."""
    return min((n for n in paths if label in paths[n]), key=lambda n: paths[n][label]["ms"])


def weights_buffer(model: dict[str, Any]) -> str:
    """The bandwidth row of a model's weight bytes ("target float32 weights")."""
    return f"{model['model']} {model['weights']} weights"


def floor(model: dict[str, Any], shape: Shape, levels: list[CacheLevel], bandwidth: list[dict[str, Any]],
          threads: int, rates: dict[str, float]) -> dict[str, Any]:
    """The fastest route of `model` (`measure_model`'s) at one-stream `shape` against its floor, the larger of: its
    weight bytes ÷ the read rate of the model's own buffer (`weights_buffer`), and its projections' multiply-adds ÷
    the rate of the instruction it multiplies with (`rates`; None where that is not measured); the smallest level
    holding the bytes on `threads` threads (memory where none does), for reference; the floor and the time in the
    model's fastest one-token steps where shape 1 was measured."""
    paths, label = model["paths"], shape.label
    name = fastest(paths, label)
    cell = paths[name][label]
    held = next((f"L{c.level}" for c in levels if cell["bytes"] <= c.capacity(threads)), "memory")
    buffer = weights_buffer(model)
    rate = next(b["gb_s"] for b in bandwidth if b["buffer"] == buffer)
    read_ms = cell["bytes"] / rate / 1e6
    kind = model["multiplies"][name]
    multiply_ms = shape.tokens * model["multiply_adds"] / rates[kind] / 1e6 if kind in rates else None
    floor_ms = max(read_ms, multiply_ms or 0.0)
    step = min((c["1"]["ms"] for c in paths.values() if "1" in c), default=None)  # the fastest one-token step
    ms = cell["ms"]
    return {"shape": label, "tokens": shape.tokens, "path": name, "bytes": cell["bytes"], "held_by": held,
            "buffer": buffer, "gb_s": rate, "read_floor_ms": read_ms, "multiplies": kind,
            "multiply_floor_ms": multiply_ms, "floor_ms": floor_ms, "ms": ms, "over_floor": ms / floor_ms,
            "floor_steps": None if step is None else floor_ms / step, "steps": None if step is None else ms / step}


def precision_name(precision: str, role: str, draft_int8: bool) -> str:
    """How a model's projections are stored at `precision`."""
    if precision != "dtype":
        return precision
    return "float32 + int8 copies" if role == "draft" and draft_int8 else "float32"


def markdown(results: dict[str, Any]) -> str:
    """The bandwidth table, the paths' table (GB/s and ms by shape, the fastest in bold) and the floors."""
    threads = results["threads"]
    caches = ", ".join(f"L{c['level']} {mib(c['size'])} "
                       + ("a core" if c["shared_by"] == 1 else f"shared by {c['shared_by']} CPUs")
                       for c in results["caches"]) or "not described in sysfs"
    lines = [f"Machine: {results['machine']}  ", f"Caches: {caches}  ", f"{results['pair']}  ",
             f"Command: `{results['command']}`", "",
             f"Read bandwidth: {READERS[results['reader']]}, a float32 buffer, {threads} threads, median of "
             f"{results['repeats']} interleaved rounds: half of each cache level, memory, and each model's weight "
             "bytes as its fastest one-token path reads them (a buffer under 64 MiB read many times a call).", "",
             "| buffer | size | GB/s |", "| --- | --- | --- |"]
    lines += [f"| {b['buffer']} | {mib(b['bytes'])} | {b['gb_s']:.1f} |" for b in results["bandwidth"]]
    lines += ["", f"Multiply rate: multiply.cpp's loop of each instruction from registers, {threads} threads, median "
              f"of {results['repeats']} interleaved rounds.", "", "| instruction | GMAC/s |", "| --- | --- |"]
    rates = results["multiply"]
    dot = INT8_DOTS.get(results["int8_dot"], "-")
    rows = [f"| {MULTIPLIES[k].format(dot)} | {r:.1f} |" for k, r in rates.items()]
    lines += rows or ["| (native library not built) | - |"]
    labels = results["shapes"]
    lines += ["", "Weight bytes read per second, effective (each path's projection bytes at its precision ÷ the median "
              "step, which also reads K/V and activations: the weights are read at least this fast): GB/s (ms a "
              "step) by tokens a forward, rows × tokens batched; the fastest path of each shape in bold.", "",
              "| model | weights | path | MB a step | " + " | ".join(labels) + " |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in labels) + " |"]
    for m in results["models"]:
        paths = m["paths"]
        best = {label: min((n for n in paths if label in paths[n]), key=lambda n: paths[n][label]["ms"], default=None)
                for label in labels}
        for name, cells in paths.items():
            sizes = sorted({c["bytes"] for c in cells.values()})
            row = [f"| {m['model']} | {m['weights']} | {name} | {'/'.join(f'{b / 1e6:.1f}' for b in sizes)} |"]
            for label in labels:
                c = cells.get(label)
                text = "-" if c is None else f"{c['gb_s']:.1f} ({c['ms']:.2f})"
                row.append(f" **{text}** |" if c is not None and best[label] == name else f" {text} |")
            lines.append("".join(row))
    lines += ["", "Floor: each model's fastest path at each one-stream shape against the larger of its read floor "
              "(its weight bytes ÷ the read rate of a buffer of those bytes, its weights row above) and its multiply "
              "floor (its projections' multiply-adds, tokens × those of one, ÷ its instruction's rate above; - where "
              "that is not measured); held by: the smallest cache level that holds the bytes on these threads, for "
              "reference; ÷ step: the floor and the time in the model's fastest one-token steps (a verify of that "
              "many tokens costs at least the first).", "",
              "| model | weights | tokens | path | MB | held by | GB/s of its bytes | read floor ms "
              "| multiply floor ms | ms | × floor | floor ÷ step | ms ÷ step |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def num(x: float | None, digits: int) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for m in results["models"]:
        for f in m["floors"]:
            lines.append(f"| {m['model']} | {m['weights']} | {f['tokens']} | {f['path']} | {f['bytes'] / 1e6:.1f} | "
                         f"{f['held_by']} | {f['gb_s']:.1f} | {f['read_floor_ms']:.3f} | "
                         f"{num(f['multiply_floor_ms'], 3)} | {f['ms']:.3f} | {f['over_floor']:.2f} | "
                         f"{num(f['floor_steps'], 2)} | {num(f['steps'], 2)} |")
    parted = [m for m in results["models"] if m.get("parts")]
    if parted:
        lines += ["", "Where a one-stream forward's time goes, on the native path fastest at the first shape: the "
                  "whole forward timed beside the same forward without attention, without its products and without "
                  "either, interleaved; products = the whole less the forward without them, attention likewise, the "
                  "rest = the forward without either (norms, rotary, quantizing activations, the waits between "
                  "loops). The parts overlap in the caches, so they need not add up to the whole.", "",
                  "| model | weights | path | tokens | ms | products ms | attention ms | rest ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in parted:
            for label, p in m["parts"]["shapes"].items():
                lines.append(f"| {m['model']} | {m['weights']} | {m['parts']['path']} | {label} | {p['ms']:.3f} | "
                             f"{p['products_ms']:.3f} | {p['attention_ms']:.3f} | {p['rest_ms']:.3f} |")
    off = [f"{m['model']} ({m['weights']}): native step off ({m['native']})" for m in results["models"]
           if m["native"] != "on"]
    if off:
        lines += ["", "; ".join(off)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `specrpc bench floor`."""
    parser = argparse.ArgumentParser(prog="specrpc bench floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=EngineConfig().target)
    parser.add_argument("--draft", default=EngineConfig().draft, help="a draft checkpoint, or none")
    parser.add_argument("--weights", default="dtype,int8",
                        help="comma-separated precisions, as `specrpc serve --weights`: " + ", ".join(PRECISIONS))
    parser.add_argument("--draft-int8", default=EngineConfig().draft_int8, action=argparse.BooleanOptionalAction,
                        help="at dtype, the draft's int8 decode copies (as `specrpc serve` runs it)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--tokens", default="1,2,3,5,9",
                        help=f"tokens of one-stream forwards (a decode step 1, a verify of k drafts k + 1; at most "
                             f"{native.MAX_TOKENS})")
    parser.add_argument("--batched", default="4x1,4x5", help="batched steps as ROWSxTOKENS, comma-separated")
    parser.add_argument("--context", type=int, default=32, help="positions in the cache before each forward")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds per shape (the median of them)")
    parser.add_argument("--memory-mib", type=int, default=0,
                        help="the memory buffer's size (0: four times the largest cache, at least 256 MiB)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    precisions = [p for p in args.weights.split(",") if p]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        parser.error(f"--weights: {unknown or 'none'}: choose from {', '.join(PRECISIONS)}")
    try:
        shapes = parse_shapes(args.tokens, args.batched)
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeats < 2 or args.context < 1 or args.memory_mib < 0:
        parser.error("--repeats at least 2, --context at least 1, --memory-mib 0 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    from specrpc.logs import configure

    configure("console", "warning")
    threads = torch.get_num_threads()
    levels = cache_levels()
    slots = max(s.rows for s in shapes)
    capacity = args.context + max(s.tokens for s in shapes)
    models = [("draft", args.draft), ("target", args.target)]
    results: dict[str, Any] = {
        "machine": machine_line(CPU, torch.float32), "caches": [asdict(c) for c in levels],
        "pair": pair_line(args.target, args.draft),
        "command": "specrpc bench floor " + " ".join(argv if argv is not None else sys.argv[1:]),
        "threads": threads, "repeats": args.repeats, "shapes": [s.label for s in shapes], "models": [],
    }
    for precision in precisions:
        for role, path in models:
            if not path or path.lower() == "none":
                continue
            try:
                lm = load(path, role, precision, args.draft_int8, slots, capacity)
            except ValueError as exc:
                parser.error(str(exc))
            measured = measure_model(lm, shapes, args.context, args.repeats)
            del lm
            results["models"].append({"model": role, "weights": precision_name(precision, role, args.draft_int8),
                                      **measured})
            print(f"{role} {precision}: measured", file=sys.stderr, flush=True)
    first = shapes[0].label  # each model's own buffer: the bytes its fastest path reads there
    own = [(weights_buffer(m), m["paths"][fastest(m["paths"], first)][first]["bytes"]) for m in results["models"]]
    results["bandwidth"], results["reader"] = read_rates(buffers(levels, args.memory_mib) + own, args.repeats)
    results["multiply"] = multiply_rates(args.repeats)
    lib = native_lib.library()
    results["int8_dot"] = lib.specrpc_int8_dot() if lib is not None else 0
    for m in results["models"]:
        m["floors"] = [floor(m, s, levels, results["bandwidth"], threads, results["multiply"]) for s in shapes
                       if s.rows == 1]
    write_results(args.out, "floor", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
