"""Tokenizer check: a matching pair passes (also with padded embedding rows); every kind of mismatch is refused with a
message naming it."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from specrpc.models.tokenizer_check import TokenizerMismatchError, check_tokenizers_match

WORDS = ["<unk>", "<bos>", "<eos>", "<pad>", "<end>", "<fim>", "def", "return", "foo", "bar", "(", ")", ":"]
VOCAB = {w: i for i, w in enumerate(WORDS)}
ROWS = len(VOCAB)


def tokenizer(vocab: dict[str, int] | None = None, **special: Any) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab` with <bos>/<eos>/<pad>/<unk> unless overridden."""
    tok = Tokenizer(WordLevel(vocab or VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    names = {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"} | special
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)  # type: ignore[no-untyped-call]


def refused(
    target: PreTrainedTokenizerFast, draft: PreTrainedTokenizerFast, rows: tuple[int, int] = (ROWS, ROWS)
) -> str:
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_match(target, draft, *rows)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_identical_pair_passes() -> None:
    assert tokenizer().encode("def foo ( ) :") == [6, 8, 10, 11, 12]
    check_tokenizers_match(tokenizer(), tokenizer(), ROWS, ROWS)


def test_padded_embedding_rows_pass() -> None:
    check_tokenizers_match(tokenizer(), tokenizer(), ROWS + 51, ROWS + 3)


def test_swapped_ids_are_named() -> None:
    swapped = VOCAB | {"foo": VOCAB["bar"], "bar": VOCAB["foo"]}
    message = refused(tokenizer(), tokenizer(swapped))
    assert message == "draft and target must share one tokenizer: token 'foo' is id 8 in the target but 9 in the draft"


def test_missing_token_is_named() -> None:
    fewer = {w: i for w, i in VOCAB.items() if w != ":"}
    assert "token ':' is id 12 in the target but not in the draft" in refused(tokenizer(), tokenizer(fewer))
    assert "token ':' is id 12 in the draft but not in the target" in refused(tokenizer(fewer), tokenizer())


def test_different_eos_is_named() -> None:
    message = refused(tokenizer(), tokenizer(eos_token="<end>"))
    assert "eos_token is '<eos>' (id 2) in the target but '<end>' (id 4) in the draft" in message


def test_unset_special_token_is_named() -> None:
    message = refused(tokenizer(), tokenizer(pad_token=None))
    assert "pad_token is '<pad>' (id 3) in the target but unset in the draft" in message


def test_extra_special_token_is_named() -> None:
    message = refused(tokenizer(extra_special_tokens=["<fim>"]), tokenizer())
    assert "'<fim>' (id 5) is a special token in the target but not in the draft" in message


@pytest.mark.parametrize(("rows", "model"), [((ROWS - 1, ROWS), "target"), ((ROWS, ROWS - 2), "draft")])
def test_id_beyond_embedding_rows_is_named(rows: tuple[int, int], model: str) -> None:
    message = refused(tokenizer(), tokenizer(), rows)
    assert f"token ':' has id 12 but the {model} embedding has only {min(rows)} rows" in message
