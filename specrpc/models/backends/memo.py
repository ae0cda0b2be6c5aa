"""What a model's start-up measurements chose (`LlamaLM.use_native`: the native step's settings, the forwards it takes,
torch's one-token path), and the step costs the engine measured over them (`Runtime`), kept on this machine for its
next start. A start with the same key (the checkpoint's files, the load settings, the native library's sources, flags
and CPU, the CPU's name, torch's version and threads) takes the remembered choice after one check, a one-token
forward within `Drift`'s tolerance of its time when the choice was made, instead of measuring every shape again
(loading the shipped pair: 0.61 s instead of 7.62, median of five starts each on a 2-core AMD EPYC Zen 3 at two
threads, `tools/start_cost.py`). A check that is off, a changed key or an unreadable file: measured as at a first
start, and the new choice kept. One JSON file a key under the native library's cache directory, written whole
(`os.replace`), so concurrent starts never read half a file."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specrpc import native

log = logging.getLogger(__name__)


def directory() -> Path:
    """Where memos are kept: beside the native libraries they were measured with (`native.cache_dir`)."""
    return native.cache_dir() / "execution"


def checkpoint_identity(path: Path) -> list[str]:
    """The checkpoint directory's files by name, size and modification time: a new export is a new key."""
    stats = sorted((p.name, p.stat()) for p in path.iterdir() if p.is_file())
    return [f"{name}:{stat.st_size}:{stat.st_mtime_ns}" for name, stat in stats]


class Memo:
    """The remembered choice of one model loaded one way on this machine (`for_model`)."""

    def __init__(self, file: Path) -> None:
        self.file = file

    @classmethod
    def for_model(cls, path: Path, settings: Mapping[str, object], name: str = "") -> Memo | None:
        """The memo of the checkpoint at `path` loaded with `settings` (what changes the paths' times: dtype, weight
        formats, slots and context, deterministic), or None without a native library (nothing to remember); its
        file named `name` (the checkpoint directory's name) and the key."""
        library = native.library_path()
        if library is None:
            return None
        cpu = native.cpu_field("model name") or platform.processor()
        parts = [str(path.resolve()), *checkpoint_identity(path), json.dumps(dict(settings), sort_keys=True),
                 library.name, cpu, torch.__version__, str(torch.get_num_threads())]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
        return cls(directory() / f"{name or path.name}-{key}.json")

    def recall(self) -> dict[str, Any] | None:
        """The choice kept for this key, or None (none kept, or a file that does not parse)."""
        try:
            entry = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return None
        return entry if isinstance(entry, dict) else None

    def keep(self, entry: Mapping[str, Any]) -> None:
        """Keep `entry` for the next start (a failure to write is logged, never raised: the next start measures)."""
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.file.parent, suffix=".tmp", delete=False) as fh:
                json.dump(dict(entry), fh)
            os.replace(fh.name, self.file)
        except OSError as exc:
            log.warning("execution memo %s not written (%s); the next start measures again", self.file, exc)
