"""Benchmark prompts cut from held-out Python files: code completion, fill-in-the-middle and natural language."""

from __future__ import annotations

import ast
import functools
import random
from dataclasses import dataclass

from specrpc.training.corpus import SourceFile, is_heldout, iter_sources


@dataclass(frozen=True)
class Case:
    """One benchmark prompt: plain text, or prefix + suffix for infilling."""

    workload: str
    name: str
    prompt: str
    suffix: str | None
    max_new_tokens: int


def heldout_files() -> list[SourceFile]:
    """Standard-library files of the held-out split, plus third-party code the models never saw (the evaluation
    packages, `corpus.EVALUATION_PACKAGES`)."""
    return list(_heldout())


@functools.cache
def _heldout() -> tuple[SourceFile, ...]:
    """`heldout_files`, read and parsed once per process (seconds: every bench row and its tests start here)."""
    files = [f for f in iter_sources() if is_heldout(f.relpath) and len(f.text) > 2000]
    try:
        from specrpc.training.evaluate import third_party_sources

        files += [f for f in third_party_sources() if len(f.text) > 2000]
    except ImportError:  # pragma: no cover - the evaluation packages come with the project's dependencies
        pass
    return tuple(files)


def completion_cases(files: list[SourceFile], n: int, rng: random.Random, context_chars: int = 1200) -> list[Case]:
    """Files cut at a random line; the prompt is up to `context_chars` before the cut."""
    cases = []
    for f in rng.sample(files, min(n, len(files))):
        lines = f.text.splitlines(keepends=True)
        cut = rng.randrange(len(lines) // 4, max(len(lines) // 4 + 1, len(lines) - 5))
        prompt = "".join(lines[:cut])[-context_chars:]
        cases.append(Case("code", f"{f.relpath}:{cut}", prompt, None, rng.randint(64, 128)))
    return cases


def infill_cases(files: list[SourceFile], n: int, rng: random.Random, context_chars: int = 1000) -> list[Case]:
    """A function body removed: prefix up to the body, suffix after the function."""
    candidates: list[tuple[SourceFile, ast.FunctionDef]] = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        candidates += [(f, node) for node in ast.walk(tree)
                       if isinstance(node, ast.FunctionDef) and node.end_lineno and 3 <= len(node.body) <= 12]
    cases = []
    for f, node in rng.sample(candidates, min(n, len(candidates))):
        lines = f.text.splitlines(keepends=True)
        body_start = node.body[0].lineno - 1
        if isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant):
            body_start = node.body[0].end_lineno or body_start  # keep the docstring in the prefix
        prefix = "".join(lines[:body_start])[-context_chars:]
        suffix = "".join(lines[node.end_lineno or body_start:])[: context_chars // 2]
        cases.append(Case("infill", f"{f.relpath}:{node.name}", prefix, suffix, 96))
    return cases


def text_cases(files: list[SourceFile], n: int, rng: random.Random) -> list[Case]:
    """Docstrings as prompts: the opening of a module/class/function docstring, continued as prose."""
    docs: list[tuple[str, str]] = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc) > 200:
                    docs.append((f"{f.relpath}:{getattr(node, 'name', 'module')}", doc))
    cases = []
    for name, doc in rng.sample(docs, min(n, len(docs))):
        cases.append(Case("text", name, '"""' + doc[: len(doc) // 3], None, 64))
    return cases


WORKLOADS = ("code", "infill", "text")


def build_cases(per_workload: int, seed: int = 0, workloads: tuple[str, ...] = WORKLOADS,
                files: list[SourceFile] | None = None) -> list[Case]:
    """The benchmark set, deterministic for a seed, cut from `files` (default: the held-out split)."""
    rng = random.Random(seed)
    files = heldout_files() if files is None else files
    makers = {"code": completion_cases, "infill": infill_cases}
    cases: list[Case] = []
    for name in workloads:
        cases += text_cases(files, per_workload, rng) if name == "text" else makers[name](files, per_workload, rng)
    return cases
