"""nginx's list of specrpc replicas (`specrpc-upstream.inc`), kept in step with each replica's grpc.health.v1.

Open-source nginx has no active gRPC health checks and does not read grpc-status, so a replica that is up but
NOT_SERVING (loading or warming its models, draining) would still be sent new sessions. This sidecar closes the gap
with nginx's own mechanisms: it asks every replica `grpc.health.v1.Health/Check` for `specrpc.v1.Generator`, writes
the ones that are not SERVING as `down` (which keeps the consistent-hash ring, so the other sessions do not move),
and reloads nginx (graceful: streams in flight finish on the old workers) whenever the file changes.

    python upstream.py render --out specrpc-upstream.inc HOST:PORT ...   # every replica up (no checks)
    python upstream.py watch  --out specrpc-upstream.inc --nginx-pid PIDFILE HOST:PORT ...   # keep it in step
    python upstream.py watch  --once --out specrpc-upstream.inc HOST:PORT ...   # check once, write, exit

With `--http-out specrpc-http-upstream.inc`, a replica written `HOST:PORT,HTTP_PORT` is also listed there by its HTTP
port (the OpenAI / llama.cpp edge, `--http-port`), `down` exactly when its gRPC entry is: the HTTP upstream follows
the same health. A replica without an HTTP port is left out of that file.

Run it with the specrpc virtual environment's Python (it needs grpcio and grpcio-health-checking).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "specrpc.v1.Generator"
SERVING = health_pb2.HealthCheckResponse.SERVING
CHANNEL_OPTIONS = [
    # Notice a replica that comes back within about a second, not after gRPC's default 2-minute backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class Replica:
    """One replica and its health as last decided (with rise/fall hysteresis)."""

    address: str
    http_address: str = ""  # HOST:HTTP_PORT, or "" when it serves no HTTP edge
    channel: grpc.Channel | None = None
    up: bool | None = None  # None: not checked yet
    streak: int = 0  # consecutive checks that disagree with `up`
    last: str = "unchecked"


def render(replicas: Sequence[tuple[str, bool]], max_fails: int, fail_timeout: str) -> str:
    """The include file: one `server` line per replica, `down` where not healthy. If none is healthy, all are
    written up (fail open, like Envoy's panic threshold): nginx's passive checks then decide per call, and a call
    no replica takes gets UNAVAILABLE."""
    panic = bool(replicas) and not any(up for _, up in replicas)
    lines = ["# Written by deploy/nginx/upstream.py; do not edit (it is rewritten when a replica's health changes)."]
    if panic:
        lines.append("# No replica is SERVING: all are listed up so that nginx's passive checks decide (panic mode).")
    for address, up in replicas:
        down = "" if up or panic else " down"
        lines.append(f"server {address} max_fails={max_fails} fail_timeout={fail_timeout}{down};")
    return "\n".join(lines) + "\n"


def parse_replica(spec: str) -> Replica:
    """`HOST:PORT` (gRPC) or `HOST:PORT,HTTP_PORT` (gRPC and the HTTP edge on the same host)."""
    address, _, http_port = spec.partition(",")
    host = address.rpartition(":")[0]
    if not host or (http_port and not http_port.isdigit()):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected HOST:PORT or HOST:PORT,HTTP_PORT")
    return Replica(address, f"{host}:{http_port}" if http_port else "")


def write_all(replicas: Sequence[Replica], args: argparse.Namespace) -> bool:
    """Write the gRPC include (and the HTTP one with --http-out) from the replicas' state; True if either changed."""
    states = [(r.address, bool(r.up)) for r in replicas]
    changed = write_if_changed(args.out, render(states, args.max_fails, args.fail_timeout))
    if args.http_out:
        http = [(r.http_address, bool(r.up)) for r in replicas if r.http_address]
        changed = write_if_changed(args.http_out, render(http, args.max_fails, args.fail_timeout)) or changed
    return changed


def write_if_changed(path: str, text: str) -> bool:
    """Atomically replace `path` with `text` unless it already holds exactly that; True when written."""
    try:
        with open(path) as fh:
            if fh.read() == text:
                return False
    except FileNotFoundError:
        pass
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".specrpc-upstream.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return True


def check(replica: Replica, timeout_s: float) -> tuple[bool | None, str]:
    """One grpc.health.v1 Check: (True: SERVING, False: the replica says it is not, None: no answer; what was
    seen)."""
    if replica.channel is None:
        replica.channel = grpc.insecure_channel(replica.address, options=CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(replica.channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        return None, f"no answer ({code.name if code else exc})"
    return response.status == SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def update(replica: Replica, result: bool | None, seen: str, rise: int, fall: int) -> bool:
    """Apply one check with hysteresis; True when the replica's up/down state changed. A replica that answers
    NOT_SERVING (loading, draining) goes down at once: it says so itself. No answer (timeout, refused) takes `fall`
    checks in a row, so one slow answer does not move every session off a busy replica (nginx's passive checks
    already steer calls around a dead one). Coming back takes `rise` SERVING answers in a row."""
    replica.last = seen
    serving = bool(result)
    if replica.up is None:
        replica.up, replica.streak = serving, 0
        return True
    if serving == replica.up:
        replica.streak = 0
        return False
    replica.streak += 1
    if replica.streak >= (rise if serving else 1 if result is False else fall):
        replica.up, replica.streak = serving, 0
        return True
    return False


def reload_nginx(pid_file: str | None, command: str | None) -> None:
    """SIGHUP the nginx master (graceful reload), or run the given command (e.g. `nginx -s reload`)."""
    if command:
        subprocess.run(command, shell=True, check=True)
    elif pid_file:
        with open(pid_file) as fh:
            os.kill(int(fh.read().strip()), signal.SIGHUP)


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} upstream.py: {message}", file=sys.stderr, flush=True)


def watch(args: argparse.Namespace) -> int:
    replicas = list(args.replicas)
    pool = ThreadPoolExecutor(max_workers=min(16, len(replicas)))
    first = True
    while True:
        started = time.monotonic()
        results = list(pool.map(lambda r: check(r, args.timeout), replicas))
        changed = [r for r, (result, seen) in zip(replicas, results, strict=True)
                   if update(r, result, seen, args.rise, args.fall)]
        for r in changed if not first else replicas:
            log(f"{r.address} {'up' if r.up else 'down'} ({r.last})")
        if write_all(replicas, args):
            log(f"wrote {args.out}{' and ' + args.http_out if args.http_out else ''}")
            if not first or not args.no_initial_reload:
                try:
                    reload_nginx(args.nginx_pid, args.reload_cmd)
                    if args.nginx_pid or args.reload_cmd:
                        log("reloaded nginx")
                except (OSError, ValueError, subprocess.CalledProcessError) as exc:
                    log(f"nginx reload failed: {exc}")
        first = False
        if args.once:
            return 0
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("render", "watch"):
        p = commands.add_parser(name)
        p.add_argument("replicas", nargs="+", type=parse_replica, metavar="HOST:PORT[,HTTP_PORT]",
                       help="the replicas' gRPC addresses (and HTTP ports)")
        p.add_argument("--out", required=True, help="the include file to write (specrpc-upstream.inc)")
        p.add_argument("--http-out", help="the HTTP edge's include file to write (specrpc-http-upstream.inc)")
        p.add_argument("--max-fails", type=int, default=2, help="nginx passive check: failed attempts ...")
        p.add_argument("--fail-timeout", default="10s", help="... within this time take a replica out for as long")
    w = commands.choices["watch"]
    w.add_argument("--interval", type=float, default=0.5, help="seconds between rounds of health checks")
    w.add_argument("--timeout", type=float, default=0.8, help="deadline of one health check, seconds")
    w.add_argument("--rise", type=int, default=2, help="consecutive SERVING answers to bring a replica back")
    w.add_argument("--fall", type=int, default=2,
                   help="consecutive checks without an answer to take a replica out (NOT_SERVING: at once)")
    w.add_argument("--once", action="store_true", help="check once, write the file, exit")
    w.add_argument("--nginx-pid", help="nginx master's pid file: SIGHUP (graceful reload) after each change")
    w.add_argument("--reload-cmd", help="command to run after each change instead, e.g. 'nginx -s reload'")
    w.add_argument("--no-initial-reload", action="store_true",
                   help="do not reload after the first write (nginx is started after it)")
    args = parser.parse_args(argv)
    if args.command == "render":
        for replica in args.replicas:
            replica.up = True
        write_all(args.replicas, args)
        return 0
    try:
        return watch(args)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
