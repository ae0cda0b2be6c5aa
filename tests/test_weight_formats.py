"""`specrpc bench bpb`'s weight formats: q8_0 rounds as ggml does (one float16 scale per 32 weights, halves away
from zero), int8 as `--weights int8` stores it (one scale per row), and each rounds the tensors its engine rounds."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specrpc.bench.weight_formats import int8_rows, q8_0, rounded


def test_q8_0_keeps_one_float16_scale_per_block_of_32_and_rounds_halves_away_from_zero() -> None:
    small = torch.tensor([1.0, -0.5, 0.5, 1.5, -1.5] + [0.0] * 26 + [127.0])  # d = 1: the halves are ties
    big = torch.linspace(-1000.0, 1000.0, 32)  # a block of its own scale
    w = torch.stack([torch.cat([small, big]), torch.zeros(64)])  # [2, 64]
    out = q8_0(w)
    assert out[0, :5].tolist() == [1.0, -1.0, 1.0, 2.0, -2.0]  # roundf, not round-half-to-even
    assert out[0, 31] == 127.0 and torch.equal(out[1], torch.zeros(64))  # an all-zero block stays zero
    d = float(torch.tensor(1000.0 / 127).to(torch.float16))
    assert torch.allclose(out[0, 32:], torch.round(big / (1000.0 / 127)) * d)  # the second block: its own scale
    per_row = int8_rows(w)  # one scale (1000 / 127) for the whole row: the small block is flattened to 0
    assert per_row[0, :5].abs().max() == 0 and (out[0, 32:] - per_row[0, 32:]).abs().max() < 1.0


def test_each_format_rounds_what_its_engine_rounds() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)).eval()
    embed = model.model.embed_tokens.weight.detach().clone()  # [V, d]
    down = model.model.layers[0].mlp.down_proj.weight.detach().clone()  # [d, ffn]
    assert torch.equal(rounded(model, "float32").model.embed_tokens.weight, embed)
    q = rounded(model, "q8_0")  # token_embd (tied: the head too) and every projection
    assert torch.equal(q.model.embed_tokens.weight, q8_0(embed)) and q.lm_head.weight is q.model.embed_tokens.weight
    assert torch.equal(q.model.layers[0].mlp.down_proj.weight, q8_0(down))
    i = rounded(model, "int8")  # the head and every projection; the embedding lookup stays float
    assert torch.equal(i.model.embed_tokens.weight, embed) and torch.equal(i.lm_head.weight, int8_rows(embed))
    assert torch.equal(i.model.layers[0].mlp.down_proj.weight, int8_rows(down))
    assert torch.equal(model.model.embed_tokens.weight, embed)  # the original untouched
