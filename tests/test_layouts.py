"""Training rows: FIM layouts spelled as the pair's contract says, cut at the character level, packed to length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from specrpc.training.layouts import Documents, RowBuilder, folder_groups, split_points
from specrpc.training.tokenizer import EOT, FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, SPECIAL_TOKENS

ASSETS = Path(__file__).resolve().parent.parent / "specrpc" / "assets"


def source(n: int, name: str) -> str:
    """A small module."""
    return "".join(f"def {name}_{i}(value):\n    total = value * {i}\n    return total + {i}\n\n" for i in range(n))


@pytest.fixture(scope="module")
def builder() -> RowBuilder:
    tok = Tokenizer.from_file(str(ASSETS / "target" / "tokenizer.json"))
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    files = [("pkg/a.py", source(30, "alpha")), ("pkg/b.py", source(5, "beta")), ("other/c.py", source(60, "gamma"))]
    blobs = [text.encode() for _, text in files]
    tokens = [len(tok.encode(f"{p}\n{t}").ids) + 2 for p, t in files]
    docs = Documents(b"".join(blobs), np.cumsum([0, *map(len, blobs)]), [p for p, _ in files],
                     np.asarray(tokens), folder_groups([("lib", p) for p, _ in files]))
    stream = np.asarray([i % 200 + 10 for i in range(5000)], dtype=np.uint16)
    return RowBuilder(tok, special, stream, docs)


def pieces(builder: RowBuilder, row: list[int], order: str) -> tuple[str, str, str, str]:
    """(header path, prefix, suffix, middle) of the first FIM example in `row`."""
    sp = builder.special
    end = row.index(sp[EOT])
    body = row[:end]
    pre, suf, mid = body.index(sp[FIM_PREFIX]), body.index(sp[FIM_SUFFIX]), body.index(sp[FIM_MIDDLE])
    if order == "psm":
        assert pre == 0 and pre < suf < mid
        prefix_ids, suffix_ids = body[pre + 1 : suf], body[suf + 1 : mid]
    else:
        assert suf == 0 and suf < pre < mid
        suffix_ids, prefix_ids = body[suf + 1 : pre], body[pre + 1 : mid]
    header = ""
    if prefix_ids and prefix_ids[0] == sp[FILE_SEP]:
        text = builder.tok.decode(prefix_ids[1:])
        header, _, rest = text.partition("\n")
        prefix_ids = builder.ids(rest)
    decode = builder.tok.decode
    return header, decode(prefix_ids), decode(suffix_ids), decode(body[mid + 1 :])


@pytest.mark.parametrize("order", ["psm", "spm"])
def test_fim_rows_are_spelled_by_the_contract_and_cut_from_one_file(builder: RowBuilder, order: str) -> None:
    texts = [builder.docs.text(i) for i in range(3)]
    mid_line = 0
    for seed in range(30):
        row = builder.row(order, 400, np.random.default_rng(seed)).tolist()
        assert len(row) == 400
        header, prefix, suffix, middle = pieces(builder, row, order)
        assert any(prefix + middle + suffix in t for t in texts), "prefix, middle and suffix are one span of a file"
        if header:
            assert header in builder.docs.relpaths
        mid_line += bool(prefix) and not prefix.endswith("\n")
    assert mid_line > 5, "cursors fall inside lines"


def test_repository_rows_put_other_files_of_the_folder_first(builder: RowBuilder) -> None:
    sp = builder.special
    seen = 0
    for seed in range(20):
        row = builder.row("repo", 600, np.random.default_rng(seed)).tolist()
        if row[0] == sp[FILE_SEP]:
            first = builder.tok.decode(row[1 : row.index(sp[EOT])]).partition("\n")[0]
            assert first in ("pkg/a.py", "pkg/b.py")
            seen += 1
        fim_start = next(i for i, t in enumerate(row) if t in (sp[FIM_PREFIX], sp[FIM_SUFFIX]))
        block = row[fim_start:]
        assert sp[FILE_SEP] in block[: block.index(sp[FIM_MIDDLE])], "the edited file is named in the repository form"
    assert seen > 0


def test_rows_are_deterministic_and_plain_rows_come_from_the_stream(builder: RowBuilder) -> None:
    a = builder.row("spm", 300, np.random.default_rng(7))
    b = builder.row("spm", 300, np.random.default_rng(7))
    assert (a == b).all()
    plain = builder.row("plain", 50, np.random.default_rng(1))
    windows = np.lib.stride_tricks.sliding_window_view(builder.stream, 50)  # [T-49, 50]
    assert (windows == plain).all(axis=1).any(), "a window of the stream"


def test_split_points_stay_inside_the_chunk() -> None:
    rng = np.random.default_rng(0)
    chunk = "a = 1\n    b = 2\nc = 3\n"
    for _ in range(200):
        i, j = split_points(chunk, rng)
        assert 0 <= i <= j <= len(chunk)
