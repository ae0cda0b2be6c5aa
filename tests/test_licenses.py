"""License classification from package metadata: what the corpus may take."""

from __future__ import annotations

from email.message import Message

import pytest

from specrpc.training.licenses import classify, spdx_ok


def metadata(expression: str = "", license_text: str = "", classifiers: tuple[str, ...] = ()) -> Message:
    """A METADATA header set."""
    meta = Message()
    if expression:
        meta["License-Expression"] = expression
    if license_text:
        meta["License"] = license_text
    for c in classifiers:
        meta["Classifier"] = c
    return meta


@pytest.mark.parametrize(("expression", "ok"), [
    ("MIT", True), ("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0", True), ("MIT OR GPL-2.0-only", True),
    ("(Apache-2.0 WITH LLVM-exception) AND BSL-1.0", True), ("GPL-3.0-or-later", False),
    ("Apache-2.0 AND LGPL-2.1-only", False), ("LicenseRef-Proprietary", False),
])
def test_spdx_expressions(expression: str, ok: bool) -> None:
    assert spdx_ok(expression) is ok


def test_the_expression_decides_first() -> None:
    assert classify(metadata("MIT", classifiers=("License :: OSI Approved :: GNU General Public License (GPL)",)))[0] \
        == "MIT"
    assert classify(metadata("AGPL-3.0-only", license_text="MIT"))[0] is None


def test_classifiers() -> None:
    assert classify(metadata(classifiers=("License :: OSI Approved :: BSD License",)))[0] == "BSD"
    assert classify(metadata(classifiers=("License :: OSI Approved :: MIT License",
                                          "License :: OSI Approved :: GNU Lesser General Public License v3 (LGPLv3)",
                                          )))[0] is None
    refused, why = classify(metadata(classifiers=("License :: Other/Proprietary License",)))
    assert refused is None and "unrecognised" in why


def test_free_text_field() -> None:
    assert classify(metadata(license_text="BSD-3-Clause"))[0] == "BSD-3-Clause"
    assert classify(metadata(license_text="Apache 2.0"))[0] == "Apache-2.0"
    assert classify(metadata(license_text="Copyright (c) 2020 X\n\nPermission is hereby granted, free of charge, to "
                                          "any person"))[0] == "MIT"
    assert classify(metadata(license_text="GNU GPL v3"))[0] is None


def test_unknown_is_refused_with_a_reason() -> None:
    name, why = classify(metadata())
    assert name is None and why == "unknown license"
    name, why = classify(metadata(license_text="see LICENSE file"))
    assert name is None and "see LICENSE file" in why
