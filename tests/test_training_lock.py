"""The training lock: measurements refuse to start beside a running training, not beside a paused or finished one;
and the pair hash that names a benchmark table's models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from specrpc.cli import main
from specrpc.models.fingerprint import pair_hash
from specrpc.training.lock import hold, holder, refuse_beside_training


def wait_state(pid: int, states: str) -> None:
    """Until the process's scheduler state is one of `states` (signals are delivered asynchronously)."""
    for _ in range(200):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in states:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {states}")


def test_holding_names_the_training_and_removes_its_file(tmp_path: Path) -> None:
    assert holder(tmp_path) is None
    with hold(tmp_path):
        reason = holder(tmp_path)
        assert reason is not None and f"pid {os.getpid()}" in reason and "kill -STOP" in reason
    assert holder(tmp_path) is None and not list(tmp_path.iterdir())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process states come from /proc")
def test_a_paused_training_lets_a_measurement_start_and_a_dead_one_is_stale(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECRPC_BESIDE_TRAINING", raising=False)
    trainer = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / f"{trainer.pid}.json").write_text(json.dumps({"pid": trainer.pid, "command": "train"}))
        with pytest.raises(SystemExit, match="specrpc bench refuses to start: a training run"):
            refuse_beside_training("specrpc bench", tmp_path)
        trainer.send_signal(signal.SIGSTOP)
        wait_state(trainer.pid, "Tt")
        assert holder(tmp_path) is None
        refuse_beside_training("specrpc bench", tmp_path)  # paused: no refusal
        trainer.send_signal(signal.SIGCONT)
        wait_state(trainer.pid, "RS")
        assert holder(tmp_path) is not None
        monkeypatch.setenv("SPECRPC_BESIDE_TRAINING", "1")
        refuse_beside_training("specrpc bench", tmp_path)  # a smoke run may start anyway
    finally:
        trainer.kill()
        trainer.wait()
    assert holder(tmp_path) is None  # the process is gone: its file is stale


def test_bench_help_answers_beside_a_training_and_a_run_refuses(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPECRPC_BESIDE_TRAINING", raising=False)
    with hold():  # this process stands for the training, in the folder `specrpc bench` reads
        with pytest.raises(SystemExit) as help_exit:
            main(["bench", "given", "--help"])
        assert help_exit.value.code == 0 and "--cases" in capsys.readouterr().out
        with pytest.raises(SystemExit, match="specrpc bench refuses to start: a training run"):
            main(["bench", "given", "--cases", "1"])


def test_pair_hash_follows_the_files(tmp_path: Path) -> None:
    target, draft = tmp_path / "t", tmp_path / "d"
    target.mkdir()
    draft.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    (draft / "model.safetensors").write_bytes(b"draft weights")
    first = pair_hash(str(target), str(draft))
    assert len(first) == 10 and first == pair_hash(str(target), str(draft))
    assert pair_hash(str(draft), str(target)) != first  # which model is the target matters
    assert pair_hash(str(target), "none") != first
    (draft / "model.safetensors").write_bytes(b"draft weightz")
    assert pair_hash(str(target), str(draft)) != first
