"""KV cache: allocated once, byte count by formula, length rules (no gaps, nothing past capacity, rollback only)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from specrpc.models import CausalLM, load_model
from specrpc.models.kv_cache import KVCache

CPU = torch.device("cpu")
SLOTS, CAPACITY = 3, 32


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny products on a busy 2-core box: a second intra-op thread only adds scheduler stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["lean", "fallback"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """A tiny GQA Llama on the lean path or a tiny GPT-2 through transformers' StaticCache; both keep 3 layers ×
    2 KV heads × head_dim 8 per position."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "lean":
        llama = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        LlamaForCausalLM(llama).save_pretrained(str(path))
    else:
        gpt2 = GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, n_positions=64, bos_token_id=0,
                          eos_token_id=0)
        GPT2LMHeadModel(gpt2).save_pretrained(str(path))
    return load_model(path, device=CPU, dtype=torch.float32, num_slots=SLOTS, max_context=CAPACITY)


def test_bytes_match_formula(model: CausalLM) -> None:
    layers, kv_heads, head_dim, fp32 = 3, 2, 8, 4
    expected = 2 * layers * SLOTS * kv_heads * CAPACITY * head_dim * fp32
    assert model.cache_bytes() == expected == sum(t.nbytes for t in model.cache.tensors())


def test_never_reallocates(model: CausalLM) -> None:
    pointers = [t.data_ptr() for t in model.cache.tensors()]
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        slot = step % SLOTS
        n = model.length(slot)
        if n + 6 > CAPACITY:
            model.truncate(slot, 0)
            n = 0
        count = int(torch.randint(1, 7, (1,), generator=g))
        model.forward(torch.randint(0, 64, (count,), generator=g), n, slot, num_logits=count)
        model.truncate(slot, n + int(torch.randint(0, count + 1, (1,), generator=g)))
    assert [t.data_ptr() for t in model.cache.tensors()] == pointers
    for slot in range(SLOTS):
        model.truncate(slot, 0)


def test_length_rules(model: CausalLM) -> None:
    ids = torch.arange(8)
    model.forward(ids, 0, 1, num_logits=2)
    assert model.length(1) == 8 and model.length(0) == 0
    with pytest.raises(ValueError, match="gap"):
        model.forward(ids[:1], 9, 1)
    with pytest.raises(ValueError, match="capacity"):
        model.forward(torch.arange(CAPACITY - 7), 8, 1)
    with pytest.raises(ValueError, match="num_logits"):
        model.forward(ids[:2], 8, 1, num_logits=3)
    with pytest.raises(ValueError, match="truncate"):
        model.truncate(1, 9)
    with pytest.raises(ValueError, match="truncate"):
        model.truncate(1, -1)
    with pytest.raises(ValueError, match="slot"):
        model.length(SLOTS)
    assert model.length(1) == 8  # rejected calls change nothing
    model.forward(ids[:3], 5, 1)  # start < length: overwrite from 5 (prefix reuse)
    assert model.length(1) == 8
    model.truncate(1, 4)
    assert model.length(1) == 4
    model.truncate(1, 0)


def test_kv_cache_layout() -> None:
    cache = KVCache(num_layers=2, num_slots=3, kv_heads=2, capacity=16, head_dim=4, device=CPU, dtype=torch.bfloat16)
    assert cache.k.shape == (2, 3, 2, 16, 4) and cache.nbytes() == 2 * 2 * 3 * 2 * 16 * 4 * 2
    assert cache.slot_k[1].data_ptr() == cache.k[:, 1].data_ptr()
    with pytest.raises(ValueError, match="gap"):
        cache.begin_write(0, 1, 1)
    cache.begin_write(0, 0, 16)
    cache.commit(0, 16)
    cache.begin_write(0, 3, 2)  # a rewrite inside the slot drops everything from its start
    assert cache.length(0) == 3


def test_copy_prefix_takes_another_slots_positions_without_gaps() -> None:
    """A slot keeps its own [0, start) and takes [start, length) of another: exactly those positions change hands,
    and a copy that would read past the source's length or leave a gap is refused."""
    cache = KVCache(num_layers=2, num_slots=3, kv_heads=2, capacity=16, head_dim=4, device=CPU, dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    before = cache.k.clone(), cache.v.clone()
    cache.commit(0, 10)
    cache.commit(1, 3)
    cache.copy_prefix(0, 1, 8, start=3)
    assert cache.length(1) == 8
    for now, old in zip((cache.k, cache.v), before, strict=True):
        assert torch.equal(now[:, 1, :, :3], old[:, 1, :, :3])  # its own first three positions
        assert torch.equal(now[:, 1, :, 3:8], old[:, 0, :, 3:8])  # the source's next five
        assert torch.equal(now[:, 1, :, 8:], old[:, 1, :, 8:]) and torch.equal(now[:, [0, 2]], old[:, [0, 2]])
    with pytest.raises(ValueError, match="cannot copy"):
        cache.copy_prefix(0, 2, 11)  # slot 0 holds 10
    with pytest.raises(ValueError, match="cannot copy"):
        cache.copy_prefix(0, 2, 5, start=1)  # slot 2 holds nothing: a gap at 0
    with pytest.raises(ValueError, match="cannot copy"):
        cache.copy_prefix(1, 1, 2)


def test_a_borrowed_slot_gets_back_its_positions_and_length_even_when_the_borrower_fails() -> None:
    """Scratch writes to a borrowed slot (timing between requests) leave its first positions' K/V and its length as
    they were, also where the work inside raises; the other slots are never touched."""
    cache = KVCache(num_layers=2, num_slots=2, kv_heads=2, capacity=16, head_dim=4, device=torch.device("cpu"),
                    dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    cache.commit(0, 11)
    k, v = cache.k.clone(), cache.v.clone()
    with pytest.raises(RuntimeError, match="mid-way"), cache.borrowed(0, 8):
        cache.truncate(0, 0)
        cache.begin_write(0, 0, 8)
        cache.k[:, 0, :, :8] = 0.0
        cache.v[:, 0, :, :8] = 0.0
        cache.commit(0, 8)
        raise RuntimeError("mid-way")
    assert cache.length(0) == 11 and torch.equal(cache.k, k) and torch.equal(cache.v, v)
