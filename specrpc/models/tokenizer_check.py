"""Refuse at start-up a draft whose tokenizer differs from the target's: its token ids would mean other text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

SHARE = "draft and target must share one tokenizer"


class TokenizerMismatchError(ValueError):
    """Draft and target tokenizers (or embedding tables) disagree; the message names the first difference."""


def _named_special(tok: PreTrainedTokenizerBase, vocab: dict[str, int]) -> dict[str, tuple[str | None, int | None]]:
    """bos/eos/unk/sep/pad/cls/mask token → (token, id), (None, None) when unset."""
    named: dict[str, tuple[str | None, int | None]] = {}
    for attr in tok.SPECIAL_TOKENS_ATTRIBUTES:
        token = getattr(tok, attr)
        named[attr] = (None, None) if token is None else (str(token), vocab.get(str(token)))
    return named


def _all_special(tok: PreTrainedTokenizerBase) -> set[str]:
    """Every special token: named, extra (additional) and added tokens flagged special."""
    return set(tok.all_special_tokens) | {str(t) for t in tok.added_tokens_decoder.values() if t.special}


def check_tokenizers_match(
    target_tok: PreTrainedTokenizerBase,
    draft_tok: PreTrainedTokenizerBase,
    target_vocab_rows: int,
    draft_vocab_rows: int,
) -> None:
    """Raise TokenizerMismatchError unless both tokenizers map every token to the same id, agree on special tokens,
    and every id has a row in both embedding tables (rows may be padded past the vocabulary)."""
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    for token, tid in sorted(target_vocab.items(), key=lambda kv: kv[1]):
        did = draft_vocab.get(token)
        if did is None:
            raise TokenizerMismatchError(f"{SHARE}: token {token!r} is id {tid} in the target but not in the draft")
        if did != tid:
            raise TokenizerMismatchError(f"{SHARE}: token {token!r} is id {tid} in the target but {did} in the draft")
    for token, did in sorted(draft_vocab.items(), key=lambda kv: kv[1]):
        if token not in target_vocab:
            raise TokenizerMismatchError(f"{SHARE}: token {token!r} is id {did} in the draft but not in the target")

    target_named, draft_named = _named_special(target_tok, target_vocab), _named_special(draft_tok, draft_vocab)
    for attr, t in target_named.items():
        d = draft_named.get(attr, (None, None))
        if t != d:
            raise TokenizerMismatchError(
                f"{SHARE}: {attr} is {_describe(t)} in the target but {_describe(d)} in the draft"
            )
    target_special, draft_special = _all_special(target_tok), _all_special(draft_tok)
    differing = sorted(target_special ^ draft_special, key=lambda tok: target_vocab.get(tok, -1))
    if differing:
        token = differing[0]
        where, other = ("target", "draft") if token in target_special else ("draft", "target")
        raise TokenizerMismatchError(
            f"{SHARE}: {token!r} (id {target_vocab.get(token)}) is a special token in the {where} "
            f"but not in the {other}"
        )

    if not target_vocab:
        return
    top_token, top_id = max(target_vocab.items(), key=lambda kv: kv[1])
    for model, rows in (("target", target_vocab_rows), ("draft", draft_vocab_rows)):
        if top_id >= rows:
            raise TokenizerMismatchError(
                f"token {top_token!r} has id {top_id} but the {model} embedding has only {rows} rows; "
                f"the {model} model must have at least {top_id + 1} embedding rows for this tokenizer"
            )


def _describe(entry: tuple[str | None, int | None]) -> str:
    token, tid = entry
    return "unset" if token is None else f"{token!r} (id {tid})"
