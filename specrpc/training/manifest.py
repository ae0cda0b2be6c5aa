"""The corpus manifest (`specrpc/assets/corpus.json`): what the corpus rules select on this installation.

`python -m specrpc.training.manifest` rebuilds it: the files `corpus.build_corpus` selects, tokenized with the
shipped tokenizer in the training stream's form (`<|file_sep|>path\\n text <|endoftext|>`). Per distribution:
``files``/``bytes``/``tokens`` count the training split, ``heldout_files`` the files held out by path hash (never
trained on). Distributions left out are listed with the reason, and files left out are counted by reason.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from specrpc.training.corpus import (
    EVALUATION_PACKAGES,
    HELDOUT_MODULUS,
    MAX_FILE_BYTES,
    MAX_LINE_CHARS,
    Corpus,
    SourceFile,
    build_corpus,
    is_heldout,
)

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def encode_files(tok: Tokenizer, files: list[SourceFile], chunk: int = 256) -> list[np.ndarray]:
    """Each file's ids as the stream holds them (`path\\n text`, without the two special tokens around it), as
    uint16 arrays; encoded a chunk of files at a time, as the tokenizer's full encodings take much memory."""
    out: list[np.ndarray] = []
    for lo in range(0, len(files), chunk):
        texts = [f"{f.relpath}\n{f.text}" for f in files[lo : lo + chunk]]
        out += [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(texts, add_special_tokens=False)]
    return out


def manifest(corpus: Corpus, train_tokens: dict[tuple[str, str], int]) -> dict[str, Any]:
    """The manifest of `corpus`; `train_tokens` maps each training file's (source, relpath) to its ids' count (2
    special tokens are added per file)."""
    entries = []
    for source in corpus.sources:
        mine = [f for f in corpus.files if f.source == source.name]
        train = [f for f in mine if not is_heldout(f.relpath)]
        if not mine:
            continue
        entries.append({
            "name": source.name, "version": source.version, "license": source.license, "files": len(train),
            "bytes": sum(len(f.text.encode()) for f in train),
            "tokens": sum(train_tokens[(f.source, f.relpath)] + 2 for f in train),
            "heldout_files": len(mine) - len(train),
        })
    return {
        "sources": entries,
        "totals": {k: sum(e[k] for e in entries) for k in ("files", "bytes", "tokens", "heldout_files")},
        "evaluation_packages": list(EVALUATION_PACKAGES),
        "excluded": corpus.excluded,
        "dropped_files": dict(sorted(corpus.dropped.items())),
        "rules": {"max_file_bytes": MAX_FILE_BYTES, "max_line_chars": MAX_LINE_CHARS,
                  "heldout_modulus": HELDOUT_MODULUS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=ASSETS / "target" / "tokenizer.json")
    parser.add_argument("--out", type=Path, default=ASSETS / "corpus.json")
    parser.add_argument("--max-files", type=int, default=0, help="a fixed subset of candidates (0: all)")
    args = parser.parse_args()
    t0 = time.time()
    corpus = build_corpus(args.max_files)
    t1 = time.time()
    train = [f for f in corpus.files if not is_heldout(f.relpath)]
    tok = Tokenizer.from_file(str(args.tokenizer))
    counts = {(f.source, f.relpath): len(ids) for f, ids in zip(train, encode_files(tok, train), strict=True)}
    t2 = time.time()
    result = manifest(corpus, counts)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(corpus.files)} files selected in {t1 - t0:.0f} s, {result['totals']['tokens']:,} training tokens "
          f"counted in {t2 - t1:.0f} s; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
