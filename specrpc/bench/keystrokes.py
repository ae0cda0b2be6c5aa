"""`specrpc bench --keystrokes`: an editor's keystrokes replayed through gRPC against a `specrpc serve` in another
process. A line is typed character by character in the middle of a held-out file (third-party package sources the
models never saw), 3,000-4,000 characters of prefix and 1,500-2,000 of suffix in whole lines, on one session, each
keystroke an Infill that cancels the one before, at fixed intervals between keys; each prompt layout runs against
prefix-first (PSM) on the same run. Reports time to first token per keystroke, the share answered before the next
key, and the prompt tokens each keystroke prefilled; then, per layout, the time to the whole completion when the
user types along the suggestion (the session's last completion is the draft)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specrpc.bench.common import free_port, pair_line, percentile
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

HELD_OUT_MODULES = ("jinja2.lexer", "click.core", "grpc.aio._channel", "fsspec.spec")
"""Third-party sources installed with the server (not the Python standard library the shipped models were trained
on): the files whose lines are typed."""

LAYOUTS: dict[str, pb.FimLayout.ValueType] = {"psm": pb.FIM_LAYOUT_PSM, "spm": pb.FIM_LAYOUT_SPM,
                                               "typed_line": pb.FIM_LAYOUT_TYPED_LINE}
PREFIX_CHARS = (3000, 4000)
SUFFIX_CHARS = (1500, 2000)


@dataclass(frozen=True)
class TypedLine:
    """One line to type: the text above it and below it (whole lines), and the line itself."""

    source: str
    above: str
    line: str
    below: str

    @property
    def path(self) -> str:
        """The file's path as an editor shows it (the module's, relative to site-packages)."""
        return self.source.split(":")[0].replace(".", "/") + ".py"

    def keystrokes(self, limit: int = 0) -> list[tuple[str, str]]:
        """(prefix, suffix) after each character typed after the line's indentation (the editor indents)."""
        indent = len(self.line) - len(self.line.lstrip())
        ends = range(indent + 1, len(self.line) + 1)
        if limit:
            ends = ends[:limit]
        return [(self.above + self.line[:end], "\n" + self.below) for end in ends]


def window(lines: list[str], chars: tuple[int, int], from_end: bool) -> str | None:
    """Whole lines, taken from the end (or the start) of `lines`, holding between chars[0] and chars[1] characters."""
    taken: list[str] = []
    total = 0
    for line in reversed(lines) if from_end else lines:
        if total + len(line) > chars[1]:
            break
        taken.append(line)
        total += len(line)
        if total >= chars[0]:
            return "".join(reversed(taken) if from_end else taken)
    return None


def held_out_lines(n: int, seed: int = 0) -> list[TypedLine]:
    """One line to type from each of `n` held-out files (HELD_OUT_MODULES that are installed), chosen at random in
    the file's middle half among code lines of 20 to 70 characters."""
    rng = random.Random(seed)
    out: list[TypedLine] = []
    for name in HELD_OUT_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        lines = Path(spec.origin).read_text().splitlines(keepends=True)
        candidates = [i for i in range(len(lines) // 4, 3 * len(lines) // 4)
                      if 20 <= len(lines[i].strip()) <= 70 and not lines[i].lstrip().startswith(("#", '"', "'"))]
        rng.shuffle(candidates)
        for i in candidates:
            above = window(lines[:i], PREFIX_CHARS, from_end=True)
            below = window(lines[i + 1:], SUFFIX_CHARS, from_end=False)
            if above is not None and below is not None:
                out.append(TypedLine(f"{name}:{i + 1}", above, lines[i].rstrip("\n"), below))
                break
        if len(out) == n:
            break
    return out


@dataclass
class Keystroke:
    """What one keystroke's Infill got."""

    ttft_ms: float | None = None
    total_ms: float | None = None
    text: str = ""
    verify_steps: int = 0
    suggestion_accepted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str = ""


async def infill(stub: pb_grpc.GeneratorStub, request: pb.InfillRequest, sent: float, out: Keystroke) -> None:
    """Run one keystroke's Infill to its end (a newer keystroke on the session cancels it), noting what it got."""
    call: Any = stub.Infill(request, timeout=120)  # an aio stream (the stubs are typed for the blocking API)
    async for response in call:
        if response.HasField("chunk"):
            out.text += response.chunk.text
            if response.chunk.token_ids and out.ttft_ms is None:
                out.ttft_ms = (time.perf_counter() - sent) * 1e3
        elif response.HasField("summary"):
            s = response.summary
            out.total_ms = (time.perf_counter() - sent) * 1e3
            out.verify_steps, out.suggestion_accepted = s.speculation.verify_steps, s.suggestion_tokens_accepted
            out.prompt_tokens, out.cached_prompt_tokens = s.prompt_tokens, s.cached_prompt_tokens
            out.completion_tokens = s.completion_tokens
            out.finish = pb.FinishReason.Name(s.finish_reason).removeprefix("FINISH_REASON_").lower()


async def type_line(stub: pb_grpc.GeneratorStub, line: TypedLine, layout: pb.FimLayout.ValueType, interval_s: float,
                    session: str, max_new_tokens: int, limit: int) -> list[Keystroke]:
    """Type `line` one key every `interval_s`, an Infill per key on `session`; wait for the last one to finish."""
    strokes: list[Keystroke] = []
    tasks = []
    start = time.perf_counter()
    for i, (prefix, suffix) in enumerate(line.keystrokes(limit)):
        await asyncio.sleep(max(0.0, start + i * interval_s - time.perf_counter()))
        request = pb.InfillRequest(prefix=prefix, suffix=suffix, session_id=session, max_new_tokens=max_new_tokens,
                                   path=line.path, layout=layout, truncate=True)
        strokes.append(Keystroke())
        tasks.append(asyncio.create_task(infill(stub, request, time.perf_counter(), strokes[-1])))
    await asyncio.gather(*tasks)
    return strokes


async def type_along(stub: pb_grpc.GeneratorStub, line: TypedLine, layout: pb.FimLayout.ValueType, session: str,
                     max_new_tokens: int, typed: int = 3) -> list[Keystroke]:
    """The user types along the suggestion: a keystroke at the line's first typed character, left to finish, then
    up to `typed` keystrokes, each adding the next character of the suggestion the editor shows (the last
    completion) and each left to finish. Returns the first keystroke (no suggestion to follow yet), then the
    typed-along ones."""
    prefix, suffix = line.keystrokes(1)[0]
    strokes: list[Keystroke] = []
    for i in range(typed + 1):
        if i:
            shown = strokes[-1].text
            if shown[:1] in ("", "\n"):
                break  # nothing shown, or the suggestion ends the line: nothing more to type along on this line
            prefix += shown[0]
        request = pb.InfillRequest(prefix=prefix, suffix=suffix, session_id=session, max_new_tokens=max_new_tokens,
                                   path=line.path, layout=layout, truncate=True)
        strokes.append(Keystroke())
        await infill(stub, request, time.perf_counter(), strokes[-1])
    return strokes


def summarize_along(lines: list[list[Keystroke]]) -> dict[str, float]:
    """Time to the whole completion for the first keystroke of a line against keystrokes typing along its
    suggestion, with verify steps and suggestion tokens accepted per typed-along keystroke."""
    first = [line[0].total_ms for line in lines if line and line[0].total_ms is not None]
    along = [k for line in lines for k in line[1:] if k.total_ms is not None]
    return {
        "lines": len(lines),
        "first_total_ms_median": statistics.median(first) if first else 0.0,
        "along_keystrokes": len(along),
        "along_total_ms_median": statistics.median([k.total_ms or 0.0 for k in along]) if along else 0.0,
        "along_total_ms_p90": percentile([k.total_ms or 0.0 for k in along], 90),
        "along_verify_steps_median": statistics.median([k.verify_steps for k in along]) if along else 0.0,
        "along_completion_tokens_median": statistics.median([k.completion_tokens for k in along]) if along else 0.0,
        "along_suggestion_accepted_median": statistics.median([k.suggestion_accepted for k in along]) if along
        else 0.0,
    }


def summarize(strokes: list[list[Keystroke]], interval_s: float) -> dict[str, float]:
    """Figures over the keystrokes of every line typed in one layout at one interval."""
    flat = [k for line in strokes for k in line]
    ttfts = [k.ttft_ms for k in flat if k.ttft_ms is not None]
    prefilled: list[int] = []
    beyond_own: list[int] = []
    for line in strokes:
        previous = 0
        for k in line:
            if k.ttft_ms is not None:  # its prefill ran to the end
                prefilled.append(k.prompt_tokens - k.cached_prompt_tokens)
                if previous:
                    beyond_own.append(prefilled[-1] - max(0, k.prompt_tokens - previous))
            previous = k.prompt_tokens or previous
    return {
        "keystrokes": len(flat),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p90": percentile(ttfts, 90),
        "ttft_ms_p99": percentile(ttfts, 99),
        "answered_before_next_key": sum(t < interval_s * 1e3 for t in ttfts) / len(flat) if flat else 0.0,
        "prefilled_median": statistics.median(prefilled) if prefilled else 0.0,
        "prefilled_beyond_own_median": statistics.median(beyond_own) if beyond_own else 0.0,
        "prompt_tokens_median": statistics.median([k.prompt_tokens for k in flat if k.prompt_tokens] or [0]),
    }


def serve(target: str, draft: str, threads: int, port: int) -> subprocess.Popen[bytes]:
    """`specrpc serve` in another process, at its defaults: no contender shares its cores here, so its idle checks of
    the paths chosen at load (`--recheck-s`) run as they do for an editor, and a keystroke may meet one."""
    command = [sys.executable, "-m", "specrpc.cli", "serve", "--target", target, "--draft", draft, "--host",
               "127.0.0.1", "--port", str(port), "--max-context", "2048", "--max-sessions", "4", "--metrics-port",
               "0", "--log-format", "console", "--log-level", "warning", "--grace-s", "1"]
    if threads:
        command += ["--threads", str(threads)]
    return subprocess.Popen(command, env=os.environ.copy())


async def wait_serving(channel: grpc.aio.Channel, process: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    """Until the server's health says SERVING (it is warm)."""
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specrpc serve exited with {process.returncode}")
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("specrpc serve did not become SERVING")


async def replay(port: int, process: subprocess.Popen[bytes], lines: list[TypedLine], layouts: list[str],
                 intervals_ms: list[int], max_new_tokens: int, limit: int) -> dict[str, Any]:
    """Every layout at every interval over the same lines, layouts interleaved line by line."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await wait_serving(channel, process)
        stub = pb_grpc.GeneratorStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        usable = [name for name in layouts if (("spm" if name == "spm" else "psm") in info.fim_orders)]
        results: dict[str, Any] = {"fim_template": info.fim_template, "fim_orders": list(info.fim_orders),
                                   "lines": [line.source for line in lines], "runs": {}}
        for interval in intervals_ms:
            strokes: dict[str, list[list[Keystroke]]] = {name: [] for name in usable}
            sessions = {name: f"keys-{name}-{uuid.uuid4().hex}" for name in usable}  # one editor buffer per layout
            for line in lines:
                for name in usable:
                    strokes[name].append(await type_line(stub, line, LAYOUTS[name], interval / 1e3, sessions[name],
                                                         max_new_tokens, limit))
            for name in usable:
                results["runs"][f"{name}@{interval}ms"] = {
                    "layout": name, "interval_ms": interval, **summarize(strokes[name], interval / 1e3),
                    "keystrokes_detail": [[asdict(k) for k in line] for line in strokes[name]]}
        along: dict[str, list[list[Keystroke]]] = {name: [] for name in usable}
        sessions = {name: f"along-{name}-{uuid.uuid4().hex}" for name in usable}
        for line in lines:
            for name in usable:
                along[name].append(await type_along(stub, line, LAYOUTS[name], sessions[name], max_new_tokens))
        results["along"] = {name: {**summarize_along(along[name]),
                                   "keystrokes_detail": [[asdict(k) for k in line] for line in along[name]]}
                            for name in usable}
        return results


def markdown(results: dict[str, Any]) -> str:
    """The keystroke table."""
    rows = ["| layout | between keys | keystrokes | TTFT p50 | p90 | p99 | answered before the next key | "
            "prefilled per key (median) | beyond its own tokens (median) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["runs"].values():
        rows.append(f"| {r['layout']} | {r['interval_ms']} ms | {r['keystrokes']} | {r['ttft_ms_p50']:.1f} ms | "
                    f"{r['ttft_ms_p90']:.1f} ms | {r['ttft_ms_p99']:.1f} ms | {r['answered_before_next_key']:.0%} | "
                    f"{r['prefilled_median']:.0f} | {r['prefilled_beyond_own_median']:.0f} |")
    along = ["| layout | first keystroke: whole completion (median) | typing along it: whole completion (median) | "
             "p90 | verify steps (median) | completion tokens (median) | suggestion tokens accepted (median) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, a in results.get("along", {}).items():
        along.append(f"| {name} | {a['first_total_ms_median']:.1f} ms | {a['along_total_ms_median']:.1f} ms | "
                     f"{a['along_total_ms_p90']:.1f} ms | {a['along_verify_steps_median']:.0f} | "
                     f"{a['along_completion_tokens_median']:.0f} | {a['along_suggestion_accepted_median']:.0f} |")
    return (f"{results['pair']}\n\n"
            f"Keystroke replay ({results['fim_template']} template, trained {results['fim_orders']}), lines typed in "
            f"{', '.join(results['lines'])}:\n\n" + "\n".join(rows) + "\n\nTyping along the suggestion (each "
            "keystroke left to finish; up to 3 characters typed, each the next one the last completion suggested):\n\n"
            + "\n".join(along) + "\n")


def run(target: str, draft: str, out: Path, files: int, layouts: list[str], intervals_ms: list[int],
        threads: int = 0, max_new_tokens: int = 16, limit: int = 0, seed: int = 0) -> dict[str, Any]:
    """Start a server, replay the keystrokes, write keystrokes.json and keystrokes.md under `out`."""
    lines = held_out_lines(files, seed)
    if not lines:
        raise RuntimeError(f"none of {HELD_OUT_MODULES} is installed: no held-out file to type in")
    port = free_port()
    process = serve(target, draft, threads, port)
    try:
        results = asyncio.run(replay(port, process, lines, layouts, intervals_ms, max_new_tokens, limit))
    finally:
        process.terminate()
        process.wait(30)
    results["pair"] = pair_line(target, draft)
    results["command_options"] = {"files": files, "layouts": layouts, "intervals_ms": intervals_ms,
                                  "max_new_tokens": max_new_tokens, "chars_per_line": limit or "all",
                                  "threads": threads or "default"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "keystrokes.json").write_text(json.dumps(results, indent=2))
    (out / "keystrokes.md").write_text(markdown(results))
    return results
