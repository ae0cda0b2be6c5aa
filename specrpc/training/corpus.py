"""The training corpus: the standard library and the permissively licensed installed distributions, by fixed rules.

Candidates, in this order (the order decides which copy of a duplicate stays):
1. the running interpreter's standard library: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` outside
   ``site-packages``/``dist-packages``/``__pycache__``, path relative to that folder (as the first pair had it);
2. every distribution installed in the interpreter's site-packages (``importlib.metadata``), sorted by name: the
   ``*.py`` files its RECORD lists, path relative to site-packages; taken only when `licenses.classify` accepts
   its license, and never the evaluation packages (`EVALUATION_PACKAGES`) or this project itself.
A candidate is dropped when it is larger than `MAX_FILE_BYTES`, has a line longer than `MAX_LINE_CHARS`, is not
UTF-8, is generated (`dedup.is_generated`), or duplicates (exactly, or nearly by MinHash) a file kept before it or
any file of an evaluation package. A kept file is held out when the SHA-1 of its relative path, read as an integer,
is divisible by `HELDOUT_MODULUS` (about 1 file in 40); held-out files are never trained on.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import platform
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from specrpc.training.dedup import NearDuplicateIndex, content_key, is_generated, minhash
from specrpc.training.licenses import classify

MAX_FILE_BYTES = 300_000
MAX_LINE_CHARS = 2_000
HELDOUT_MODULUS = 40
EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})
STDLIB = "python-stdlib"
# Installed, permissively licensed, not vendored by pip or setuptools, and nothing the pair's training or serving
# leans on: code the pair never sees, to measure it on.
EVALUATION_PACKAGES = ("networkx", "jinja2", "fsspec")
PROJECT_DISTRIBUTIONS = frozenset({"specrpc", "specrpc-client"})


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to its root (stdlib folder or site-packages), its text and source."""

    relpath: str
    text: str
    source: str = STDLIB


@dataclass(frozen=True)
class Source:
    """A distribution (or the standard library) whose files are candidates."""

    name: str
    version: str
    license: str
    root: Path
    relpaths: tuple[str, ...]


@dataclass
class Corpus:
    """The selected files (train and held-out together, in selection order) and what the rules left out."""

    files: list[SourceFile]
    sources: list[Source]
    excluded: list[dict[str, str]] = field(default_factory=list)  # distributions left out: name, version, reason
    dropped: Counter[str] = field(default_factory=Counter)  # files left out, by reason


def stdlib_root() -> Path:
    """The standard-library folder of the interpreter running this code."""
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages() -> list[Path]:
    """The interpreter's site-packages folders (purelib and platlib, once each)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def is_heldout(relpath: str) -> bool:
    """True for the deterministic held-out split (by path hash, not by content)."""
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def canonical(name: str) -> str:
    """The distribution name normalised as PEP 503 does (for comparisons only)."""
    return "-".join(name.lower().replace("_", "-").replace(".", "-").split("-"))


def stdlib_source() -> Source:
    """The standard library as a candidate source."""
    root = stdlib_root()
    rels = [p.relative_to(root) for p in sorted(root.rglob("*.py"))]
    keep = tuple(r.as_posix() for r in rels if not EXCLUDED_PARTS.intersection(r.parts))
    return Source(STDLIB, platform.python_version(), "PSF-2.0", root, keep)


def distribution_source(dist: md.Distribution, root: Path) -> Source:
    """One installed distribution's ``*.py`` files (from its RECORD) as a candidate source; license may be ''."""
    license_name, _ = classify(dist.metadata)  # type: ignore[arg-type]
    rels = sorted({f.as_posix() for f in dist.files or [] if f.suffix == ".py" and ".." not in f.parts
                   and "__pycache__" not in f.parts})
    return Source(dist.metadata["Name"], dist.version, license_name or "", root, tuple(rels))


def installed_sources() -> tuple[list[Source], list[Source], list[dict[str, str]]]:
    """(accepted distributions, evaluation distributions, excluded distributions with the reason), by name."""
    accepted: list[Source] = []
    evaluation: list[Source] = []
    excluded: list[dict[str, str]] = []
    seen: set[str] = set()
    for root in site_packages():
        dists = sorted(md.distributions(path=[str(root)]), key=lambda d: canonical(d.metadata["Name"]))
        for dist in dists:
            name = canonical(dist.metadata["Name"])
            if name in seen:
                continue
            seen.add(name)
            source = distribution_source(dist, root)
            _, why = classify(dist.metadata)  # type: ignore[arg-type]
            if name in PROJECT_DISTRIBUTIONS:
                excluded.append({"name": source.name, "version": source.version, "reason": "this project"})
            elif not source.license:
                excluded.append({"name": source.name, "version": source.version, "reason": why})
            elif name in EVALUATION_PACKAGES:
                evaluation.append(source)
            elif source.relpaths:
                accepted.append(source)
    return accepted, evaluation, excluded


def read_text(path: Path) -> tuple[str | None, str]:
    """(text, '') for a usable candidate, else (None, the reason it is dropped)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None, "larger than MAX_FILE_BYTES"
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except OSError:
        return None, "unreadable"
    if any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
        return None, "line longer than MAX_LINE_CHARS"
    return text, ""


def read_source(source: Source, dropped: Counter[str], keep: set[str] | None = None) -> list[SourceFile]:
    """The files of `source` that pass the per-file rules (size, lines, encoding, not generated)."""
    out = []
    for rel in source.relpaths:
        if keep is not None and rel not in keep:
            continue
        text, why = read_text(source.root / rel)
        if text is None:
            dropped[why] += 1
        elif is_generated(rel, text):
            dropped["generated"] += 1
        else:
            out.append(SourceFile(rel, text, source.name))
    return out


def sample_paths(sources: list[Source], max_files: int) -> set[str]:
    """A deterministic subset of `max_files` candidate paths (the first by path hash), for quick runs."""
    rels = sorted((hashlib.sha1(r.encode()).hexdigest(), r) for s in sources for r in s.relpaths)
    return {r for _, r in rels[:max_files]}


def build_corpus(max_files: int = 0) -> Corpus:
    """Apply the module's rules to this installation; `max_files` > 0 takes only a fixed subset of candidates."""
    accepted, evaluation, excluded = installed_sources()
    sources = [stdlib_source(), *accepted]
    keep = sample_paths(sources, max_files) if max_files else None
    dropped: Counter[str] = Counter()
    seen_exact: set[bytes] = set()
    eval_index, index = NearDuplicateIndex(), NearDuplicateIndex()
    for source in evaluation:
        for f in read_source(source, Counter()):
            seen_exact.add(content_key(f.text))
            sig = minhash(f.text)
            if sig is not None:
                eval_index.add(sig)
    files: list[SourceFile] = []
    for source in sources:
        for f in read_source(source, dropped, keep):
            key = content_key(f.text)
            if key in seen_exact:
                dropped["exact duplicate"] += 1
                continue
            seen_exact.add(key)
            sig = minhash(f.text)
            if sig is not None and eval_index.find(sig) is not None:
                dropped["near duplicate of an evaluation file"] += 1
                continue
            if sig is not None and index.find(sig) is not None:
                dropped["near duplicate"] += 1
                continue
            if sig is not None:
                index.add(sig)
            files.append(f)
    for source in evaluation:
        excluded.append({"name": source.name, "version": source.version, "reason": "evaluation package"})
    return Corpus(files, sources, sorted(excluded, key=lambda e: canonical(e["name"])), dropped)


def evaluation_sources(name: str, limit_files: int = 60) -> list[SourceFile]:
    """Up to `limit_files` files of an evaluation package (evenly spread over its sorted paths), per-file rules
    applied."""
    _, evaluation, _ = installed_sources()
    source = next((s for s in evaluation if canonical(s.name) == canonical(name)), None)
    if source is None:
        raise SystemExit(f"evaluation package {name!r} is not installed here (or its license is not accepted)")
    files = read_source(source, Counter())
    return files[:: max(1, len(files) // limit_files)][:limit_files]


def iter_sources(root: Path | None = None) -> list[SourceFile]:
    """Every file under `root` (default: the standard library) that passes the per-file rules, by relative path."""
    base = root or stdlib_root()
    rels = tuple(p.relative_to(base).as_posix() for p in sorted(base.rglob("*.py"))
                 if not EXCLUDED_PARTS.intersection(p.relative_to(base).parts))
    return read_source(Source(STDLIB, "", "", base, rels), Counter())


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout) by `is_heldout`."""
    train = [f for f in files if not is_heldout(f.relpath)]
    heldout = [f for f in files if is_heldout(f.relpath)]
    return train, heldout
