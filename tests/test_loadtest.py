"""tools/loadtest.py end to end, briefly: it starts a server, drives every kind of work for a few seconds, reports,
and passes (the 3-minute and one-hour runs are in docs/reliability.md, not in the suite). And tools/stream_speed.py
against the shared test server."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import models_missing

from specrpc.edges.server import Running

REPO = Path(__file__).resolve().parents[1]


def test_loadtest_runs_every_kind_of_work_and_reports(tmp_path: Path) -> None:
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "tools/loadtest.py", "--clients", "3", "--duration", "8", "--warmup", "2",
                             "--sample-s", "1", "--max-new-tokens", "12", "--max-rss-growth-mib", "512",
                             "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert report["pass"] and summary["hung"] == 0 and summary["tokens"] > 0
    kinds = {"generate", "keystrokes", "infill", "converse", "cancel"}
    assert set(summary["kinds"]) <= kinds and len(summary["kinds"]) >= 3, summary["kinds"]
    assert set(summary["codes"]) <= {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}
    assert summary["ttft_ms_p50"] is not None and summary["total_ms_p99"] is not None
    assert report["memory"]["rss_mib_start"] and report["memory"]["rss_mib_end"]
    assert "verdict: PASS" in result.stdout


async def test_stream_speed_reports_every_setting(server: Running) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "tools/stream_speed.py", "--target", f"127.0.0.1:{server.port}", "--ks", "adaptive,0,3",
        "--cases", "1", cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert [line.split(":")[0] for line in lines] == ["adaptive", "k=0", "k=3"], lines
    for line in lines:
        rate = re.search(r"([\d.]+) decode tokens/s", line)
        tokens = re.search(r"(\d+) tokens over 3 requests", line)
        assert rate and float(rate.group(1)) > 0 and tokens and int(tokens.group(1)) >= 3, line


async def test_stream_speed_refuses_a_bad_k_list() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "tools/stream_speed.py", "--target", "127.0.0.1:1", "--ks", "fast", cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and "--ks takes" in err.decode()
