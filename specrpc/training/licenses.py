"""Which installed distributions the corpus may take: a license read from package metadata, or None.

Read in this order, the first that decides wins: ``License-Expression`` (an SPDX expression, PEP 639), the
``License ::`` trove classifiers, then the free-text ``License`` field (a short name, or the license text itself).
Accepted: permissive licenses (MIT, BSD, Apache-2.0, PSF, ISC and the like) and the file-level MPL-2.0. Anything
copyleft (GPL, LGPL, AGPL), mixed or unrecognised is refused; the caller reports it.
"""

from __future__ import annotations

import re
from email.message import Message

# SPDX identifiers accepted (compared upper-case), plus "BSD", the name the BSD trove classifier gives.
PERMISSIVE_SPDX = frozenset({
    "BSD",
    "MIT", "MIT-0", "MIT-CMU", "BSD-2-CLAUSE", "BSD-3-CLAUSE", "BSD-3-CLAUSE-CLEAR", "0BSD", "APACHE-2.0",
    "PSF-2.0", "PYTHON-2.0", "PYTHON-2.0.1", "CNRI-PYTHON", "ISC", "MPL-2.0", "ZLIB", "CC0-1.0", "UNLICENSE", "HPND",
    "BSL-1.0",
})
# Trove classifier → SPDX-like name.
CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "License :: OSI Approved :: zlib/libpng License": "Zlib",
    "License :: CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
    "License :: OSI Approved :: The Unlicense (Unlicense)": "Unlicense",
}
COPYLEFT = re.compile(r"\b(A?GPL|LGPL|GNU|General Public License|EUPL|SSPL|copyleft)", re.IGNORECASE)
# Free-text License field: short names and the opening words of license texts.
TEXT_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^\s*(the\s+)?MIT(\s+license)?\s*$|Permission is hereby granted, free of charge", re.I), "MIT"),
    (re.compile(r"^\s*BSD[- ]?3[- ]?Clause|^\s*new BSD|^\s*3-clause BSD", re.I), "BSD-3-Clause"),
    (re.compile(r"^\s*BSD[- ]?2[- ]?Clause|^\s*simplified BSD", re.I), "BSD-2-Clause"),
    (re.compile(r"^\s*BSD(\s+license)?\s*$|Redistribution and use in source and binary forms", re.I), "BSD"),
    (re.compile(r"^\s*Apache(\s+Software)?(\s+License)?[ ,-]*(v(ersion)?\s*)?2(\.0)?\b|Apache License,?\s+Version 2\.0",
                re.I), "Apache-2.0"),
    (re.compile(r"^\s*(PSF|Python Software Foundation)", re.I), "PSF-2.0"),
    (re.compile(r"^\s*ISC(\s+license)?\s*$", re.I), "ISC"),
    (re.compile(r"^\s*(MPL[- ]?2(\.0)?|Mozilla Public License,?\s*(v(ersion)?\s*)?2(\.0)?)", re.I), "MPL-2.0"),
]


def spdx_ok(expression: str) -> bool:
    """True when some alternative of the SPDX expression (split on OR) has only accepted licenses (joined by AND,
    WITH exceptions ignored)."""
    expr = expression.replace("(", " ").replace(")", " ")
    for alternative in re.split(r"\s+OR\s+", expr, flags=re.IGNORECASE):
        names = [re.split(r"\s+WITH\s+", part.strip(), flags=re.IGNORECASE)[0].strip().upper()
                 for part in re.split(r"\s+AND\s+", alternative, flags=re.IGNORECASE)]
        if names and all(n in PERMISSIVE_SPDX for n in names):
            return True
    return False


def classify(meta: Message) -> tuple[str | None, str]:
    """(accepted license name or None, what decided it): the license the corpus records, or why it was refused."""
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return (expression, "License-Expression") if spdx_ok(expression) else (None, f"refused: {expression}")
    classifiers = [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if any(COPYLEFT.search(c) for c in classifiers):
        return None, "refused: copyleft classifier " + "; ".join(classifiers)
    named = sorted({CLASSIFIERS[c] for c in classifiers if c in CLASSIFIERS})
    if named and len(named) == len({c for c in classifiers if c != "License :: OSI Approved"}):
        return " AND ".join(named), "classifier"
    text = (meta.get("License") or "").strip()
    if text:
        head = text[:400]
        if COPYLEFT.search(head):
            return None, f"refused: License field {head.splitlines()[0][:80]!r}"
        for pattern, name in TEXT_PATTERNS:
            if pattern.search(head):
                return name, "License field"
    if classifiers:
        return None, "unrecognised classifier " + "; ".join(classifiers)
    return None, "unknown license" + (f" {text.splitlines()[0][:80]!r}" if text else "")
