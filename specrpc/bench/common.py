"""Small pieces several bench modules share: nearest-rank percentiles, a free loopback port for a server the
bench starts in another process, the lines naming the machine and the model pair a table was measured with,
writing a bench's results, and the one-slot runtime of the in-process rows."""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

from specrpc import native
from specrpc.config import Config, EngineConfig, Limits, ServerConfig
from specrpc.models.fingerprint import pair_hash
from specrpc.serving.runtime import Runtime

NO_RECHECK = 0.0
"""`--recheck-s` of the servers a benchmark runs beside contenders: no idle checks of the paths chosen at load, as they
would run in the gaps a contender (llama.cpp, transformers, another of ours) fills, on its cores, and a re-measure
made then would time the contender's load (`--keystrokes`, with no contender, keeps them)."""


def server_env() -> dict[str, str]:
    """The environment of a `specrpc serve` a benchmark starts: this one, with `NO_RECHECK`, and each start measuring
    its paths afresh (no `--remember-execution`: a fresh start's choice is part of what `--starts` samples), through
    the environment, which a checkout without a setting ignores, where a flag would stop its server (`--against`)."""
    return {**os.environ, "SPECRPC_RECHECK_S": str(NO_RECHECK), "SPECRPC_REMEMBER_EXECUTION": "0"}


def one_slot_runtime(target: str, draft: str, threads: int, dtype: str, weights: str, native_decode: bool = True
                     ) -> Runtime:
    """A calibrated runtime with one slot of 2,048 positions, for the in-process rows (`given`, `controls`); logs at
    warning, torch at `threads` (0: its default)."""
    from specrpc.logs import configure

    if threads:
        torch.set_num_threads(threads)
    config = Config(engine=EngineConfig(target=target, draft=draft, max_sessions=1, max_context=2048, threads=threads,
                                        dtype=dtype, weights=weights, native_decode=native_decode,
                                        remember_execution=False),
                    server=ServerConfig(port=0, log_format="console", log_level="warning"), limits=Limits())
    configure("console", "warning")
    runtime = Runtime(config)
    runtime.engine.calibrate()
    return runtime


ISA_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"),
             ("amx_int8", "AMX"))
"""/proc/cpuinfo flags a CPU's name is given with: the vector extensions the products can use."""


def cpu_name() -> str:
    """The CPU's model name and its vector extensions (`ISA_FLAGS`) from /proc/cpuinfo, else what `platform` says."""
    flags = set(native.cpu_field("flags").split())
    isa = [label for flag, label in ISA_FLAGS if flag in flags]
    base = native.cpu_field("model name") or platform.processor() or "unknown CPU"
    return f"{base} ({', '.join(isa)})" if isa else base


def machine_line(device: object, dtype: object) -> str:
    """The machine a table was measured on: architecture, the CPU by name, cores, torch, threads, device and dtype."""
    return (f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {device}, {dtype}")


def write_results(out: Path, name: str, results: dict[str, Any], table: str) -> None:
    """`name`.json (the results) and `name`.md (the table) in `out`, and the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))
    (out / f"{name}.md").write_text(table)
    print(table)


def pair_line(target: str, draft: str) -> str:
    """`Pair: <hash of its files> (target <folder>, draft <folder>)`: figures from two pairs are never mixed."""
    return f"Pair: `{pair_hash(target, draft)}` (target {Path(target).name}, draft {Path(draft).name})"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    """A currently free loopback TCP port (the server binds it right after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
