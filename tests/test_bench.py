"""Smoke test of `specrpc bench` on two prompts: every contender runs, outputs are identical, files are written."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

import pytest

from specrpc.bench.run import main
from specrpc.config import ASSETS
from specrpc.models.backends.native import prefetch_settings
from specrpc.models.fingerprint import pair_hash

SHIPPED = pytest.mark.skipif(not (ASSETS / "target" / "config.json").exists(), reason="default models missing")


@SHIPPED
def test_bench_runs_every_contender_on_two_prompts(tmp_path: Path) -> None:
    assert main(["--cases", "1", "--workloads", "code,infill", "--max-new-tokens", "12", "--ks", "2",
                 "--concurrency", "1,2", "--sweep-rounds", "2", "--sweep-ks", "1", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    contenders = results["contenders"]
    expected = {"target-only", "adaptive", "adaptive draft only", "adaptive, draft on the whole context", "k=2",
                "prompt lookup only", "hf generate", "hf assisted"}
    assert expected <= set(contenders)
    for name in ("adaptive", "adaptive draft only", "adaptive, draft on the whole context", "k=2",
                 "prompt lookup only"):
        assert contenders[name]["identical"] == 1.0, name  # greedy: token-for-token the target-only output
    for name, entry in contenders.items():  # each request's figures beside the summary, one per case
        requests = entry["requests"]
        assert len(requests) == 2 and all(r["tokens"] > 0 and r["ttft_ms"] > 0 for r in requests), name
    assert all(r["mean_k"] == 0 and r["proposed"] == 0 for r in contenders["target-only"]["requests"])
    assert all(r["steps"] > 0 and 0 < r["mean_k"] <= 2 for r in contenders["k=2"]["requests"])  # 2, less near the end
    sweep = results["grpc"]["concurrency"]
    assert sweep["2:adaptive"]["aggregate_tokens_per_s"] > 0
    for mode, name, streams in itertools.product(("batched", "round-robin"), ("adaptive", "target-only"), (1, 2)):
        point = sweep[f"{streams}:{mode}:{name}"]  # batched against round-robin in one run (one stream's together)
        assert point["aggregate_tokens_per_s"] > 0 and point["per_stream_tokens_per_s"] > 0
        assert point["itl_p99_ms"] >= point["itl_p50_ms"] > 0 and point["bound_tokens_per_s"] > 0
    assert sweep["2:batched:target-only"]["mean_k"] == 0 and sweep["2:batched:adaptive"]["rounds"] == 2
    assert sweep["1:batched:target-only"]["paired_times_one_stream"] == 1.0  # each round's one stream ÷ itself
    assert sweep["2:batched:adaptive"]["paired_over_other_mode"] > 0  # batched ÷ round-robin, round by round
    assert sweep["2:batched:adaptive"]["paired_over_target_only"] > 0
    assert len(sweep["2:round-robin:target-only"]["round_tokens_per_s"]) == 2
    # steps that advanced both streams, timed against the bound's forward of 2 tokens; round-robin has none
    assert sweep["2:batched:target-only"]["full_step_share"] > 0
    assert sweep["2:round-robin:target-only"]["full_step_share"] == 0
    markdown = (tmp_path / "results.md").read_text()
    assert "| 2 | round-robin |" in markdown and "reached of the bound's ×" in markdown
    assert "a stream's prompts found cached from the rounds before" in markdown
    assert "the bound's forward ÷ target-only's full step" in markdown
    # each point says how much of its prompts it prefilled (a point that lost its cached prompts shows it)
    row = next(line for line in markdown.splitlines() if line.startswith("| 2 | batched |"))
    assert row.rstrip(" |").endswith(f"{sweep['2:batched:adaptive']['prefilled_share']:.0%} / "
                                     f"{sweep['2:batched:target-only']['prefilled_share']:.0%}")
    # a fixed k in the sweep too, each point against the default round by round
    fixed = sweep["2:batched:k=1"]
    assert fixed["aggregate_tokens_per_s"] > 0 and 0 < fixed["mean_k"] <= 1 and len(fixed["round_tokens_per_s"]) == 2
    assert "| 2 | batched | k=1 |" in markdown and "| 1 | round-robin | k=1 |" in markdown
    pair = pair_hash(str(ASSETS / "target"), str(ASSETS / "draft"))
    assert f"Pair: `{pair}` (target target, draft draft)" in markdown
    assert "batched ÷ round-robin, target-only" in markdown
    for chart in ("tokens_per_s.png", "accepted_length.png", "speedup_vs_k.png"):
        assert (tmp_path / chart).stat().st_size > 0
    assert "| adaptive |" in (tmp_path / "results.md").read_text()
    assert "llama.cpp: skipped" in results["llama_cpp"]["skipped"]  # no --llama-server: said, not run


@SHIPPED
def test_a_fresh_sweep_prefills_every_prompt_whole(tmp_path: Path) -> None:
    """`--sweep-fresh`: each request of the concurrency sweep opens with a line of its own, so the server finds none
    of its prompt cached (but a first token or two that another request's line shares) and prefills it whole, where
    the default sweep's requests find their prompts cached from the warm-up on."""
    assert main(["--cases", "1", "--workloads", "code", "--max-new-tokens", "4", "--ks", "2", "--no-hf",
                 "--concurrency", "1,2", "--sweep-rounds", "1", "--sweep-fresh", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["grpc"]["fresh"] is True
    for key, point in results["grpc"]["concurrency"].items():
        assert point["prefilled_share"] > 0.9, (key, point["prefilled_share"])
    assert "each request a prompt of its own, prefilled whole" in (tmp_path / "results.md").read_text()


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
    assert (tmp_path / "keystrokes.md").read_text().startswith("Pair: `")
    along = results["along"]["typed_line"]  # typing along the suggestion: each keystroke ran to its end
    assert along["lines"] == 1 and along["first_total_ms_median"] > 0
    strokes = along["keystrokes_detail"][0]
    assert 1 <= len(strokes) <= 4 and all(k["finish"] for k in strokes)
    for shown, typed in itertools.pairwise(strokes):  # each typed character was the one suggested
        assert shown["text"][:1] not in ("", "\n") and typed["prompt_tokens"] >= shown["prompt_tokens"]


def test_realistic_mode_reports_costs_and_simulated_speedups_at_scaled_shapes(tmp_path: Path) -> None:
    """`specrpc bench realistic --quick` on CPU: random-weight 7B/0.5B shapes divided by 32, simulated acceptance."""
    from specrpc.cli import main as cli_main

    assert cli_main(["bench", "realistic", "--quick", "--scale", "32", "--device", "cpu", "--threads", "1",
                     "--pair", "qwen2.5-coder-7b/0.5b", "--alphas", "0.8", "--ks", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "realistic.json").read_text())
    r = results["pairs"]["qwen2.5-coder-7b/0.5b"]
    assert r["c"] > 0 and list(r["V"]) == [str(k) for k in range(1, 9)]
    rows = r["alphas"]["0.8"]
    assert set(rows) == {"adaptive", "k=2"} and rows["k=2"]["bound"] > 0 and rows["k=2"]["mean_k"] > 0
    assert "measured costs, simulated acceptance" in (tmp_path / "realistic.md").read_text()


def test_a_requests_figures_rate_its_decode_and_nothing_without_two_tokens() -> None:
    """`request_figures`' tokens/s is the tokens after the first ÷ the time after the first, as every other rate of
    the bench (`decode_rate`); a request that made no token or one has none, never a negative one."""
    from specrpc.bench.contenders import Run
    from specrpc.bench.run import request_figures

    assert request_figures(Run([1, 2, 3, 4, 5], ttft_s=0.1, total_s=0.5))["tokens_per_s"] == pytest.approx(10.0)
    assert request_figures(Run([], ttft_s=0.1, total_s=0.3))["tokens_per_s"] == 0.0
    assert request_figures(Run([7], ttft_s=0.1, total_s=0.3))["tokens_per_s"] == 0.0


def test_the_concurrency_bound_counts_each_prompts_prefill_riding_along_the_other_streams() -> None:
    """The sweep's bound (`bound_tokens_per_s`) for a point's work: every token after a request's first at `streams`
    a forward of `streams` tokens, and each prompt's uncached tokens in chunks, a chunk costing what it adds to the
    other streams' forward (at one stream, the whole forward); a prompt found cached costs nothing."""
    from specrpc.bench.contenders import Run
    from specrpc.bench.run import bound_tokens_per_s
    from specrpc.engine.policy import BatchCosts

    costs = BatchCosts(target_s={1: 0.002, 3: 0.0028, 4: 0.003, 36: 0.005, 39: 0.0052, 64: 0.0075, 67: 0.0078})
    runs = [Run([1] * 11, ttft_s=0.1, total_s=0.5, prefilled=100) for _ in range(4)]  # chunks of 64 and 36
    along = (0.0078 - 0.0028) + (0.0052 - 0.0028)  # each chunk beside the other three streams' tokens
    assert bound_tokens_per_s(runs, 4, costs, 64) == pytest.approx(44 / (40 / 4 * 0.003 + 4 * along))
    assert bound_tokens_per_s(runs[:1], 1, costs, 64) == pytest.approx(11 / (10 * 0.002 + 0.0075 + 0.005))
    cached = [Run([1] * 11, ttft_s=0.1, total_s=0.5) for _ in range(4)]
    assert bound_tokens_per_s(cached, 4, costs, 64) == pytest.approx(44 / (40 / 4 * 0.003))
    assert bound_tokens_per_s(cached, 4, BatchCosts(), 64) == 0.0


def test_simulated_verifier_accepts_until_the_first_rejection() -> None:
    import torch

    from specrpc.bench.simulated import simulated_verifier
    from specrpc.engine.sampling import SamplingParams

    logits = torch.zeros(5, 10)
    logits[:, 7] = 1.0  # the target's argmax is 7 everywhere
    drafts = torch.tensor([1, 2, 3, 4])
    all_in = simulated_verifier(1.0)(drafts, None, logits, SamplingParams(temperature=0.0), None)
    assert all_in.accepted == 4 and all_in.tokens == [1, 2, 3, 4, 7] and all_in.bonus
    none_in = simulated_verifier(0.0)(drafts, None, logits, SamplingParams(temperature=0.0), None)
    assert none_in.accepted == 0 and none_in.tokens == [7]
    counts = [simulated_verifier(0.5, seed)(drafts, None, logits, SamplingParams(temperature=0.0), None).accepted
              for seed in range(400)]
    assert 0.35 < sum(c >= 1 for c in counts) / 400 < 0.65 and sum(c >= 2 for c in counts) < sum(c >= 1 for c in counts)


def test_random_checkpoint_of_a_published_shape_loads_in_transformers_and_matches_the_lean_forward(
        tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from specrpc.bench.families import config
    from specrpc.models import load_model
    from specrpc.models.random_weights import random_lm, write_checkpoint

    for name in ("qwen2.5-coder-1.5b", "llama-3.2-1b"):
        cfg = config(name, 32)
        path = write_checkpoint(cfg, tmp_path / name, seed=1, dtype=torch.float32)
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        cpu = torch.device("cpu")
        loaded = load_model(path, device=cpu, dtype=torch.float32, num_slots=1, max_context=32)
        built = random_lm(cfg, name, seed=1, num_slots=1, max_context=32, device=cpu, dtype=torch.float32)
        ids = torch.randint(0, cfg["vocab_size"], (12,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(ids[None]).logits[0]
        assert torch.equal(loaded.forward(ids, 0, 0, num_logits=12), built.forward(ids, 0, 0, num_logits=12))
        assert (built.forward(ids, 0, 0, num_logits=12) - ref).abs().max().item() < 1e-4


def test_random_checkpoint_can_carry_a_byte_level_tokenizer_for_gguf_converters(tmp_path: Path) -> None:
    """`--write-checkpoint … --tokenizer`: a byte-level BPE with GPT-2's pre-tokenizer within the family's vocabulary
    (what llama.cpp's converter needs); any text round-trips."""
    from transformers import AutoTokenizer

    from specrpc.cli import main as cli_main

    assert cli_main(["bench", "realistic", "--write-checkpoint", str(tmp_path), "--model", "qwen2.5-coder-0.5b",
                     "--scale", "32", "--tokenizer"]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["model"]["type"] == "BPE" and spec["model"]["merges"]
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "def f(x):\n    return x  # é ✓"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < cfg["vocab_size"] and len(tok) <= cfg["vocab_size"]


def test_given_rows_are_built_as_the_issue_describes() -> None:
    """rewrite: the prompt ends with the changed region, `# The same code again:` and its first line; the
    prediction is the unchanged rest, one line apart from the changed rest. repeated: distinct prompts, five tools."""
    from specrpc.bench.given import AGAIN, repeated_cases, rewrite_cases
    from specrpc.bench.workloads import heldout_files

    cases = rewrite_cases(heldout_files(), 3, random.Random(0))
    assert len(cases) == 3
    for case in cases:
        head, first = case.prompt.rsplit(AGAIN, 1)
        changed = head[head.rindex(first):] if first else head
        region = first + case.prediction
        assert 20 <= region.count("\n") + 1 <= 61
        differing = [(a, b) for a, b in zip(changed.split("\n"), region.split("\n"), strict=True) if a != b]
        assert len(differing) == 1 and "_new" in differing[0][0], differing
    repeated = repeated_cases(10, random.Random(0))
    assert len({c.prompt for c in repeated}) == 10 and len({c.name.split(":")[0] for c in repeated}) == 5


@SHIPPED
def test_given_bench_runs_every_row(tmp_path: Path) -> None:
    from specrpc.bench.given import ROWS
    from specrpc.bench.given import main as given_main

    assert given_main(["--cases", "1", "--repeated", "2", "--warmup", "1", "--max-new-tokens", "8", "--threads", "1",
                       "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "given.json").read_text())
    for row, contenders in ROWS.items():
        figures = results["rows"][row]
        assert {c.name for c in contenders} <= set(figures) and "ratio" in figures["goal"]
        for c in contenders:
            assert figures[c.name]["identical"] == 1.0, (row, c.name)  # greedy: target-only's tokens
    assert "Goal: prompt lookup + suffix" in (tmp_path / "given.md").read_text()


def test_ties_bench_counts_divergences_and_deterministic_has_none(tmp_path: Path) -> None:
    """`specrpc bench ties` at tiny settings, on a tiny random pair with the shipped tokenizer and prompts cut from
    this package's files (loading the shipped pair and the held-out split takes longer than the rest): every
    contender of both modes is counted against its mode's target-only, each divergence carries its position and the
    target's top-2 gap, and --deterministic diverges nowhere (the exit status says so too)."""
    import shutil

    from engine_helpers import requires_native
    from test_engine import tiny_llama

    from specrpc.bench import ties

    requires_native()
    pair = []
    for name, seed, hidden in (("target", 1, 64), ("draft", 2, 32)):
        path = tiny_llama(tmp_path / name, seed=seed, hidden=hidden, vocab=8192, positions=2048)
        for spec in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(ASSETS / "target" / spec, path / spec)
        pair.append(str(path))
    files = [str(Path(ties.__file__)), str(Path(ties.__file__).with_name("given.py"))]
    out = tmp_path / "out"
    assert ties.main(["--target", pair[0], "--draft", pair[1], "--files", *files, "--cases", "1", "--workloads",
                      "code,text", "--ks", "5", "--streams", "2", "--max-new-tokens", "12", "--threads", "1",
                      "--calibration-s", "0.1", "--out", str(out)]) == 0
    results = json.loads((out / "ties.json").read_text())
    expected = {"adaptive", "k=5", "2 streams, target-only", "2 streams, adaptive"}
    for mode in ("default", "deterministic"):
        rows = results["modes"][mode]
        assert set(rows) == expected, mode
        for row in rows.values():
            assert row["streams"] == 2 and row["identical"] + row["diverged"] == 2
        found = results["divergences"][mode]
        assert len(found) == sum(r["diverged"] for r in rows.values())
        assert all(d["position"] >= 0 and (d["gap"] is None or d["gap"] >= 0) for d in found)
    assert not results["divergences"]["deterministic"]
    assert results["speed"]["deterministic_tokens_per_s"] > 0 and results["speed"]["ratio"] > 0
    table = (out / "ties.md").read_text()
    assert "| deterministic | 2 streams, adaptive | 2 | 2 | 0 | 0 | - |" in table
    assert "--deterministic, adaptive on one stream" in table
    # a divergence's report: its first differing position and the target's top-2 logit gap there
    rt = ties.load(argparse.Namespace(target=pair[0], draft=pair[1], streams=1, threads=1, calibration_s=0.1), False)
    prompt = rt.encode("def f(x):\n")
    reference = ties.run_together(rt, [ties.request(rt, prompt, 6, 0)])[0]
    assert len(reference) >= 3 and ties.divergence(rt, "c", "k=5", prompt, reference, reference) is None
    other = [*reference[:2], (reference[2] + 1) % 8192]
    d = ties.divergence(rt, "c", "k=5", prompt, reference, other)
    assert d is not None and (d.position, d.reference, d.token) == (2, reference[2], other[2])
    assert d.gap is not None and d.gap > 0  # the reference token is the target's most likely one there
    shorter = ties.divergence(rt, "c", "k=5", prompt, reference, reference[:2])
    assert shorter is not None and shorter.position == 2 and shorter.gap is None


@SHIPPED
def test_controls_bench_runs_every_row(tmp_path: Path) -> None:
    """Both rows with their four contenders, each identical to target-only under the same controls; the control's
    own work counted inside the runs (nothing without it); the k = 8 costs measured at the positions asked for."""
    from specrpc.bench.controls import contenders
    from specrpc.bench.controls import main as controls_main

    assert controls_main(["--cases", "1", "--rounds", "1", "--max-new-tokens", "12", "--cost-positions", "2",
                          "--threads", "1", "--no-native-decode", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "controls.json").read_text())
    for row in ("json", "penalty"):
        figures = results["rows"][row]
        assert {c.name for c in contenders(row)} <= set(figures) and figures["goal"]["ratio"] > 0
        for c in contenders(row):
            assert figures[c.name]["identical"] == 1.0, (row, c.name)  # greedy: target-only's tokens
            assert (figures[c.name]["control_share"] > 0) == c.controlled, (row, c.name)
    assert results["samples"]["json"]["target-only + json"].startswith("{")  # the schema's object, from its start
    costs = results["costs"]
    assert costs["positions"] == {"mask": 2, "transform": 2} and costs["step_ms"] > 0
    assert costs["mask"]["ms"] > 0 and costs["transform"]["along_ms"] > 0
    text = (tmp_path / "controls.md").read_text()
    assert "Goal: speed-up with json" in text and "Goal: speed-up with penalty" in text and "costs at k = 8" in text


def test_floor_bench_reports_every_path_at_every_shape_beside_the_read_bandwidth(tmp_path: Path) -> None:
    """`specrpc bench floor` at tiny settings on a tiny random pair: the read bandwidth (by the native reader where the
    library builds) of each cache level found, of memory and of each model's weight bytes; per model and precision
    every path (the native step in each prefetch mode where it builds, the torch forward) at every shape, MKL's
    one-row product at one token only, with positive times and rates; int8 reads about a quarter of float32's bytes;
    the multiply rate of the float products' instruction (and VNNI's where the build has it); each model's floor at
    each one-stream shape is the larger of its fastest path's bytes ÷ the rate of its own buffer of those bytes and
    its multiply-adds (tokens × the model's projections' N × K) ÷ its instruction's rate, names the level holding
    the bytes, and is said in one-token steps. `--help` measures nothing."""
    from test_engine import VOCAB, tiny_llama

    from specrpc import native
    from specrpc.bench import floor
    from specrpc.cli import main as cli_main

    with pytest.raises(SystemExit) as help_exit:
        cli_main(["bench", "floor", "--help"])
    assert help_exit.value.code == 0
    assert floor.parse_size("2048K") == 2 << 20 and floor.parse_size("260M") == 260 << 20
    assert floor.count_cpus("0-1,4\n") == 3
    target = tiny_llama(tmp_path / "target", seed=1, hidden=64)
    draft = tiny_llama(tmp_path / "draft", seed=2, hidden=32)
    out = tmp_path / "out"
    assert floor.main(["--target", str(target), "--draft", str(draft), "--weights", "dtype,int8", "--threads", "1",
                       "--tokens", "1,3", "--batched", "2x2", "--repeats", "2", "--memory-mib", "8",
                       "--out", str(out)]) == 0
    results = json.loads((out / "floor.json").read_text())
    levels = [f"L{c['level']}" for c in results["caches"]]
    own = ["draft float32 + int8 copies weights", "target float32 weights", "draft int8 weights", "target int8 weights"]
    assert [b["buffer"] for b in results["bandwidth"]] == [*levels, "memory", *own]
    assert all(b["gb_s"] > 0 and b["bytes"] > 0 for b in results["bandwidth"])
    built = native.library() is not None
    assert results["reader"] == ("native" if built else "torch")
    rows = {b["buffer"]: b for b in results["bandwidth"]}
    assert results["shapes"] == ["1", "3", "2×2"]
    assert [(m["model"], m["weights"]) for m in results["models"]] == [
        ("draft", "float32 + int8 copies"), ("target", "float32"), ("draft", "int8"), ("target", "int8")]
    for m in results["models"]:
        names = set(m["paths"])
        assert (m["native"] == "on") == built, m
        native_paths = {n for n in names if n.startswith("native")}
        assert len(native_paths) == (len(prefetch_settings()) if built else 0), names  # each mode and distance
        for name, cells in m["paths"].items():
            assert set(cells) == ({"1"} if name == "torch, MKL one-row" else {"1", "3", "2×2"}), (m["model"], name)
            assert all(c["ms"] > 0 and c["gb_s"] > 0 and c["bytes"] > 0 for c in cells.values())
        assert [f["shape"] for f in m["floors"]] == ["1", "3"]
        row = rows[f"{m['model']} {m['weights']} weights"]
        h = 64 if m["model"] == "target" else 32  # tiny_llama: 2 layers of qkv 2h × h, o h × h, gate and up 4h × h,
        assert m["multiply_adds"] == 2 * 9 * h * h + VOCAB * h  # down h × 2h; the head vocab × h
        step = min(c["1"]["ms"] for c in m["paths"].values())
        for f in m["floors"]:
            assert f["held_by"] in [*levels, "memory"] and f["path"] in names and f["buffer"] == row["buffer"]
            assert f["gb_s"] == row["gb_s"] and f["read_floor_ms"] == pytest.approx(f["bytes"] / f["gb_s"] / 1e6)
            assert f["bytes"] == m["paths"][f["path"]][f["shape"]]["bytes"]
            kind = m["multiplies"][f["path"]]
            if kind in results["multiply"]:
                assert f["multiply_floor_ms"] == pytest.approx(
                    f["tokens"] * m["multiply_adds"] / results["multiply"][kind] / 1e6)
            else:
                assert f["multiply_floor_ms"] is None
            assert f["floor_ms"] == max(f["read_floor_ms"], f["multiply_floor_ms"] or 0.0) > 0
            assert f["floor_steps"] == pytest.approx(f["floor_ms"] / step) and f["steps"] == pytest.approx(
                f["ms"] / step)
        assert m["floors"][0]["bytes"] == m["paths"][m["floors"][0]["path"]]["1"]["bytes"]
    assert set(results["multiply"]) == ({"float", "int8"} if built and native.library().specrpc_int8_group() > 1
                                        else {"float"} if built else set())
    assert all(r > 0 for r in results["multiply"].values())
    by = {(m["model"], m["weights"]): m["paths"] for m in results["models"]}
    float_bytes = by["target", "float32"]["torch, oneDNN"]["3"]["bytes"]
    int8_bytes = by["target", "int8"]["torch int8"]["3"]["bytes"]
    assert float_bytes / 4 <= int8_bytes < float_bytes / 3  # int8 weights and their bf16 row scales
    table = (out / "floor.md").read_text()
    assert "| model | weights | path | MB a step | 1 | 3 | 2×2 |" in table and "| buffer | size | GB/s |" in table
    assert "× floor" in table and "GB/s of its bytes" in table and results["machine"] in table
    assert "| instruction | GMAC/s |" in table and "multiply floor ms" in table and "floor ÷ step" in table
    if "int8" in results["multiply"]:  # named as this build multiplies (AVX-512 VNNI, AVX2, AVX-VNNI)
        assert f"int8 products' integer multiply-adds ({floor.INT8_DOTS[results['int8_dot']]})" in table
    assert floor.READERS[results["reader"]] in table
    for m in results["models"]:  # where the fastest native path's one-stream forwards spend their time
        if not built:
            assert m["parts"] == {}
            continue
        assert m["parts"]["path"].startswith("native") and set(m["parts"]["shapes"]) == {"1", "3"}
        for p in m["parts"]["shapes"].values():
            assert p["ms"] > 0 and all(p[f"{name} ms"] > 0 for name in floor.PARTS)
            assert p["products_ms"] == pytest.approx(p["ms"] - p["without products ms"])
            assert p["attention_ms"] == pytest.approx(p["ms"] - p["without attention ms"])
            assert p["rest_ms"] == p["without either ms"]
    assert ("| model | weights | path | tokens | ms | products ms | attention ms | rest ms |" in table) == built
