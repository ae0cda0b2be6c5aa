"""`specrpc bench --llama-server`: argument plumbing, the sweep's command lines, the skip line, the best-of report and
how a /completion reply becomes a Run (llama-server itself is started only by the integrator's comparison; where
`SPECRPC_LLAMA_SERVER` names a built binary, its own help is checked to take every flag the sweep passes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from specrpc.bench.llama_server import SKIP_LINE, SWEEP, specs, sweep, to_run
from specrpc.bench.run import best_speculative, llama_cpp_lines, summarize


def test_no_binary_means_no_contender_and_a_skip_line() -> None:
    assert specs(None, [], [], 2) == []
    assert specs("", ["ignored.gguf"], [], 2) == []
    assert "skipped" in SKIP_LINE and "--llama-server" in SKIP_LINE
    assert llama_cpp_lines({"llama_cpp": {"skipped": SKIP_LINE}, "contenders": {}}) == SKIP_LINE


def _files(tmp_path: Path) -> dict[str, Path]:
    files = {}
    for name in ("binary", "target-f32", "draft-f32", "target-q8_0", "draft-q8_0"):
        files[name] = tmp_path / (f"{name}.gguf" if name != "binary" else "llama-server")
        files[name].write_bytes(b"")
    return files


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_per_target_plain_then_the_whole_sweep_with_the_same_threads(tmp_path: Path) -> None:
    files = _files(tmp_path)
    out = specs(str(files["binary"]), [str(files["target-f32"]), str(files["target-q8_0"])],
                [str(files["draft-f32"]), str(files["draft-q8_0"])], 2)
    drafted = [f"draft-{n}-{p}" for n in (3, 8, 16) for p in ("0", "0.5")]
    assert [s.name for s in out] == [
        *(["llama.cpp target-f32"] + [f"llama.cpp target-f32 + draft-f32 {k}" for k in drafted]
          + ["llama.cpp target-f32 ngram-mod", "llama.cpp target-f32 ngram-cache"]),
        *(["llama.cpp target-q8_0"] + [f"llama.cpp target-q8_0 + draft-q8_0 {k}" for k in drafted]
          + ["llama.cpp target-q8_0 ngram-mod", "llama.cpp target-q8_0 ngram-cache"])]
    plain = out[0].command(8080)
    assert plain[0] == str(files["binary"]) and _flag(plain, "-t") == "2" and _flag(plain, "-tb") == "2"
    assert "-md" not in plain and "--spec-type" not in plain
    for spec, (n, p) in zip(out[1:7], [(n, p) for n in (3, 8, 16) for p in ("0", "0.5")], strict=True):
        cmd = spec.command(8080)
        assert _flag(cmd, "-md") == str(files["draft-f32"]) and _flag(cmd, "-td") == "2"
        assert _flag(cmd, "--spec-type") == "draft-simple"
        assert (_flag(cmd, "--spec-draft-n-max"), _flag(cmd, "--spec-draft-p-min")) == (str(n), p)
    for spec, kind in zip(out[7:9], ["ngram-mod", "ngram-cache"], strict=True):  # model-free, their own lengths
        cmd = spec.command(8080)
        assert _flag(cmd, "--spec-type") == kind and "-md" not in cmd and "--spec-draft-n-max" not in cmd
    assert _flag(out[10].command(8080), "-md") == str(files["draft-q8_0"])  # each target its own draft


def test_the_sweep_without_a_draft_and_by_key(tmp_path: Path) -> None:
    files = _files(tmp_path)
    alone = specs(str(files["binary"]), [str(files["target-f32"])], [], 2)
    assert [s.name for s in alone] == ["llama.cpp target-f32", "llama.cpp target-f32 ngram-mod",
                                       "llama.cpp target-f32 ngram-cache"]
    assert [s.key for s in sweep("all")] == [s.key for s in SWEEP] and sweep("none") == []
    assert [s.key for s in sweep("draft-8-0.5, ngram-cache")] == ["draft-8-0.5", "ngram-cache"]
    picked = specs(str(files["binary"]), [str(files["target-f32"])], [str(files["draft-f32"])], 2, sweep("draft-16-0"))
    assert [s.name for s in picked] == ["llama.cpp target-f32", "llama.cpp target-f32 + draft-f32 draft-16-0"]
    with pytest.raises(ValueError, match="--llama-spec draft-4-0: not one of all, none, draft-3-0"):
        sweep("draft-4-0")


def test_the_report_names_the_best_setting_and_divides_by_it() -> None:
    rates = {"target-only": 100.0, "adaptive": 240.0, "llama.cpp t": 80.0, "llama.cpp t + d draft-3-0": 60.0,
             "llama.cpp t + d draft-8-0.5": 96.0, "llama.cpp t ngram-mod": 81.0}
    contenders = {n: {"summary": {"tokens_per_s": r}, "identical": 1.0} for n, r in rates.items()}
    info = {"binary": "llama-server", "threads": 2, "plain": ["llama.cpp t"],
            "speculative": {"llama.cpp t": [n for n in rates if n.startswith("llama.cpp t ")]}}
    info["best"] = best_speculative(info, contenders)
    assert info["best"] == {"llama.cpp t": "llama.cpp t + d draft-8-0.5"}
    table = llama_cpp_lines({"llama_cpp": info, "contenders": contenders})
    assert "Best speculative setting: llama.cpp t: llama.cpp t + d draft-8-0.5." in table
    assert "| adaptive | 240.0 | 1.00 | 3.00× | 2.50× |" in table
    assert "| llama.cpp t ngram-mod | 81.0 | 1.00 | 1.01× | 0.84× |" in table


@pytest.mark.skipif(not os.environ.get("SPECRPC_LLAMA_SERVER"),
                    reason="SPECRPC_LLAMA_SERVER names no llama-server binary (none on CI)")
def test_the_built_llama_server_takes_every_flag_and_spec_type_of_the_sweep() -> None:
    help_text = subprocess.run([os.environ["SPECRPC_LLAMA_SERVER"], "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for flag in ("-md", "-td", "-tbd", "--spec-type", "--spec-draft-n-max", "--spec-draft-p-min", "--no-webui"):
        assert f"{flag}," in help_text or f"{flag} " in help_text, flag
    for kind in {s.kind for s in SWEEP}:
        assert kind in help_text, kind


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


def test_starts_mode_divides_each_modes_rate_at_a_requested_stream_interval_by_its_rate_at_the_servers() -> None:
    """`--starts N --stream-intervals 0,50`: per start and mode, the median rate of its requests asking for each
    interval ÷ its median at the server's own interval, one column per interval and mode."""
    from specrpc.bench.starts import MODES, against_server_interval, interval_name, markdown

    medians = {"adaptive": 600.0, "k=3": 500.0, "k=0": 250.0}
    medians |= {interval_name(m, 0): r * 0.9 for m, r in list(medians.items())}
    medians |= {interval_name(m, 50): r * 1.05 for m, r in list(medians.items()) if "@" not in m}
    ratios = against_server_interval(medians, (0, 50))
    assert set(ratios) == set(MODES) and interval_name("k=0", 0) == "k=0 @0 ms"
    assert all(ratios[m][0] == pytest.approx(0.9) and ratios[m][50] == pytest.approx(1.05) for m in MODES)
    spread = {name: {"min": 1.0, "median": 1.0, "max": 1.0} for name in MODES}
    start = {"median_tokens_per_s": medians, "ratio": 2.4, "intervals": ratios,
             "execution": {"target": "1: native, prefetch none", "draft": ""}}
    table = markdown({"pair": "Pair: `x`", "starts": [start], "spread": spread, "cases": 2, "threads": 2,
                      "dtype": "float32", "weights": "dtype"})
    assert "| start | adaptive @0 ms | k=3 @0 ms | k=0 @0 ms | adaptive @50 ms | k=3 @50 ms | k=0 @50 ms |" in table
    assert "| 1 | 0.900× | 0.900× | 0.900× | 1.050× | 1.050× | 1.050× |" in table
    from specrpc.cli import main as cli_main

    for argv in (["--stream-intervals", "0"], ["--starts", "1", "--stream-intervals", "fast"],
                 ["--starts", "1", "--stream-intervals", "1001"]):  # refused before any server starts
        with pytest.raises(SystemExit) as refused:
            cli_main(["bench", *argv])
        assert refused.value.code == 2, argv


def test_starts_mode_compares_each_start_with_llama_cpp_plain_and_its_best() -> None:
    """`--starts N --llama-server …`: per start, adaptive and k = 0 ÷ llama.cpp plain (the first peer), adaptive ÷
    the fastest of its settings in that start; identical where ours (stopping at end of text) starts its reply."""
    from specrpc.bench.starts import against_peers, markdown
    from specrpc.models import execution_line

    plain, draft8, ngram = "llama.cpp t", "llama.cpp t + d draft-8-0.5", "llama.cpp t ngram-mod"
    medians = {"adaptive": 600.0, "k=3": 500.0, "k=0": 250.0, plain: 200.0, draft8: 240.0, ngram: 210.0}
    tokens = {name: [[1, 2, 3], [4, 5]] for name in ("adaptive", "k=3", "k=0")}
    tokens |= {plain: [[1, 2, 3, 9], [4, 6]], draft8: [[1, 2, 3], [4, 5, 0]], ngram: [[1, 2], [4, 5]]}
    peer = against_peers(medians, tokens, [plain, draft8, ngram])
    assert (peer["plain"], peer["best"]) == (plain, draft8)
    assert peer["adaptive_vs_plain"] == pytest.approx(3.0) and peer["adaptive_vs_best"] == pytest.approx(2.5)
    assert peer["k0_vs_plain"] == pytest.approx(1.25)
    assert peer["identical"] == {plain: 0.5, draft8: 1.0, ngram: 0.5}
    paths = [("1", "native, prefetch none"), ("2+", "torch")]
    start = {"median_tokens_per_s": medians, "ratio": 2.4, "llama_cpp": peer,
             "execution": {"target": execution_line(paths), "draft": execution_line(paths[:1])}}
    spread = {name: {"min": 1.0, "median": 1.0, "max": 1.0} for name in ("adaptive", "k=3", "k=0")}
    table = markdown({"pair": "Pair: `x`", "starts": [start], "spread": spread, "cases": 2, "threads": 2,
                      "dtype": "float32", "weights": "dtype"})
    assert f"| 1 | 200.0 | 1.25× | 3.00× | 2.50× ({draft8}) | 0.50 |" in table
    assert "1. 1: native, prefetch none; 2+: torch / 1: native, prefetch none" in table  # the paths each start chose
