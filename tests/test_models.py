"""Lean Llama-family forward and transformers fallback against transformers' own full-sequence forward: prefill,
chunked prefill, token-by-token decode, verify after a prefix, rollback then a different continuation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import requires_native
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import specrpc
from specrpc.models import BatchRow, CausalLM, load_model, padded_sizes
from specrpc.models.backends import eager
from specrpc.models.backends import native as native_step
from specrpc.models.backends.eager import bucket_for, bucket_sizes
from specrpc.models.hf_fallback import HFCausalLM
from specrpc.models.llama import LlamaArgs, LlamaLM, LlamaWeights, forward, weights
from specrpc.models.llama.rope import rope_inv_freq
from specrpc.serving.runtime import checkpoint_info

CPU, F32 = torch.device("cpu"), torch.float32
VOCAB, N, CAPACITY = 96, 40, 48
ATOL = 1e-4
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES: dict[str, tuple[type[PreTrainedModel], PreTrainedConfig]] = {
    "llama-tied-gqa": (LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=True)),
    "llama-untied-mha-bias": (LlamaForCausalLM, LlamaConfig(**{**TINY, "num_key_value_heads": 4},
                                                            attention_bias=True, mlp_bias=True)),
    "llama-head-dim": (LlamaForCausalLM, LlamaConfig(**TINY, head_dim=24)),
    "llama3-rope": (LlamaForCausalLM, LlamaConfig(**TINY, rope_parameters=dict(LLAMA3))),
    "linear-rope": (LlamaForCausalLM, LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 500.0})),
    "dynamic-rope": (LlamaForCausalLM, LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                            "rope_theta": 10000.0})),
    "mistral-window": (MistralForCausalLM, MistralConfig(**TINY, sliding_window=6)),
    "mistral-head-dim-64-window": (MistralForCausalLM, MistralConfig(**TINY, head_dim=64, sliding_window=6)),
    "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config(**{**TINY, "num_key_value_heads": 1})),
    "qwen2-window": (Qwen2ForCausalLM, Qwen2Config(**TINY, use_sliding_window=True, sliding_window=5,
                                                   max_window_layers=1)),
    "qwen3-qk-norm": (Qwen3ForCausalLM, Qwen3Config(**TINY, head_dim=16)),
    "qwen3-head-dim-bias-window": (Qwen3ForCausalLM, Qwen3Config(**TINY, head_dim=24, attention_bias=True,
                                                                 use_sliding_window=True, sliding_window=5,
                                                                 max_window_layers=1)),
    "starcoder2": (Starcoder2ForCausalLM, Starcoder2Config(**TINY, tie_word_embeddings=False)),
    "starcoder2-tied-window": (Starcoder2ForCausalLM, Starcoder2Config(**TINY, sliding_window=6)),
    "starcoder2-no-bias": (Starcoder2ForCausalLM, Starcoder2Config(**TINY, use_bias=False)),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny products on a busy 2-core box: a second intra-op thread only adds scheduler stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save(tmp: Path, cls: type[PreTrainedModel], config: PreTrainedConfig, **kw: Any) -> tuple[Path, PreTrainedModel]:
    """Random float32 weights (norms and biases perturbed) saved to `tmp`, sharded when max_shard_size is given."""
    torch.manual_seed(0)
    model = cls(config)
    model.train(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # also LayerNorm's ("…layernorm.weight") and Qwen3's q/k norms
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp), **kw)
    return tmp, model


def reference(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [T, V] for one full sequence, no cache."""
    with torch.no_grad():
        logits: torch.Tensor = model(ids[None]).logits[0].float()
    return logits


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.dtype == torch.float32 and a.shape == b.shape
    assert (a - b).abs().max().item() < atol, f"max abs diff {(a - b).abs().max().item():.2e}"


def check_against_reference(lm: CausalLM, model: PreTrainedModel, atol: float = ATOL) -> None:
    """Every engine-style call pattern gives transformers' logits; slot 0 holds unrelated tokens throughout."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N,), generator=g)
    other = torch.randint(0, VOCAB, (N,), generator=g)
    alt = torch.randint(0, VOCAB, (8,), generator=g)
    ref = reference(model, ids)  # [N, V]
    lm.forward(other, 0, 0, num_logits=1)

    close(lm.forward(ids, 0, 1, num_logits=N), ref, atol)  # full prefill
    assert lm.length(1) == N

    lm.truncate(1, 0)  # chunked prefill
    for lo, hi in [(0, 7), (7, 12), (12, 13), (13, 29), (29, N)]:
        close(lm.forward(ids[lo:hi], lo, 1, num_logits=hi - lo), ref[lo:hi], atol)

    lm.truncate(1, 0)  # token-by-token decode
    for t in range(N):
        close(lm.forward(ids[t : t + 1], t, 1), ref[t : t + 1], atol)

    prefix = 20  # verify: k+1 = 6 tokens after a prefix
    lm.truncate(1, prefix)
    close(lm.forward(ids[prefix : prefix + 6], prefix, 1, num_logits=6), ref[prefix : prefix + 6], atol)
    close(lm.forward(ids[prefix + 6 : prefix + 7], prefix + 6, 1), ref[prefix + 6 : prefix + 7], atol)

    keep = prefix + 2  # rollback: keep 2 accepted, continue differently; stale K/V past the length must not leak
    lm.truncate(1, keep)
    fresh_ids = torch.cat([ids[:keep], alt])
    fresh = reference(model, fresh_ids)
    close(lm.forward(alt[:5], keep, 1, num_logits=5), fresh[keep : keep + 5], atol)
    close(lm.forward(alt[5:6], keep + 5, 1), fresh[keep + 5 : keep + 6], atol)
    assert lm.length(1) == keep + 6
    close(lm.forward(other[N - 1 :], N - 1, 0), reference(model, other)[N - 1 :], atol)  # slot 0 untouched


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("case", list(CASES))
def test_lean_matches_transformers(case: str, native: bool, tmp_path: Path) -> None:
    """`native`: one-token forwards through the native step (specrpc/native) wherever it takes the model (every
    RMSNorm/SiLU family here: biases, GQA and MHA, head_dim, every RoPE type, sliding windows, Qwen3's q/k norms)."""
    requires_native(native)
    cls, config = CASES[case]
    path, model = save(tmp_path, cls, config)
    lm = load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY, native_decode=native)
    assert isinstance(lm, LlamaLM) and isinstance(lm, CausalLM) and lm.lean_forward
    assert (lm.native is not None) == (native and not case.startswith("starcoder2"))
    assert lm.vocab_size == VOCAB and lm.max_context == CAPACITY and lm.name == tmp_path.name
    check_against_reference(lm, model)


@pytest.mark.parametrize(("case", "native"), [("qwen3-qk-norm", False), ("qwen3-qk-norm", True),
                                             ("mistral-window", True), ("starcoder2-tied-window", False)])
def test_lean_greedy_decode_equals_transformers_generate(case: str, native: bool, tmp_path: Path) -> None:
    """Greedy-exact: the lean path's token-by-token argmax equals transformers' generate."""
    requires_native(native)
    cls, config = CASES[case]
    path, model = save(tmp_path, cls, config)
    lm = load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY, native_decode=native)
    assert isinstance(lm, LlamaLM) and checkpoint_info(str(path), lm, F32).lean, "ModelInfo.lean_forward"
    assert (lm.native is not None) == native
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(6))
    expected = model.generate(prompt[None], max_new_tokens=30, min_new_tokens=30, do_sample=False,
                              pad_token_id=0)[0, 9:].tolist()
    out, token = [], int(lm.forward(prompt, 0, 0)[0].argmax())
    for t in range(9, 9 + 30):
        out.append(token)
        token = int(lm.forward(torch.tensor([token]), t, 0)[0].argmax())
    assert out == expected


@pytest.mark.parametrize("case", ["llama-tied-gqa", "llama3-rope", "mistral-window", "qwen2-window",
                                  "qwen3-head-dim-bias-window", "starcoder2-tied-window"])
def test_static_forward_matches_transformers(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-shape forward that CUDA graphs capture, run eagerly on CPU for every call pattern."""
    cls, config = CASES[case]
    path, model = save(tmp_path, cls, config)
    lm = load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY)
    assert isinstance(lm, LlamaLM)

    def static(w: LlamaWeights, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, start: int,
               num_logits: int, valid: int | None = None) -> torch.Tensor:
        assert valid in (None, ids.shape[0]), "no padding without buckets"
        return forward.llama_forward_static(w, k, v, ids, w.positions[start : start + ids.shape[0]], num_logits)

    monkeypatch.setattr(eager, "llama_forward", static)
    check_against_reference(lm, model)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY), max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    check_against_reference(load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY), model)


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                                    eos_token_id=0)),
        (LlamaForCausalLM, LlamaConfig(**TINY)),
    ],
    ids=["gpt2", "llama-not-lean"],
)
def test_fallback_matches_transformers(cls: type[PreTrainedModel], config: PreTrainedConfig, tmp_path: Path) -> None:
    path, model = save(tmp_path, cls, config)
    lm = load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY, lean=False)
    assert isinstance(lm, HFCausalLM) and isinstance(lm, CausalLM) and not lm.lean_forward
    check_against_reference(lm, model)


def test_unsupported_rope_falls_back(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    path, _ = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY, rope_parameters=yarn))
    assert isinstance(load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY), HFCausalLM)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        LLAMA3,
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_inv_freq_matches_transformers(rope: dict[str, Any]) -> None:
    config = LlamaConfig(**TINY, rope_parameters=dict(rope))
    args = LlamaArgs.from_config(config.to_dict())
    capacity = 200  # past max_position_embeddings: dynamic scales its base for the whole capacity
    expected: torch.Tensor
    if rope["rope_type"] == "default":
        expected = LlamaRotaryEmbedding(config).inv_freq
    else:
        expected = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, device=CPU, seq_len=capacity)[0]
    assert torch.equal(rope_inv_freq(args, capacity), expected)


def test_legacy_rope_config_keys() -> None:
    """rope_theta + rope_scaling {"type": …} (transformers 4 configs) parse like rope_parameters."""
    new = LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}).to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old |= {"rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert torch.equal(rope_inv_freq(LlamaArgs.from_config(old), 64), rope_inv_freq(LlamaArgs.from_config(new), 64))


def test_bfloat16_forward_close_to_float32(tmp_path: Path) -> None:
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    lm = load_model(path, device=CPU, dtype=torch.bfloat16, num_slots=1, max_context=CAPACITY)
    logits = torch.cat([lm.forward(ids[:7], 0, 0, num_logits=7), lm.forward(ids[7:8], 7, 0),
                        lm.forward(ids[8:], 8, 0, num_logits=4)])
    close(logits, reference(model, ids), atol=5e-2)


def test_int8_decode_serves_small_products_close_to_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lm = load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY, int8_decode=True)
    assert isinstance(lm, LlamaLM) and lm.weights.head.q8 is not None and lm.weights.head.q8.dtype == torch.int8
    rows: list[int] = []
    product = weights._int8_product
    monkeypatch.setattr(weights, "_int8_product", lambda x, p: rows.append(x.shape[0]) or product(x, p))
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(4))
    logits = torch.cat([lm.forward(ids[:9], 0, 0, num_logits=9), lm.forward(ids[9:10], 9, 0),
                        lm.forward(ids[10:], 10, 0, num_logits=4)])
    assert rows and set(rows) == {1, 4}, "a 9-row prefill takes the float32 path, decode and verify sizes int8"
    ref = reference(model, ids)
    close(logits[:9], ref[:9])  # exact path
    close(logits[9:], ref[9:], atol=0.05 * max(1.0, ref.abs().max().item()))  # int8 weights: close, not equal


def test_int8_weights_keep_no_float_copy_and_stay_close_to_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """`int8_weights`: decode and verify sizes through the int8 kernel, a long prefill through weights dequantized
    block by block; both close to float32, and the same token's logits whichever way it is computed."""
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lm = load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY, int8_weights=True)
    assert isinstance(lm, LlamaLM)
    assert lm.weights.head.wt is None and lm.weights.head.packed is None and lm.weights.head.q8 is not None
    kernel, dequant = weights._int8_product, weights._dequantized_product
    rows: list[tuple[str, int]] = []
    monkeypatch.setattr(weights, "_int8_product", lambda x, p: rows.append(("int8", x.shape[0])) or kernel(x, p))
    monkeypatch.setattr(weights, "_dequantized_product",
                        lambda x, p: rows.append(("dequant", x.shape[0])) or dequant(x, p))
    monkeypatch.setattr(weights, "DEQUANT_BLOCK", 7)  # several blocks even at this size
    monkeypatch.setattr(weights, "INT8_WEIGHT_ROWS", 8)
    lm = load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY, int8_weights=True)
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(4))
    logits = torch.cat([lm.forward(ids[:9], 0, 0, num_logits=9), lm.forward(ids[9:10], 9, 0),
                        lm.forward(ids[10:], 10, 0, num_logits=4)])
    assert set(rows) == {("dequant", 9), ("int8", 1), ("int8", 4)}, "a 9-row prefill dequantizes, the rest int8"
    ref = reference(model, ids)
    close(logits, ref, atol=0.05 * max(1.0, ref.abs().max().item()))  # int8 weights: close, not equal


@pytest.mark.skipif(not weights.bf16_available(CPU), reason="no oneDNN bf16 on this CPU")
def test_bf16_weights_keep_only_bf16_and_stay_close_to_float32(tmp_path: Path) -> None:
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lm = load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY, bf16_weights=True)
    assert isinstance(lm, LlamaLM) and lm.weights.head.bf16_only and lm.weights.head.wt is None
    assert lm.cache.slot_k[0].dtype == F32  # activations and KV stay float32
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    logits = torch.cat([lm.forward(ids[:7], 0, 0, num_logits=7), lm.forward(ids[7:8], 7, 0),
                        lm.forward(ids[8:], 8, 0, num_logits=4)])
    close(logits, reference(model, ids), atol=5e-2)


def test_int8_weights_need_the_lean_forward_and_name_the_flag(tmp_path: Path) -> None:
    from specrpc.config import build_config

    path, _ = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="--weights int8 needs the lean forward"):
        load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY, lean=False, int8_weights=True)
    with pytest.raises(ValueError, match="--weights must be dtype, int8 or bf16"):
        build_config(None, env={"SPECRPC_WEIGHTS": "q8_0"})
    assert build_config(None, env={"SPECRPC_WEIGHTS": "int8"}).engine.weights == "int8"


def test_decode_kernel_tuning_keeps_the_output(tmp_path: Path) -> None:
    """Both one-row kernels give the reference output while the plain copy is kept; where oneDNN won at load the
    plain copy is gone and only it is left to check."""
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lm = load_model(path, device=CPU, dtype=F32, num_slots=1, max_context=CAPACITY)
    assert isinstance(lm, LlamaLM) and lm.length(0) == 0, "tuning at load leaves slot 0 empty"
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5))
    ref = reference(model, ids)
    for packed in (False, True) if lm.weights.head.wt is not None else (True,):
        lm.weights = weights.with_packed_decode(lm.weights, packed)
        assert lm.weights.head.packed_rows == (1 if packed else 2)
        lm.truncate(0, 0)
        lm.forward(ids[:9], 0, 0, num_logits=9)
        close(lm.forward(ids[9:], 9, 0), ref[9:])
    packed = lm.tune_decode()
    assert lm.length(0) == 0 and (lm.weights.head.wt is None) == packed
    lm.forward(ids[:9], 0, 0, num_logits=9)
    close(lm.forward(ids[9:], 9, 0), ref[9:])


ASSET_TARGET = Path(specrpc.__file__).parent / "assets" / "target"


@pytest.mark.skipif(not (ASSET_TARGET / "config.json").exists(), reason="default models not trained yet")
def test_shipped_target_lean_matches_transformers() -> None:
    cfg = json.loads((ASSET_TARGET / "config.json").read_text())
    lm = load_model(ASSET_TARGET, device=CPU, dtype=F32, num_slots=1, max_context=64)
    assert isinstance(lm, LlamaLM)
    ids = torch.randint(0, cfg["vocab_size"], (40,), generator=torch.Generator().manual_seed(3))
    ref = reference(AutoModelForCausalLM.from_pretrained(str(ASSET_TARGET), dtype=F32, local_files_only=True), ids)
    atol = 1e-3 * max(1.0, ref.abs().max().item())
    close(lm.forward(ids[:30], 0, 0, num_logits=30), ref[:30], atol)
    close(lm.forward(ids[30:31], 30, 0), ref[30:31], atol)
    close(lm.forward(ids[31:37], 31, 0, num_logits=6), ref[31:37], atol)
    lm.truncate(0, 33)
    close(lm.forward(ids[33:], 33, 0, num_logits=7), ref[33:], atol)


def test_bucket_sizes_and_choice() -> None:
    assert bucket_sizes(37, 512) == (64, 128, 256, 512)
    assert bucket_sizes(1, 6) == (1, 2, 4, 6)
    assert bucket_sizes(600, 512) == ()
    assert padded_sizes(9, 512) == (64, 128, 256, 512), "past what graphs of 9 tokens cover (4 pieces: 36 tokens)"
    sizes = (64, 128, 256, 512)
    assert bucket_for(37, sizes, room=1000) == 64
    assert bucket_for(64, sizes, room=1000) == 64
    assert bucket_for(65, sizes, room=1000) == 128
    assert bucket_for(100, sizes, room=120) == 100, "no bucket fits the room: the exact count"
    assert bucket_for(600, sizes, room=1000) == 600


def test_padded_forwards_give_the_unpadded_logits_and_leave_no_trace(tmp_path: Path) -> None:
    """Eager forwards padded to a bucket: the last real token's logits, the slot length of the real tokens, and the
    padding's K/V (written past the length) never read by later forwards."""
    path, model = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lm = LlamaLM.load(path, json.loads((path / "config.json").read_text()), num_slots=1, max_context=CAPACITY,
                      device=CPU, dtype=F32, buckets=(8, 16, 32))
    ids = torch.randint(0, VOCAB, (CAPACITY - 1,), generator=torch.Generator().manual_seed(7))
    ref = reference(model, ids)
    assert lm.length(0) == 0, "the warm-up at load leaves slot 0 empty"
    close(lm.forward(ids[:5], 0, 0), ref[4:5])  # padded to 8
    assert lm.length(0) == 5
    close(lm.forward(ids[5:17], 5, 0), ref[16:17])  # padded to 16
    for t in range(17, 20):  # decode over the padding's stale K/V
        close(lm.forward(ids[t : t + 1], t, 0), ref[t : t + 1])
    close(lm.forward(ids[20:44], 20, 0, num_logits=24), ref[20:44])  # all logits: never padded
    close(lm.forward(ids[44:], 44, 0), ref[-1:])  # 3 tokens with 4 positions left: 8 does not fit, run as 3
    assert lm.length(0) == CAPACITY - 1


def test_greedy_draft_loop_equals_step_by_step_greedy(tmp_path: Path) -> None:
    """The loop CUDA graphs capture (no host sync: each step feeds the previous argmax), run eagerly on CPU."""
    path, _ = save(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    lm = load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY)
    assert isinstance(lm, LlamaLM)
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(8))
    expected = [int(lm.forward(prompt, 0, 0)[0].argmax())]
    for i in range(5):
        expected.append(int(lm.forward(torch.tensor(expected[-1:]), 10 + i, 0)[0].argmax()))
    lm.forward(prompt, 0, 1)
    w, cache = lm.weights, lm.cache
    with torch.inference_mode():
        tokens = forward.greedy_draft_static(w, cache.slot_k[1], cache.slot_v[1], torch.tensor(expected[:1]),
                                               torch.tensor([10]), 5)
    assert tokens.tolist() == expected


def test_native_greedy_draft_equals_step_by_step_greedy(tmp_path: Path) -> None:
    """`greedy_draft` through the native step: one call drafts what k one-token forwards and argmaxes would, and
    leaves the slot where they would (its K/V there too: the next step continues from it alike)."""
    path, _ = save(tmp_path, Qwen3ForCausalLM, CASES["qwen3-head-dim-bias-window"][1])
    requires_native()
    lm = load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(8))
    first = lm.forward(prompt, 0, 0)  # [1, V]
    expected = [int(first[0].argmax())]
    for i in range(6):
        expected.append(int(lm.forward(torch.tensor(expected[-1:]), 10 + i, 0)[0].argmax()))
    after = lm.forward(torch.tensor(expected[-1:]), 16, 0)
    lm.forward(prompt, 0, 1)
    tokens = lm.greedy_draft(first, 10, 1, 7)
    assert tokens is not None and tokens.tolist() == expected and lm.length(1) == 16
    assert torch.equal(lm.forward(torch.tensor(expected[-1:]), 16, 1), after)
    lm.truncate(1, 8)  # a draft's steady catch-up: two tokens it has not seen, then its k drafts in the same call
    fused = lm.feed_greedy(prompt[8:10], 8, 1, 7)
    assert fused is not None and fused.tolist() == expected and lm.length(1) == 16


@pytest.mark.parametrize(("case", "lean"), [("llama-tied-gqa", True), ("qwen3-head-dim-bias-window", True),
                                            ("starcoder2-tied-window", True), ("mistral-window", True),
                                            ("llama-tied-gqa", False)])
def test_batched_forward_gives_each_rows_solo_logits(case: str, lean: bool, tmp_path: Path) -> None:
    """Ragged rows on five of six slots in one call (a prefill chunk; two verifies of 5, one into an empty slot;
    plain decodes at different positions, one rewriting rolled-back positions; slot 3, inside the range of the
    slots of equal-length rows, not in the batch): each row's logits, and its slot's cache afterwards, are those of
    the row run alone; slot 3 is left as it was."""
    cls, config = CASES[case]
    path, _ = save(tmp_path, cls, config)
    solo = load_model(path, device=CPU, dtype=F32, num_slots=6, max_context=CAPACITY, lean=lean)
    batched = load_model(path, device=CPU, dtype=F32, num_slots=6, max_context=CAPACITY, lean=lean)
    g = torch.Generator().manual_seed(3)
    contexts = [0, 12, 20, 9, 30, 0]  # tokens each slot already holds
    for lm in (solo, batched):
        for slot, n in enumerate(contexts):
            if n:
                lm.forward(torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(slot)), 0, slot)
        lm.truncate(4, 7)  # a rollback: the row below rewrites position 7 of slot 4
    shapes = {0: (11, 0, 1), 1: (5, 12, 5), 2: (1, 20, 1), 4: (1, 7, 1), 5: (5, 0, 5)}  # slot: (tokens, start, logits)
    rows = [BatchRow(torch.randint(0, VOCAB, (t,), generator=g), start, slot, logits)
            for slot, (t, start, logits) in shapes.items()]
    out = batched.forward_batch(list(reversed(rows)))[::-1]
    for row, logits in zip(rows, out, strict=True):
        close(logits, solo.forward(row.ids, row.start, row.slot, row.num_logits), atol=1e-5)
        assert batched.length(row.slot) == solo.length(row.slot) == row.start + row.ids.shape[0]
    for slot in range(6):
        nxt = torch.tensor([7])
        close(batched.forward(nxt, batched.length(slot), slot), solo.forward(nxt, solo.length(slot), slot), atol=1e-5)
    assert batched.length(3) == 10
    with pytest.raises(ValueError, match="each slot once"):
        batched.forward_batch([rows[0], rows[0]])


@pytest.mark.parametrize("case", ["llama-tied-gqa", "qwen3-head-dim-bias-window", "mistral-window"])
def test_native_batch_gives_each_rows_solo_logits_bit_for_bit(case: str, tmp_path: Path) -> None:
    """Rows of several slots in one native forward (verifies, decodes, one rewriting rolled-back positions): every
    row's logits, and what its slot holds afterwards, are the same bits as the row run alone, whatever shares the
    forward (the exactness batching needs)."""
    cls, config = CASES[case]
    path, _ = save(tmp_path, cls, config)
    requires_native()
    solo = load_model(path, device=CPU, dtype=F32, num_slots=5, max_context=CAPACITY, native_decode=True)
    batched = load_model(path, device=CPU, dtype=F32, num_slots=5, max_context=CAPACITY, native_decode=True)
    for lm in (solo, batched):
        assert isinstance(lm, LlamaLM) and lm.native is not None
        lm.native_rows = native_step.MAX_TOKENS
        for slot, n in enumerate([12, 20, 9, 30, 3]):
            lm.forward(torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(slot)), 0, slot)
        lm.truncate(3, 7)
    g = torch.Generator().manual_seed(5)
    shapes = {0: (5, 12, 5), 1: (1, 20, 1), 3: (1, 7, 1), 4: (4, 3, 2)}  # slot: (tokens, start, logits)
    rows = [BatchRow(torch.randint(0, VOCAB, (t,), generator=g), start, slot, logits)
            for slot, (t, start, logits) in shapes.items()]
    assert isinstance(batched, LlamaLM) and sum(r.ids.shape[0] for r in rows) <= batched.native_rows
    out = batched.forward_batch(list(reversed(rows)))[::-1]
    for row, logits in zip(rows, out, strict=True):
        assert torch.equal(logits, solo.forward(row.ids, row.start, row.slot, row.num_logits))
    for slot in range(5):
        nxt = torch.tensor([7])
        assert torch.equal(batched.forward(nxt, batched.length(slot), slot), solo.forward(nxt, solo.length(slot), slot))


@pytest.mark.parametrize("case", ["llama-untied-mha-bias", "qwen3-head-dim-bias-window", "mistral-head-dim-64-window"])
def test_native_verify_gives_a_tokens_decode_logits_bit_for_bit(case: str, tmp_path: Path) -> None:
    """Through the native step a token's logits are the same bits decoded alone or verified among others (each
    weight row meets every token through the same dot product, and each query's scores the same sums in a verify
    as alone, blocks a window cuts included), so greedy
    speculation equals greedy decoding exactly; ids out of range are refused before anything is written."""
    cls, config = CASES[case]
    path, _ = save(tmp_path, cls, config)
    requires_native()
    lm = load_model(path, device=CPU, dtype=F32, num_slots=2, max_context=CAPACITY, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    lm.native_rows = native_step.MAX_TOKENS
    ids = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(4))
    lm.forward(ids[:20], 0, 1)
    together = lm.forward(ids[20:29], 20, 1, num_logits=9)  # [9, V]
    lm.truncate(1, 20)
    alone = torch.cat([lm.forward(ids[t : t + 1], t, 1) for t in range(20, 29)])  # [9, V]
    assert torch.equal(together, alone)
    with pytest.raises(ValueError, match="out of range"):
        lm.forward(torch.tensor([VOCAB + 5]), 29, 1)


def test_batched_forward_of_more_tokens_than_one_context_holds(tmp_path: Path) -> None:
    """Three rows that each fit a slot but together hold more tokens than a context (as drafts catching up on
    whole prompts at once after drafting was off): each row's logits are its own, none is left empty."""
    cls, config = CASES["llama-tied-gqa"]
    path, _ = save(tmp_path, cls, config)
    lm = load_model(path, device=CPU, dtype=F32, num_slots=3, max_context=CAPACITY, lean=True)
    length = CAPACITY // 2 + 1
    g = torch.Generator().manual_seed(5)
    rows = [BatchRow(torch.randint(0, VOCAB, (length,), generator=g), 0, slot, 2) for slot in range(3)]
    out = lm.forward_batch(rows)
    for row, logits in zip(rows, out, strict=True):
        assert logits.shape == (2, lm.vocab_size)
        lm.truncate(row.slot, 0)
        close(logits, lm.forward(row.ids, 0, row.slot, 2), atol=1e-5)
