"""The docs describe the product as it is: short, every benchmark section says where, how and when it was measured,
and no text is named or ordered by work periods."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"

# Sections of docs/benchmarks.md that explain rather than report figures.
EXPLAINING_SECTIONS = {"How to reproduce and read these figures"}
COMMAND = re.compile(r"`[^`]*(specrpc bench|make bench|make gpu-check|tools/)[^`]*`")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
WORK_PERIODS = (r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
                r"|[0-9]+(st|nd|rd|th)) session")


def sections(text: str) -> dict[str, list[str]]:
    """`## ` headings → their lines (up to the next `## `), code blocks skipped for headings."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            current = out.setdefault(line[3:].strip(), [])
        elif current is not None:
            current.append(line)
    return out


def labelled(lines: list[str], label: str) -> list[str]:
    """Lines that start with `label:` (after list markers or emphasis), with their continuation lines."""
    found: list[str] = []
    for i, line in enumerate(lines):
        if re.match(rf"^[\s\-*]*{label}:", line):
            block = [line]
            for nxt in lines[i + 1:]:
                if not nxt.startswith("  ") or not nxt.strip():
                    break
                block.append(nxt)
            found.append(" ".join(block))
    return found


def test_benchmarks_is_short_and_each_section_says_machine_command_and_date() -> None:
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "docs/benchmarks.md: keep it to 300 lines (history lives in git)"
    found = sections(text)
    assert len(found) >= 7, f"expected a section per question, found {sorted(found)}"
    for title, lines in found.items():
        if title in EXPLAINING_SECTIONS:
            continue
        assert labelled(lines, "Machine"), f"section {title!r} names no machine (a 'Machine:' line)"
        commands = labelled(lines, "Command")
        assert any(COMMAND.search(c) for c in commands), (
            f"section {title!r} gives no command ('Command:' with `specrpc bench`, `make bench`, `make gpu-check` "
            "or `tools/...`)")
        assert any(DATE.search(d) for d in labelled(lines, "Date")), f"section {title!r} has no 'Date: YYYY-MM-DD'"


def test_benchmark_headings_name_questions_not_tracker_items() -> None:
    for title in sections(BENCHMARKS.read_text(encoding="utf-8")):
        assert not re.search(r"\bissue\s*\d+", title, re.IGNORECASE), title


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 160, "README.md: keep it to 160 lines; detail goes to docs/"
    block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "README.md has no code block"
    first_two = block.group(1).splitlines()[:2]
    assert len(first_two) == 2
    assert first_two[0].startswith("make serve"), first_two
    assert first_two[1].startswith("make test"), first_two


def test_no_text_is_named_or_ordered_by_work_periods() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        [git, "grep", "-n", "-i", "-E", WORK_PERIODS, "--", ".", ":!tests/test_docs.py"],
        cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode in (0, 1), result.stderr
    assert result.stdout == "", "text named or ordered by work periods:\n" + result.stdout
