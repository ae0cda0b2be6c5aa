"""The training corpus: the running interpreter's standard-library Python sources, split by path hash.

Selection: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, excluding ``site-packages`` and
``dist-packages`` (third-party code stays out, so it can serve as held-out evaluation), files larger than
``MAX_FILE_BYTES`` and files that are not valid UTF-8. A file is held out when the SHA-1 of its path relative to
the stdlib root, read as an integer, is divisible by ``HELDOUT_MODULUS`` (about 1 file in 40).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_BYTES = 400_000
HELDOUT_MODULUS = 40
EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to the stdlib root and its text."""

    relpath: str
    text: str


def stdlib_root() -> Path:
    """The standard-library folder of the interpreter running this code."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """True for the deterministic held-out split (by path hash, not by content)."""
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def iter_sources(root: Path | None = None) -> list[SourceFile]:
    """All selected files, sorted by relative path."""
    base = root or stdlib_root()
    files: list[SourceFile] = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if EXCLUDED_PARTS.intersection(rel.parts) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(rel.as_posix(), text))
    return files


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout) by `is_heldout`."""
    train = [f for f in files if not is_heldout(f.relpath)]
    heldout = [f for f in files if is_heldout(f.relpath)]
    return train, heldout
