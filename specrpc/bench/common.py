"""Small pieces several bench modules share: nearest-rank percentiles, a free loopback port for a server the
bench starts in another process, and the line naming the model pair a table was measured with."""

from __future__ import annotations

import socket
from pathlib import Path

from specrpc.models.fingerprint import pair_hash


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
