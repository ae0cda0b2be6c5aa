"""specrpc/prompts/token_floor.py: the floor never exceeds the real token count, for the shipped pair's byte-level
BPE, the test tokenizers with chat tokens added, a Llama-2-layout sentencepiece BPE with byte fallback, a Metaspace
Unigram with byte fallback and an NFC-normalized byte-level BPE (Qwen2's layout), on code, prose, the tokenizers' own
longest tokens, whitespace runs, composed and decomposed Unicode and added tokens; it refuses (None) pipelines that
drop or merge characters; and it puts the 20,000-value enum far over the context without tokenizing it."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from specrpc.prompts.token_floor import TokenFloor
from specrpc.prompts.tool_formats import HERMES
from specrpc.prompts.tools import Tool, tools_prompt

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "specrpc" / "assets" / "target"
ENUM = Tool("f", "", json.dumps({"type": "object", "properties": {"e": {"enum": [f"value-{i}"
                                                                                 for i in range(20_000)]}}}))
BYTES = [f"<0x{b:02X}>" for b in range(256)]


@functools.cache
def corpus() -> list[str]:
    """Real text to train and test on: some of the package's sources and docs."""
    files = sorted([*(REPO / "specrpc").rglob("*.py"), *(REPO / "docs").glob("*.md")])
    return [f.read_text() for f in files[::8]]


def shipped() -> Tokenizer:
    return Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))


def with_chat_tokens() -> Tokenizer:
    """The shipped tokenizer with Qwen's and Llama 3's chat tokens added, as the tests' tool checkpoints have."""
    tok = shipped()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|eot_id|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def nfc() -> Tokenizer:
    """The shipped byte-level BPE behind an NFC normalizer (Qwen2's tokenizer.json layout)."""
    tok = shipped()
    tok.normalizer = normalizers.NFC()
    return tok


@functools.cache
def llama2_layout() -> Tokenizer:
    """A sentencepiece-style BPE as Llama 2 / Mistral v0.1 ship it: `▁` for spaces (Prepend + Replace), byte
    fallback tokens, `<unk>` fused."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=3000, special_tokens=["<unk>", "<s>", "</s>",
                                                                                          *BYTES]))
    return tok


@functools.cache
def unigram_metaspace() -> Tokenizer:
    """A Metaspace Unigram (T5 / Gemma-like) with byte fallback."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(corpus(), trainers.UnigramTrainer(vocab_size=2000, unk_token="<unk>",
                                                              special_tokens=["<unk>", *BYTES]))
    spec = json.loads(tok.to_str())
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"shipped": shipped, "chat tokens": with_chat_tokens, "nfc": nfc, "llama2 layout": llama2_layout,
              "unigram metaspace": unigram_metaspace}


def hard_texts(tok: Tokenizer) -> Iterator[str]:
    """Texts that press the floor: the tokenizer's longest tokens repeated (where the floor is tightest), runs of
    one character, Unicode that normal forms compose, decompose or fold, added tokens back to back, and the
    hostile declaration."""
    vocab = sorted(tok.get_vocab(), key=len)
    for token in vocab[-40:]:
        yield tok.decode([tok.token_to_id(token)], skip_special_tokens=False) * 30
    rng = random.Random(7)
    yield "".join(tok.decode([tok.token_to_id(t)]) for t in rng.choices(vocab, k=3000))
    yield from (" " * 2000, "\n" * 500, "\t \n" * 300, "#" * 1000, "\n" + " " * 64 * 20)
    yield from ("e\u0301" * 500, "é" * 500, "Ａｂｃ１２３" * 300, "\u1100\u1161\u11a8" * 300, "\u212b\u2126" * 300,
                "漢字かな交じり文" * 200, "🙂👍🏽" * 200, ">\u0338" * 300, "\u0301" * 300)
    yield from ("<|im_start|>" * 100 + "<|eot_id|><tool_call>" * 50, "<s></s><unk>" * 100, "<0x41>" * 100)
    yield tools_prompt([ENUM], HERMES)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_floor_never_exceeds_the_token_count(name: str) -> None:
    tok = TOKENIZERS[name]()
    floor = TokenFloor.of_spec(json.loads(tok.to_str()))
    assert floor is not None
    texts = [*corpus(), *hard_texts(tok)]
    counts = [len(ids.ids) for ids in tok.encode_batch(texts, add_special_tokens=False)]
    for text, count in zip(texts, counts, strict=True):
        assert floor.tokens(text) <= count, (name, text[:60])
    # and it is a floor worth having: the hostile declaration is over any small context by its floor alone
    assert floor.tokens(tools_prompt([ENUM], HERMES)) > 4096


def test_the_shipped_tokenizer_is_read_through_transformers_and_the_enum_is_far_over_its_context() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED))
    floor = TokenFloor.of(tokenizer)
    assert floor is not None and floor.byte_level
    text = tools_prompt([ENUM], HERMES)
    least = floor.tokens(text)
    assert 2048 * 4 < least <= len(tokenizer(text).input_ids)


def spec_of(tok: Tokenizer, **changes: Any) -> dict[str, Any]:
    spec = json.loads(tok.to_str())
    spec.update(changes)
    return spec


def test_pipelines_that_drop_or_merge_characters_have_no_floor() -> None:
    """A whitespace splitter drops spaces, WordPiece turns a whole word into [UNK], a lowercasing normalizer
    shortens some characters, an added token with lstrip swallows the spaces before it, and a Unigram without byte
    fallback fuses unknown characters: a megabyte of such text may be a handful of tokens."""
    base = shipped()
    whitespace = shipped()
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    assert TokenFloor.of_spec(json.loads(whitespace.to_str())) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert TokenFloor.of_spec(json.loads(wordpiece.to_str())) is None
    lower = shipped()
    lower.normalizer = normalizers.Lowercase()
    assert TokenFloor.of_spec(json.loads(lower.to_str())) is None
    spec = spec_of(base)
    spec["added_tokens"][0]["lstrip"] = True
    assert TokenFloor.of_spec(spec) is None
    unigram = json.loads(unigram_metaspace().to_str())
    unigram["model"]["byte_fallback"] = False
    assert TokenFloor.of_spec(unigram) is None
