"""`specrpc bench --llama-server`: argument plumbing, the command lines, the skip line and how a /completion reply
becomes a Run (llama-server itself is never started here: the integrator runs that comparison)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrpc.bench.llama_server import SKIP_LINE, specs, to_run
from specrpc.bench.run import llama_cpp_lines, summarize


def test_no_binary_means_no_contender_and_a_skip_line() -> None:
    assert specs(None, [], [], 2) == []
    assert specs("", ["ignored.gguf"], [], 2) == []
    assert "skipped" in SKIP_LINE and "--llama-server" in SKIP_LINE
    assert llama_cpp_lines({"llama_cpp": {"skipped": SKIP_LINE}, "contenders": {}}) == SKIP_LINE


def test_plain_and_speculative_contenders_per_target_with_the_same_threads(tmp_path: Path) -> None:
    binary, files = tmp_path / "llama-server", {}
    for name in ("binary", "target-f32", "draft-f32", "target-q8_0", "draft-q8_0"):
        files[name] = tmp_path / (f"{name}.gguf" if name != "binary" else "llama-server")
        files[name].write_bytes(b"")
    out = specs(str(binary), [str(files["target-f32"]), str(files["target-q8_0"])],
                [str(files["draft-f32"]), str(files["draft-q8_0"])], 2)
    assert [s.name for s in out] == ["llama.cpp target-f32", "llama.cpp target-f32 + draft-f32",
                                     "llama.cpp target-q8_0", "llama.cpp target-q8_0 + draft-q8_0"]
    plain, spec = out[0].command(8080), out[1].command(8080)
    assert plain[0] == str(binary) and "-md" not in plain and plain[plain.index("-t") + 1] == "2"
    assert spec[spec.index("-md") + 1] == str(files["draft-f32"]) and spec[spec.index("-td") + 1] == "2"
    assert spec[spec.index("--spec-type") + 1] == "draft-simple" and "--spec-draft-n-max" not in spec  # its defaults


@pytest.mark.parametrize(("targets", "drafts", "message"), [
    ([], [], "at least one --gguf-target"),
    (["missing.gguf"], [], "--gguf-target missing.gguf: no such file"),
    (["t.gguf", "t.gguf"], ["d.gguf"], "one per target"),
])
def test_bad_arguments_name_the_flag(tmp_path: Path, targets: list[str], drafts: list[str], message: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("llama-server", "t.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=message):
        specs("llama-server", targets, drafts, 2)
    with pytest.raises(ValueError, match="--llama-server nowhere: no such file"):
        specs("nowhere", ["t.gguf"], [], 2)


def test_a_completion_reply_is_timed_by_the_servers_own_clock() -> None:
    reply = {"tokens": list(range(64)), "timings": {"prompt_n": 100, "prompt_ms": 40.0, "predicted_n": 64,
                                                    "predicted_ms": 252.0, "predicted_per_second": 253.97,
                                                    "draft_n": 90, "draft_n_accepted": 60}}
    run = to_run(reply)
    assert run.ttft_s == pytest.approx(0.040) and run.total_s == pytest.approx(0.292)
    assert (run.proposed, run.accepted, run.reported_tokens_per_s) == (90, 60, 253.97)
    assert summarize([run])["tokens_per_s"] == pytest.approx(63 / 0.252)  # (n - 1) / predicted_ms, like ours


def test_starts_mode_serves_with_the_bench_model_options() -> None:
    """`--starts N` starts `specrpc serve` with the bench's dtype, weights and threads (the run itself is the
    integrator's: each start loads and calibrates the pair)."""
    from specrpc.bench.starts import serve_command

    command = serve_command("t", "d", 5000, 2, "float32", "int8")
    assert command[1:4] == ["-m", "specrpc.cli", "serve"]
    for flag, value in (("--port", "5000"), ("--threads", "2"), ("--weights", "int8"), ("--dtype", "float32"),
                        ("--target", "t"), ("--draft", "d")):
        assert command[command.index(flag) + 1] == value
