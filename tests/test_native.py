"""The native decode step's build: cached by source, flags and CPU; without a compiler (or with a failing one) there
is no library and the torch forward serves every step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specrpc import native
from specrpc.config import ASSETS
from specrpc.models import load_model
from specrpc.models.llama import LlamaLM


def test_build_is_cached_per_compiler_and_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRPC_NATIVE_CACHE", str(tmp_path))
    first = native.build()
    if first is None:
        pytest.skip("no C++ compiler here")
    assert first.parent == tmp_path and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime, "a second build reuses the cached file"


def test_no_compiler_means_no_library_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SPECRPC_NATIVE_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert native.build(compiler=str(tmp_path / "no-such-compiler")) is None
    assert "build failed" in caplog.text and not list(tmp_path.glob("*.so"))


def test_a_model_the_native_step_cannot_take_keeps_the_torch_forward() -> None:
    """int8 weights keep no float copy: the torch forward (and its int8 kernel) serves every step."""
    cpu = torch.device("cpu")
    if not hasattr(torch, "_weight_int8pack_mm"):
        pytest.skip("no int8 kernel")
    lm = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=64,
                    int8_weights=True, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is None
