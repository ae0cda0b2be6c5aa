"""The per-position logits transform (specrpc/engine/logits_transform.py) is exact under speculation: its k+1 rows
along a drafted path equal a from-scratch count at each position and the draft's running cursor; greedy output with
every transform equals target-only decoding and a reference built on Hugging Face's model, alone and in a batch;
sampled output under each transform with forced k = 4 speculation follows the transformed target distribution (χ²,
with a negative control against the untransformed target that fails)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import decode, decode_together, requires_native
from test_engine import VOCAB, chi_square_pvalue, make_engine, tiny_llama
from transformers import LlamaForCausalLM

from specrpc import native
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.logits_transform import LogitsTransform
from specrpc.engine.sampling import SamplingParams, logits_to_probs

END = 0
"""The tiny models' end-of-text token in these tests."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    return tiny_llama(root / "target", seed=1), tiny_llama(root / "draft", seed=2, hidden=16, layers=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> object:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def reference(logits: torch.Tensor, params: SamplingParams, context: list[int], prompt_len: int,
              ends: set[int]) -> torch.Tensor:
    """The transform at one position, written out token by token from a fresh count of the window: logits [V]."""
    out = logits.float().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    last_n = params.penalty_last_n
    start = prompt_len if last_n == 0 else (0 if last_n < 0 else max(0, len(context) - last_n))
    for token, count in Counter(context[start:]).items():
        if params.repetition_penalty != 1.0:
            out[token] = (out[token] / params.repetition_penalty if out[token] > 0
                          else out[token] * params.repetition_penalty)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    if params.ignore_eos or len(context) - prompt_len < params.min_tokens:
        for token in ends:
            out[token] = float("-inf")
    return out


CASES = {
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    "presence-frequency-last2": SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6,
                                               penalty_last_n=2),
    "bias-min_p": SamplingParams(temperature=0.8, logit_bias=((2, 1.5), (5, -2.0)), min_p=0.15, min_keep=2),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=3),
    "ignore_eos-repetition-all": SamplingParams(temperature=1.0, ignore_eos=True, repetition_penalty=0.7,
                                                penalty_last_n=-1),
}


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("last_n", [0, 1, 2, 3, -1])
def test_rows_along_a_path_equal_a_fresh_count_and_the_drafts_cursor(last_n: int, path: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of `along` (built at once) equals the reference at that position and, bit for bit, the cursor's
    row as the draft walks the path; windows shorter than the path let drafted tokens slide out too. Through the
    native pass, and through the torch ops that serve without a compiler."""
    if path == "native":
        requires_native()
    else:
        monkeypatch.setattr(native, "library", lambda: None)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                            penalty_last_n=last_n, logit_bias=((1, 2.0),), min_tokens=6)
    gen = torch.Generator().manual_seed(0)
    vocab, prompt = 7, [1, 2, 2, 3]
    transform = LogitsTransform(params, {END}, len(prompt))
    context = list(prompt)
    for step in range(4):  # the committed window is kept up to date from step to step
        drafted = torch.randint(0, vocab, (5,), generator=gen).tolist()
        logits = torch.randn(len(drafted) + 1, vocab, generator=gen)  # [k+1, V]
        rows = transform.along(logits, context, drafted)  # [k+1, V]
        cursor = transform.cursor(context, vocab, torch.device("cpu"))
        for i in range(len(drafted) + 1):
            expected = reference(logits[i], params, context + drafted[:i], len(prompt), {END})
            assert torch.allclose(rows[i], expected, atol=1e-6, rtol=0), (step, i)  # float32 rounding apart
            assert torch.equal(cursor.apply(logits[i : i + 1])[0], rows[i]), (step, i)
            if i < len(drafted):
                cursor.advance(torch.tensor([drafted[i]]))
        context += drafted[: step + 1]


@pytest.mark.parametrize("last_n", [0, 3, -1])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_native_pass_gives_the_torch_paths_bits(last_n: int, ignore_eos: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With every control on (the three penalties over windows the path slides through, logit_bias on counted and
    end-of-text ids, min_tokens or ignore_eos, min_p with min_keep), the native pass's rows along a k = 8 path and
    its cursor's rows, and the distributions sampled from them, are the torch path's bit for bit: random logits
    (some -inf, as a grammar's mask leaves them) over 300 tokens, the path drawing from 20 so tokens repeat."""
    requires_native()
    params = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.45, frequency_penalty=-0.3,
                            penalty_last_n=last_n, logit_bias=((1, 2.0), (5, -1.5), (7, 0.3), (299, 4.0)),
                            min_tokens=6, ignore_eos=ignore_eos, min_p=0.1, min_keep=3)
    gen = torch.Generator().manual_seed(last_n + 10 * ignore_eos)
    vocab, ends, prompt = 300, {END, 5}, torch.randint(0, 20, (7,), generator=gen).tolist()
    fast, slow = LogitsTransform(params, ends, len(prompt)), LogitsTransform(params, ends, len(prompt))
    context = list(prompt)
    for step in range(5):
        drafted = torch.randint(0, 20, (8,), generator=gen).tolist()
        logits = torch.randn(len(drafted) + 1, vocab, generator=gen) * 3  # [k+1, V]
        logits[:, 250:] = float("-inf")
        rows = fast.along(logits, context, drafted)  # [k+1, V]
        cursors = [fast.cursor(context, vocab, torch.device("cpu"))]
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)  # as without a compiler: the torch path
            expected = slow.along(logits, context, drafted)  # [k+1, V]
            expected_probs = logits_to_probs(expected, params)  # [k+1, V]
            cursors.append(slow.cursor(context, vocab, torch.device("cpu")))
        assert torch.equal(rows.view(torch.int32), expected.view(torch.int32)), step
        assert torch.equal(logits_to_probs(rows, params).view(torch.int32), expected_probs.view(torch.int32)), step
        for i in range(len(drafted) + 1):
            for cursor in cursors:  # the native one, then the torch one (whose counts live in the cursor)
                assert torch.equal(cursor.apply(logits[i : i + 1])[0].view(torch.int32), rows[i].view(torch.int32))
                if i < len(drafted):
                    cursor.advance(torch.tensor([drafted[i]]))
        assert not torch.equal(rows[:, :250], logits[:, :250]), "the controls change the logits"
        context += drafted[: step + 2]


def reference_greedy(path: Path, prompt: list[int], params: SamplingParams, ends: set[int], n: int) -> list[int]:
    """Target-only greedy decoding with the reference transform on Hugging Face's model."""
    hf = LlamaForCausalLM.from_pretrained(str(path)).eval()
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]  # [V]
            out.append(int(reference(logits, params, prompt + out, len(prompt), ends).argmax()))
            if out[-1] in ends:
                break
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_each_transform_equals_target_only_and_the_reference(pair: tuple[Path, Path], case: str) -> None:
    params = replace(CASES[case], temperature=0.0)
    engine = make_engine(pair)
    changed = False
    for prompt in ([3, 1, 4], [2, 2, 5, 1]):
        request = GenerationRequest(prompt, 24, params, num_draft_tokens=0, stop_token_ids=frozenset({END}))
        plain = decode(engine, engine.new_slot(0), request)
        untransformed = decode(engine, engine.new_slot(0), replace(request, sampling=SamplingParams(temperature=0)))
        changed |= plain != untransformed
        assert plain == reference_greedy(pair[0], prompt, params, {END}, 24)
        for k, proposer in [(1, "draft"), (4, "draft"), (8, "draft"), (4, "lookup"), (4, "combined")]:
            spec = decode(engine, engine.new_slot(0), replace(request, num_draft_tokens=k, proposer=proposer))
            assert spec == plain, (k, proposer)
    assert changed, "the transform changes the greedy output of one of the prompts at least"


@pytest.mark.parametrize("case", list(CASES))
def test_a_greedy_draft_under_a_transform_is_one_native_call_with_the_cursors_tokens(
        pair: tuple[Path, Path], case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy drafting under a transform runs the catch-up and the k drafts in one native call, each draft the
    argmax of the logits transformed at its position (`LogitsTransform.greedy_draft`), the tokens the step-by-step
    cursor drafts; a last-N window that would slide over the drafts is left to the cursor."""
    requires_native()
    params = replace(CASES[case], temperature=0.0)
    engine = make_engine(pair)
    assert engine.drafter is not None and engine.draft is not None
    draft = engine.draft
    fused_calls: list[bool] = []
    feed_greedy = draft.feed_greedy  # type: ignore[attr-defined]

    def counted(*args: object) -> object:
        fused_calls.append(args[-1] is not None)
        return feed_greedy(*args)

    monkeypatch.setattr(draft, "feed_greedy", counted)
    prompt = [3, 1, 4, 1, 5, 2]
    for k in (1, 4, 8):
        for cut in range(3, len(prompt) + 1):
            context = prompt[:cut]
            transform = LogitsTransform(params, {END}, 2)
            drafts = []
            for fused in (True, False):
                fused_calls.clear()
                draft.truncate(0, 0)
                with monkeypatch.context() as m:
                    if not fused:
                        m.setattr(LogitsTransform, "greedy_draft", lambda *a: None)
                    drafts.append(engine.drafter.propose(context, 0, k, params, None, None, transform).token_ids)
                if fused:
                    slides = transform.window_start(len(context) + k - 1) > len(context)
                    assert fused_calls == ([] if slides else [True]), (k, cut)
            assert drafts[0] == drafts[1], (k, cut)


def test_transformed_streams_in_a_batch_equal_their_solo_runs(pair: tuple[Path, Path]) -> None:
    """Each row of a batched draft and verify carries its own stream's transform."""
    engine = make_engine(pair, slots=3)
    stops = frozenset({END})
    requests = [GenerationRequest([1, 2, 3], 16, replace(CASES["repetition"], temperature=0.0), 4, "draft",
                                  stop_token_ids=stops),
                GenerationRequest([3, 1, 4], 16, SamplingParams(temperature=0.0), 3, "draft"),
                GenerationRequest([2, 2], 16, replace(CASES["presence-frequency-last2"], seed=5), 5, "draft",
                                  stop_token_ids=stops)]
    solo = [decode(engine, engine.new_slot(0), r) for r in requests]
    together, _ = decode_together(engine, [(engine.new_slot(i), r, 0) for i, r in enumerate(requests)])
    assert together == solo


def transformed_sequence_probs(path: Path, prompt: list[int], params: SamplingParams, length: int,
                               transformed: bool) -> dict[tuple[int, ...], float]:
    """Exact probability of every `length`-token continuation under the target with `params`, through the
    reference transform (`transformed`) or without it (the negative control)."""
    hf = LlamaForCausalLM.from_pretrained(str(path)).eval()
    probs: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=length):
            logits = hf(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1]  # [length, V]
            if transformed:
                logits = torch.stack([reference(logits[i], params, prompt + list(seq[:i]), len(prompt), {END})
                                      for i in range(length)])  # [length, V]
            p = logits_to_probs(logits, params)  # [length, V]
            probs[seq] = float(torch.prod(p[torch.arange(length), torch.tensor(seq)]))
    return probs


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_under_each_transform_follows_the_transformed_target(pair: tuple[Path, Path], case: str) -> None:
    """4-token continuations (1296 cells) sampled with forced k = 4 speculation: the first token from the prefill,
    the next four drafted under the transform and verified in one step, each position with its own counts. They
    follow the transformed target (p > 1e-4) and not the untransformed one (p < 1e-4), so the test can fail."""
    params = CASES[case]
    engine = make_engine(pair)
    prompt = [3, 1, 4]
    n = 3000
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, 6, replace(params, seed=i), 4, "draft",
                                                                 stop_token_ids=frozenset({END})))
        first = engine.step_one(gen)
        tokens = list(first.token_ids)
        if not gen.finished:  # (the first token may end the text)
            verify = engine.step_one(gen)
            assert verify.proposed == 4, "the verify step after the first token drafts k = 4"
            tokens += verify.token_ids
        while len(tokens) < 4 and not gen.finished:
            tokens += engine.step_one(gen).token_ids
        counts[tuple(tokens[:4])] = counts.get(tuple(tokens[:4]), 0) + 1
    exact = transformed_sequence_probs(pair[0], prompt, params, 4, transformed=True)
    if params.min_tokens or params.ignore_eos:  # no run ends early: the first 3 tokens cannot end the text
        assert all(len(s) == 4 for s in counts)
    else:  # runs ending at END early are cut short: count them as their prefix's mass
        exact = shorter(exact, counts)
    assert chi_square_pvalue(counts, exact, n) > 1e-4
    control = transformed_sequence_probs(pair[0], prompt, params, 4, transformed=False)
    assert chi_square_pvalue(counts, shorter(control, counts), n) < 1e-4


def shorter(probs: dict[tuple[int, ...], float], counts: dict[tuple[int, ...], int]) -> dict[tuple[int, ...], float]:
    """`probs` with the sequences that end at END before their last token merged into their prefix (generation
    stops there), matching how `counts` records them."""
    merged: dict[tuple[int, ...], float] = {}
    for seq, p in probs.items():
        cut = next((i + 1 for i, t in enumerate(seq[:-1]) if t == END), len(seq))
        merged[seq[:cut]] = merged.get(seq[:cut], 0.0) + p
    return merged
