"""The shipped default pair: loads offline, tokenizers match, and speculative greedy decoding is token-for-token the
target's own greedy output (engine without speculation, and transformers `generate`) over 20+ code prompts."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import decode, requires_native
from transformers import AutoModelForCausalLM

from specrpc.config import ASSETS, EngineConfig
from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.sampling import SamplingParams
from specrpc.models import load_model, load_tokenizer
from specrpc.models.backends import native as native_step
from specrpc.models.llama import LlamaLM, bf16_available, int8_available
from specrpc.models.tokenizer_check import check_tokenizers_match

TARGET, DRAFT = ASSETS / "target", ASSETS / "draft"
pytestmark = pytest.mark.skipif(not (TARGET / "config.json").exists(), reason="default models not trained yet")

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for i in range(len(items)):\n",
    "def read_config(path):\n    \"\"\"Read a configuration file and return a dict.\"\"\"\n",
    "try:\n    import json\nexcept ImportError:\n",
    "    if not isinstance(value, str):\n        raise TypeError(",
    "def __repr__(self):\n        return",
    "# Copyright (c) Python Software Foundation.\n",
    "with open(filename, 'rb') as f:\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "    @property\n    def name(self):\n",
    "class HTTPError(Exception):\n",
    "def _quote(s):\n    return s.replace(",
    "    def __eq__(self, other):\n        if not isinstance(other, ",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "\"\"\"Utilities for working with paths.\"\"\"\n\n",
    "    result = []\n    for key, value in sorted(mapping.items()):\n",
    "def merge_sort(items):\n",
    "if __name__ == '__main__':\n",
    "    def close(self):\n        if self._file is not None:\n",
    "lines = text.splitlines()\n",
]


@pytest.fixture(scope="module", params=[True, False], ids=["native", "torch"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """The pair as the server runs it on CPU (one-token steps native), and with the torch forward alone."""
    requires_native(request.param)
    cpu, f32 = torch.device("cpu"), torch.float32
    config = EngineConfig(max_sessions=1, max_context=512)
    target = load_model(TARGET, device=cpu, dtype=f32, num_slots=1, max_context=512 + 9, native_decode=request.param)
    draft = load_model(DRAFT, device=cpu, dtype=f32, num_slots=1, max_context=512 + 9, native_decode=request.param)
    assert isinstance(target, LlamaLM) and (target.native is not None) == request.param
    return Engine(target, draft, config)


def test_pair_shares_one_tokenizer() -> None:
    target_rows = AutoModelForCausalLM.from_pretrained(TARGET).config.vocab_size
    draft_rows = AutoModelForCausalLM.from_pretrained(DRAFT).config.vocab_size
    check_tokenizers_match(load_tokenizer(TARGET), load_tokenizer(DRAFT), target_rows, draft_rows)


def generate(engine: Engine, prompt: list[int], n: int, k: int | None) -> list[int]:
    return decode(engine, engine.new_slot(0), GenerationRequest(prompt, n, SamplingParams(temperature=0.0), k, "draft"))


def test_greedy_speculation_is_the_targets_greedy_output(engine: Engine) -> None:
    tok = load_tokenizer(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    accepted = proposed = 0
    for text in PROMPTS:
        prompt = tok(text).input_ids
        n = 32
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=tok.eos_token_id)[0, len(prompt):].tolist()
        assert generate(engine, prompt, n, 0) == ref, text
        gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, n, SamplingParams(temperature=0.0), 4,
                                                                 "draft"))
        out: list[int] = []
        while not gen.finished:
            out += engine.step_one(gen).token_ids
        assert out == ref, text
        accepted += gen.stats.accepted
        proposed += gen.stats.proposed
    assert accepted / proposed > 0.15  # the draft is trained, not random (quality figures are in the model card)


@pytest.mark.parametrize(("weights", "k"), [("int8", None), ("int8", 3), ("int8", 8), ("int8-native", None),
                                            ("int8-native", 8), ("bf16", None), ("bf16", 4)])
def test_low_precision_weights_greedy_speculation_equals_target_only_at_that_precision(weights: str,
                                                                                       k: int | None) -> None:
    """`--weights int8` / `bf16` for target and draft: exact relative to itself (adaptive and fixed k against k = 0
    at that precision), with no float copy of any projection left resident; "int8-native": through the native step
    (as the server runs --weights int8), every decode and verify there."""
    cpu, f32 = torch.device("cpu"), torch.float32
    int8 = weights.startswith("int8")
    if (int8 and not int8_available(cpu)) or (weights == "bf16" and not bf16_available(cpu)):
        pytest.skip(f"no CPU {weights} kernel here")
    requires_native(weights == "int8-native")
    kw = {"int8_weights": int8, "bf16_weights": weights == "bf16", "native_decode": weights == "int8-native"}
    target = load_model(TARGET, device=cpu, dtype=f32, num_slots=1, max_context=512 + 9, **kw)
    draft = load_model(DRAFT, device=cpu, dtype=f32, num_slots=1, max_context=512 + 9, **kw)
    for model in (target, draft):
        assert isinstance(model, LlamaLM)
        w = model.weights
        for p in [w.head, *(q for layer in w.layers for q in (layer.qkv, layer.o, layer.up, layer.down))]:
            assert p.wt is None
            if int8:
                assert p.packed is None and p.q8 is not None and p.q8.dtype == torch.int8
            else:
                assert p.bf16_only and p.packed is not None and p.q8 is None
        assert (model.native is not None) == (weights == "int8-native")
    engine = Engine(target, draft, EngineConfig(max_sessions=1, max_context=512))
    tok = load_tokenizer(TARGET)
    for text in PROMPTS[:8]:
        prompt = tok(text).input_ids
        spec, plain = generate(engine, prompt, 32, k), generate(engine, prompt, 32, 0)
        if weights == "bf16":  # a verify's bf16 products may round apart from a one-token step's on some CPUs
            assert_equal_but_at_a_near_tie(engine.target, prompt, spec, plain, text)
        else:
            assert spec == plain, text


def assert_equal_but_at_a_near_tie(target: LlamaLM, prompt: list[int], a: list[int], b: list[int], text: str,
                                   tolerance: float = 0.02) -> None:
    """`a` and `b` are the same greedy sequence, or part where the target's two choices are a floating-point near-tie:
    their logits within `tolerance` of the larger logit's size (bf16 keeps 8 bits of mantissa) at the first token
    they differ in. Decoding after that point follows two different contexts, so only the first one is judged."""
    if a == b:
        return
    j = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    ids = torch.tensor(prompt + a[:j], dtype=torch.long)  # [T]
    target.truncate(0, 0)
    logits = target.forward(ids, 0, 0, num_logits=1)[0]  # [V]
    target.truncate(0, 0)
    gap = abs(float(logits[a[j]] - logits[b[j]]))
    assert gap <= tolerance * max(1.0, float(logits.abs().max())), f"{text!r}: tokens {a[j]} / {b[j]} at {j}, gap {gap}"


def test_deterministic_greedy_is_identical_across_draft_lengths_and_batchmates() -> None:
    """`--deterministic`: every target forward through the native step's per-token products, so concurrent streams
    with different draft lengths (k = 0, 2, 5, 8), joining at different steps (a prompt chunk beside verifies), give
    each its own target-only tokens bit for bit; without it, a verify wider than the native step's forwards takes the
    torch forward and may round apart (equal but at near-ties)."""
    from engine_helpers import decode_together

    requires_native()
    cpu, f32 = torch.device("cpu"), torch.float32
    target = load_model(TARGET, device=cpu, dtype=f32, num_slots=4, max_context=512 + 9, native_decode=True,
                        deterministic=True)
    draft = load_model(DRAFT, device=cpu, dtype=f32, num_slots=4, max_context=512 + 9, native_decode=True)
    wider, path = target.execution()[-1]
    # the thread count load measured may follow the path (", on 1 thread" on a machine where one thread was faster)
    assert isinstance(target, LlamaLM) and target.deterministic
    assert wider == f"{native_step.MAX_TOKENS + 1}+" and path.startswith("native in chunks"), target.execution()
    engine = Engine(target, draft, EngineConfig(max_sessions=4, max_context=512, max_draft_tokens=8))
    tok = load_tokenizer(TARGET)
    prompts = [tok(text).input_ids for text in PROMPTS[:8]]
    alone = [generate(engine, prompt, 24, 0) for prompt in prompts]
    for group in (range(0, 4), range(4, 8)):
        runs = [(engine.new_slot(slot), GenerationRequest(prompts[i], 24, SamplingParams(temperature=0.0), k,
                                                          "draft"), join)
                for slot, (i, k, join) in enumerate(zip(group, (0, 2, 5, 8), (0, 1, 0, 3), strict=True))]
        together, _ = decode_together(engine, runs)
        assert together == [alone[i] for i in group]
