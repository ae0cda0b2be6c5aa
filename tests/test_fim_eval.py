"""FIM next-line cases: deterministic, cut inside a line, spelled in both orders."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from specrpc.training.corpus import SourceFile
from specrpc.training.fim_eval import fim_cases, prompt_ids

ASSETS = Path(__file__).resolve().parent.parent / "specrpc" / "assets"
TEXT = "".join(f"def function_{i}(value):\n    result = value + {i}\n    return result\n\n" for i in range(40))


def test_cases_are_deterministic_and_complete_the_line() -> None:
    files = [SourceFile("pkg/mod.py", TEXT, "pkg")]
    for mid_line in (False, True):
        cases = fim_cases(files, 10, mid_line)
        assert cases == fim_cases(files, 10, mid_line) and len(cases) == 10
        for c in cases:
            assert c.expected and "\n" not in c.expected
            assert TEXT.find(c.prefix + c.expected + "\n" + c.suffix) >= 0
            assert c.prefix.endswith("\n") != mid_line


def test_prompts_follow_the_contract() -> None:
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "target"), local_files_only=True)
    case = fim_cases([SourceFile("pkg/mod.py", TEXT, "pkg")], 1)[0]
    psm, spm = tok.decode(prompt_ids(tok, case, "psm")), tok.decode(prompt_ids(tok, case, "spm"))
    header = "<|file_sep|>pkg/mod.py\n"
    assert psm == f"<|fim_prefix|>{header}{case.prefix}<|fim_suffix|>{case.suffix}<|fim_middle|>"
    assert spm == f"<|fim_suffix|>{case.suffix}<|fim_prefix|>{header}{case.prefix}<|fim_middle|>"
