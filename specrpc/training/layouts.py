"""Training rows: plain windows of the token stream, and fill-in-the-middle examples cut at the character level.

A row of the batch has one layout, drawn with the plan's mix:
- ``plain``: a window of the training stream (files as `<|file_sep|>path\\n text <|endoftext|>`, one after another);
- ``psm``: ``<|fim_prefix|>`` [``<|file_sep|>path\\n``] prefix ``<|fim_suffix|>`` suffix ``<|fim_middle|>`` middle
  ``<|endoftext|>``;
- ``spm`` (llama.cpp's ``--spm-infill`` order): ``<|fim_suffix|>`` suffix ``<|fim_prefix|>`` [``<|file_sep|>path\\n``]
  prefix ``<|fim_middle|>`` middle ``<|endoftext|>``;
- ``repo``: one to two other files of the same folder first, each ``<|file_sep|>path\\n text <|endoftext|>`` (cut to
  a quarter of the row each), then a PSM or SPM block (even odds) for the file being edited.
FIM examples are cut from one file's text before tokenization, as an editor's request is: a chunk of the file that
fits the row (whole when it fits; otherwise starting at a random line), a cursor at any character (a quarter of
the time just after the line's indentation), and a middle that runs either to the end of the cursor's line and
0-2 more lines (half the time) or to a uniformly drawn later character. Prefix, suffix and middle are tokenized
separately, as the service tokenizes a request; when they come out longer than the row allows, the suffix's end
(then the prefix's start) is trimmed, never the middle. The path header is there whenever the prefix starts at the
file's start (it then reads exactly as the plain form does), in half of the other examples (an editor that trims
the prefix but names the file), and always in the repository form. Examples are packed until the row is full; a tail
too short for an example (< `MIN_EXAMPLE_TOKENS`) is filled from the plain stream; the last example may be cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from specrpc.training.tokenizer import EOT, FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

LAYOUTS = ("plain", "psm", "spm", "repo")
MIN_EXAMPLE_TOKENS = 128
CHARS_MARGIN = 0.9  # chunks are sized from the file's own characters per token, with this margin


@dataclass(frozen=True)
class Documents:
    """The training files, for FIM examples: concatenated UTF-8 text, per-file byte offsets, paths, token counts
    and the files of the same folder (for the repository form)."""

    blob: bytes
    offsets: np.ndarray  # [N+1] int64 byte offsets into blob
    relpaths: list[str]
    tokens: np.ndarray  # [N] int64 tokens per file (as encoded in the stream)
    siblings: list[list[int]]

    def text(self, i: int) -> str:
        """File i's text."""
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].decode("utf-8")


def folder_groups(keys: list[tuple[str, str]]) -> list[list[int]]:
    """For each (source, relpath), the indices of the other files of the same source and folder."""
    by_folder: dict[tuple[str, str], list[int]] = {}
    for i, (source, rel) in enumerate(keys):
        by_folder.setdefault((source, rel.rpartition("/")[0]), []).append(i)
    return [[j for j in by_folder[(s, r.rpartition("/")[0])] if j != i] for i, (s, r) in enumerate(keys)]


def split_points(chunk: str, rng: np.random.Generator) -> tuple[int, int]:
    """(cursor, end of middle) character positions in `chunk`, as described in the module docstring."""
    i = int(rng.integers(0, len(chunk) + 1))
    if rng.random() < 0.25:  # the cursor just after the indentation of its line
        start = chunk.rfind("\n", 0, i) + 1
        i = start + len(chunk[start:]) - len(chunk[start:].lstrip(" \t"))
        i = min(i, len(chunk))
    if rng.random() < 0.5:
        j = i
        for _ in range(1 + int(rng.integers(0, 3))):
            nl = chunk.find("\n", j)
            j = len(chunk) if nl < 0 else nl + 1
        return i, j
    return i, int(rng.integers(i, len(chunk) + 1))


def chunk_of(text: str, n_tokens: int, budget: int, rng: np.random.Generator) -> tuple[str, bool]:
    """(a chunk of `text` of about `budget` tokens, whether it starts at the file's start). Long files give a chunk
    from a random line start, ending at a line end."""
    chars = int(budget * len(text) / max(1, n_tokens) * CHARS_MARGIN)
    if len(text) <= chars:
        return text, True
    a = int(rng.integers(0, len(text) - chars + 1))
    a = text.rfind("\n", 0, a) + 1
    end = text.rfind("\n", a, a + chars)
    return text[a : (end + 1 if end > a else a + chars)], a == 0


class RowBuilder:
    """Builds training rows of one layout from the stream and the documents, deterministically from a generator."""

    def __init__(self, tok: Tokenizer, special: dict[str, int], stream: np.ndarray, docs: Documents) -> None:
        self.tok, self.special, self.stream, self.docs = tok, special, stream, docs
        self.cum = np.cumsum(docs.tokens)  # [N]

    def ids(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return list(self.tok.encode(text, add_special_tokens=False).ids) if text else []

    def plain(self, n: int, rng: np.random.Generator) -> list[int]:
        """n consecutive tokens of the stream from a random position."""
        s = int(rng.integers(0, len(self.stream) - n))
        return [int(t) for t in self.stream[s : s + n]]

    def pick(self, rng: np.random.Generator) -> int:
        """A file, with probability proportional to its tokens."""
        return int(np.searchsorted(self.cum, rng.integers(0, int(self.cum[-1])), side="right"))

    def fim(self, i: int, order: str, budget: int, rng: np.random.Generator, force_path: bool = False) -> list[int]:
        """One FIM example of file i in `order` ("psm"/"spm"), about `budget` tokens or fewer."""
        sp = self.special
        path = self.ids(f"{self.docs.relpaths[i]}\n")
        chunk, at_start = chunk_of(self.docs.text(i), int(self.docs.tokens[i]), budget - 4 - len(path), rng)
        a, b = split_points(chunk, rng)
        header = [sp[FILE_SEP], *path] if force_path or at_start or rng.random() < 0.5 else []
        prefix, middle, suffix = self.ids(chunk[:a]), self.ids(chunk[a:b]), self.ids(chunk[b:])
        excess = 4 + len(header) + len(prefix) + len(middle) + len(suffix) - budget
        if excess > 0:  # the chunk's text tokenized longer than its estimate: trim the suffix's end, then the prefix's
            cut = min(excess, len(suffix))  # start, so the middle stays whole
            suffix, prefix = suffix[: len(suffix) - cut], prefix[min(len(prefix), excess - cut) :]
        if order == "psm":
            return [sp[FIM_PREFIX], *header, *prefix, sp[FIM_SUFFIX], *suffix, sp[FIM_MIDDLE], *middle, sp[EOT]]
        return [sp[FIM_SUFFIX], *suffix, sp[FIM_PREFIX], *header, *prefix, sp[FIM_MIDDLE], *middle, sp[EOT]]

    def repo(self, budget: int, rng: np.random.Generator) -> list[int]:
        """Other files of the same folder first, then a FIM block (PSM or SPM) of the edited file."""
        i = self.pick(rng)
        order = "psm" if rng.random() < 0.5 else "spm"
        others = self.docs.siblings[i]
        out: list[int] = []
        if others:
            count = min(len(others), 1 + int(rng.integers(0, 2)))
            for j in sorted(rng.choice(len(others), size=count, replace=False).tolist()):
                k = others[j]
                text, _ = chunk_of(self.docs.text(k), int(self.docs.tokens[k]), budget // 4, rng)
                out += [self.special[FILE_SEP], *self.ids(f"{self.docs.relpaths[k]}\n{text}"), self.special[EOT]]
        return out + self.fim(i, order, budget - len(out), rng, force_path=True)

    def row(self, layout: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """n tokens of one layout. # [n] int64"""
        out: list[int] = []
        while len(out) < n:
            left = n - len(out)
            if layout == "plain" or left < MIN_EXAMPLE_TOKENS:
                out += self.plain(left, rng)
            elif layout == "repo":
                out += self.repo(left, rng)
            else:
                out += self.fim(self.pick(rng), layout, left, rng)
        return np.asarray(out[:n], dtype=np.int64)
