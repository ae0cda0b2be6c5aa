"""A lower bound on a text's token count, known without tokenizing it: refusing a prompt far over the context (a tool
whose schema holds a 20,000-value enum renders to 290 KB) costs a count of its bytes, not a second of tokenizing.

Every token stands for a run of the model's input units (bytes for a byte-level BPE, characters otherwise), and a
unit `x` can only lie in a token at most `longest[x]` units long, the longest token holding it. Give each unit of the
text the weight 1 / longest[x]: the units a token of length L stands for weigh at most L / L = 1 together, so the
tokens number at least the text's total weight. A unit that is no token by itself costs a token of its own or more
where the model has a byte fallback or an unknown token (weight 1 at most), and may be dropped where it has neither
(weight 0). Added and special tokens count as tokens of their text.

The bound holds only for pipelines whose every step keeps the text's units: `TokenFloor.of` reads the tokenizer's
own description (tokenizer.json) and returns None for any step it does not know to (a normalizer or pre-tokenizer
that drops or merges characters, WordPiece's and fused unknowns that stand for whole words, an added token that
swallows the whitespace beside it), so such a tokenizer is simply counted by tokenizing. Unicode normal forms keep
every ASCII character, either as itself or as the base of one composed character of two bytes or more; under them
only ASCII units are weighed, each by at most 1 / the longest token holding it or any non-ASCII unit."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
KEEPING_SPLITS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
"""Pre-tokenizers that only split (and ByteLevel / Metaspace, which map each unit to one unit): unless `Removed`."""

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A byte-fallback token's text: it stands for one byte of a character no other token holds."""


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte in a byte-level BPE's vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenFloor:
    """The least number of tokens a text can have for one tokenizer (see the module's docstring)."""

    def __init__(self, longest: dict[int, int], singles: set[int], unknown: float, byte_level: bool,
                 ascii_only: bool, char_map: dict[int, int]) -> None:
        self.byte_level = byte_level  # units are the text's UTF-8 bytes, else its characters (code points)
        self.ascii_only = ascii_only  # a Unicode normal form: only ASCII units are weighed
        self.char_map = char_map  # characters the pipeline replaces one for one (' ' → '▁')
        non_ascii = max((n for u, n in longest.items() if u >= 0x80), default=1) if ascii_only else 1
        # the weight of a unit no token holds: 1 with a fallback or unknown token, else 0 (and under a normal form,
        # an ASCII character may be a composed character's base: no more than its share of that token)
        self.unknown = min(unknown, 1 / non_ascii)
        # unit → its weight, for units some token holds (longest: the length in units of the longest one)
        self.weight = {u: 1 / max(n, non_ascii) if u in singles or unknown else 0.0 for u, n in longest.items()}
        self.byte_weight = np.array([self.weight_of(b) for b in range(256)])  # [256] for byte-level counts

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TokenFloor | None:
        """The floor of `tokenizer(text)` (with or without special tokens added), None where the tokenizer is not
        a plain Rust `tokenizers` pipeline of steps known to keep the text's units."""
        backend = plain_encoder(tokenizer)
        if backend is None:
            return None
        return cls.of_spec(json.loads(backend.to_str()))

    @classmethod
    def of_spec(cls, spec: dict[str, Any]) -> TokenFloor | None:
        """The floor of the pipeline a tokenizer.json describes, None where a step may drop or merge units."""
        steps = normalizer_steps(spec.get("normalizer"))
        pre = pre_tokenizer_steps(spec.get("pre_tokenizer"))
        model = spec.get("model") or {}
        added = spec.get("added_tokens") or []
        if steps is None or pre is None or not model_keeps_units(model):
            return None
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            return None  # it also stands for any whitespace beside it
        char_map: dict[int, int] = {}
        ascii_only = False
        for step in steps:
            if step["type"] in UNICODE_FORMS:
                ascii_only = True
            elif step["type"] == "Replace":
                char_map[ord(step["pattern"]["String"])] = ord(step["content"])
        byte_level = any(step["type"] == "ByteLevel" for step in pre)
        for step in pre:
            if step["type"] == "Metaspace":
                char_map[ord(" ")] = ord(step["replacement"])
        if char_map and (ascii_only or byte_level or set(char_map.values()) & set(char_map)):
            return None  # a replaced character is no longer the unit it was; not worth the care
        alphabet = byte_alphabet()
        longest: dict[int, int] = {}
        singles: set[int] = set()  # units that are a vocabulary token by themselves

        def hold(units: list[int]) -> None:
            for u in units:
                longest[u] = max(longest.get(u, 1), len(units))

        fallback = byte_fallback(model)
        for piece in vocabulary(model):
            if fallback and BYTE_TOKEN.fullmatch(piece):
                continue
            units = [alphabet.get(c, ord(c)) for c in piece] if byte_level else [ord(c) for c in piece]
            hold(units)
            if len(units) == 1:
                singles.add(units[0])
        for token in added:
            content = token["content"]
            hold(list(content.encode()) if byte_level else [char_map.get(ord(c), ord(c)) for c in content])
        unknown = 1.0 if fallback or model.get("unk_token") else 0.0
        return cls(longest, singles, unknown, byte_level, ascii_only, char_map)

    def weight_of(self, unit: int) -> float:
        """The weight of one unit of a text (see the module's docstring)."""
        if self.ascii_only and unit >= 0x80:
            return 0.0
        return self.weight.get(self.char_map.get(unit, unit), self.unknown)

    def tokens(self, text: str) -> int:
        """A number of tokens `text` certainly has, or more: its units' total weight, counted in C (a millisecond
        for 290 KB), not its tokenization (a second)."""
        if self.byte_level:
            counts = np.bincount(np.frombuffer(text.encode(), np.uint8), minlength=256)  # [256]
            weight = float(counts @ self.byte_weight)
        else:
            units, n = np.unique(np.frombuffer(text.encode("utf-32-le"), np.uint32), return_counts=True)  # [U], [U]
            weight = math.fsum(int(c) * self.weight_of(int(u)) for u, c in zip(units, n, strict=True))
        return max(0, math.floor(weight - 1e-6))  # the sum's rounding error is far below 1e-6 tokens


def plain_encoder(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The `tokenizers.Tokenizer` that does the whole of `tokenizer(text)`: None when the tokenizer's class adds
    anything to it (or is a slow, Python tokenizer)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or any(
            getattr(cls, name, None) is not getattr(TokenizersBackend, name, None)
            for name in ("_encode_plus", "tokenize", "__call__", "_call_one", "encode")):
        return None
    return getattr(tokenizer, "_tokenizer", None)


def normalizer_steps(spec: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The normalizer's steps, None when one may drop or shorten characters beyond what TokenFloor allows for."""
    steps = flatten(spec, "normalizers")
    for step in steps:
        kind = step.get("type")
        if kind == "Replace":
            pattern, content = step.get("pattern", {}).get("String"), step.get("content", "")
            if not isinstance(pattern, str) or len(pattern) != 1 or len(content) != 1:
                return None
        elif kind not in {"Prepend", *UNICODE_FORMS}:
            return None
    return steps


def pre_tokenizer_steps(spec: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The pre-tokenizer's steps, None when one drops characters (whitespace splitters, `Removed` splits)."""
    steps = flatten(spec, "pretokenizers")
    for step in steps:
        if step.get("type") not in KEEPING_SPLITS or step.get("behavior") == "Removed":
            return None
        if step.get("type") == "Metaspace" and len(step.get("replacement", "")) != 1:
            return None
    return steps


def flatten(spec: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A step and its nested `Sequence`s as one list."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [s for inner in spec.get(key, []) for s in flatten(inner, key)]
    return [spec]


def model_keeps_units(model: dict[str, Any]) -> bool:
    """Whether every token of the model stands for exactly its own text: BPE, unless unknown characters fuse into
    one token (fuse_unk without byte fallback); Unigram only with byte fallback (its unknowns always fuse)."""
    kind = model.get("type")
    if kind == "BPE":
        return not (model.get("unk_token") and model.get("fuse_unk") and not byte_fallback(model))
    return kind == "Unigram" and byte_fallback(model)


def byte_fallback(model: dict[str, Any]) -> bool:
    """Whether a character no token holds becomes its bytes' tokens: the fallback is on and all 256 are there."""
    pieces = set(vocabulary(model))
    return bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in pieces for b in range(256))


def vocabulary(model: dict[str, Any]) -> Iterable[str]:
    """The model's token texts (BPE's vocab keys, Unigram's pieces)."""
    vocab = model.get("vocab") or {}
    return vocab.keys() if isinstance(vocab, dict) else (piece for piece, _ in vocab)
