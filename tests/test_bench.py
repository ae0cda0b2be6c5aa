"""Smoke test of `specrpc bench` on two prompts: every contender runs, outputs are identical, files are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrpc.bench.run import main
from specrpc.config import ASSETS

pytestmark = pytest.mark.skipif(not (ASSETS / "target" / "config.json").exists(), reason="default models missing")


def test_bench_runs_every_contender_on_two_prompts(tmp_path: Path) -> None:
    assert main(["--cases", "1", "--workloads", "code,infill", "--max-new-tokens", "12", "--ks", "2",
                 "--concurrency", "1,2", "--threads", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    contenders = results["contenders"]
    expected = {"target-only", "adaptive", "adaptive draft only", "k=2", "prompt lookup only", "hf generate",
                "hf assisted"}
    assert expected <= set(contenders)
    for name in ("adaptive", "adaptive draft only", "k=2", "prompt lookup only"):
        assert contenders[name]["identical"] == 1.0, name  # greedy: token-for-token the target-only output
    assert results["grpc"]["concurrency"]["2:adaptive"]["aggregate_tokens_per_s"] > 0
    for chart in ("tokens_per_s.png", "accepted_length.png", "speedup_vs_k.png"):
        assert (tmp_path / chart).stat().st_size > 0
    assert "| adaptive |" in (tmp_path / "results.md").read_text()


def test_keystroke_replay_runs_through_grpc_from_another_process(tmp_path: Path) -> None:
    """The workload runs end to end (timings are the integrator's to measure, not asserted here)."""
    assert main(["--keystrokes", "--keystroke-files", "1", "--keystroke-chars", "4", "--keystroke-intervals", "120",
                 "--keystroke-layouts", "typed_line,spm,psm", "--max-new-tokens", "4", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "keystrokes.json").read_text())
    assert results["fim_template"] == "specrpc" and results["lines"]
    runs = results["runs"]
    assert set(runs) == {"typed_line@120ms", "psm@120ms"}  # the shipped pair is trained prefix-first only
    for run in runs.values():
        assert run["keystrokes"] == 4
        assert all(k["prompt_tokens"] > 0 and k["finish"] for line in run["keystrokes_detail"] for k in line)
    assert "| typed_line | 120 ms | 4 |" in (tmp_path / "keystrokes.md").read_text()
