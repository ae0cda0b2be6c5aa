"""A client's prediction as a draft (OpenAI's Predicted Outputs): greedy output with a prediction is the target's
own, whether the prediction is the output or misses a line, adds one or changes one (the proposer re-aligns and
copies on); sampled output follows the target's distribution with the prediction as the draft; accepted and
rejected prediction tokens are counted as OpenAI counts them."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from test_engine import chi_square_pvalue, make_engine, sequence_probs, tiny_llama
from transformers import PreTrainedTokenizerBase

from specrpc.config import ASSETS, EngineConfig
from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest, GenerationStats
from specrpc.engine.plan import MAX_SUGGESTION_TOKENS, plan
from specrpc.engine.prediction import PredictionProposer
from specrpc.engine.sampling import SamplingParams, logits_to_probs, sample
from specrpc.engine.verify import VerifyResult
from specrpc.models import load_model, load_tokenizer

GREEDY = SamplingParams(temperature=0.0)
shipped = pytest.mark.skipif(not (ASSETS / "target" / "config.json").exists(), reason="default models not trained")


@cache
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(str(ASSETS / "target"))


def encode(text: str) -> list[int]:
    return list(tokenizer()(text, add_special_tokens=False).input_ids)


def decode_text(ids: list[int]) -> str:
    return str(tokenizer().decode(ids, clean_up_tokenization_spaces=False))


@cache
def shipped_engine() -> Engine:
    cpu = torch.device("cpu")
    target = load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=2, max_context=400)
    draft = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=2, max_context=400)
    return Engine(target, draft, EngineConfig(max_sessions=2, max_context=380, max_draft_tokens=4, prefill_chunk=128))


def generate(engine: Engine, prompt: list[int], n: int, k: int | None,
             prediction: PredictionProposer | None = None) -> tuple[list[int], GenerationStats]:
    """Every token of a greedy request on a fresh slot, and its figures (the prediction's counted)."""
    gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, n, GREEDY, k, prediction=prediction))
    out: list[int] = []
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    gen.count_prediction()
    return out, gen.stats


def edits(text: str) -> dict[str, str]:
    """`text` as predicted: itself, and with its third line deleted, a line inserted before it, and a line that
    mentions `self` changed."""
    lines = text.split("\n")
    changed = next(i for i, line in enumerate(lines) if i >= 2 and "self" in line)
    return {
        "same": text,
        "deleted": "\n".join(lines[:2] + lines[3:]),
        "inserted": "\n".join([*lines[:2], "    total = compute(values)", *lines[2:]]),
        "changed": "\n".join([*lines[:changed], lines[changed].replace("self", "this"), *lines[changed + 1 :]]),
    }


@shipped
@pytest.mark.parametrize("text", ["class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n"])
def test_greedy_output_with_a_prediction_is_the_targets_and_copies_past_edited_lines(text: str) -> None:
    """The native step verifies up to 64 tokens at fp32 and the torch forward longer spans (a whole span of
    MAX_SUGGESTION_TOKENS and the token before it); greedy output is the target-only output token for token either way
    (fp32: exact, not a near-tie mode), with the span the policy chooses and with whole spans of MAX_SUGGESTION_TOKENS.
    With those (a request's own k: no measured cost decides the span, so the step count is fixed), a prediction equal to
    the output commits 150 tokens in a few verify steps; one with a line deleted, inserted or changed still copies on
    after the edit (re-aligned), in far fewer steps than the 149 plain decoding takes."""
    engine = shipped_engine()
    prompt = list(tokenizer()(text).input_ids)
    plain, plain_stats = generate(engine, prompt, 150, 0)
    assert plain_stats.verify_steps == 149
    for name, predicted in edits(decode_text(plain)).items():
        ids = encode(predicted)
        out, stats = generate(engine, prompt, 150, None, PredictionProposer(ids, len(prompt), decode_text))
        assert out == plain, name
        assert stats.accepted_prediction_tokens >= len(ids) - 10, name  # all but the edited line's tokens
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == len(ids)
        out, stats = generate(engine, prompt, 150, MAX_SUGGESTION_TOKENS,
                              PredictionProposer(ids, len(prompt), decode_text))
        assert out == plain, name
        assert stats.verify_steps <= (8 if name == "same" else 20), (name, stats.verify_steps)


def test_prediction_tokens_are_counted_as_those_in_the_completion() -> None:
    """OpenAI's accepted / rejected prediction tokens: the prediction's tokens a diff matches in the completion,
    and the rest, however many verify attempts there were."""
    proposer = PredictionProposer([1, 2, 3, 4, 5, 6], 0, lambda ids: "".join(WORDS[i] for i in ids))
    assert proposer.count([1, 2, 9, 4, 5, 6, 7]) == (5, 1)
    assert proposer.count([]) == (0, 6)
    assert proposer.count([6, 5, 4, 3, 2, 1]) == (1, 5)


WORDS = [f"[token{i}]" for i in range(10)]  # 8 characters each: one token is a re-alignment anchor


def words(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    return tiny_llama(root / "target", seed=1), tiny_llama(root / "draft", seed=2, hidden=16, layers=1)


PREDICTED = [0, 1, 2, 3, 4, 5, 0, 2, 4]
"""Every token once, each followed by two others: after any first token the prediction re-aligns there and drafts
the two after it."""


def accept_every_draft(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                       params: SamplingParams, generator: torch.Generator | None) -> VerifyResult:
    """A wrong verifier (the negative control): every drafted token accepted, the bonus from the target."""
    k = draft_ids.shape[0]
    bonus = int(sample(logits_to_probs(target_logits[k:], params), generator)[0])
    return VerifyResult(k, [*draft_ids.tolist(), bonus], True)


def sampled_counts(engine: Engine, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple[int, ...], int]:
    """3-token continuations of n seeded runs, each verify step drafting k = 2 tokens of the prediction."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        prediction = PredictionProposer(PREDICTED, len(prompt), words)
        request = GenerationRequest(prompt, 4, replace(params, seed=i), 2, "draft", prediction=prediction)
        gen = engine.start(engine.new_slot(0), request)
        first = engine.step_one(gen)
        planned = plan(engine.drafting, gen, None)
        assert planned.proposal.source == "prediction" and len(planned.proposal) == 2, planned
        second = engine.step_one(gen)
        assert second.proposed == 2
        third = engine.step_one(gen).token_ids if not gen.finished else []
        seq = tuple((first.token_ids + second.token_ids + third)[:3])
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7-p0.9"])
def test_sampled_sequences_with_a_prediction_follow_the_target_distribution(pair: tuple[Path, Path],
                                                                           params: SamplingParams) -> None:
    """The prediction drafts k = 2 (forced) at the verify step after the first token, a point mass verified as
    prompt lookup's: 3-token continuations follow the target's exact probabilities (false alarm 1e-4). The
    negative control: with a verifier that accepts every drafted token, the same test fails."""
    prompt = [3, 1, 4]
    probs = sequence_probs(pair[0], prompt, 3, params)
    engine = make_engine(pair)
    n = 5000
    assert chi_square_pvalue(sampled_counts(engine, prompt, params, n), probs, n) > 1e-4
    engine.verifier = accept_every_draft
    n = 2000
    assert chi_square_pvalue(sampled_counts(engine, prompt, params, n), probs, n) < 1e-4
