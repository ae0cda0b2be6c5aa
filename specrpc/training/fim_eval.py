"""Fill-in-the-middle next-line exact match: how often the target completes a held-out line exactly, per order.

A case is a held-out file cut in one of its lines (a line of at least 8 non-blank characters, not the first or
last): the cursor sits at the line's start ("line start": the whole line, indentation included, is to write; the
prefix ends at a newline, a token boundary) or, for "mid-line" cases, after the indentation and 1 to half of the
line's characters (an editor's cursor mid-line, often inside a token). The prefix
is up to `PREFIX_CHARS` before the cursor, the suffix up to `SUFFIX_CHARS` after the line, and the expected middle
is the rest of the line. The prompt follows the pair's spelling with the path header (`layouts`); the target decodes
greedily until a newline or `<|endoftext|>`, and the case counts when the first line it wrote equals the rest of
the line (trailing whitespace ignored). Cases come from a seeded generator over the files given: deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from specrpc.training.corpus import SourceFile
from specrpc.training.tokenizer import FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

PREFIX_CHARS = 2400
SUFFIX_CHARS = 1200
MAX_NEW_TOKENS = 48


@dataclass(frozen=True)
class FimCase:
    """One held-out line to complete."""

    path: str
    prefix: str
    suffix: str
    expected: str


def fim_cases(files: list[SourceFile], n: int, mid_line: bool = True, seed: int = 0) -> list[FimCase]:
    """n cases, drawn deterministically from `files` (files of fewer than 5 lines are skipped)."""
    rng = random.Random(seed)
    pool = [f for f in files if f.text.count("\n") >= 5]
    cases: list[FimCase] = []
    for _ in range(50 * n if pool else 0):
        if len(cases) == n:
            break
        f = rng.choice(pool)
        lines = f.text.splitlines(keepends=True)
        k = rng.randrange(1, len(lines) - 1)
        body = lines[k].strip()
        if len(body) < 8:
            continue
        indent = len(lines[k]) - len(lines[k].lstrip())
        cut = indent + rng.randint(1, len(body) // 2) if mid_line else 0
        start = sum(len(line) for line in lines[:k])
        cases.append(FimCase(f.relpath, f.text[: start + cut][-PREFIX_CHARS:],
                             f.text[start + len(lines[k]) :][:SUFFIX_CHARS], lines[k][cut:].rstrip()))
    return cases


def prompt_ids(tok: PreTrainedTokenizerBase, case: FimCase, order: str) -> list[int]:
    """The case as a FIM prompt in `order` ("psm" or "spm"), path header included."""
    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids) if text else []

    def special(token: str) -> int:
        return int(tok.convert_tokens_to_ids(token))  # type: ignore[arg-type]

    header = [special(FILE_SEP), *ids(f"{case.path}\n")]
    pre, suf, mid = special(FIM_PREFIX), special(FIM_SUFFIX), special(FIM_MIDDLE)
    if order == "psm":
        return [pre, *header, *ids(case.prefix), suf, *ids(case.suffix), mid]
    return [suf, *ids(case.suffix), pre, *header, *ids(case.prefix), mid]


@torch.inference_mode()
def greedy_line(model: torch.nn.Module, tok: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The model's greedy continuation of `ids` up to its first newline or end of text (at most MAX_NEW_TOKENS)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    generated: list[int] = []
    for _ in range(MAX_NEW_TOKENS):
        nxt = int(out.logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        generated.append(nxt)
        if "\n" in str(tok.decode(generated)):
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return str(tok.decode(generated, skip_special_tokens=True)).split("\n")[0]


def fim_exact_match(model: torch.nn.Module, tok: PreTrainedTokenizerBase, files: list[SourceFile], n: int,
                    order: str) -> dict[str, float]:
    """{"cases", "line_start", "mid_line"}: the fractions of `n` held-out lines of each kind that the model
    completes exactly in `order` ("psm" or "spm")."""
    result: dict[str, float] = {"cases": n}
    for kind, mid_line in (("line_start", False), ("mid_line", True)):
        cases = fim_cases(files, n, mid_line)
        hits = sum(greedy_line(model, tok, prompt_ids(tok, c, order)).rstrip() == c.expected for c in cases)
        result[kind] = hits / max(1, len(cases))
    return result
