"""tools/soak.py end to end, briefly (the one-hour soak is `make soak`, figures in docs/reliability.md): it starts a
server, runs every traffic kind on both edges for ~20 s, samples RSS, reports latency per kind per window, and
passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import models_missing

REPO = Path(__file__).resolve().parents[1]
KINDS = {"editor", "voice", "chat", "completion", "hostile"}


@pytest.mark.timeout(180)
def test_soak_runs_every_traffic_kind_on_both_edges_and_reports(tmp_path: Path) -> None:
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "soak.json"
    # a short run: RSS still grows while warming up, and latency has no time to settle, so those limits are loose
    result = subprocess.run([sys.executable, "tools/soak.py", "--duration", "20", "--window-s", "10", "--sample-s", "2",
                             "--baseline-s", "6", "--rss-pct", "50", "--no-latency-check", "--threads", "1",
                             "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["pass"] and report["hung"] == {} and report["why"] == []
    outcomes = {tuple(key.split("/")): n for key, n in report["outcomes"].items()}
    assert {kind for kind, _ in outcomes} == KINDS, outcomes
    edges_ok = {outcome for _, outcome in outcomes}
    assert {"OK", "200"} <= edges_ok, "both edges should have served requests"
    assert len(report["windows"]) >= 2
    for window in report["windows"][:2]:
        for kind, figures in window["kinds"].items():
            assert figures["n"] > 0 and figures["total_p50"] is not None and figures["total_p90"] is not None, kind
    memory = report["memory"]
    assert memory["start_mib"] and memory["baseline_mib"] and memory["end_mib"] and len(memory["samples"]) >= 5
    assert "verdict: PASS" in result.stdout and "first p50" in result.stdout


def test_soak_refuses_half_a_target() -> None:
    result = subprocess.run([sys.executable, "tools/soak.py", "--target", "127.0.0.1:1"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--http-target" in result.stderr
