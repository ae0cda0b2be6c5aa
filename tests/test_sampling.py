"""Tests for specrpc/engine/sampling.py: temperature, top-k, top-p, greedy, seeded sampling."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from engine_helpers import requires_native
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specrpc import native
from specrpc.engine.sampling import SamplingParams, _min_p, argmax_ids, logits_to_probs, make_generator, sample

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.0  # [..., V]


def _nucleus_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Row by row: keep the smallest set of most likely tokens whose mass reaches top_p, renormalise."""
    out = torch.zeros_like(probs)  # [N, V]
    for r, row in enumerate(probs):
        order = sorted(range(row.numel()), key=lambda i: (-row[i].item(), i))
        mass = 0.0
        for i in order:
            out[r, i] = row[i]
            mass += row[i].item()
            if mass >= top_p:
                break
    return out / out.sum(dim=-1, keepdim=True)


def test_greedy_flag() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert not SamplingParams().greedy


def test_temperature_scaling() -> None:
    logits = _logits(4, 32)  # [4, V]
    for t in (0.3, 1.0, 2.5):
        got = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(got, torch.softmax(logits / t, dim=-1))
    assert (
        logits_to_probs(logits, SamplingParams(temperature=0.3)).max() > logits_to_probs(logits, SamplingParams()).max()
    )


def test_greedy_is_one_hot_at_first_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])  # [2, 4] with ties
    got = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.5))
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert got.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ids_are_torchs_argmax_ties_nan_and_infinities_too(dtype: torch.dtype) -> None:
    """The greedy host path's argmax (numpy's for float32 on the CPU) picks what torch's does: the first maximum on
    ties, the first NaN above everything, +inf over finite values, the first of a row all -inf."""
    g = torch.Generator().manual_seed(0)
    inf, nan = float("inf"), float("nan")
    named = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf], [0.0, inf, 2.0, inf]])
    assert argmax_ids(named.to(dtype)) == [1, 1, 0, 1]
    for rows, vocab in [(1, 8192), (5, 8192), (3, 7)]:
        logits = torch.randint(0, 4, (rows, vocab), generator=g).float()  # [R, V] many ties
        logits[torch.rand(rows, vocab, generator=g) < 0.02] = nan
        logits[torch.rand(rows, vocab, generator=g) < 0.3] = -inf
        logits = logits.to(dtype)
        assert argmax_ids(logits) == logits.argmax(dim=-1).tolist()
        assert argmax_ids(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()  # a strided view


@pytest.mark.parametrize("k", [1, 5, 31])
def test_top_k_keeps_exactly_k(k: int) -> None:
    logits = _logits(6, 32)  # [6, V], no ties
    got = logits_to_probs(logits, SamplingParams(top_k=k))
    assert ((got > 0).sum(dim=-1) == k).all()
    kept = torch.topk(logits, k, dim=-1).indices  # [6, k]
    torch.testing.assert_close(got.gather(-1, kept).sum(dim=-1), torch.ones(6))
    expected = torch.softmax(logits.gather(-1, kept), dim=-1)  # [6, k]
    torch.testing.assert_close(got.gather(-1, kept), expected)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])  # [1, 4]
    got = logits_to_probs(logits, SamplingParams(top_k=2))
    assert (got > 0).tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("k", [0, 32, 1000])
def test_top_k_off_or_at_least_vocab_is_identity(k: int) -> None:
    logits = _logits(3, 32)  # [3, V]
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(top_k=k)), torch.softmax(logits, dim=-1))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(1e-9, [1]), (0.4, [1]), (0.6, [1, 2]), (0.8, [1, 2, 0]), (0.9, [1, 2, 0, 3])],
)
def test_top_p_minimal_nucleus(top_p: float, kept: list[int]) -> None:
    """Mass ranked: 0.5, 0.75, 0.875, 1; the tie between tokens 0 and 3 goes to the lower index."""
    base = torch.tensor([0.125, 0.5, 0.25, 0.125])  # [V]
    got = logits_to_probs(base.log(), SamplingParams(top_p=top_p))  # [V]
    expected = torch.zeros(4)
    expected[kept] = base[kept] / base[kept].sum()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("min_p", "temperature", "kept"),
                         [(0.3, 1.0, [1, 2]), (0.2, 1.0, [0, 1, 2, 3]), (0.6, 1.0, [1]), (0.3, 0.5, [1])])
def test_min_p_keeps_tokens_within_a_fraction_of_the_best_after_temperature(min_p: float, temperature: float,
                                                                            kept: list[int]) -> None:
    """Probabilities 0.125, 0.5, 0.25, 0.125: min_p 0.3 keeps ≥ 0.15 (tokens 1, 2); at temperature 0.5 the
    tempered probabilities are 1/22, 16/22, 4/22, 1/22 and 0.3 × 16/22 drops token 2 too."""
    base = torch.tensor([0.125, 0.5, 0.25, 0.125])  # [V]
    got = logits_to_probs(base.log(), SamplingParams(temperature=temperature, min_p=min_p))  # [V]
    tempered = base ** (1 / temperature)  # [V]
    expected = torch.zeros(4)
    expected[kept] = tempered[kept] / tempered[kept].sum()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("params", [SamplingParams(min_p=0.9, min_keep=3), SamplingParams(top_p=0.1, min_keep=3),
                                    SamplingParams(top_k=1, min_keep=3)], ids=["min_p", "top_p", "top_k"])
def test_min_keep_keeps_that_many_tokens_whatever_filters(params: SamplingParams) -> None:
    base = torch.tensor([0.1, 0.5, 0.25, 0.15])  # [V]
    got = logits_to_probs(base.log(), params)  # [V]
    expected = torch.tensor([0.0, 0.5, 0.25, 0.15]) / 0.9
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("min_p", "keep"), [(0.05, 1), (0.3, 1), (0.2, 4), (1.0, 1), (0.9, 300)])
def test_native_min_p_gives_the_torch_ops_bits(min_p: float, keep: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native min-p pass (transform.cpp) against the torch ops, bit for bit: random rows, a row with -inf (a
    grammar's mask), a row of -inf only, a row with a NaN (left as it is), ties at the maximum."""
    requires_native()
    scaled = _logits(6, 300, seed=3)  # [6, V]
    scaled[1, ::3] = float("-inf")
    scaled[2] = float("-inf")
    scaled[3, 17] = float("nan")
    scaled[4, :5] = scaled[4].max() + 1.0
    fast = _min_p(scaled.clone(), min_p, keep)  # [6, V]
    monkeypatch.setattr(native, "library", lambda: None)  # as without a compiler: the torch ops
    slow = _min_p(scaled.clone(), min_p, keep)  # [6, V]
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))
    kept_all = keep == scaled.shape[-1]
    assert kept_all or (fast == float("-inf")).sum() > (scaled == float("-inf")).sum(), "min-p drops tokens here"


@pytest.mark.parametrize("top_p", [0.0, 1.0])
def test_top_p_off(top_p: float) -> None:
    logits = _logits(3, 16)  # [3, V]
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(top_p=top_p)), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 0.9), (0.5, 0, 0.7), (1.5, 6, 0.8), (0.7, 3, 0.95)]
)
def test_temperature_then_top_k_then_top_p(temperature: float, top_k: int, top_p: float) -> None:
    logits = _logits(8, 16, seed=3)  # [8, V]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    after_k = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k))  # [8, V]
    expected = _nucleus_reference(after_k, top_p)
    torch.testing.assert_close(logits_to_probs(logits, params), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_gives_float32(dtype: torch.dtype) -> None:
    logits = _logits(2, 16).to(dtype)  # [2, V]
    got = logits_to_probs(logits, SamplingParams(temperature=0.8, top_p=0.9))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(2))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(0.7, 0.9, 5)])
def test_batched_leading_dims_match_rows(params: SamplingParams) -> None:
    logits = _logits(2, 3, 16)  # [2, 3, V]
    got = logits_to_probs(logits, params)  # [2, 3, V]
    assert got.shape == (2, 3, 16)
    rows = torch.stack([logits_to_probs(row, params) for row in logits.reshape(6, 16)])  # [6, V]
    torch.testing.assert_close(got.reshape(6, 16), rows)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    vocab=st.integers(1, 12),
    temperature=st.floats(0.05, 5.0),
    top_p=st.floats(0.0, 1.0),
    top_k=st.integers(0, 15),
    seed=st.integers(0, 2**31),
)
def test_probs_invariants(vocab: int, temperature: float, top_p: float, top_k: int, seed: int) -> None:
    """A distribution; top-k support within the k largest (ties aside); the top-p nucleus is minimal."""
    logits = _logits(3, vocab, seed=seed)  # [3, V]
    got = logits_to_probs(logits, SamplingParams(temperature, top_p, top_k))  # [3, V]
    assert (got >= 0).all() and ((got > 0).sum(dim=-1) >= 1).all()
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(3))
    if 0 < top_k < vocab:
        assert ((got > 0).sum(dim=-1) <= top_k).all()  # randn logits: no ties
    if 0 < top_p < 1:
        before = logits_to_probs(logits, SamplingParams(temperature, 1.0, top_k))  # [3, V]
        kept = torch.where(got > 0, before, 0.0).sort(dim=-1, descending=True).values  # [3, V]
        mass = kept.sum(dim=-1)  # [3]
        assert (mass >= top_p - 1e-6).all()
        smallest = torch.where(kept > 0, kept, torch.inf).min(dim=-1).values  # [3]
        assert ((mass - smallest < top_p) | ((got > 0).sum(dim=-1) == 1)).all()  # dropping any one falls short


def test_make_generator() -> None:
    assert make_generator(SamplingParams(temperature=0.0, seed=1), CPU) is None
    a, b = (make_generator(SamplingParams(seed=7), CPU) for _ in range(2))
    assert a is not None and b is not None
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    c, d = (make_generator(SamplingParams(), CPU) for _ in range(2))
    assert c is not None and d is not None
    assert not torch.equal(torch.rand(8, generator=c), torch.rand(8, generator=d))


def test_sample_seeded_reproducible_and_seeds_differ() -> None:
    probs = logits_to_probs(_logits(64, 50), SamplingParams())  # [64, V]
    runs = [sample(probs, make_generator(SamplingParams(seed=s), CPU)) for s in (1, 1, 2)]
    assert runs[0].shape == (64,) and runs[0].dtype == torch.int64
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_sample_never_picks_zero_probability() -> None:
    probs = logits_to_probs(_logits(2000, 16), SamplingParams(top_k=3))  # [2000, V]
    ids = sample(probs, torch.Generator().manual_seed(0))  # [2000]
    assert (probs.gather(-1, ids[:, None]) > 0).all()


def test_sample_greedy_one_hot_is_argmax() -> None:
    logits = _logits(10, 16)  # [10, V]
    ids = sample(logits_to_probs(logits, SamplingParams(temperature=0.0)), None)
    assert torch.equal(ids, logits.argmax(dim=-1))


def test_sample_distribution_unnormalised() -> None:
    """20 000 draws from one row (scaled by 3, unnormalised) match it: chi-square p-value > 1e-4."""
    probs = logits_to_probs(_logits(12, seed=5), SamplingParams(top_k=8))  # [V]
    n = 20_000
    ids = sample((3.0 * probs).expand(n, -1), torch.Generator().manual_seed(11))  # [n]
    counts = np.bincount(ids.numpy(), minlength=12)
    support = probs.numpy() > 0
    assert counts[~support].sum() == 0
    expected = probs.double().numpy()[support] * n
    assert stats.chisquare(counts[support], expected / expected.sum() * n).pvalue > 1e-4
