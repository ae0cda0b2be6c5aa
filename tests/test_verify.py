"""Tests for specrpc/engine/verify.py, after vLLM's rejection-sampler tests: forced argmax, named cases, seeded
determinism, and chi-square tests that the emitted tokens are distributed exactly as the target's.

Statistical tests: Pearson chi-square of the emitted-token counts against the target distribution, cells with an
expected count under 5 pooled, a hit on a zero-probability cell failing outright. Each test fails a correct
sampler with probability ALPHA = 1e-4 over its seed; the seeds are fixed, so every run is deterministic.
`test_chi_square_false_alarm_rate` checks that rate, the `..._detects_...` tests that the same sample sizes catch
real bugs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specrpc.engine.sampling import SamplingParams, logits_to_probs, make_generator
from specrpc.engine.verify import VerifyResult, verify

ALPHA = 1e-4  # false-alarm rate of each statistical test for a correct sampler
MIN_EXPECTED = 10.0  # cells expected below this are pooled
N_FIRST = 6_000  # verify calls per first-token test
N_JOINT = 8_000  # sequences per two-token test
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------------------
# chi-square helper


def chi2_pvalues(counts: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """P-values of count rows [R, C] (same total) against probs [C]; 0 for a row with a zero-probability hit.

    Cells expected below MIN_EXPECTED are pooled with the next smallest until the pool reaches it.
    """
    counts = np.atleast_2d(counts)  # [R, C]
    n = int(counts[0].sum())
    probs = probs.astype(np.float64) / probs.sum()  # [C]
    support = probs > 0
    impossible = counts[:, ~support].sum(axis=1) > 0  # [R]
    expected = n * probs[support]  # [S]
    observed = counts[:, support]  # [R, S]
    order = np.argsort(expected, kind="stable")
    expected, observed = expected[order], observed[:, order]
    small = int((expected < MIN_EXPECTED).sum())
    if small:
        pool = max(small, int(np.searchsorted(np.cumsum(expected), MIN_EXPECTED)) + 1)
        expected = np.concatenate([[expected[:pool].sum()], expected[pool:]])
        observed = np.concatenate([observed[:, :pool].sum(axis=1, keepdims=True), observed[:, pool:]], axis=1)
    if expected.size < 2:
        return np.where(impossible, 0.0, 1.0)
    statistic = ((observed - expected) ** 2 / expected).sum(axis=1)  # [R]
    pvalues: np.ndarray = stats.chi2.sf(statistic, df=expected.size - 1)
    return np.where(impossible, 0.0, pvalues)


def chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """P-value of observed token ids against probs [C]."""
    counts = np.bincount(np.asarray(samples), minlength=probs.numel())
    return float(chi2_pvalues(counts, probs.double().numpy())[0])


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _forced_logits(ids: list[int], vocab: int) -> torch.Tensor:
    """Logits [len(ids), V]: +100 at each id, -100 elsewhere."""
    logits = torch.full((len(ids), vocab), -100.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 100.0
    return logits


def _random_logits(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5


def _draw(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """N independent draft proposals from probs [k, V] → ids [n, k]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, n, replacement=True, generator=gen).T.contiguous()  # [n, k]


def _first_tokens(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    proposals: torch.Tensor,
    params: SamplingParams,
    seed: int,
) -> list[int]:
    """tokens[0] of one verify call per proposal row [n, k]."""
    generator = make_generator(SamplingParams(seed=seed), CPU)
    return [verify(ids, draft_probs, target_logits, params, generator).tokens[0] for ids in proposals]


# ---------------------------------------------------------------------------------------------------------------
# named cases


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(seed=0), SamplingParams(0.5, 0.9, 3, seed=0)])
@pytest.mark.parametrize("point_mass", [False, True])
def test_forced_argmax_all_accepted_gives_bonus(params: SamplingParams, point_mass: bool) -> None:
    target = [3, 1, 4, 1, 5]
    draft_ids = torch.tensor(target[:4])  # [k]
    draft_probs = None if point_mass else logits_to_probs(_forced_logits(target[:4], 8), params)  # [k, V]
    generator = make_generator(params, CPU)
    result = verify(draft_ids, draft_probs, _forced_logits(target, 8), params, generator)
    assert result == VerifyResult(accepted=4, tokens=target, bonus=True)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(seed=0), SamplingParams(0.5, 0.9, 3, seed=0)])
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("j", [0, 1, 3])
def test_forced_argmax_early_mismatch_takes_target_token(params: SamplingParams, point_mass: bool, j: int) -> None:
    target = [3, 1, 4, 1, 5]
    draft = [3, 1, 4, 1]
    draft[j] = 6  # mismatch at position j
    draft_probs = None if point_mass else logits_to_probs(_forced_logits(draft, 8), params)  # [k, V]
    generator = make_generator(params, CPU)
    result = verify(torch.tensor(draft), draft_probs, _forced_logits(target, 8), params, generator)
    assert result == VerifyResult(accepted=j, tokens=target[: j + 1], bonus=False)


def test_greedy_ignores_draft_probs_and_uses_first_argmax() -> None:
    target_logits = torch.tensor([[0.0, 2.0, 2.0], [1.0, 1.0, 0.0], [0.0, 0.0, 3.0]])  # [k+1, V] with ties
    draft_probs = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])  # [k, V] disagrees: irrelevant when greedy
    result = verify(torch.tensor([1, 0]), draft_probs, target_logits, GREEDY, None)
    assert result == VerifyResult(accepted=2, tokens=[1, 0, 2], bonus=True)
    result = verify(torch.tensor([2, 0]), None, target_logits, GREEDY, None)
    assert result == VerifyResult(accepted=0, tokens=[1], bonus=False)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.7, 0.9, 5)])
def test_perfect_match_accepts_everything(params: SamplingParams) -> None:
    """Draft distribution == target distribution: acceptance probability 1 at every position."""
    target_logits = _random_logits(4, 16, seed=1)  # [k+1, V]
    draft_probs = logits_to_probs(target_logits[:3], params)  # [k, V]
    generator = make_generator(SamplingParams(seed=2), CPU)
    for ids in _draw(draft_probs, 200, seed=3):
        result = verify(ids, draft_probs, target_logits, params, generator)
        assert result.accepted == 3 and result.bonus and result.tokens[:3] == ids.tolist()


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(seed=4)])
def test_k_zero_samples_one_token_from_p0(params: SamplingParams) -> None:
    target_logits = _forced_logits([6], 8)  # [1, V]
    for draft_probs in (None, torch.zeros(0, 8)):
        result = verify(
            torch.zeros(0, dtype=torch.int64), draft_probs, target_logits, params, make_generator(params, CPU)
        )
        assert result == VerifyResult(accepted=0, tokens=[6], bonus=True)


def test_accepted_tokens_are_the_draft_tokens() -> None:
    target_logits = _random_logits(5, 10, seed=5)  # [k+1, V]
    draft_probs = logits_to_probs(_random_logits(4, 10, seed=6), SamplingParams())  # [k, V]
    generator = make_generator(SamplingParams(seed=7), CPU)
    for ids in _draw(draft_probs, 300, seed=8):
        result = verify(ids, draft_probs, target_logits, SamplingParams(), generator)
        assert len(result.tokens) == result.accepted + 1
        assert result.tokens[: result.accepted] == ids[: result.accepted].tolist()
        assert result.bonus == (result.accepted == 4)


def _run_seeded(seed: int) -> list[VerifyResult]:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    target_logits = _random_logits(4, 12, seed=9)  # [k+1, V]
    draft_probs = logits_to_probs(_random_logits(3, 12, seed=10), params)  # [k, V]
    generator = make_generator(params, CPU)
    return [verify(ids, draft_probs, target_logits, params, generator) for ids in _draw(draft_probs, 50, seed=11)]


def test_seeded_determinism_and_seeds_differ() -> None:
    assert _run_seeded(1) == _run_seeded(1)
    assert _run_seeded(1) != _run_seeded(2)


def test_unseeded_generator_none_still_samples() -> None:
    target_logits = _random_logits(3, 12, seed=12)  # [k+1, V]
    draft_probs = logits_to_probs(_random_logits(2, 12, seed=13), SamplingParams())  # [k, V]
    result = verify(torch.tensor([0, 1]), draft_probs, target_logits, SamplingParams(), None)
    assert len(result.tokens) == result.accepted + 1


def test_vocab_mismatch_is_rejected() -> None:
    target_logits = torch.zeros(3, 16)  # [k+1, V]
    with pytest.raises(AssertionError):
        verify(torch.tensor([0, 1]), torch.full((2, 20), 0.05), target_logits, SamplingParams(), None)
    with pytest.raises(AssertionError):
        verify(torch.tensor([0, 1, 2]), None, target_logits, SamplingParams(), None)


def test_all_zero_residual_falls_back_to_target() -> None:
    """q = 2p (unnormalised): rejections leave max(0, p - q) = 0, so the token comes from p, never a p = 0 cell."""
    params = SamplingParams(top_k=4)
    target_logits = _random_logits(2, 10, seed=14)  # [k+1, V]
    p0 = logits_to_probs(target_logits[0], params)  # [V]
    draft_probs = 2.0 * p0[None]  # [k, V]
    generator = make_generator(SamplingParams(seed=15), CPU)
    results = [verify(ids, draft_probs, target_logits, params, generator) for ids in _draw(p0[None], 400, seed=16)]
    assert 100 < sum(r.accepted == 0 for r in results) < 300  # accepted with probability p/q = 1/2
    assert all(p0[r.tokens[0]] > 0 for r in results)


def test_zero_draft_probability_does_not_crash() -> None:
    """A draft token its own q gives 0 (a broken proposer) is accepted when p > 0 and emitted as a valid id."""
    draft_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]])  # [k, V]
    target_logits = _random_logits(2, 4, seed=17)  # [k+1, V]
    result = verify(torch.tensor([0]), draft_probs, target_logits, SamplingParams(), torch.Generator().manual_seed(0))
    assert result.accepted == 1 and result.tokens[0] == 0 and 0 <= result.tokens[1] < 4


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    k=st.integers(0, 4),
    vocab=st.integers(1, 9),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_p=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    top_k=st.integers(0, 10),
    point_mass=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_invariants(
    k: int, vocab: int, temperature: float, top_p: float, top_k: int, point_mass: bool, seed: int
) -> None:
    """Any shape and params: a valid result whose accepted prefix is the draft and whose last token p allows."""
    params = SamplingParams(temperature, top_p, top_k, seed)
    target_logits = _random_logits(k + 1, vocab, seed=seed)  # [k+1, V]
    draft_probs = logits_to_probs(_random_logits(k, vocab, seed=seed + 1), params)  # [k, V]
    draft_ids = _draw(draft_probs, 1, seed=seed + 2)[0] if k else torch.zeros(0, dtype=torch.int64)  # [k]
    result = verify(draft_ids, None if point_mass else draft_probs, target_logits, params, make_generator(params, CPU))
    assert 0 <= result.accepted <= k and len(result.tokens) == result.accepted + 1
    assert result.tokens[:-1] == draft_ids[: result.accepted].tolist()
    assert result.bonus == (result.accepted == k)
    assert logits_to_probs(target_logits[result.accepted], params)[result.tokens[-1]] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generator_and_tensors() -> None:
    cuda = torch.device("cuda")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    target_logits = _random_logits(4, 64, seed=18).to(cuda, torch.bfloat16)  # [k+1, V]
    draft_probs = logits_to_probs(_random_logits(3, 64, seed=19).to(cuda), params)  # [k, V]
    ids = _draw(draft_probs.cpu(), 1, seed=20)[0]  # [k] on the CPU, as a proposer may hand it over
    runs = [verify(ids, draft_probs, target_logits, params, make_generator(params, cuda)) for _ in range(2)]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------------------------
# statistical exactness


FIRST_TOKEN_CASES = [
    pytest.param(SamplingParams(), 1, 8, id="t1-k1-V8"),
    pytest.param(SamplingParams(), 2, 12, id="t1-k2-V12"),
    pytest.param(SamplingParams(), 3, 16, id="t1-k3-V16"),
    pytest.param(SamplingParams(temperature=0.7, top_p=0.9), 2, 12, id="t0.7-topp0.9-k2-V12"),
    pytest.param(SamplingParams(top_k=5), 3, 12, id="topk5-k3-V12"),
]


@pytest.mark.parametrize(("params", "k", "vocab"), FIRST_TOKEN_CASES)
def test_first_token_distribution_is_target(params: SamplingParams, k: int, vocab: int) -> None:
    """Drafts drawn from q, tokens[0] counted: its distribution must be p[0], whatever q is."""
    target_logits = _random_logits(k + 1, vocab, seed=100 + k)  # [k+1, V]
    draft_probs = logits_to_probs(_random_logits(k, vocab, seed=200 + k), params)  # [k, V]
    p0 = logits_to_probs(target_logits[0], params)  # [V]
    proposals = _draw(draft_probs, N_FIRST, seed=300 + k)  # [n, k]
    tokens = _first_tokens(target_logits, draft_probs, proposals, params, seed=400 + k)
    assert chi2_pvalue(tokens, p0) > ALPHA


@pytest.mark.parametrize("proposer", ["random", "fixed"])
def test_point_mass_first_token_distribution_is_target(proposer: str) -> None:
    """Proposals without probabilities (prompt lookup), random or always the same token, still give p[0]."""
    params = SamplingParams(temperature=0.8, top_k=6)
    target_logits = _random_logits(3, 10, seed=21)  # [k+1, V]
    p0 = logits_to_probs(target_logits[0], params)  # [V]
    if proposer == "random":
        proposals = _draw(torch.full((2, 10), 0.1), N_FIRST, seed=22)  # [n, k]
    else:
        proposals = torch.tensor([[int(p0.argmax()), 3]]).expand(N_FIRST, 2)  # [n, k]
    tokens = _first_tokens(target_logits, None, proposals, params, seed=23)
    assert chi2_pvalue(tokens, p0) > ALPHA


class _TwoTokenToy:
    """A target and a draft over V tokens whose position-1 rows depend on the token at position 0."""

    def __init__(self, vocab: int, params: SamplingParams, seed: int) -> None:
        self.vocab, self.params = vocab, params
        self.p0 = _random_logits(vocab, seed=seed)  # [V] target logits at position 0
        self.p1 = _random_logits(vocab, vocab, seed=seed + 1)  # [V, V] target logits at 1, row = token at 0
        self.p2 = _random_logits(vocab, seed=seed + 2)  # [V] target logits at 2 (bonus; never counted)
        self.q0 = logits_to_probs(_random_logits(vocab, seed=seed + 3), params)  # [V] draft probs at 0
        self.q1 = logits_to_probs(_random_logits(vocab, vocab, seed=seed + 4), params)  # [V, V] at 1

    def joint(self) -> torch.Tensor:
        """Target law of the first two tokens, p0(a) p1(b | a), flattened [V * V]."""
        p0 = logits_to_probs(self.p0, self.params)  # [V]
        return (p0[:, None] * logits_to_probs(self.p1, self.params)).reshape(-1)  # [V * V]

    def pairs(self, n: int, seed: int) -> list[int]:
        """First two emitted tokens (as a * V + b) of n independent sequences, each one speculative step with
        k = 2 and, when that step emitted a single token a, a second step with k = 1 drafted after a."""
        draft = torch.Generator().manual_seed(seed)
        x0 = torch.multinomial(self.q0, n, replacement=True, generator=draft)  # [n]
        x1 = torch.multinomial(self.q1[x0], 1, generator=draft)[:, 0]  # [n] drafted after x0
        y1 = torch.multinomial(self.q1, n, replacement=True, generator=draft).T  # [n, V] drafted after each a
        generator = make_generator(SamplingParams(seed=seed + 1), CPU)
        out = []
        for i in range(n):
            a0 = int(x0[i])
            logits = torch.stack([self.p0, self.p1[a0], self.p2])  # [3, V]
            draft_probs = torch.stack([self.q0, self.q1[a0]])  # [2, V]
            result = verify(torch.stack([x0[i], x1[i]]), draft_probs, logits, self.params, generator)
            a = result.tokens[0]
            if len(result.tokens) > 1:
                b = result.tokens[1]
            else:  # next step: the target row after a, a fresh draft after a
                logits = torch.stack([self.p1[a], self.p2])  # [2, V]
                b = verify(y1[i, a : a + 1], self.q1[a : a + 1], logits, self.params, generator).tokens[0]
            out.append(a * self.vocab + b)
        return out


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=4)], ids=["t1", "t0.8-topk4"]
)
def test_two_token_joint_distribution_is_target(params: SamplingParams) -> None:
    """(first, second) emitted token, across a rejection and the next step, is distributed as p0(a) p1(b | a)."""
    toy = _TwoTokenToy(vocab=6, params=params, seed=30)
    pairs = toy.pairs(N_JOINT, seed=31)
    joint = toy.joint()  # [V * V]
    assert chi2_pvalue(pairs, joint) > ALPHA
    marginals = joint.view(6, 6).sum(dim=1)[:, None] * joint.view(6, 6).sum(dim=0)[None]  # [V, V] b ignores a
    assert chi2_pvalue(pairs, marginals.reshape(-1)) < ALPHA  # the test can tell conditioning apart


# ---------------------------------------------------------------------------------------------------------------
# the statistical tests can fail


@pytest.mark.parametrize(("vocab", "n", "seed"), [(12, N_FIRST, 40), (36, N_JOINT, 41)])
def test_chi_square_false_alarm_rate(vocab: int, n: int, seed: int) -> None:
    """On 100 000 exact multinomial samples of the tests' sizes the helper rejects at about its nominal rate.

    (With 10^6 replicates the rate at ALPHA measured 1.1-1.2e-4: pooling keeps the approximation honest.)
    """
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(vocab, 0.5))  # skewed: a few cells get pooled
    replicates = 100_000
    pvalues = chi2_pvalues(rng.multinomial(n, probs, size=replicates), probs)  # [replicates]
    assert 0.85e-2 < (pvalues < 1e-2).mean() < 1.15e-2
    assert 0.7e-3 < (pvalues < 1e-3).mean() < 1.3e-3
    assert (pvalues < ALPHA).sum() <= 3 * replicates * ALPHA


def test_chi_square_detects_resampling_from_p_on_rejection() -> None:
    """The classic bug, a rejection resampled from p instead of max(0, p - q), fails at N_FIRST samples."""
    target_logits = _random_logits(2, 12, seed=102)  # the t1-k2-V12 case above
    p0 = logits_to_probs(target_logits[0], SamplingParams())  # [V]
    q0 = logits_to_probs(_random_logits(2, 12, seed=202)[0], SamplingParams())  # [V]
    gen = torch.Generator().manual_seed(50)
    x = torch.multinomial(q0, N_FIRST, replacement=True, generator=gen)  # [n]
    accept = torch.rand(N_FIRST, generator=gen) < p0[x] / q0[x]  # [n]
    wrong = torch.where(accept, x, torch.multinomial(p0, N_FIRST, replacement=True, generator=gen))  # [n]
    assert chi2_pvalue(wrong.tolist(), p0) < ALPHA


def test_chi_square_detects_draft_probs_before_temperature() -> None:
    """Real verify, misused: drafts sampled at temperature 0.7 but verified against untempered q."""
    params = SamplingParams(temperature=0.7)
    target_logits = _random_logits(2, 12, seed=60)  # [k+1, V]
    draft_logits = _random_logits(1, 12, seed=61)  # [k, V]
    proposals = _draw(logits_to_probs(draft_logits, params), N_FIRST // 2, seed=62)  # [n, k]
    wrong_q = logits_to_probs(draft_logits, SamplingParams())  # [k, V] temperature forgotten
    tokens = _first_tokens(target_logits, wrong_q, proposals, params, seed=63)
    assert chi2_pvalue(tokens, logits_to_probs(target_logits[0], params)) < ALPHA
