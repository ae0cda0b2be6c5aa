"""`specrpc serve | complete | chat | bench`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from specrpc import config as config_mod
from specrpc.logs import configure

PRIMITIVE_CACHE_CAPACITY = "256"
"""Entries in oneDNN's and ideep's per-shape primitive caches for `specrpc serve` (their default is 1024 each)."""


def bound_native_caches() -> None:
    """Cap oneDNN's and ideep's primitive caches unless the environment sets them. Both keep one compiled primitive,
    with its buffers, per input shape; a server sees a new shape for every prompt length, so with the default
    capacity of 1024 each its memory kept growing under load (docs/reliability.md). 256 entries still hold every
    decode and verify shape and many recent prefill shapes. Read at the first oneDNN call, so this runs before
    torch is used."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, PRIMITIVE_CACHE_CAPACITY)


def _serve(args: argparse.Namespace) -> int:
    from specrpc.edges.auth import read_tokens

    try:
        cfg = config_mod.build_config(args)
        if cfg.server.auth_tokens_file and not read_tokens(cfg.server.auth_tokens_file):
            raise ValueError(f"--auth-tokens-file {cfg.server.auth_tokens_file} has no tokens (one per line)")
    except (ValueError, OSError) as exc:
        print(f"specrpc serve: {exc}", file=sys.stderr)
        return 2
    bound_native_caches()
    from specrpc.edges.server import serve  # torch and the models: only once the configuration is known to be good

    configure(cfg.server.log_format, cfg.server.log_level)
    if cfg.server.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            print("specrpc serve: --event-loop uvloop needs the uvloop package (pip install uvloop)", file=sys.stderr)
            return 2
        uvloop.run(serve(cfg))
    else:
        asyncio.run(serve(cfg))
    return 0


def _bench(argv: list[str]) -> int:
    from specrpc.training.lock import refuse_beside_training

    if not {"-h", "--help"} & set(argv):  # reading the options measures nothing
        refuse_beside_training("specrpc bench")
    if argv[:1] == ["given"]:  # drafts a request brings (prediction) or earlier ones left (suffix source)
        from specrpc.bench.given import main as given_main

        return given_main(argv[1:])
    if argv[:1] == ["ties"]:  # how often greedy speculation leaves target-only's tokens, default and deterministic
        from specrpc.bench.ties import main as ties_main

        return ties_main(argv[1:])
    if argv[:1] == ["controls"]:  # what a JSON schema and a repetition penalty cost speculation
        from specrpc.bench.controls import main as controls_main

        return controls_main(argv[1:])
    if argv[:1] == ["floor"]:  # weight bytes each path reads per second here, beside the caches' and memory's rate
        from specrpc.bench.floor import main as floor_main

        return floor_main(argv[1:])
    if argv[:1] == ["realistic"]:  # random-weight models of published shapes, simulated acceptance
        from specrpc.bench.realistic import main as realistic_main

        return realistic_main(argv[1:])
    if argv[:1] == ["bpb"]:  # bits per byte on held-out code: float32, int8 per row, llama.cpp's q8_0 per 32
        from specrpc.bench.weight_formats import main as bpb_main

        return bpb_main(argv[1:])
    from specrpc.bench.run import main as bench_main

    return bench_main(argv)


def _add_client_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`complete` and `chat` come from the Python client (clients/python): only its argparse module is imported
    here; the client itself loads when one of them runs. Without the client installed they say how to get it."""
    try:
        from specrpc_client.cli import add_commands
    except ImportError as exc:
        reason = f"the Python client is not installed ({exc}); run `make install` or `pip install -e clients/python`"
        for name in ("complete", "chat"):
            missing = commands.add_parser(name, help=f"(unavailable: {reason})")
            missing.set_defaults(func=lambda _args: print(f"specrpc: {reason}", file=sys.stderr) or 2)
        return
    add_commands(commands)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `specrpc` command."""
    parser = argparse.ArgumentParser(prog="specrpc", description="Exact speculative decoding over gRPC.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the gRPC server",
        description="Run the gRPC server. Every option can also come from the environment (SPECRPC_<NAME>) or a "
        "TOML --config file; flags win over the environment, which wins over the file.",
    )
    config_mod.add_arguments(serve)
    serve.set_defaults(func=_serve)
    _add_client_commands(commands)
    commands.add_parser("bench", help="side-by-side benchmarks (see `specrpc bench --help`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
