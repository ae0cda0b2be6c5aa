"""`make models` end to end on the tiny `smoke` plan: tokenizer, corpus (a fixed subset) and its manifest, joint and
draft-only phases on the mixed layouts, a stop and a resume from the checkpoint, the export that transformers and the
server load offline, and the model card."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import decode
from transformers import AutoModelForCausalLM, AutoTokenizer

from specrpc.config import Config, EngineConfig
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.sampling import SamplingParams
from specrpc.prompts.fim import InfillInput
from specrpc.serving.runtime import Runtime
from specrpc.training.tokenizer import SPECIAL_TOKENS
from specrpc.training.train import PLANS, fit_phase


def train(work: Path, out: Path, *extra: str) -> str:
    """One `python -m specrpc.training.train --plan smoke` run; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "specrpc.training.train", "--plan", "smoke", "--device", "cpu", "--threads", "1",
         "--checkpoint-every", "1", "--work-dir", str(work), "--out-dir", str(out), *extra],
        capture_output=True, text=True, timeout=600, check=True,
    )
    return done.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(out dir, output of a run stopped after 3 steps, output of the run resuming it)."""
    root = tmp_path_factory.mktemp("smoke")
    first = train(root / "work", root / "out", "--stop-after", "3")
    assert not (root / "out").exists(), "a stopped run exports nothing"
    second = train(root / "work", root / "out")
    return root / "out", first, second


def test_stops_and_resumes_from_the_checkpoint(trained: tuple[Path, str, str]) -> None:
    out, first, second = trained
    assert "stopped at step 3" in first
    assert "resumed at step 3" in second and "exported to" in second
    log = [json.loads(line) for line in (out.parent / "work" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(6)), "each step once across the two runs"


def test_export_loads_offline_with_fim_tokens(trained: tuple[Path, str, str]) -> None:
    out = trained[0]
    for name in ("target", "draft"):
        files = {p.name for p in (out / name).iterdir()}
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
        assert any(f.endswith(".safetensors") for f in files)
        tok = AutoTokenizer.from_pretrained(str(out / name), local_files_only=True)
        assert all(tok.convert_tokens_to_ids(t) != tok.unk_token_id for t in SPECIAL_TOKENS)
        model = AutoModelForCausalLM.from_pretrained(str(out / name), local_files_only=True)
        assert next(model.parameters()).dtype == torch.bfloat16
        config = json.loads((out / name / "tokenizer_config.json").read_text())
        assert config["fim"] == {"template": "specrpc", "orders": ["psm", "spm"]}
    training = json.loads((out / "training.json").read_text())
    assert training["plan"]["joint_steps"] + training["plan"]["draft_steps"] == 6
    assert training["layouts"] == ["plain", "psm", "spm", "repo"]


def test_the_manifest_comes_with_the_pair(trained: tuple[Path, str, str]) -> None:
    manifest = json.loads((trained[0] / "corpus.json").read_text())
    names = [s["name"] for s in manifest["sources"]]
    assert names[0] == "python-stdlib" and len(names) > 1
    for source in manifest["sources"]:
        assert set(source) == {"name", "version", "license", "files", "bytes", "tokens", "heldout_files"}
        assert source["files"] > 0 and source["tokens"] > source["files"] and source["license"]
    assert not {"networkx", "Jinja2", "fsspec"} & set(names), "evaluation packages stay out"
    assert manifest["totals"]["files"] == sum(s["files"] for s in manifest["sources"])


def test_the_server_runs_the_exported_pair(trained: tuple[Path, str, str]) -> None:
    out = trained[0]
    runtime = Runtime(Config(engine=EngineConfig(target=str(out / "target"), draft=str(out / "draft"),
                                                 max_sessions=1, max_context=128)))
    engine = runtime.engine
    tokens = decode(engine, engine.new_slot(0), GenerationRequest(runtime.encode("def f(x):"), 8,
                                                                  SamplingParams(temperature=0.0)))
    assert len(tokens) == 8
    assert runtime.fim is not None and runtime.fim.name == "specrpc"  # the export declares its FIM template
    assert runtime.infill_prompt(InfillInput("a", "b", path="x.py")).ids


def test_model_card_renders(trained: tuple[Path, str, str]) -> None:
    out = trained[0]
    subprocess.run([sys.executable, "-m", "specrpc.training.evaluate", "--assets", str(out), "--max-tokens", "600",
                    "--window", "128", "--fim-cases", "3"], capture_output=True, text=True, timeout=600, check=True)
    card = (out / "MODEL_CARD.md").read_text()
    results = json.loads((out / "model_card.json").read_text())["results"]
    assert results["stdlib_heldout"]["target_bits_per_byte"] > 0
    assert 0 <= results["stdlib_heldout"]["greedy_agreement"] <= 1
    assert "bits/byte" in card and "greedy agreement" in card
    assert {"third_party_networkx", "third_party_jinja2", "third_party_fsspec"} <= set(results)
    fim = json.loads((out / "model_card.json").read_text())["fim_next_line"]
    assert set(fim) == {"psm", "spm"}
    assert all(v["cases"] == 3 and 0 <= v["line_start"] <= 1 and 0 <= v["mid_line"] <= 1 for v in fim.values())
    assert "| python-stdlib |" in card and "| SPM | 3 |" in card and "suffix-prefix-middle" in card
    assert not re.search(r"/(?:root|work|home)/", card), "the card names a path of the training machine"


def test_a_warm_start_continues_the_pair_with_its_tokenizer(trained: tuple[Path, str, str], tmp_path: Path) -> None:
    """What the cpu plan does with the shipped pair, on the smoke pair: joint training from its weights."""
    out = trained[0]
    log = train(tmp_path / "work", tmp_path / "out", "--init-from", str(out), "--warm-start", "--stop-after", "1")
    assert "joint training" in log and "stopped at step 1" in log
    tokenizer = (tmp_path / "work" / "tokenizer" / "tokenizer.json").read_text()
    assert tokenizer == (out / "target" / "tokenizer.json").read_text(), "the pair's tokenizer, not a new one"
    first = json.loads((tmp_path / "work" / "train_log.jsonl").read_text().splitlines()[0])
    trained_log = (out.parent / "work" / "train_log.jsonl").read_text().splitlines()
    assert first["step"] == 0 and "target_loss" in first
    assert first["target_loss"] < json.loads(trained_log[0])["target_loss"], "starts from the trained weights"


def test_a_time_budget_cuts_the_phase_it_sizes_and_never_raises_it() -> None:
    plan = replace(PLANS["smoke"], joint_steps=100, draft_steps=100)
    joint = fit_phase(plan, True, budget_s=1.0, step=10, per_step_s=0.1)
    assert (joint.joint_steps, joint.draft_steps) == (10 + 9, 100)  # 3 % of the budget is kept for evaluations
    draft = fit_phase(joint, False, budget_s=2.0, step=25, per_step_s=0.1)
    assert (draft.joint_steps, draft.draft_steps) == (19, 25 + 20 - 19)
    assert fit_phase(plan, True, budget_s=1e6, step=10, per_step_s=0.1) == plan
    assert fit_phase(plan, False, budget_s=1e6, step=10, per_step_s=0.1) == plan
