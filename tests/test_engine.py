"""End-to-end exactness of the engine on small random Llama models (CPU): greedy equality, the sampled sequence
distribution equal to the target's, rollback, prefix reuse, and no KV reallocation."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import decode, decode_together, requires_native
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from specrpc.bench.simulated import simulated_verifier
from specrpc.config import ASSETS, EngineConfig, build_config, validate
from specrpc.engine import engine as engine_module
from specrpc.engine.engine import PREFILL_STALL, Engine, Stall
from specrpc.engine.generation import GenerationRequest, GenerationStats, Slot, StepResult, TokenLogprob
from specrpc.engine.plan import plan
from specrpc.engine.policy import AcceptanceEstimate, BatchCosts, BatchGuard, CostModel, HostTimes
from specrpc.engine.proposers import DraftRequest, lookup_kind
from specrpc.engine.sampling import SamplingParams, logits_to_probs
from specrpc.engine.verify import VerifyResult, accept_greedy, verify
from specrpc.models import BatchRow, load_model, load_tokenizer
from specrpc.models.backends import native as native_step
from specrpc.models.llama import LlamaLM
from specrpc.serving.sessions import SessionRegistry

VOCAB = 6
CAPACITY = 64


def tiny_llama(path: Path, seed: int, hidden: int = 32, layers: int = 2, vocab: int = VOCAB, positions: int = 128
               ) -> Path:
    """A random Llama with well-separated logits (large init) saved as a Hugging Face directory."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         initializer_range=0.4, tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
                         pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path))
    return path


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


def make_engine(pair: tuple[Path, Path], draft_int8: bool = False, dtype: torch.dtype = torch.float32,
                slots: int = 2, native: bool = True, lean: bool = True, **overrides: object) -> Engine:
    """`draft_int8`: the draft decodes on int8 weight copies, as the server runs it on CPU by default; one-token
    steps at float32 run native, as in the server (the torch forward's are checked in test_models and
    test_shipped_models)."""
    config = replace(EngineConfig(max_sessions=slots, max_context=CAPACITY - 9, max_draft_tokens=8, prefill_chunk=16),
                     **overrides)  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    target = load_model(pair[0], device=cpu, dtype=dtype, num_slots=slots, max_context=CAPACITY, native_decode=native,
                        lean=lean)
    draft = load_model(pair[1], device=cpu, dtype=dtype, num_slots=slots, max_context=CAPACITY,
                       int8_decode=draft_int8, native_decode=native, lean=lean)
    assert not draft_int8 or (isinstance(draft, LlamaLM) and draft.weights.head.q8 is not None)
    return Engine(target, draft, config)


def measured_guard(widths: list[int], drafted_s: float, plain_s: float) -> BatchGuard:
    """A batch guard that measured, at each of `widths`, drafted steps at `drafted_s` and plain ones at `plain_s`
    per token, and probes no more: faster drafting leaves the policy's k standing (but for a measured plain step
    one step in 33), slower turns it off there."""
    guard = BatchGuard(probe_every=10**6)
    for width in widths:
        for drafted, seconds in ((True, drafted_s), (False, plain_s)):
            for _ in range(guard.min_steps):
                guard.observe(width, drafted, seconds, 1)
    return guard


def run(engine: Engine, prompt: list[int], n: int, params: SamplingParams, k: int | None,
        proposer: str = "draft", slot: Slot | None = None) -> list[int]:
    """Generate n tokens on `slot` (a fresh slot 0 by default)."""
    request = GenerationRequest(prompt, n, params, num_draft_tokens=k, proposer=proposer)
    return decode(engine, slot or engine.new_slot(0), request)


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(("k", "draft_int8"), [(1, False), (3, False), (8, False), (3, True), (8, True)])
def test_greedy_speculation_equals_target_only_and_transformers(pair: tuple[Path, Path], k: int,
                                                                 draft_int8: bool) -> None:
    engine = make_engine(pair, draft_int8=draft_int8)
    hf = LlamaForCausalLM.from_pretrained(str(pair[0])).eval()
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        spec = run(engine, prompt, 24, GREEDY, k)
        plain = run(engine, prompt, 24, GREEDY, 0)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert spec == plain == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft_int8", [False, True])
def test_greedy_speculation_in_bfloat16_equals_target_only(pair: tuple[Path, Path], draft_int8: bool) -> None:
    """bf16 on CPU (oneDNN-packed bf16 weights where the CPU has them): verify rows and decode rows round alike."""
    engine = make_engine(pair, draft_int8=draft_int8, dtype=torch.bfloat16)
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        assert run(engine, prompt, 24, GREEDY, 4) == run(engine, prompt, 24, GREEDY, 0)


def test_prompt_lookup_and_combined_are_exact_greedy(pair: tuple[Path, Path]) -> None:
    engine = make_engine(pair)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = run(engine, prompt, 20, GREEDY, 0)
    assert run(engine, prompt, 20, GREEDY, 4, proposer="lookup") == plain
    assert run(engine, prompt, 20, GREEDY, 4, proposer="combined") == plain


def test_combined_takes_prompt_lookup_only_where_its_match_beats_the_draft(pair: tuple[Path, Path]) -> None:
    """A match's kind (its n-gram size) carries its own acceptance: a one-token match, rarely right, loses to a good
    draft; a likely one wins (it costs no draft steps)."""
    engine = make_engine(pair)
    engine.costs = CostModel(target_step_s=1e-3, draft_step_s=1e-4, verify_s={1: 1e-3, 9: 1.4e-3})
    prompt = [1, 2, 3, 4, 0, 1]  # the last token's one earlier occurrence: a one-token match proposing 2, 3, 4, 0, 1
    for lookup_alpha, draft_alpha, chosen in ((0.05, 0.8, "draft"), (0.95, 0.5, lookup_kind(1))):
        slot = engine.new_slot(0)
        slot.policy.acceptance[lookup_kind(1)] = AcceptanceEstimate(lookup_alpha * 100, 100)
        slot.policy.acceptance["draft"] = AcceptanceEstimate(draft_alpha * 100, 100)
        gen = engine.start(slot, GenerationRequest(prompt, 20, GREEDY, proposer="combined"))
        gen.begin(0)  # the context is the prompt: what the step after its prefill plans from
        chosen_plan = plan(engine.drafting, gen, None)
        assert chosen_plan.source == chosen
        assert chosen_plan.draft_k or chosen_plan.proposal.token_ids[:2] == slot.tokens[1:3]


def test_adaptive_skips_a_draft_catch_up_the_request_cannot_repay(pair: tuple[Path, Path]) -> None:
    """A new 40-token prompt: the draft must first catch up on it. At a known catch-up cost far above what 8 tokens
    can save the policy decodes without the draft (the same tokens); at no cost, or with a request's own k, it
    drafts."""
    engine = make_engine(pair)
    prompt = [(i * 5) % VOCAB for i in range(40)]
    plain = run(engine, prompt, 8, GREEDY, 0)
    drafted: dict[str, int] = {}
    for name, per_token_s, k in (("costly", 1e-3, None), ("free", 0.0, None), ("own k", 1e-3, 2)):
        engine.costs = CostModel(target_step_s=1e-3, draft_step_s=1e-4, verify_s=dict.fromkeys(range(1, 10), 1e-3),
                                 draft_prefill_s=per_token_s)  # as known when the request starts
        slot = engine.new_slot(0)
        request = GenerationRequest(prompt, 8, GREEDY, num_draft_tokens=k, proposer="draft")
        gen = engine.start(slot, request)
        out: list[int] = []
        proposed = 0
        while not gen.finished:
            step = engine.step_one(gen)
            out += step.token_ids
            proposed += step.proposed
        assert out == plain, name
        drafted[name] = proposed
    assert drafted == {"costly": 0, "free": drafted["free"], "own k": drafted["own k"]}
    assert drafted["free"] > 0 and drafted["own k"] > 0


def test_a_new_policy_decodes_from_the_costs_other_slots_measured(pair: tuple[Path, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up costs say verifying is free; in fact every verify forward takes 20 ms beside a plain step's
    fraction of one. A request on slot 0 pays for finding out (it drafts, then stops); the device's costs it measured
    are every policy's, so a request on slot 1, with a policy of its own, decodes without drafting from its first
    step, where a copy of the start-up costs would draft again. Output unchanged."""
    engine = make_engine(pair)
    prompt = [(i * 3) % VOCAB for i in range(12)]
    plain = run(engine, prompt, 24, GREEDY, 0)
    engine.costs = CostModel(target_step_s=1e-3, draft_step_s=1e-4, verify_s=dict.fromkeys(range(1, 10), 1e-3))
    forward_batch = engine.target.forward_batch

    def slow_verifies(rows: list[BatchRow]) -> list[torch.Tensor]:
        if sum(row.ids.shape[0] for row in rows) > 1:
            time.sleep(0.02)
        return forward_batch(rows)

    monkeypatch.setattr(engine.target, "forward_batch", slow_verifies)
    proposed: list[list[int]] = []
    for index in (0, 1):
        out, ks = proposed_per_step(engine, GenerationRequest(prompt, 24, GREEDY, proposer="draft"), index)
        assert out == plain
        proposed.append(ks[1:])  # after the prefill
    assert proposed[0][0] > 0, "slot 0's request starts from the start-up costs"
    assert engine.costs.v(4) > 5, "its verifies were measured into the device's costs"
    assert sum(proposed[1]) == 0, proposed[1]


def test_the_time_between_a_lone_streams_steps_is_host_time_that_drafting_saves(pair: tuple[Path, Path],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Costs held where drafting does not pay (a drafted token 0.5 target steps, each verified one 2 more: S(1) =
    1.75 / 3.5 with no host time, below 1 up to 2 target steps of it): stepped back to back, the request decodes
    plainly but for the policy's probes. With 20 ms (20 target steps) between its steps (a caller handing each step's
    tokens on, as an edge streams them), that time is each step's host time, paid once however many tokens the step
    commits, so drafting pays and most steps draft. Output unchanged."""
    engine = make_engine(pair)
    prompt = [(i * 3) % VOCAB for i in range(12)]
    plain = run(engine, prompt, 30, GREEDY, 0)
    engine.costs = CostModel(target_step_s=1e-3, draft_step_s=5e-4,
                             verify_s={n: 1e-3 * (1 + 2 * (n - 1)) for n in range(1, 10)})
    for name in ("observe_target", "observe_draft"):  # the costs stay as given
        monkeypatch.setattr(engine.costs, name, lambda *args: None)
    drafted: dict[float, list[int]] = {}
    for pause in (0.0, 0.02):
        gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, 30, GREEDY, proposer="draft"))
        out: list[int] = []
        ks: list[int] = []
        while not gen.finished:
            if out:
                time.sleep(pause)
            result = engine.step_one(gen)
            out += result.token_ids
            ks.append(result.proposed)
        assert out == plain
        drafted[pause] = ks[1:]  # after the prefill
        if pause:
            assert gen.slot.policy.host.of("plain") >= pause
    assert sum(k > 0 for k in drafted[0.0]) <= len(drafted[0.0]) // 16 + 1, drafted[0.0]
    assert sum(k > 0 for k in drafted[0.02]) >= len(drafted[0.02]) // 2, drafted[0.02]


def test_adaptive_switches_off_when_whole_steps_are_slow(pair: tuple[Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model says verifying is free; a stall it does not see (as a GPU's first use of a shape) makes
    whole steps far slower than plain decoding, and the policy must notice and stop speculating."""
    engine = make_engine(pair)
    prompt = [2] * 12
    plain = run(engine, prompt, 40, GREEDY, 0)
    engine.costs = CostModel(target_step_s=1e-3, draft_step_s=1e-3, verify_s=dict.fromkeys(range(1, 10), 1e-3))
    engine.stall = Stall(draft_s=0.02)
    verifier = engine.verifier
    calls: list[int] = []  # drafts per speculative step

    def counted(drafts: torch.Tensor, *args: Any) -> Any:
        if drafts.numel():
            calls.append(drafts.numel())
        return verifier(drafts, *args)

    monkeypatch.setattr(engine, "verifier", counted)
    counts: dict[bool, int] = {}
    for guard in (False, True):
        calls.clear()
        slot = engine.new_slot(0)
        for name in ("observe_target", "observe_draft"):  # the costs stay as given: verifying is free
            monkeypatch.setattr(slot.policy.costs, name, lambda *args: None)
        monkeypatch.setattr(slot.policy.host, "observe", lambda *args: None)
        if not guard:
            slot.policy.min_realized_steps = 10**9
        assert run(engine, prompt, 40, GREEDY, None, proposer="lookup", slot=slot) == plain
        counts[guard] = len(calls)
    assert counts[False] >= 15, "the cost model alone keeps drafting through the stalls"
    assert counts[True] <= slot.policy.min_realized_steps + 3, "off after a few measured steps, then probes"
    assert slot.policy.realized_speedup(lookup_kind(3)) < 1.0, "a run of one token: three-token matches"


@pytest.mark.parametrize("where", ["draft_s", "verify_s"])
def test_adaptive_falls_back_under_a_stall_and_comes_back_when_it_goes(tmp_path: Path, where: str) -> None:
    """The guard both ways through the engine's stall hook: every draft is accepted (simulated α = 1), so only the
    stall makes speculating lose; it must switch off within min_realized_steps steps and come back at the first
    probe once the stall is gone."""
    cpu, capacity = torch.device("cpu"), 256
    target = load_model(tiny_llama(tmp_path / "t", seed=3, hidden=256, layers=8, positions=capacity), device=cpu,
                        dtype=torch.float32, num_slots=1, max_context=capacity)
    draft = load_model(tiny_llama(tmp_path / "d", seed=4, hidden=16, layers=1, positions=capacity), device=cpu,
                       dtype=torch.float32, num_slots=1, max_context=capacity)
    config = EngineConfig(max_sessions=1, max_context=capacity - 5, max_draft_tokens=4, prefill_chunk=16)
    engine = Engine(target, draft, config, verifier=simulated_verifier(1.0))
    engine.costs = CostModel(target_step_s=1e-3, draft_step_s=1e-4, verify_s=dict.fromkeys(range(1, 6), 1e-3))
    slot = engine.new_slot(0)
    policy = slot.policy
    policy.probe_every, policy.probe_k = 4, 4
    gen = engine.start(slot, GenerationRequest([1, 2, 3], capacity, GREEDY, proposer="draft"))
    engine.step_one(gen)  # prefill
    assert engine.step_one(gen).proposed > 0, "speculating before the stall"
    engine.stall = Stall(**{where: 0.2})  # far above any noise of this shared CPU
    stalled = [engine.step_one(gen).proposed for _ in range(5 * policy.probe_every)]
    assert sum(k > 0 for k in stalled) <= policy.min_realized_steps + 6, stalled  # the stalled steps, probes
    assert sum(k > 0 for k in stalled[-policy.probe_every :]) <= 1, stalled  # off, but for a probe
    engine.stall = None
    after = [engine.step_one(gen).proposed for _ in range(5 * policy.probe_every)]
    # back once a probe finds the stall gone: most steps speculate, not just the probes (at most 2 of these)
    assert sum(k > 0 for k in after[-2 * policy.probe_every :]) >= policy.probe_every, after


def sequence_probs(path: Path, prompt: list[int], length: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `length` tokens under the target with `params`."""
    hf = LlamaForCausalLM.from_pretrained(str(path)).eval()
    probs: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=length):
            ids = torch.tensor([prompt + list(seq)])
            logits = hf(ids).logits[0, len(prompt) - 1 : -1]  # [length, V]
            p = logits_to_probs(logits, params)  # [length, V]
            probs[seq] = float(torch.prod(p[torch.arange(length), torch.tensor(seq)]))
    return probs


def chi_square_pvalue(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson chi-square p-value, cells of expected count < 10 pooled; 0 if a sample has zero probability."""
    if any(probs[s] == 0 for s in counts):
        return 0.0  # sampled a sequence the reference cannot produce
    cells = sorted(probs, key=lambda s: probs[s])
    observed, expected = [], []
    pool_o, pool_e = 0.0, 0.0
    for s in cells:
        if probs[s] == 0:
            continue
        e = probs[s] * n
        if e < 10:
            pool_o += counts.get(s, 0)
            pool_e += e
            if pool_e >= 10:
                observed.append(pool_o)
                expected.append(pool_e)
                pool_o = pool_e = 0.0
        else:
            observed.append(counts.get(s, 0))
            expected.append(e)
    if pool_e > 0:
        observed[-1] += pool_o
        expected[-1] += pool_e
    scale = sum(observed) / sum(expected)  # the float32 probabilities sum to 1 only within rounding
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize(
    ("params", "draft_int8", "window"),
    [
        (SamplingParams(temperature=1.0), False, 0),
        (SamplingParams(temperature=0.7, top_p=0.9), False, 0),
        (SamplingParams(temperature=1.0, top_k=5), False, 0),
        (SamplingParams(temperature=1.0), True, 0),
        (SamplingParams(temperature=1.0), False, 16),
    ],
    ids=["t1", "t0.7-p0.9", "k5", "t1-int8-draft", "t1-draft-window"],
)
def test_sampled_sequences_follow_the_target_distribution(pair: tuple[Path, Path], params: SamplingParams,
                                                          draft_int8: bool, window: int) -> None:
    """3-token continuations (216 cells) sampled with k = 2 speculation vs exact target probabilities.

    Each run generates 4 tokens, so that the verify step after the prefill's first token has room for k = 2 drafts
    (k stops one short of max_new_tokens for the bonus token); tokens 2 and 3 come from that step, and the first 3
    tokens of a run are distributed as the target's 3-token continuations. False-alarm rate: 1e-4 per test (seeds
    are fixed, so the outcome is deterministic). The same samples must be rejected against the draft's own
    distribution, so the test can fail. With a draft window, on a prompt longer than it: the draft's
    probabilities are those of the context's last 16 tokens (of 21 at the verify)."""
    engine = make_engine(pair, draft_int8=draft_int8, draft_window=window, prefill_chunk=32)
    prompt = [3, 1, 4] if not window else [3, 1, 4, 1, 5, 0, 2, 3, 5, 4, 1, 2, 0, 3, 1, 4, 5, 2, 1, 3]
    n = 5000
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, 4, replace(params, seed=i), 2, "draft"))
        steps = [engine.step_one(gen) for _ in range(2)]
        assert [s.proposed for s in steps] == [0, 2], "the verify step after the first token drafts k = 2"
        assert engine.draft is not None and engine.draft.offset[0] == (len(prompt) + 1 - window if window else 0)
        third = engine.step_one(gen).token_ids if not gen.finished else []
        seq = tuple((steps[0].token_ids + steps[1].token_ids + third)[:3])
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_pvalue(counts, sequence_probs(pair[0], prompt, 3, params), n) > 1e-4
    assert chi_square_pvalue(counts, sequence_probs(pair[1], prompt, 3, params), n) < 1e-4


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5)],
                         ids=["t1", "k5"])
def test_sampled_sequences_follow_the_target_distribution_in_a_batch(pair: tuple[Path, Path],
                                                                     params: SamplingParams) -> None:
    """As above, with two streams stepped together (one batched draft and one batched verify per step), each
    with its own generator: every stream's 3-token continuations are the target's."""
    engine = make_engine(pair)
    prompt = [3, 1, 4]
    n = 5000
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n // 2):
        gens = [engine.start(engine.new_slot(s), GenerationRequest(prompt, 4, replace(params, seed=2 * i + s), 2,
                                                                   "draft")) for s in (0, 1)]
        steps = [engine.step(gens) for _ in range(2)]
        tokens: list[list[int]] = [[], []]
        for step in steps:
            for j, result in enumerate(step):
                assert not isinstance(result, Exception)
                tokens[j] += result.token_ids
        assert [[r.proposed for r in step if not isinstance(r, Exception)] for step in steps] == [[0, 0], [2, 2]]
        for j, gen in enumerate(gens):
            if not gen.finished:
                tokens[j] += engine.step_one(gen).token_ids
            counts[tuple(tokens[j][:3])] = counts.get(tuple(tokens[j][:3]), 0) + 1
    assert chi_square_pvalue(counts, sequence_probs(pair[0], prompt, 3, params), n) > 1e-4
    assert chi_square_pvalue(counts, sequence_probs(pair[1], prompt, 3, params), n) < 1e-4


def test_batched_streams_equal_their_solo_runs(pair: tuple[Path, Path]) -> None:
    """Four streams with different prompts, k, proposers and logprobs share every step; one joins late with a
    prompt of three prefill chunks while the others decode (none of them waits for it): each stream's tokens and
    log-probabilities are its solo run's."""
    engine = make_engine(pair, slots=4)
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    requests = [
        GenerationRequest([0, 5, 2, 1, 1], 30, GREEDY, None, "draft"),
        GenerationRequest(long_prompt, 12, GREEDY, 3, "combined"),
        GenerationRequest([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 20, GREEDY, 4, "lookup", logprobs=True, top_logprobs=2),
        GenerationRequest([4, 4, 1], 25, GREEDY, 0, "draft", logprobs=True),
    ]
    solo = [decode(engine, engine.new_slot(0), r) for r in requests]
    together, steps = decode_together(engine, [(engine.new_slot(i), r, 3 if i == 1 else 0)
                                               for i, r in enumerate(requests)])
    assert together == solo
    joined = next(i for i, got in enumerate(steps) if got[1] >= 0)
    first = next(i for i, got in enumerate(steps) if got[1] > 0)
    assert first - joined == 2, "40 prompt tokens: chunks of 16, 16, 8 (the last gives the first token)"
    assert all(got[3] >= 1 for got in steps[joined : first + 1]), "the others decode during its prefill"
    assert max(sum(n >= 0 for n in got) for got in steps) == 4
    solo_lp = [logprob_run(engine, r.prompt_ids, r.max_new_tokens, r.num_draft_tokens or 0, r.top_logprobs,
                           proposer=r.proposer or "draft")[1] for r in requests[2:]]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests[2:])]
    batched_lp: list[list[TokenLogprob]] = [[], []]
    while not all(gen.finished for gen in gens):
        live = [i for i, gen in enumerate(gens) if not gen.finished]
        for i, result in zip(live, engine.step([gens[i] for i in live]), strict=True):
            assert not isinstance(result, Exception)
            batched_lp[i] += result.logprobs
    for a, b in zip(batched_lp, solo_lp, strict=True):
        assert_logprobs_close(a, b)


@pytest.mark.parametrize("together", [False, True], ids=["solo", "batch"])
def test_greedy_rows_verified_on_the_host_equal_the_verifiers_path(pair: tuple[Path, Path], together: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows, plain and drafted, are verified on the host by `accept_greedy` on the argmax of each row as
    shaped: as the target gave it without a grammar or logits transform, with a transform's changes (a repetition
    penalty here). Alone and in a batch, every step's result and every request's figures are those of the
    verifier's path (which a verifier other than `verify` takes)."""
    engine = make_engine(pair, slots=4)
    penalty = SamplingParams(temperature=0.0, repetition_penalty=1.5, penalty_last_n=8)
    requests = [GenerationRequest([0, 5, 2, 1, 1], 20, GREEDY, 0, "draft"),
                GenerationRequest([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 20, GREEDY, 4, "lookup", logprobs=True),
                GenerationRequest([4, 4, 1], 20, GREEDY, 3, "draft"),
                GenerationRequest([2, 3, 2, 3, 2, 3], 20, penalty, 3, "draft")]
    on_host: list[int] = []  # drafts of each row verified on the host

    def counted(drafts: list[int], target_ids: list[int]) -> VerifyResult:
        on_host.append(len(drafts))
        return accept_greedy(drafts, target_ids)

    monkeypatch.setattr(engine_module, "accept_greedy", counted)

    def decode_all() -> tuple[list[StepResult | Exception], list[GenerationStats]]:
        gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
        results: list[StepResult | Exception] = []
        for group in ([gens] if together else [[g] for g in gens]):
            while not all(g.finished for g in group):
                results += engine.step([g for g in group if not g.finished])
        return results, [g.stats for g in gens]

    host = decode_all()
    assert len(on_host) == sum(stats.verify_steps for stats in host[1]), "every decoding row verified on the host"
    assert 0 in on_host and max(on_host) > 0
    on_host.clear()
    engine.verifier = lambda *args: verify(*args)
    assert decode_all() == host
    assert on_host == []


@pytest.mark.parametrize("k", [0, 2])
def test_a_step_calls_its_on_device_hook_once_as_its_first_forward_starts(pair: tuple[Path, Path], k: int) -> None:
    """`on_device` (the scheduler wakes the readers of the last step's chunks there, beside the forward) runs once
    a step, before any model takes the step's tokens: plain steps before the target's forward, drafted ones before
    the draft's; and once in a step that ends without a forward."""
    engine = make_engine(pair, slots=2)
    requests = [GenerationRequest([0, 5, 2, 1, 1], 6, GREEDY, k, "draft") for _ in range(2)]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    assert engine.draft is not None
    seen: list[list[tuple[int, int]]] = []
    while not all(g.finished for g in gens):
        live = [g for g in gens if not g.finished]
        before = [(engine.target.length(g.slot.index), engine.draft.length(g.slot.index)) for g in live]
        calls: list[list[tuple[int, int]]] = []
        engine.step(live, on_device=lambda live=live, calls=calls: calls.append(
            [(engine.target.length(g.slot.index), engine.draft.length(g.slot.index)) for g in live]))
        assert len(calls) == 1
        assert calls[0] == before, "a model took the step's tokens before the hook"
        seen += calls
    assert len(seen) >= 3
    done: list[int] = []
    engine.step([gens[0]], on_device=lambda: done.append(1))  # a finished generation: no forward
    assert done == [1]


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_seeded_sampling_in_a_batch_reproduces_its_solo_run(pair: tuple[Path, Path], native: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded request at a given k samples what it samples alone, whatever shares its steps (an adaptive k
    follows measured timings, so there only greedy output is fixed): every forward through the torch forward, or
    every one through the native step (a token's logits the same bits alone or batched). Mixed, a native solo step
    and a torch batched product round differently in the last bits, and where a sample path crosses a rejection
    whose residual max(0, p - q) is that small, the same seed resamples differently (the distribution is the
    target's either way)."""
    requires_native(native)
    for costs, names in ((CostModel, ("observe_target", "observe_draft", "observe_catch_up")),
                         (HostTimes, ("observe",)), (BatchCosts, ("observe_target", "observe_draft"))):
        for name in names:  # "combined" picks lookup or the draft by costs: measured ones would follow the host
            monkeypatch.setattr(costs, name, lambda *args: None)
    engine = make_engine(pair, slots=3, native=native)
    assert engine.draft is not None
    for model in (engine.target, engine.draft.model):
        if native:
            assert isinstance(model, LlamaLM) and model.native is not None
            model.native_rows = native_step.MAX_TOKENS  # no batch here exceeds it: all native
    seeded = GenerationRequest([0, 5, 2], 30, SamplingParams(temperature=1.0, seed=11), 3, "draft")
    others = [GenerationRequest([1, 2, 3, 1, 2, 3], 20, SamplingParams(temperature=0.8, seed=3), 2, "combined"),
              GenerationRequest([2, 2], 28, GREEDY, None, "draft")]
    solo = decode(engine, engine.new_slot(0), seeded)
    runs = [(engine.new_slot(i), r, 0) for i, r in enumerate([seeded, *others])]
    together, _ = decode_together(engine, runs)
    assert together[0] == solo
    assert decode_together(engine, [(engine.new_slot(i), r, j) for i, (_, r, j) in enumerate(runs)])[0] == together


def test_batch_calibration_measures_widths_and_leaves_the_slots_empty(pair: tuple[Path, Path]) -> None:
    engine = make_engine(pair, slots=4)
    costs = engine.calibrate_batches([0, 1, 2, 3], context=8, repeats=1)
    assert sorted(costs.draft_s) == [1, 2, 4]
    assert {1, 5, 9, 2, 10, 18, 4, 20, 36} <= set(costs.target_s)
    assert all(engine.target.length(s) == 0 and engine.draft is not None and engine.draft.length(s) == 0
               for s in range(4))


def test_rollback_leaves_target_logits_as_without_speculation(pair: tuple[Path, Path]) -> None:
    """After many rejections, the cached slot's next-position logits equal those of a fresh full prefill."""
    engine = make_engine(pair)
    slot = engine.new_slot(0)
    gen = engine.start(slot, GenerationRequest([0, 5, 2], 30, SamplingParams(temperature=1.0, seed=7), 4, "draft"))
    rejected = 0
    while not gen.finished:
        result = engine.step_one(gen)
        rejected += result.proposed - result.accepted
    assert rejected > 0
    tokens = slot.tokens
    assert engine.target.length(0) == len(tokens) - 1
    cached = engine.target.forward(torch.tensor(tokens[-1:]), len(tokens) - 1, 0, num_logits=1)  # [1, V]
    fresh = engine.target.forward(torch.tensor(tokens), 0, 1, num_logits=1)  # [1, V]
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


def test_prefix_reuse_counts_cached_tokens_and_keeps_output(pair: tuple[Path, Path]) -> None:
    engine = make_engine(pair)
    slot = engine.new_slot(0)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    first = run(engine, prompt, 10, GREEDY, 3, slot=slot)
    gen = engine.start(slot, GenerationRequest(prompt + first[:4], 10, GREEDY, 3, "draft"))
    out: list[int] = []
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    assert gen.stats.cached_prompt_tokens == len(prompt) + 3
    assert out == run(engine, prompt + first[:4], 10, GREEDY, 0, slot=engine.new_slot(1))


def test_kv_caches_are_never_reallocated(pair: tuple[Path, Path]) -> None:
    engine = make_engine(pair)
    before = cache_pointers(engine)
    for seed in range(5):
        run(engine, [seed, 1, 2], 40, SamplingParams(temperature=1.0, seed=seed), 6)
    assert cache_pointers(engine) == before


def cache_pointers(engine: Engine) -> list[int]:
    """data_ptr of every preallocated K/V tensor of both models."""
    models = [engine.target, engine.draft]
    return [t.data_ptr() for m in models if m is not None for t in m.cache.tensors()]


def test_speculation_off_on_the_server_wins_over_a_request_k(pair: tuple[Path, Path]) -> None:
    """`--speculation off`: an operator turned speculation off, so a request's num_draft_tokens does not draft."""
    engine = make_engine(pair, speculation="off")
    gen = engine.start(engine.new_slot(0), GenerationRequest([1, 2, 3, 1, 2], 12, GREEDY, 4, "draft"))
    while not gen.finished:
        assert engine.step_one(gen).proposed == 0
    assert gen.stats.proposed == 0 and gen.stats.verify_steps == 11
    on = make_engine(pair)
    assert on.start(on.new_slot(0), GenerationRequest([1, 2, 3], 12, GREEDY, 4, "draft")).fixed_k == 4


def proposed_per_step(engine: Engine, request: GenerationRequest, slot: int = 0) -> tuple[list[int], list[int]]:
    """The tokens `request` generates on a fresh `slot`, and each step's number of draft tokens verified."""
    gen = engine.start(engine.new_slot(slot), request)
    tokens: list[int] = []
    proposed: list[int] = []
    while not gen.finished:
        result = engine.step_one(gen)
        tokens += result.token_ids
        proposed.append(result.proposed)
    return tokens, proposed


def test_a_requests_draft_cap_and_floor_bound_every_step(pair: tuple[Path, Path]) -> None:
    """llama.cpp's per-request `speculative.n_max` / `n_min` (GenerationRequest.max_draft_tokens / min_draft_tokens):
    under `--speculation fixed` (k 8) a cap of 3 verifies 3 draft tokens a step, a cap of 0 none (target-only), and
    a floor above the request's k leaves every step plain; the greedy tokens stay target-only's throughout."""
    engine = make_engine(pair, speculation="fixed")
    prompt = [1, 2, 3, 1, 2]
    plain, none = proposed_per_step(engine, GenerationRequest(prompt, 16, GREEDY, 0, "draft"))
    uncapped, eights = proposed_per_step(engine, GenerationRequest(prompt, 16, GREEDY, None, "draft"))
    capped, threes = proposed_per_step(engine, GenerationRequest(prompt, 16, GREEDY, None, "draft",
                                                                 max_draft_tokens=3))
    off, zeros = proposed_per_step(engine, GenerationRequest(prompt, 16, GREEDY, None, "draft", max_draft_tokens=0))
    floored, below = proposed_per_step(engine, GenerationRequest(prompt, 16, GREEDY, 2, "draft", min_draft_tokens=3))
    drafted, twos = proposed_per_step(engine, GenerationRequest(prompt, 16, GREEDY, 2, "draft"))
    assert plain == uncapped == capped == off == floored == drafted
    assert max(eights) == 8 and max(threes) == 3 and 3 in threes[1:-1] and max(twos) == 2
    assert not any(none) and not any(zeros) and not any(below)


def logprob_run(engine: Engine, prompt: list[int], n: int, k: int, top: int, params: SamplingParams = GREEDY,
                proposer: str = "draft") -> tuple[list[int], list[TokenLogprob]]:
    gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, n, params, k, proposer, logprobs=True,
                                                             top_logprobs=top))
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    while not gen.finished:
        result = engine.step_one(gen)
        assert len(result.logprobs) == len(result.token_ids)
        tokens += result.token_ids
        logprobs += result.logprobs
    return tokens, logprobs


def assert_logprobs_close(a: list[TokenLogprob], b: list[TokenLogprob], atol: float = 1e-4) -> None:
    assert [x.token_id for x in a] == [y.token_id for y in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) <= atol
        assert len(x.top) == len(y.top)
        for u, v in zip(x.top, y.top, strict=True):
            assert abs(u.logprob - v.logprob) <= atol
            assert u.token_id == v.token_id or abs(u.logprob - v.logprob) <= atol  # ties may swap


def test_logprobs_are_the_targets_raw_log_softmax(pair: tuple[Path, Path]) -> None:
    """Each token's log-probability is the target's log-softmax at its position (transformers as reference), before
    temperature; the top alternatives are the largest, best first; speculation reports the same as plain decoding."""
    engine = make_engine(pair)
    prompt = [3, 1, 4, 1, 5]
    hot = SamplingParams(temperature=0.5, seed=3)
    tokens, logprobs = logprob_run(engine, prompt, 12, 4, 3, params=hot)
    hf = LlamaForCausalLM.from_pretrained(str(pair[0])).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1], dim=-1)
    for i, lp in enumerate(logprobs):
        assert lp.token_id == tokens[i]
        assert abs(lp.logprob - float(ref[i, tokens[i]])) < 1e-4
        assert [a.token_id for a in lp.top] == ref[i].topk(3).indices.tolist()
        assert [a.logprob for a in lp.top] == sorted((a.logprob for a in lp.top), reverse=True)
    spec_tokens, spec = logprob_run(engine, prompt, 12, 4, 5)
    plain_tokens, plain = logprob_run(engine, prompt, 12, 0, 5)
    assert spec_tokens == plain_tokens
    assert_logprobs_close(spec, plain)
    assert engine.step_one(engine.start(engine.new_slot(0), GenerationRequest(prompt, 2))).logprobs == ()


@pytest.mark.skipif(not (ASSETS / "target" / "config.json").exists(), reason="default models not trained yet")
def test_logprobs_under_speculation_equal_target_only_on_the_shipped_pair() -> None:
    """The shipped pair at fp32: log-probabilities read off the verify pass (k+1 rows, drafts accepted or not)
    equal those of target-only decoding (one row per step) within 1e-4, with the top 5 alternatives."""
    cpu = torch.device("cpu")
    target = load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=1, max_context=320)
    draft = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=320)
    engine = Engine(target, draft, EngineConfig(max_sessions=1, max_context=300, max_draft_tokens=6,
                                                prefill_chunk=128))
    tokenizer = load_tokenizer(str(ASSETS / "target"))
    proposed = 0
    for text in ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n"]:
        prompt = list(tokenizer(text).input_ids)
        plain_tokens, plain = logprob_run(engine, prompt, 40, 0, 5)
        for k, proposer in ((4, "draft"), (6, "lookup")):
            gen_tokens, spec = logprob_run(engine, prompt, 40, k, 5, proposer=proposer)
            assert gen_tokens == plain_tokens
            assert_logprobs_close(spec, plain)
        proposed += 1
    assert proposed == 2


def test_prefill_only_caches_the_prompt_and_generates_nothing(pair: tuple[Path, Path]) -> None:
    """Both caches hold the whole prompt; the next request on the slot extending it prefills only its new tokens
    (the last cached one is recomputed) and generates what it would on a cold slot."""
    engine = make_engine(pair)
    slot = engine.new_slot(0)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2]  # two prefill chunks of 16
    gen = engine.start(slot, GenerationRequest(prompt, 10, GREEDY, prefill_only=True))
    results = []
    while not gen.finished:
        results.append(engine.step_one(gen))
    assert [r.token_ids for r in results] == [[], []] and gen.finish == "length"
    assert gen.stats.completion_tokens == 0 and gen.stats.verify_steps == 0
    assert engine.draft is not None
    assert engine.target.length(0) == engine.draft.length(0) == len(prompt) == gen.stats.tokens_cached
    longer = [*prompt, 3, 3]
    gen = engine.start(slot, GenerationRequest(longer, 10, GREEDY, 3, "draft"))
    out = []
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    assert gen.stats.cached_prompt_tokens == len(prompt)
    assert out == run(engine, longer, 10, GREEDY, 0, slot=engine.new_slot(1))


def test_calibration_measures_every_width_and_stops_once_settled(pair: tuple[Path, Path]) -> None:
    """Every verify width and the draft get a cost; at least `repeats` measured rounds, then more only while a
    median ratio still moves (up to `max_repeats` within the budget); the slot is left empty."""
    engine = make_engine(pair)
    costs = engine.calibrate(context=16, repeats=4, max_repeats=12, settle=float("inf"))
    assert engine.calibration_rounds == 4  # anything counts as settled: the minimum
    assert sorted(costs.verify_s) == list(range(1, engine.max_k + 2))
    assert costs.verify_s[1] == costs.target_step_s > 0 and costs.draft_step_s > 0
    assert engine.target.length(0) == 0 and engine.draft is not None and engine.draft.length(0) == 0
    engine.calibrate(context=16, repeats=4, max_repeats=12, settle=-1.0, budget_s=60.0)
    assert engine.calibration_rounds == 12  # nothing ever settles: up to the most rounds


def test_calibration_times_each_draft_length_as_a_speculative_step_drafts(pair: tuple[Path, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts of k = 1 .. max_k tokens are timed as speculation runs them, each right after the verify of k + 1
    tokens: k greedy forwards in a row, the first over the steady catch-up's two tokens, each next one fed the argmax
    before it (the first finds the draft's weights evicted by the target's, so a short draft costs more a token than
    a long one: each k has its own cost, `CostModel.d`)."""
    engine = make_engine(pair)
    assert engine.draft is not None
    calls: list[tuple[str, list[int], int]] = []
    for name, model in (("target", engine.target), ("draft", engine.draft)):
        def recorded(ids: torch.Tensor, start: int, slot: int, num_logits: int = 1, *, name: str = name,
                     forward: Any = model.forward) -> torch.Tensor:
            logits: torch.Tensor = forward(ids, start, slot, num_logits=num_logits)
            calls.append((name, ids.tolist(), start))
            return logits
        monkeypatch.setattr(model, "forward", recorded)
    context = 16
    costs = engine.calibrate(context=context, repeats=2, max_repeats=2, settle=float("inf"))
    assert sorted(costs.draft_s) == list(range(1, engine.max_k + 1)) and all(costs.d(k) > 0 for k in costs.draft_s)
    runs: list[list[int]] = []  # each timed draft: the indices of its forwards
    for i, (name, _, start) in enumerate(calls):
        if name == "draft" and start >= context:  # not the context's feeds
            if calls[i - 1][0] == "target":
                runs.append([])
            runs[-1].append(i)
    assert [len(run) for run in runs] == list(range(1, engine.max_k + 1)) * (engine.calibration_rounds + 1)  # warm-up
    prefix = next(ids for name, ids, start in calls if name == "draft" and start == 0)  # the context, one chunk
    assert len(prefix) == context
    for run in runs:
        k = len(run)
        assert len(calls[run[0] - 1][1]) == k + 1  # right after the verify of k + 1 tokens
        assert [len(calls[i][1]) for i in run] == [2] + [1] * (k - 1)
        assert [calls[i][2] for i in run] == [context] + [context + 1 + i for i in range(1, k)]
        engine.draft.truncate(0, 0)
        engine.draft.forward(torch.tensor(prefix), 0, 0)
        fed = calls[run[0]][1]
        expected: list[int] = []  # the tokens the second .. k-th forwards are fed: each the argmax before it
        for i in range(k - 1):
            at = context if i == 0 else context + 1 + i
            expected.append(int(engine.draft.forward(torch.tensor(fed), at, 0)[-1].argmax()))
            fed = expected[-1:]
        assert [calls[i][1][0] for i in run[1:]] == expected
        engine.draft.truncate(0, 0)


@pytest.mark.parametrize("per_token_s", [0.0, 1e-2])
def test_batched_adaptive_k_follows_the_cost_of_the_batch(pair: tuple[Path, Path], per_token_s: float) -> None:
    """Four adaptive streams in one step: where a batch costs the same whatever its tokens (a GPU far from
    compute-bound), they draft; where each token costs a plain step's worth (compute-bound), none does, and
    the output is the same."""
    engine = make_engine(pair, slots=4)
    fixed = 1e-2
    engine.batch_costs = BatchCosts(target_s={n: fixed + per_token_s * n for n in (1, 4, 8, 16, 36)},
                                    draft_s={w: 1e-4 for w in (1, 2, 4)}, decay=1.0)  # decay 1: measurements ignored
    engine.batch_guard = measured_guard([2, 4], 0.25, 1.0)  # the guard found drafting faster: out of the way
    requests = [GenerationRequest([i, 2, 3, 1], 16, GREEDY, None, "draft") for i in range(4)]
    out, _ = decode_together(engine, [(engine.new_slot(i), r, 0) for i, r in enumerate(requests)])
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    proposed = 0
    while not all(g.finished for g in gens):
        live = [g for g in gens if not g.finished]
        proposed += sum(r.proposed for r in engine.step(live) if not isinstance(r, Exception))
    assert (proposed > 0) == (per_token_s == 0.0)
    assert out == [run(engine, r.prompt_ids, 16, GREEDY, 0) for r in requests]


def test_batch_guard_off_at_a_width_stops_policy_drafts_but_not_a_requests_own_k(pair: tuple[Path, Path]) -> None:
    """Where the guard found drafting slower at a width (3 here), adaptive streams decode plainly there, a request
    that asked for k still drafts, and the output is the same (once a stream is done, the width is another one)."""
    engine = make_engine(pair, slots=3)
    engine.batch_guard = measured_guard([3], 4.0, 1.0)  # drafting 4× slower per token at 3 streams
    requests = [GenerationRequest([1, 2, 3, 1, 2, 3], 20, GREEDY, None, "combined"),
                GenerationRequest([0, 5, 2], 20, GREEDY, None, "draft"),
                GenerationRequest([4, 4, 1], 20, GREEDY, 3, "draft")]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    proposed = [0, 0, 0]
    out: list[list[int]] = [[], [], []]
    while not all(g.finished for g in gens):
        live = [i for i, g in enumerate(gens) if not g.finished]
        for i, result in zip(live, engine.step([gens[i] for i in live]), strict=True):
            assert not isinstance(result, Exception)
            proposed[i] += result.proposed if len(live) == 3 else 0
            out[i] += result.token_ids
    assert proposed[0] == proposed[1] == 0 and proposed[2] > 0
    assert out == [run(engine, r.prompt_ids, 20, GREEDY, 0, proposer=r.proposer or "draft") for r in requests]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("k", [0, 3])
def test_a_prompt_another_slot_holds_is_copied_not_prefilled(pair: tuple[Path, Path], k: int, lean: bool) -> None:
    """A request whose prompt starts with what another slot has cached (its prompt and some of its output) takes
    those positions of both caches in one copy, not a prefill; its output is the one a fresh slot gives, with the
    lean forward and with the transformers fallback."""
    engine = make_engine(pair, slots=3, lean=lean)
    assert engine.target.lean_forward == lean
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3, 1, 2, 3]
    first = run(engine, prompt, 8, GREEDY, 0)  # slot 0 now holds the prompt and its first 7 output tokens
    held_draft = engine.draft.length(0) if engine.draft is not None else 0
    longer = prompt + first[:4] + [5, 5]
    gen = engine.start(engine.new_slot(1), GenerationRequest(longer, 10, GREEDY, k, "draft"))
    out: list[int] = []
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    assert gen.stats.cached_prompt_tokens == len(prompt) + 4  # the copy: nothing of it was prefilled
    assert engine.draft is not None and engine.draft.length(1) >= min(held_draft, len(prompt) + 4)
    engine.new_slot(0)  # forget slot 0's cache: no more source
    assert out == run(engine, longer, 10, GREEDY, 0, slot=engine.new_slot(2))


def test_a_lone_streams_steps_refine_the_batch_costs_of_their_size(pair: tuple[Path, Path]) -> None:
    """A stream alone steps outside the batched forward, yet its forwards are batches of one row: they refine the
    batch costs of their token count (the one-token entry a batched width's bound is compared with), no other."""
    engine = make_engine(pair)
    engine.batch_costs = BatchCosts(target_s={1: 10.0, 4: 10.0}, decay=0.5)
    run(engine, [1, 2, 3], 6, GREEDY, 0)
    assert engine.batch_costs.target_s[1] < 1.0  # ten-second forwards nowhere: measured ones took over
    assert engine.batch_costs.target_s[4] == 10.0


def test_a_lone_decoding_stream_amid_prompts_keeps_to_the_guard_of_the_width_they_make(
        pair: tuple[Path, Path]) -> None:
    """One stream decodes while two prompts are still in their prefill chunks: the width it decodes at next is
    three, where the guard found drafting slower, so it does not draft now either (its draft would catch up on the
    whole context for steps that then decode plainly); the output is the same."""
    engine = make_engine(pair, slots=3)
    engine.batch_costs = BatchCosts(target_s=dict.fromkeys(range(1, 64), 1e-2),
                                    draft_s=dict.fromkeys(range(1, 4), 1e-4),
                                    decay=1.0)  # drafting pays here (every size priced: measurements ignored)
    engine.batch_guard = measured_guard([3], 4.0, 1.0)  # drafting 4× slower per token at 3 streams
    long = [(i * 7) % 6 for i in range(40)]  # three prefill chunks (16, 16, 8)
    requests = [GenerationRequest([1, 2, 3], 12, GREEDY, None, "draft"),
                GenerationRequest(long, 4, GREEDY, None, "draft"),
                GenerationRequest(long[::-1], 4, GREEDY, None, "draft")]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    out: list[list[int]] = [[], [], []]
    proposed = 0
    while not all(g.finished for g in gens):
        live = [i for i, g in enumerate(gens) if not g.finished]
        prompts = any(gens[i].prefilling for i in live)
        for i, result in zip(live, engine.step([gens[i] for i in live]), strict=True):
            assert not isinstance(result, Exception)
            proposed += result.proposed if prompts else 0
            out[i] += result.token_ids
    assert proposed == 0
    assert out == [run(engine, r.prompt_ids, r.max_new_tokens, GREEDY, 0) for r in requests]


async def test_a_prompt_no_free_slot_shares_overwrites_a_duplicated_cache_before_the_oldest(
        pair: tuple[Path, Path]) -> None:
    """Anonymous prompts taking turns: a prompt that no free slot shares takes a free slot whose cached prompt
    another slot holds too (nothing is lost), not the one taken longest ago when that one holds its prompt's only
    copy, so that the next request for it still finds it cached."""
    engine = make_engine(pair, slots=4)
    registry = SessionRegistry(engine, 4, 60.0)
    p, q, r, s = [1, 2, 3, 4] * 10, [5, 4, 3, 2] * 10, [0, 1, 0, 2] * 10, [2, 2, 5, 1] * 10

    async def take(prompt: list[int]) -> Slot:
        lease = await registry.acquire("", prompt)
        decode(engine, lease.slot, GenerationRequest(prompt, 2, GREEDY, 0))
        return lease.slot

    only_q = await take(q)
    registry.release(registry.leases[only_q.index])
    copies = [await take(p), await take(p)]  # two streams at once on the same prompt: two copies
    for slot in copies:
        registry.release(registry.leases[slot.index])
    assert len({only_q.index, *(slot.index for slot in copies)}) == 3
    await take(r)  # the never-taken slot, held
    assert (await take(s)).index == copies[0].index  # not q's, taken longest ago: q's only copy
    assert (await take(q)).index == only_q.index  # still cached there


def test_a_prompt_joining_a_decoding_stream_is_prefilled_within_the_stall_budget(pair: tuple[Path, Path]) -> None:
    """While another stream decodes, a prompt's chunk keeps their step within `PREFILL_STALL` × that stream's plain
    step by the batch costs (here 2 ms a step, 0.26 ms per further token: 24 tokens); alone it takes its whole
    prefill chunk; the output is the same either way."""
    engine = make_engine(pair, slots=2, prefill_chunk=48)
    engine.batch_costs = BatchCosts(target_s={1: 2e-3, 2: 2e-3, 100: 2e-3 + 98 * 0.26e-3},
                                    decay=1.0)  # measurements ignored
    assert PREFILL_STALL == 4.0 and engine.prefill_budget(1) == 24 and engine.prefill_budget(0) == 48
    prompt = [(i * 5) % 6 for i in range(40)]
    requests = [GenerationRequest([1, 2, 3], 8, GREEDY, 0), GenerationRequest(prompt, 8, GREEDY, 0)]
    first = engine.start(engine.new_slot(0), requests[0])
    out = [engine.step_one(first).token_ids, []]
    joining = engine.start(engine.new_slot(1), requests[1])
    lengths = []
    while not (first.finished and joining.finished):
        live = [g for g in (first, joining) if not g.finished]
        for gen, result in zip(live, engine.step(live), strict=True):
            assert not isinstance(result, Exception)
            out[gen is joining] += result.token_ids
        lengths.append(engine.target.length(1))
    assert lengths[:2] == [24, 40]
    alone = engine.start(engine.new_slot(1), requests[1])
    assert engine.step_one(alone).token_ids == out[1][:1] and engine.target.length(1) == 40
    assert out == [run(engine, r.prompt_ids, 8, GREEDY, 0) for r in requests]


def test_a_batched_prefill_feeds_the_draft_the_same_chunks(pair: tuple[Path, Path]) -> None:
    """In a batched step, prompts that may draft go through the draft with the target's prefill chunks (no
    whole-prompt catch-up in a later step every stream waits for) where the guard has drafting on at the width;
    plain and lookup-only requests do not."""
    engine = make_engine(pair, slots=3)
    engine.batch_guard = measured_guard([3], 1.0, 4.0)
    assert engine.batch_guard.drafting_on(3)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2]  # 20 tokens: chunks of 16 and 4
    requests = [GenerationRequest(prompt, 8, GREEDY, None, "draft"), GenerationRequest(prompt, 8, GREEDY, 0, "draft"),
                GenerationRequest(prompt, 8, GREEDY, None, "lookup")]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    assert engine.draft is not None
    engine.step(gens)
    assert [engine.draft.length(i) for i in range(3)] == [16, 0, 0]  # at least 16 prompt tokens each per step
    engine.step(gens)
    assert [engine.draft.length(i) for i in range(3)] == [20, 0, 0]
    assert [g.generated for g in gens] == [1, 1, 1]
    out, _ = decode_together(engine, [(engine.new_slot(i), r, 0) for i, r in enumerate(requests)])
    assert out == [run(engine, prompt, 8, GREEDY, 0)] * 3


def test_a_batched_prefill_feeds_the_draft_only_for_drafts_to_come(pair: tuple[Path, Path]) -> None:
    """Where the guard has not found drafting faster at the width (not measured yet, here), an adaptive prompt
    skips the draft's prefill (its draft catches up if drafting comes); a request's own k drafts whatever the
    guard says, so its prompt still goes through the draft; the output is the same."""
    engine = make_engine(pair, slots=2)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    requests = [GenerationRequest(prompt, 8, GREEDY, None, "draft"), GenerationRequest(prompt, 8, GREEDY, 2, "draft")]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    assert engine.draft is not None and not engine.batch_guard.drafting_on(2)
    engine.step(gens)
    assert [engine.draft.length(i) for i in range(2)] == [0, 16]
    out, _ = decode_together(engine, [(engine.new_slot(i), r, 0) for i, r in enumerate(requests)])
    assert out == [run(engine, prompt, 8, GREEDY, 0)] * 2


def test_drafts_catching_up_at_once_share_a_prefill_chunk_per_step(pair: tuple[Path, Path]) -> None:
    """Three adaptive streams whose drafts sat out (caches emptied, as after drafting was off at a width): one
    batched step catches up at most `prefill_chunk` (16) tokens of drafts beyond the first, so one stream drafts
    in the first step and the others in later ones, in turn (a draft that has caught up feeds its steady two tokens
    a step outside the budget); the output is the same."""
    engine = make_engine(pair, slots=3)
    engine.batch_costs = BatchCosts(target_s=dict.fromkeys(range(1, 64), 1e-2),
                                    draft_s=dict.fromkeys(range(1, 4), 1e-4),
                                    decay=1.0)  # drafting pays here (every size priced: measurements ignored)
    engine.batch_guard = measured_guard([2, 4], 0.25, 1.0)
    requests = [GenerationRequest([i, 2, 3, 1, 4, 4, 0, 5, 2, 3, 1, i], 12, GREEDY, None, "draft") for i in range(3)]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    out: list[list[int]] = [list(r.token_ids) for r in engine.step(gens) if not isinstance(r, Exception)]
    assert engine.draft is not None and all(g.started and not g.prefilling for g in gens)
    for i in range(3):
        engine.draft.truncate(i, 0)  # 13 tokens behind each: two catch-ups do not fit 16
    drafted: list[list[int]] = []
    while not all(g.finished for g in gens):
        live = [i for i, g in enumerate(gens) if not g.finished]
        results = engine.step([gens[i] for i in live])
        drafted.append([r.proposed for r in results if not isinstance(r, Exception)])
        for i, result in zip(live, results, strict=True):
            assert not isinstance(result, Exception)
            out[i] += result.token_ids
    assert drafted[0][0] > 0 and drafted[0][1:] == [0, 0], drafted
    assert drafted[1][1] > 0 and drafted[1][2] == 0, drafted  # the first caught up: the second's turn
    assert drafted[2][2] > 0, drafted  # then the third's, while the others keep drafting
    assert out == [run(engine, r.prompt_ids, 12, GREEDY, 0) for r in requests]


def test_batched_drafts_report_a_catch_up_apart_from_drafting(pair: tuple[Path, Path]) -> None:
    """Drafts catching up on whole prompts in a batched draft forward: that forward's time is reported as catch-up
    (which the batch guard leaves out), not as a drafting forward for the batch cost model; once the drafts are
    steady, every forward is drafting and nothing is catch-up."""
    engine = make_engine(pair)
    assert engine.drafter is not None
    prompts = [[(i * 5 + s) % VOCAB for i in range(30)] for s in (1, 2)]
    for slot, prompt in enumerate(prompts):
        engine.new_slot(slot)
        engine.target.forward(torch.tensor(prompt), 0, slot)
    requests = [DraftRequest(prompt, slot, 3, GREEDY, None) for slot, prompt in enumerate(prompts)]
    proposals, timings, catch_up_s = engine.drafter.propose_batch(requests)
    assert catch_up_s > 0 and [rows for rows, _ in timings] == [2, 2] and all(len(p) == 3 for p in proposals)
    steady = [DraftRequest([*prompt, *p.token_ids[:1], 0], slot, 2, GREEDY, None)
              for slot, (prompt, p) in enumerate(zip(prompts, proposals, strict=True))]
    for slot, request in enumerate(steady):
        engine.draft.truncate(slot, len(request.tokens) - 2)
    _, timings, catch_up_s = engine.drafter.propose_batch(steady)
    assert catch_up_s == 0.0 and [rows for rows, _ in timings] == [2, 2]


LONG_PROMPT = [(i * 7 + i // 5) % VOCAB for i in range(40)]
"""40 tokens: longer than the draft windows below."""


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_draft_window_bounds_the_catch_up_and_keeps_greedy_exact(pair: tuple[Path, Path], lean: bool) -> None:
    """With a window of 16, a lone stream's draft catches up on the context's last 16 tokens, held from its slot's
    first position, not on the 41 before its first verify; greedy output is the target's alone, with the fused
    greedy path (lean) and with the transformers fallback's step by step drafting."""
    engine = make_engine(pair, lean=lean, draft_window=16)
    assert engine.draft is not None
    inner = engine.draft.model
    fed: list[int] = []  # tokens each of the draft's calls took

    def counted(call: Any) -> Any:
        def counting(ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            fed.append(ids.shape[0])
            return call(ids, *args, **kwargs)
        return counting

    inner.forward = counted(inner.forward)  # type: ignore[method-assign]
    if lean:
        inner.feed_greedy = counted(inner.feed_greedy)  # type: ignore[attr-defined]
    gen = engine.start(engine.new_slot(0), GenerationRequest(LONG_PROMPT, 12, GREEDY, 3, "draft"))
    out: list[int] = []
    while not out:  # the prompt's chunks of 16, then its first token: the draft has not run
        out += engine.step_one(gen).token_ids
    assert fed == [] and engine.draft.length(0) == 0
    out += engine.step_one(gen).token_ids
    assert fed[0] == 16 and engine.draft.offset[0] == len(LONG_PROMPT) + 1 - 16
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    assert max(fed) == 16 and engine.draft.offset[0] == 25, fed
    assert engine.draft.length(0) == inner.length(0) + 25 <= len(LONG_PROMPT) + len(out)
    assert out == run(engine, LONG_PROMPT, 12, GREEDY, 0)


def test_a_batched_prefill_feeds_the_draft_from_the_chunk_its_window_begins_in(pair: tuple[Path, Path]) -> None:
    """A batched prefill skips the draft on chunks before its window and starts the slot over at the chunk the
    window begins in: 40 prompt tokens in chunks of 16, a window of 16 (from position 24), so the draft takes
    positions 16-39 in two chunks; the output is the target's alone."""
    engine = make_engine(pair, slots=3, draft_window=16)
    engine.batch_guard = measured_guard([2], 1.0, 4.0)
    requests = [GenerationRequest(LONG_PROMPT, 8, GREEDY, 3, "draft"), GenerationRequest(LONG_PROMPT, 8, GREEDY, 0)]
    gens = [engine.start(engine.new_slot(i), r) for i, r in enumerate(requests)]
    assert engine.draft is not None
    engine.step(gens)
    assert engine.draft.length(0) == 0  # [0, 16) lies before the window
    engine.step(gens)
    assert (engine.draft.offset[0], engine.draft.length(0)) == (16, 32)
    engine.step(gens)
    assert (engine.draft.offset[0], engine.draft.length(0), engine.draft.model.length(0)) == (16, 40, 24)
    out, _ = decode_together(engine, [(engine.new_slot(i), r, 0) for i, r in enumerate(requests)])
    assert out == [run(engine, LONG_PROMPT, 8, GREEDY, 0)] * 2


def test_a_prefix_cut_into_the_draft_window_starts_it_over(pair: tuple[Path, Path]) -> None:
    """A slot whose draft holds a window keeps what the next prompt shares of it and catches up from there where
    that and the new tokens make a window; where they make less (a shorter prompt), or the shared prefix ends
    before the window, the draft starts over on the new context's window; a slot copying another's prefix takes its
    window. Every output is the target's alone."""
    engine = make_engine(pair, slots=3, draft_window=16)
    draft = engine.draft
    assert draft is not None
    slot = engine.new_slot(0)
    run(engine, LONG_PROMPT, 8, GREEDY, 3, slot=slot)
    assert draft.offset[0] == 25  # the window of the first verify's 41 tokens
    # (shared prefix, prompt length): the draft's (length, offset) once prefix reuse cut it, its offset after
    cases = ((30, 40, (30, 25), 25), (30, 34, (30, 25), 19), (10, 40, (10, 10), 25))
    for shift, (cut, size, kept, after) in enumerate(cases, 1):  # (each prompt shares `cut` with the one before)
        prompt = LONG_PROMPT[:cut] + [(t + shift) % VOCAB for t in LONG_PROMPT[cut:size]]
        gen = engine.start(slot, GenerationRequest(prompt, 6, GREEDY, 3, "draft"))
        out = list(engine.step_one(gen).token_ids)  # (the prefix reuse, a prefill chunk)
        assert (draft.length(0), draft.offset[0]) == kept, cut
        while not gen.finished:
            out += engine.step_one(gen).token_ids
        assert draft.offset[0] == after, (cut, size)
        assert out == run(engine, prompt, 6, GREEDY, 0, slot=engine.new_slot(1)), (cut, size)
    first = run(engine, LONG_PROMPT, 8, GREEDY, 3, slot=engine.new_slot(2))  # slot 2's draft: from position 25
    prompt = [*LONG_PROMPT, (first[0] + 1) % VOCAB, 2]
    gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, 6, GREEDY, 3, "draft"))
    out = list(engine.step_one(gen).token_ids)
    assert gen.stats.cached_prompt_tokens == len(LONG_PROMPT)
    assert (draft.length(0), draft.offset[0]) == (len(LONG_PROMPT), 25)  # slot 2's window, copied
    while not gen.finished:
        out += engine.step_one(gen).token_ids
    assert out == run(engine, prompt, 6, GREEDY, 0, slot=engine.new_slot(1))
    engine.calibrate(slot=0, context=20, repeats=1, max_repeats=1)  # forwards from position 0: the window starts over
    assert draft.offset[0] == 0 and draft.length(0) == 0


def test_the_draft_window_setting_is_checked_and_zero_keeps_the_whole_context(pair: tuple[Path, Path]) -> None:
    """`--draft-window` (SPECRPC_DRAFT_WINDOW) takes 0 or at least 16; at 0 the draft holds every context position
    from its slot's first, however long the prompt."""
    assert build_config(None, env={}).engine.draft_window == 256
    validate(build_config(None, env={"SPECRPC_DRAFT_WINDOW": "0"}))
    with pytest.raises(ValueError, match="--draft-window must be 0"):
        validate(build_config(None, env={"SPECRPC_DRAFT_WINDOW": "8"}))
    engine = make_engine(pair, draft_window=0)
    assert engine.draft is not None
    out = run(engine, LONG_PROMPT, 8, GREEDY, 3)
    assert engine.draft.offset[0] == 0 and engine.draft.model.length(0) == engine.draft.length(0) >= len(LONG_PROMPT)
    assert out == run(engine, LONG_PROMPT, 8, GREEDY, 0)
