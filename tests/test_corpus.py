"""The corpus rules on this installation: deterministic, permissive only, evaluation packages and generated code out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrpc.training.corpus import (
    EVALUATION_PACKAGES,
    STDLIB,
    Corpus,
    build_corpus,
    canonical,
    evaluation_sources,
    installed_sources,
    is_heldout,
    split_sources,
)
from specrpc.training.licenses import spdx_ok

ASSETS = Path(__file__).resolve().parent.parent / "specrpc" / "assets"


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return build_corpus(max_files=400)


def test_a_rebuild_selects_the_same_files(corpus: Corpus) -> None:
    again = build_corpus(max_files=400)
    assert [(f.source, f.relpath) for f in again.files] == [(f.source, f.relpath) for f in corpus.files]


def test_sources_are_permissive_and_evaluation_packages_stay_out(corpus: Corpus) -> None:
    accepted, evaluation, excluded = installed_sources()
    assert {canonical(s.name) for s in evaluation} == set(EVALUATION_PACKAGES)
    assert all(s.license for s in accepted)
    assert not {canonical(f.source) for f in corpus.files} & set(EVALUATION_PACKAGES)
    assert {"specrpc", "specrpc-client"} <= {canonical(e["name"]) for e in excluded}
    assert corpus.files[0].source == STDLIB and len({f.source for f in corpus.files}) > 3


def test_no_generated_stubs_and_no_duplicates(corpus: Corpus) -> None:
    assert not [f for f in corpus.files if f.relpath.endswith(("_pb2.py", "_pb2_grpc.py"))]
    texts = [f.text for f in corpus.files]
    assert len(set(texts)) == len(texts)


def test_the_split_is_by_path_hash(corpus: Corpus) -> None:
    train, heldout = split_sources(corpus.files)
    assert heldout and all(is_heldout(f.relpath) for f in heldout) and not any(is_heldout(f.relpath) for f in train)
    assert is_heldout("asyncio/base_futures.py") == is_heldout("asyncio/base_futures.py")


def test_evaluation_sources_are_spread_over_the_package() -> None:
    files = evaluation_sources("networkx", limit_files=10)
    assert len(files) == 10 and len({f.relpath.split("/")[1] for f in files}) > 3


def test_the_committed_manifest_follows_the_rules() -> None:
    manifest = json.loads((ASSETS / "corpus.json").read_text())
    names = {canonical(s["name"]) for s in manifest["sources"]}
    assert "python-stdlib" in names and not names & set(EVALUATION_PACKAGES)
    for source in manifest["sources"]:
        assert spdx_ok(source["license"]), source
    assert manifest["totals"]["tokens"] == sum(s["tokens"] for s in manifest["sources"])
