"""Small pieces several bench modules share: nearest-rank percentiles and a free loopback port for a server the
bench starts in another process."""

from __future__ import annotations

import socket


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
