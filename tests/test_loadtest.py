"""tools/loadtest.py end to end, briefly: it starts a server, drives every kind of work for a few seconds, reports,
and passes (the 3-minute and one-hour runs are in docs/reliability.md, not in the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import models_missing

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
