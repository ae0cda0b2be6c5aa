"""CUDA paths: graph replay equals the eager forward, and speculation with graphs stays exact. Skipped without a GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import decode

import specrpc
from specrpc.bench.simulated import simulated_verifier
from specrpc.config import EngineConfig
from specrpc.engine.engine import Engine, Stall
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.sampling import SamplingParams
from specrpc.models import load_model, padded_sizes
from specrpc.models.llama import LlamaLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ASSETS = Path(specrpc.__file__).parent / "assets"
CUDA = torch.device("cuda")


def _pair(dtype: torch.dtype, graphs: bool) -> tuple[LlamaLM, LlamaLM]:
    """The shipped pair on CUDA; with `graphs` as the server loads it there (graphs, padded eager shapes, one-replay
    greedy draft loops)."""
    kw: dict[str, Any] = {"device": CUDA, "dtype": dtype, "num_slots": 2, "max_context": 400,
                          "graph_tokens": 9 if graphs else 0, "buckets": padded_sizes(9, 256) if graphs else ()}
    target = load_model(ASSETS / "target", **kw)
    draft = load_model(ASSETS / "draft", **kw, draft_loop_steps=7 if graphs else 0)
    assert isinstance(target, LlamaLM) and isinstance(draft, LlamaLM)
    assert (target.graphs is not None) == graphs
    return target, draft


def test_graph_replay_matches_eager_forward() -> None:
    graphed, _ = _pair(torch.float32, graphs=True)
    eager, _ = _pair(torch.float32, graphs=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, graphed.vocab_size, (240,), generator=g).to(CUDA)
    for lm in (graphed, eager):
        lm.forward(ids[:150], 0, 1, num_logits=1)  # prefill (eager in both)
    start = 150
    for width in (1, 3, 9, 1, 9, 2):  # every width twice at different positions: replays, not just captures
        for lm in (graphed, eager):
            lm.truncate(1, start)
        a = graphed.forward(ids[start : start + width], start, 1, num_logits=width)
        b = eager.forward(ids[start : start + width], start, 1, num_logits=width)
        assert a.shape == b.shape == (width, graphed.vocab_size)
        assert (a - b).abs().max().item() < 1e-3 * max(1.0, b.abs().max().item())
        start += max(1, width - 2)  # roll back part of the burst, like a rejection
    assert graphed.graphs is not None and len(graphed.graphs.graphs) == 2 * (2 * 9 - 1)  # captured at load
    for width in (20, 36):  # a draft catching up: graph-sized pieces, last logits only
        for lm in (graphed, eager):
            lm.truncate(1, start)
        assert graphed.graphs.covers(width, 1) and not graphed.graphs.covers(width, width)
        a = graphed.forward(ids[start : start + width], start, 1)
        b = eager.forward(ids[start : start + width], start, 1)
        assert (a - b).abs().max().item() < 1e-3 * max(1.0, b.abs().max().item())
        assert graphed.length(1) == eager.length(1) == start + width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_with_graphs_equals_target_only(dtype: torch.dtype) -> None:
    target, draft = _pair(dtype, graphs=True)
    engine = Engine(target, draft, replace(EngineConfig(), max_sessions=2, max_context=390))
    greedy = SamplingParams(temperature=0.0)
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef walk(path):\n", "class Stack:\n    def __init__(self):\n"]
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(ASSETS / "target"))
    mismatches = 0
    for text in prompts:
        prompt = tok(text)["input_ids"]
        outs = []
        for k in (0, 4, 8):
            outs.append(decode(engine, engine.new_slot(0), GenerationRequest(prompt, 64, greedy, num_draft_tokens=k)))
        mismatches += outs[1] != outs[0] or outs[2] != outs[0]
    # float32 must be exact; bf16 verify (k+1 rows) and decode (1 row) round differently, so near-ties may flip
    assert mismatches == 0 if dtype == torch.float32 else mismatches <= 1


@pytest.mark.parametrize("where", ["draft_s", "verify_s"])
def test_guard_both_ways_on_the_gpu(where: str) -> None:
    """With graphs and bf16, every draft accepted (simulated): a stall switches speculation off within a bounded
    number of steps, and it comes back once the stall is gone."""
    target, draft = _pair(torch.bfloat16, graphs=True)
    engine = Engine(target, draft, replace(EngineConfig(), max_sessions=2, max_context=390, proposer="draft"),
                    verifier=simulated_verifier(1.0, vocab=min(target.vocab_size, draft.vocab_size)))
    engine.calibrate()
    slot = engine.new_slot(0)
    policy = slot.policy
    policy.probe_every, policy.probe_k = 4, 4
    gen = engine.start(slot, GenerationRequest([1, 2, 3], 380, SamplingParams(temperature=0.0), proposer="draft"))
    engine.step_one(gen)
    engine.stall = Stall(**{where: 0.05})
    stalled = [engine.step_one(gen).proposed for _ in range(5 * policy.probe_every)]
    assert sum(k > 0 for k in stalled[-policy.probe_every :]) <= 1, stalled
    engine.stall = None
    after = [engine.step_one(gen).proposed for _ in range(5 * policy.probe_every)]
    assert sum(k > 0 for k in after[-2 * policy.probe_every :]) >= policy.probe_every, after


def test_draft_loop_replay_equals_step_by_step_and_padded_prefill_equals_exact() -> None:
    graphed_target, graphed = _pair(torch.float32, graphs=True)
    eager_target, eager = _pair(torch.float32, graphs=False)
    assert graphed.draft_loop is not None and len(graphed.draft_loop.graphs) == 2 * 7
    ids = torch.randint(0, graphed.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).to(CUDA)
    for lm in (graphed, eager):
        lm.forward(ids[:100], 0, 1)  # 100 tokens: padded to 128 on the graphed model
    a, b = graphed_target.forward(ids[:100], 0, 1), eager_target.forward(ids[:100], 0, 1)
    assert (a - b).abs().max().item() < 1e-3 * max(1.0, b.abs().max().item())
    last = eager.forward(ids[100:101], 100, 1)  # [1, V]
    first = last[0].argmax().view(1)
    graphed.forward(ids[100:101], 100, 1)
    assert graphed.greedy_draft(last, 101, 1, 1) is None, "k = 1 needs no forward: nothing to replay"
    for k in (2, 5, 8):
        for lm in (graphed, eager):
            lm.truncate(1, 101)
        looped = graphed.greedy_draft(last, 101, 1, k)
        expected = [first]
        for i in range(k - 1):
            expected.append(eager.forward(expected[-1], 101 + i, 1)[0].argmax().view(1))
        assert looped is not None and looped.tolist() == torch.cat(expected).tolist()
        assert graphed.length(1) == 101 + k - 1
