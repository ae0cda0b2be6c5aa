"""The native forward of a few tokens (decode.cpp), the native logits transform and min-p (transform.cpp) and the
read-bandwidth and multiply-rate loops of `specrpc bench floor` (bandwidth.cpp, multiply.cpp): built with the
machine's C++ compiler on first use (or by `make install`) into one library cached by the sources, the flags and the
CPU, loaded with ctypes into torch's OpenMP runtime.

A decode step of a small model spends as much time in a thousand small torch ops as in reading its weights; the
native step reads each weight once in one OpenMP parallel region, for a one-token step and a verify alike. The
request's logits controls and a grammar's mask are a dozen small torch ops each, a pass over the logits in C.
Where no compiler is found, or the build fails, `library()` is None and the lean torch forward serves every step,
torch ops every transform and mask (logged once)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode.cpp", "transform.cpp", "bandwidth.cpp",
                                                          "multiply.cpp"))
HEADERS = (Path(__file__).with_name("vector.h"),)  # included by the sources: part of what a built library is of
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-psabi")


def cache_dir() -> Path:
    """Where built libraries are kept: $SPECRPC_NATIVE_CACHE, else $XDG_CACHE_HOME/specrpc, else ~/.cache/specrpc."""
    explicit = os.environ.get("SPECRPC_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specrpc" / "native"


def cpu_field(name: str) -> str:
    """The first CPU's `name` line of /proc/cpuinfo ("model name", "flags"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    return cpu_field("flags") or platform.processor()


def _flags() -> tuple[str, ...]:
    """FLAGS, for the CPU $SPECRPC_NATIVE_MARCH names where set (g++'s -march: `haswell` builds the AVX2 step on any
    CPU that runs it, for a fleet's oldest machines or tests of that path), with the AMX tile instructions emulated
    where $SPECRPC_AMX_EMULATE is 1 and AVX-VNNI's where $SPECRPC_AVXVNNI_EMULATE is 1 (tests of those products on
    CPUs without them: slower, never for serving)."""
    march = os.environ.get("SPECRPC_NATIVE_MARCH")
    flags = tuple(f"-march={march}" if f == "-march=native" and march else f for f in FLAGS)
    emulated = tuple(f"-DSPECRPC_{name}_EMULATE" for name in ("AMX", "AVXVNNI")
                     if os.environ.get(f"SPECRPC_{name}_EMULATE") == "1")
    return flags + emulated


def build_key(cxx: str) -> str:
    """What a built library is of: its sources, the compiler, the flags and the CPU (a hash)."""
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    parts = [*texts, cxx, *_flags(), _cpu_flags(), platform.machine()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build(compiler: str | None = None) -> Path | None:
    """The shared library for these sources, compiler, flags and CPU, built now unless cached; None without a
    compiler or when the build fails (logged). Where the toolchain does not know AMX's tile instructions, built
    again without the AMX products (decode.cpp's SPECRPC_NO_AMX)."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        log.warning("native decode: no C++ compiler found; the torch forward serves every step")
        return None
    flags = _flags()
    target = cache_dir() / f"decode-{build_key(cxx)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        detail = ""
        for extra in ((), ("-DSPECRPC_NO_AMX",)):
            try:
                subprocess.run([cxx, *flags, *extra, *map(str, SOURCES), "-o", str(out)], check=True,
                               capture_output=True, text=True, timeout=120)
                break
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", "") or str(exc)
                if not extra:
                    log.info("native decode: build with AMX failed (%s); building without it", detail[-300:])
        else:
            log.warning("native decode: build failed (%s); the torch forward serves every step", detail[-500:])
            return None
        os.replace(out, target)  # atomic: a concurrent build of the same key leaves one whole file
    return target


class Layer(ctypes.Structure):
    """decode.cpp's Layer."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "attn_norm", "qkv", "qkv_scale", "qkv_bias", "qk_norm", "o", "o_scale", "o_bias", "mlp_norm", "up", "up_scale",
        "up_bias", "down", "down_scale", "down_bias")] + [("window", ctypes.c_int64)]


class Model(ctypes.Structure):
    """decode.cpp's Model."""

    _fields_ = ([(name, ctypes.c_int64) for name in ("d", "hq", "hkv", "dh", "ffn", "vocab", "layers", "slots",
                                                     "capacity", "max_tokens", "prefetch")]
                + [("eps", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("embed", "norm", "head", "head_scale", "cos", "sin")]
                + [("layer", ctypes.POINTER(Layer))]
                + [(name, ctypes.c_void_p) for name in ("k_cache", "v_cache", "x", "h", "qkv", "att", "up", "scores",
                                                        "xq", "xs", "xsum")]
                + [(name, ctypes.c_int64) for name in ("kq", "prefetch_ahead", "amx_from")]
                + [("pass_tokens", ctypes.c_void_p)])
    # `prefetch`: a `PREFETCH` mode; `prefetch_ahead`: the bytes ahead of the column read that a prefetch asks for;
    # `amx_from`: the tokens from which int8 products run on AMX tiles (0: never; only where `amx_available`);
    # `pass_tokens`: int64 [max_tokens + 1], by a product's tokens the most one pass over its weights takes (null or
    # 0: decode.cpp's own choice)


class Controls(ctypes.Structure):
    """transform.cpp's Controls: one generation's logit_bias, end-of-text ids and penalties (`PENALTIES` bits)."""

    _fields_ = [("bias_ids", ctypes.c_void_p), ("bias_values", ctypes.c_void_p), ("n_bias", ctypes.c_int64),
                ("ends", ctypes.c_void_p), ("n_ends", ctypes.c_int64), ("penalties", ctypes.c_int64),
                ("repetition", ctypes.c_float), ("frequency", ctypes.c_float), ("presence", ctypes.c_float)]


class DraftTransform(ctypes.Structure):
    """decode.cpp's DraftTransform: a greedy draft's logits transform (transform.cpp's `Controls`, the committed
    window's counts, what slides out of a last-N window at each drafted position, the positions with end-of-text
    banned) and a [vocab] float32 scratch row. Whoever fills it keeps the arrays it points into alive."""

    _fields_ = [("controls", ctypes.c_void_p), ("window_ids", ctypes.c_void_p), ("window_counts", ctypes.c_void_p),
                ("n_window", ctypes.c_int64), ("gone", ctypes.c_void_p), ("gone_end", ctypes.c_void_p),
                ("banned", ctypes.c_int64), ("scratch", ctypes.c_void_p)]


PENALTIES = {"repetition": 1, "frequency": 2, "presence": 4}
"""transform.cpp's `Penalty` bits by name: which penalties a `Controls` applies."""


PREFETCH = {"none": 0, "non-temporal": 1, "temporal": 2, "outer": 3}
"""decode.cpp's `Prefetch` modes by name: how the products prefetch their weight panels, a hint that never changes
the results. "non-temporal" reads weights past the caches (what won on a 2-core AMD EPYC whose L3 the target exceeds);
"temporal" keeps them (where the last-level cache holds the model: an Intel Xeon with 260 MB of L3 ran the target's
one-token step 5× faster with it); "outer" fetches them to the L2 and L3, not the L1 (an int8 verify through a model
far larger than the caches: 0.78-0.82× the time on a Zen 4); "none" leaves it to the hardware. Which wins is measured
at load, per model."""


@functools.cache
def library_path() -> Path | None:
    """The library's file (built if needed; its name carries `build_key`), or None where it cannot be built or
    $SPECRPC_NATIVE is 0."""
    if os.environ.get("SPECRPC_NATIVE", "1") == "0":
        return None
    return build()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library (built if needed), or None where it cannot be built. torch is imported first, so the
    library's OpenMP symbols bind to torch's runtime (one thread pool, not two)."""
    path = library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    fn = lib.specrpc_forward
    fn.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    row = lib.specrpc_forward_row
    row.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    row.restype = ctypes.c_int
    greedy = lib.specrpc_greedy
    greedy.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(DraftTransform)]
    greedy.restype = ctypes.c_int
    transform = lib.specrpc_transform
    transform.argtypes = [ctypes.POINTER(Controls), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    transform.restype = ctypes.c_int
    min_p = lib.specrpc_min_p
    min_p.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int64]
    min_p.restype = None
    mask = lib.specrpc_mask
    mask.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    mask.restype = None
    read = lib.specrpc_read
    read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    read.restype = ctypes.c_double
    for name in ("specrpc_multiply_float", "specrpc_multiply_int8"):
        getattr(lib, name).argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        getattr(lib, name).restype = ctypes.c_double
    for name in ("specrpc_int8_group", "specrpc_int8_block", "specrpc_int8_dot", "specrpc_amx_enable"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_int
    lib.specrpc_amx_check.argtypes = [ctypes.c_int]
    lib.specrpc_amx_check.restype = ctypes.c_int
    return lib


@functools.cache
def amx_available() -> bool:
    """Whether int8 products may run on AMX tiles in this process: the CPU has AMX-INT8, Linux grants the tile state,
    and the tile products gave VNNI's bits on made-up data in a process of their own (`python -m specrpc.native
    --amx-check`: a fault there would cost that process, not this one). Asked once; logged where the check fails."""
    lib = library()
    enabled = 0 if lib is None else lib.specrpc_amx_enable()
    if enabled == -1:
        log.warning("native decode: this CPU has AMX but Linux refused its tile state (arch_prctl); int8 products "
                    "stay on VNNI")
    if enabled != 1:
        return False
    root = str(Path(__file__).resolve().parents[2])  # where this specrpc is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-m", "specrpc.native", "--amx-check"], capture_output=True, text=True,
                              timeout=300, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native decode: the AMX check did not finish (%s); int8 products stay on VNNI", exc)
        return False
    if done.returncode != 0:
        log.warning("native decode: the AMX check failed (exit %d: %s); int8 products stay on VNNI", done.returncode,
                    (done.stdout + done.stderr)[-300:].strip())
        return False
    return True


def pointer(t: torch.Tensor | None) -> int | None:
    """A contiguous float32 CPU tensor's data address (None for None)."""
    if t is None:
        return None
    assert t.is_contiguous() and t.dtype == torch.float32 and t.device.type == "cpu", "native decode: bad tensor"
    return int(t.data_ptr())


def read_sum(lib: ctypes.CDLL, x: torch.Tensor, passes: int) -> float:
    """The sum of float32 `x` read `passes` times by bandwidth.cpp's kernel on torch's threads, each thread its own
    share of `x` on every pass (as the native step splits its weights): what `specrpc bench floor` times."""
    assert x.is_contiguous() and x.dtype == torch.float32 and x.device.type == "cpu", "native read: bad tensor"
    return float(lib.specrpc_read(x.data_ptr(), x.numel(), passes, torch.get_num_threads()))


def multiply(lib: ctypes.CDLL, kind: str, rounds: int) -> float:
    """Multiply-adds done by multiply.cpp's loop of the products' instruction (`kind` "float": 16-lane fused
    multiply-adds; "int8": VNNI's vpdpbusd (AVX-512's, or AVX-VNNI's on AVX2), else AVX2's byte multiply-adds, 0
    where int8 products widen to float) for `rounds` rounds on torch's threads, from registers: what `specrpc bench
    floor` times as the multiply rate."""
    fn = lib.specrpc_multiply_float if kind == "float" else lib.specrpc_multiply_int8
    sink = ctypes.c_double()
    return float(fn(rounds, torch.get_num_threads(), ctypes.byref(sink)))
