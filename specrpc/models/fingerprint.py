"""A short hash naming a model pair by its files, so that benchmark figures from two pairs are never mixed up."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 20


def pair_hash(target: str, draft: str) -> str:
    """The first 10 hex digits of a SHA-256 over both models' files (names relative to each folder, then contents,
    in name order). A model that is not a local folder (`none`, a name) contributes its name."""
    digest = hashlib.sha256()
    for model in (target, draft):
        folder = Path(model)
        digest.update(b"\0model\0")
        if not folder.is_dir():
            digest.update(model.encode())
            continue
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
    return digest.hexdigest()[:10]
