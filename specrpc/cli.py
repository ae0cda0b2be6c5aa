"""`specrpc serve | complete | chat | bench`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from specrpc import config as config_mod
from specrpc.logs import configure


def _serve(args: argparse.Namespace) -> int:
    from specrpc.server import serve

    try:
        cfg = config_mod.build_config(args)
    except (ValueError, OSError) as exc:
        print(f"specrpc serve: {exc}", file=sys.stderr)
        return 2
    configure(cfg.server.log_format, cfg.server.log_level)
    asyncio.run(serve(cfg))
    return 0


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
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
