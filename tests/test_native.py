"""The native decode step's build: cached by source, flags and CPU; without a compiler (or with a failing one) there
is no library and the torch forward serves every step."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import counted_calls, native_draft_step, requires_native

from specrpc import native
from specrpc.config import ASSETS
from specrpc.models import load_model
from specrpc.models.backends import eager, memo
from specrpc.models.backends import native as native_step
from specrpc.models.backends.timing import Drift
from specrpc.models.llama import LlamaLM, bf16_available, int8_available
from specrpc.models.llama import lm as llama_lm


def test_build_is_cached_per_compiler_and_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache logic on a one-line source (the real sources compile in every test that loads the library)."""
    monkeypatch.setenv("SPECRPC_NATIVE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "one.cpp"
    source.write_text('extern "C" int specrpc_one() { return 1; }\n')
    monkeypatch.setattr(native, "SOURCES", (source,))
    first = native.build()
    if first is None:
        pytest.skip("no C++ compiler here")
    assert first.parent == tmp_path / "cache" and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime, "a second build reuses the cached file"
    source.write_text('extern "C" int specrpc_one() { return 2; }\n')
    assert native.build() not in (None, first), "a changed source is a new library"


def test_no_compiler_means_no_library_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SPECRPC_NATIVE_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert native.build(compiler=str(tmp_path / "no-such-compiler")) is None
    assert "build failed" in caplog.text and not list(tmp_path.glob("*.so"))


def test_a_model_the_native_step_cannot_take_keeps_the_torch_forward() -> None:
    """bf16 weights: the torch forward (oneDNN's bf16 products) serves every step; int8 weights go native."""
    cpu = torch.device("cpu")
    if bf16_available(cpu):
        lm = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=64,
                        bf16_weights=True, native_decode=True)
        assert isinstance(lm, LlamaLM) and lm.native is None
    if int8_available(cpu) and native.library() is not None:
        lm = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=64,
                        int8_weights=True, native_decode=True)
        assert isinstance(lm, LlamaLM) and lm.native is not None and lm.native.int8


def test_int8_native_step_stays_close_to_the_torch_int8_forward() -> None:
    """The same int8 weights and scales through the native step and through torch's int8 kernel (bf16
    activations there): logits within int8's own error of each other, a verify's the same bits as decoding."""
    cpu = torch.device("cpu")
    if not int8_available(cpu):
        pytest.skip("no int8 kernel")
    requires_native()
    models = [load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=1, max_context=128,
                         int8_weights=True, native_decode=native) for native in (True, False)]
    ids = torch.tensor([(i * 7919) % 4000 for i in range(40)])
    native_lm, torch_lm = models
    assert isinstance(native_lm, LlamaLM) and native_lm.native is not None
    native_lm.native_rows = native_step.MAX_TOKENS
    for lm in models:
        lm.forward(ids[:30], 0, 0)
    a = native_lm.forward(ids[30:35], 30, 0, num_logits=5)  # [5, V]
    b = torch_lm.forward(ids[30:35], 30, 0, num_logits=5)
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()
    native_lm.truncate(0, 30)
    one_by_one = torch.cat([native_lm.forward(ids[t : t + 1], t, 0) for t in range(30, 35)])
    assert torch.equal(a, one_by_one)


def test_a_forward_with_parts_left_out_leaves_out_those_parts() -> None:
    """`run_parts` (what `specrpc bench floor` times): without attention, every layer's keys are still the products'
    (layer 0's equal a whole forward's; later layers' differ, their input lacking attention's output); without the
    products, no key is computed (the cache gets the work buffer's stale row, not the tokens' keys); a whole forward
    after either writes the true keys again."""
    requires_native()
    lm = load_model(ASSETS / "target", device=torch.device("cpu"), dtype=torch.float32, num_slots=1, max_context=64,
                    native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    step = lm.native
    ids = torch.tensor([(i * 7919) % 4000 for i in range(24)])
    with torch.inference_mode():
        lm.forward(ids[:16], 0, 0)
        step.run(ids[16:21], 16, 0, 1)
        true_k = lm.cache.k[:, 0, :, 16:21].clone()  # [L, H, 5, D]
        step.run_parts(ids[16:21], 16, 0, native_step.SKIP_ATTENTION)
        no_attention = lm.cache.k[:, 0, :, 16:21].clone()
        step.run(ids[0:5], 16, 0, 1)  # other tokens' keys there, and in the work buffers
        step.run_parts(ids[16:21], 16, 0, native_step.SKIP_PRODUCTS)
        no_products = lm.cache.k[:, 0, :, 16:21].clone()
        step.run(ids[16:21], 16, 0, 1)
        again = lm.cache.k[:, 0, :, 16:21].clone()
    assert torch.equal(no_attention[0], true_k[0]) and not torch.equal(no_attention[1:], true_k[1:])
    assert not torch.equal(no_products[0], true_k[0])
    assert torch.equal(again, true_k)


@pytest.mark.parametrize("head_dim", [18, 64])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_rows_that_do_not_fill_a_panel(int8: bool, head_dim: int, tmp_path: Path) -> None:
    """Weights are packed in panels of 16 output rows: shapes that leave a panel partly empty (hidden 72, FFN 100,
    vocabulary 101) give the torch forward's logits (float32), and a verify of up to 16 tokens gives each token its
    decode logits bit for bit (float32 and int8), with attention's values weighed in registers (head_dim 64) or not
    (18)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    requires_native()
    cpu = torch.device("cpu")
    if int8 and not int8_available(cpu):
        pytest.skip("no int8 kernel")
    config = LlamaConfig(vocab_size=101, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    native_lm, torch_lm = (load_model(tmp_path, device=cpu, dtype=torch.float32, num_slots=1, max_context=48,
                                      int8_weights=int8, native_decode=native) for native in (True, False))
    assert isinstance(native_lm, LlamaLM) and native_lm.native is not None
    native_lm.native_rows = native_step.MAX_TOKENS
    ids = torch.randint(0, 101, (36,), generator=torch.Generator().manual_seed(1))
    for lm in (native_lm, torch_lm):
        lm.forward(ids[:20], 0, 0)
    together = native_lm.forward(ids[20:36], 20, 0, num_logits=16)  # [16, V]
    if not int8:
        torch.testing.assert_close(together, torch_lm.forward(ids[20:36], 20, 0, num_logits=16), atol=1e-4, rtol=1e-4)
    native_lm.truncate(0, 20)
    alone = torch.cat([native_lm.forward(ids[t : t + 1], t, 0) for t in range(20, 36)])  # [16, V]
    assert torch.equal(together, alone)


@pytest.mark.parametrize("mode", ["int8", "deterministic", "float32"])
def test_int8_and_deterministic_prompts_and_wide_batches_run_native_as_decoding_does(mode: str) -> None:
    """With int8 weights, or float32 with `deterministic`, a prompt longer than a native forward takes runs in native
    chunks, and a batch of more tokens than one takes (a prefill chunk beside decoding rows) in several native calls:
    every token's logits are those of decoding it alone, bit for bit, so batched and speculative output stays the
    solo output. Plain float32 (the control) runs them through the torch forward, which rounds apart."""
    from specrpc.models import BatchRow

    requires_native()
    cpu = torch.device("cpu")
    if mode == "int8" and not int8_available(cpu):
        pytest.skip("no int8 kernel")
    lm = load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=3, max_context=128,
                    int8_weights=mode == "int8", native_decode=True, deterministic=mode == "deterministic")
    assert isinstance(lm, LlamaLM) and lm.native is not None and lm.native.int8 == (mode == "int8")
    n = native_step.MAX_TOKENS + 30  # a prompt longer than one native forward takes
    ids = torch.tensor([(i * 7919) % 4000 for i in range(n + 20)])
    prompt = lm.forward(ids[:n], 0, 0, num_logits=3)  # [3, V]: native chunks (torch in float32)
    lm.truncate(0, 0)
    alone = torch.cat([lm.forward(ids[t : t + 1], t, 0) for t in range(n)])  # [n, V]
    if mode == "float32":
        assert not torch.equal(prompt, alone[-3:])  # through torch: another reduction order
        return
    assert torch.equal(prompt, alone[-3:])
    lm.forward(ids[:10], 0, 1)
    lm.truncate(0, n - 3)
    rows = [BatchRow(ids[n - 3 : n], n - 3, 0, 3), BatchRow(ids[10 : n - 2], 10, 1, 2), BatchRow(ids[:1], 0, 2, 1)]
    batched = lm.forward_batch(rows)  # more than one native forward takes: a verify, a prefill chunk, a first token
    assert torch.equal(batched[0], alone[-3:])
    lm.truncate(1, 10)
    assert torch.equal(batched[1], torch.cat([lm.forward(ids[t : t + 1], t, 1) for t in range(10, n - 2)])[-2:])
    lm.truncate(2, 0)
    assert torch.equal(batched[2], lm.forward(ids[:1], 0, 2))


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_the_prefetch_mode_is_a_hint_that_never_changes_the_logits(int8: bool) -> None:
    """Every prefetch mode (none, non-temporal, temporal, outer), prefetch distance and cap on the tokens a pass over
    the weights takes gives the same logits bit for bit, for a decode step, a verify and a prompt chunk: which one runs
    is a speed choice made at load, never a numerical one."""
    step = native_draft_step(int8)
    ids = torch.tensor([(i * 7919) % 4000 for i in range(30)])
    step.run(ids[:16], 0, 0)
    seen = []
    for mode in native.PREFETCH:
        for ahead, cap in ((0, 0), (512, 6), (4096, 4), (2048, 2)):
            step.prefetch_everywhere(mode, ahead)
            step.passes[:] = cap
            seen.append((step.run(ids[16:17], 16, 0), step.run(ids[16:21], 16, 0, num_logits=5),
                         step.run(ids[:16], 0, 0, num_logits=16)))
    for one, five, chunk in seen[1:]:
        assert torch.equal(one, seen[0][0]) and torch.equal(five, seen[0][1]) and torch.equal(chunk, seen[0][2])


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("on_threads", [2], indirect=True)
def test_the_threads_a_forward_takes_never_change_the_logits(int8: bool, on_threads: int) -> None:
    """A decode step, a verify, a prompt chunk and a greedy draft give the same logits and tokens bit for bit on one
    thread as on all of torch's: which count runs a shape is a speed choice made at load (`calibrate_threads`),
    never a numerical one."""
    step = native_draft_step(int8)
    ids = torch.tensor([(i * 7919) % 4000 for i in range(30)])
    seen = []
    for threads in native_step.thread_counts(on_threads):
        step.threads_chosen = dict.fromkeys(native_step.THREAD_SHAPES, threads)
        assert step.threads(1) == step.threads(5) == threads
        step.run(ids[:16], 0, 0)
        seen.append((step.run(ids[16:17], 16, 0), step.run(ids[16:21], 16, 0, num_logits=5),
                     step.run(ids[:16], 0, 0, num_logits=16), step.greedy(ids[16:18], 16, 0, 4)))
    assert len(seen) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))


STALL_S = 0.02
"""An injected stall: far above any tiny model's forward here, so a path that pays it on every call loses to the others
however noisy the machine (each is measured in interleaved rounds)."""


def stall(seconds: float = STALL_S) -> None:
    """`seconds` of busy work, as a slow path spends it: a sleep would hand the CPU to a neighbour and come back with
    the scheduler's favour, so that the forward after it ran less often preempted than the path it is compared with."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Forwards on one thread while a stall test runs: on a shared 2-core machine a two-thread parallel region waits at
    every barrier for a preempted partner (a tiny model's native step took 55 ms instead of 0.1), which would measure
    the neighbours, not the choice under test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def on_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's threads set to the test's parameter for the test (indirect parametrization), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def tiny_llama(path: Path) -> Path:
    """A small random Llama checkpoint at `path` (a forward well under a millisecond)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def stalled_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 stalls: Callable[[native_step.NativeStep, int], bool]) -> native_step.NativeStep:
    """A tiny model's native step whose one-row calls of `count` tokens `stall` where `stalls(step, count)`."""
    step = stalled_model(tmp_path, monkeypatch, stalls).native
    assert step is not None
    return step


def stalled_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  stalls: Callable[[native_step.NativeStep, int], bool]) -> LlamaLM:
    """`stalled_step`'s model."""
    requires_native()
    lm = load_model(tiny_llama(tmp_path), device=torch.device("cpu"), dtype=torch.float32, num_slots=1,
                    max_context=64, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    step = lm.native
    fast_row = step._row

    def row(*args: object) -> int:
        count = args[2]
        assert isinstance(count, int)
        if stalls(step, count):
            stall()
        return int(fast_row(*args))

    monkeypatch.setattr(step, "_row", row)
    return lm


@pytest.mark.parametrize("stalled", list(native.PREFETCH))
@pytest.mark.usefixtures("one_thread")
def test_a_stalled_prefetch_mode_is_never_chosen(stalled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever prefetch mode is slowed by an injected stall (every native call in it sleeps) is chosen at neither
    shape calibrated, one token nor a verify."""
    step = stalled_step(tmp_path, monkeypatch, lambda step, _: step.model.prefetch == native.PREFETCH[stalled])
    table = step.calibrate_prefetch()
    assert set(table) == {1, native_step.VERIFY_TOKENS}
    assert step.prefetch_one != stalled and step.prefetch_many != stalled, table


@pytest.mark.parametrize("stalled", native_step.PREFETCH_DISTANCES)
@pytest.mark.usefixtures("one_thread")
def test_a_stalled_prefetch_distance_is_never_chosen(stalled: int, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever prefetch distance is slowed by an injected stall (every native call prefetching that far ahead
    sleeps, in either prefetching mode; "none" carries the default distance, so it stalls with it) is chosen at
    neither shape, and the table names every setting timed."""
    step = stalled_step(tmp_path, monkeypatch, lambda step, _: step.model.prefetch_ahead == stalled)
    table = step.calibrate_prefetch()
    assert all(len(times) == len(native_step.prefetch_settings()) for times in table.values()), table
    assert step.ahead_one != stalled and step.ahead_many != stalled, table


def test_the_served_pick_keeps_the_finalist_whose_forwards_took_least() -> None:
    """Forwards of several tokens take the finalists in turn, each `rounds` of them, and the one with the least
    median is kept: one slow forward (a neighbour's burst) does not sink a finalist, a slow setting does."""
    finalists = [("non-temporal", 32768), ("outer", 32768), ("none", 2048)]
    pick = native_step.ServedPick(finalists, rounds=5)
    times = {("non-temporal", 32768): 1.2e-3, ("outer", 32768): 1.0e-3, ("none", 2048): 1.1e-3}
    taken, chosen = [], None
    for i in range(15):
        setting = pick.setting()
        taken.append(setting)
        seconds = 0.1 if setting == ("outer", 32768) and i < 3 else times[setting]  # one stall of the fastest
        chosen = pick.observe(seconds)
        assert (chosen is None) == (i < 14)
    assert taken == finalists * 5
    assert chosen == ("outer", 32768)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("slow", ["non-temporal", "temporal", "outer", "none"])
@pytest.mark.usefixtures("one_thread")
def test_a_prefetch_slow_as_served_is_not_kept_though_fastest_at_load(slow: str, tokens: int, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Once serving, forwards of one token and of several each choose their prefetch among each mode's fastest at
    load by their own times: a mode that stalls only as served (not while load timed it) is not kept, whichever was
    fastest at load, and what a shape chose is what its forwards then run; the other shape's choice is its own."""
    serving = False
    step = stalled_step(tmp_path, monkeypatch, lambda step, count: serving and (count > 1) == (tokens > 1)
                        and step.model.prefetch == native.PREFETCH[slow])
    step.calibrate_prefetch()
    assert {shape: sorted(mode for mode, _ in f) for shape, f in step.finalists.items()} == {
        shape: sorted(native.PREFETCH) for shape in (1, native_step.VERIFY_TOKENS)}
    serving = True
    step.serve()
    shape = 1 if tokens == 1 else native_step.VERIFY_TOKENS
    ids = torch.arange(3, 3 + tokens)
    while shape in step.picks:
        step.run(ids, 0, 0, tokens)
    chosen = step.prefetch_one if tokens == 1 else step.prefetch_many
    assert chosen != slow
    assert step.prefetch_label(tokens).split()[0] == chosen
    assert set(step.picks) == {1, native_step.VERIFY_TOKENS} - {shape}  # the other shape still choosing
    step.run(ids, 0, 0, tokens)
    assert step.model.prefetch == native.PREFETCH[chosen]


@pytest.mark.parametrize("stalled", [1, 2])
@pytest.mark.parametrize("on_threads", [2], indirect=True)
def test_a_stalled_thread_count_is_never_chosen(stalled: int, on_threads: int, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever number of threads is slowed by an injected stall (every native call on that many) is chosen at no
    shape, one token, a verify nor a wide forward, and the forwards then run on the other; the table names every
    count."""
    step = stalled_step(tmp_path, monkeypatch, lambda step, count: step.threads(count) == stalled)
    table = step.calibrate_threads()
    shapes = (1, native_step.VERIFY_TOKENS, native_step.WIDE_TOKENS)
    assert {shape: sorted(times) for shape, times in table.items()} == {shape: [1, 2] for shape in shapes}
    assert all(step.threads(count) != stalled for count in (*shapes, native_step.MAX_TOKENS)), table
    chosen = step.choices()
    assert chosen.threads_one == chosen.threads_many == chosen.threads_wide == (1 if stalled == 2 else 0)  # 0: all


@pytest.mark.parametrize("on_threads", [2], indirect=True)
def test_the_threads_a_verify_takes_do_not_decide_a_prompt_chunks(on_threads: int, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Verifies slow on all threads (as where two vCPUs share a core) take one, while forwards of `WIDE_TOKENS`
    and more (prompt chunks, wide batches), timed apart and slow on one, keep all: a 5-token verify's choice does
    not halve a prefill's threads. The execution table names each range's count."""
    def stalls(step: native_step.NativeStep, count: int) -> bool:
        verify = native_step.thread_shape(count) == native_step.VERIFY_TOKENS
        return step.threads(count) == (on_threads if verify else 1)

    lm = stalled_model(tmp_path, monkeypatch, stalls)
    step = lm.native
    assert step is not None
    step.calibrate_threads()
    assert [step.threads(count) for count in (1, 2, native_step.WIDE_TOKENS - 1, native_step.WIDE_TOKENS,
                                              native_step.MAX_TOKENS)] == [2, 1, 1, 2, 2]
    lm.native_rows = native_step.MAX_TOKENS
    assert [row for row in lm.execution() if row[0] != "1"][:2] == [
        (f"2-{native_step.WIDE_TOKENS - 1}", f"native, prefetch {step.prefetch_label(2)}, on 1 thread"),
        (f"{native_step.WIDE_TOKENS}-{native_step.MAX_TOKENS}", f"native, prefetch {step.prefetch_label(2)}")]


@pytest.mark.parametrize("tokens", [1, 3, native_step.WIDE_TOKENS + 4])
@pytest.mark.parametrize("on_threads", [2], indirect=True)
def test_fewer_threads_slow_as_served_are_not_kept_though_fastest_at_load(tokens: int, on_threads: int,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Where load chose fewer threads than all for a shape (here all of them stalled at load), the forwards served
    take that count and all in turn and keep the faster: one thread stalling only as served is not kept. A shape that
    load gave all threads (here one thread stalled) is left to them (no served choice)."""
    serving = False

    def stalls(step: native_step.NativeStep, count: int) -> bool:
        if native_step.thread_shape(count) != native_step.thread_shape(tokens):
            return step.threads(count) == 1
        return step.threads(count) == 1 if serving else step.threads(count) == on_threads

    step = stalled_step(tmp_path, monkeypatch, stalls)
    step.calibrate_threads()
    shape = native_step.thread_shape(tokens)
    assert step.threads(shape) == 1
    serving = True
    step.serve()
    assert set(step.thread_picks) == {shape}  # the shapes load gave all threads serve on them
    ids = torch.arange(3, 3 + tokens)
    while shape in step.thread_picks:
        step.run(ids, 0, 0, tokens)
    assert step.threads(shape) == on_threads
    chosen = step.choices()
    assert (chosen.threads_one, chosen.threads_many, chosen.threads_wide) == (0, 0, 0)  # all of torch's


def test_no_served_choice_of_threads_where_load_gave_a_shape_all() -> None:
    """A step whose every shape runs on all of torch's threads (as load leaves it where all win) serves on them from
    the first forward: no forward served on fewer."""
    step = native_draft_step(False)
    step.threads_chosen = dict.fromkeys(native_step.THREAD_SHAPES, 0)  # all of torch's everywhere, whatever load chose
    step.serve()
    assert step.thread_picks == {}


@pytest.mark.parametrize("stalled", native_step.PASS_CAPS)
@pytest.mark.usefixtures("one_thread")
def test_a_stalled_pass_size_is_never_chosen(stalled: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever cap on the tokens a pass over the weights takes is slowed by an injected stall (every native call
    under it at the width being timed) is chosen for no token count."""
    step = stalled_step(tmp_path, monkeypatch, lambda step, count: int(step.passes[count]) == stalled)
    table = step.calibrate_passes()
    assert set(table) == set(native_step.PASS_TOKENS)
    assert stalled not in step.passes[3:].tolist(), table


@pytest.mark.usefixtures("one_thread")
def test_a_stalled_native_step_serves_no_forward_not_even_one_token(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The native step slowed by an injected stall: the start-up choice measures it against torch at one token too,
    so torch serves every forward (native_rows 0), a one-token step included."""
    requires_native()
    calls = []
    fast_run = native_step.NativeStep.run

    def run(self: native_step.NativeStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        stall()
        return fast_run(self, *args, **kwargs)

    monkeypatch.setattr(native_step.NativeStep, "run", run)
    lm = load_model(tiny_llama(tmp_path), device=torch.device("cpu"), dtype=torch.float32, num_slots=1,
                    max_context=64, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None and lm.native_rows == 0
    calls.clear()
    lm.forward(torch.tensor([1, 2, 3]), 0, 0)
    lm.forward(torch.tensor([4]), 3, 0)
    assert calls == [], "torch serves every forward"


def remembered_model(path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], LlamaLM]:
    """Loads of the tiny model at `path` that remember their choice (`Memo`), in a memo directory of the test's."""
    requires_native()
    monkeypatch.setattr(memo, "directory", lambda: path.parent / "memos")

    def load() -> LlamaLM:
        lm = load_model(path, device=torch.device("cpu"), dtype=torch.float32, num_slots=1, max_context=64,
                        native_decode=True, remember=True)
        assert isinstance(lm, LlamaLM) and lm.native is not None and lm.memo is not None
        return lm
    return load


def counting_calibrations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every prefetch calibration (the first measurement of a choice at load)."""
    return counted_calls(monkeypatch, native_step.NativeStep, "calibrate_prefetch")


@pytest.mark.usefixtures("one_thread")
def test_a_restart_takes_the_choice_it_remembers_and_computes_the_same(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The second load of a model, loaded the same way on the same machine, takes the first one's choice without
    measuring (no calibration runs), and its forwards are the same bits; another setting is another memo."""
    load = remembered_model(tiny_llama(tmp_path / "tiny"), monkeypatch)
    # What the memo restores is this test's subject; the check that turns a memo down is the next test's (10x off).
    # The suite's other worker shares the cores, and a tiny model's forward of a few hundred microseconds can time
    # 1.3x apart in two loads a second apart there: the check's tolerance is widened to what no such burst reaches.
    monkeypatch.setattr(llama_lm, "Drift", functools.partial(Drift, tolerance=4.0))
    calls = counting_calibrations(monkeypatch)
    first = load()
    assert calls and first.memo is not None and first.memo.recall() is not None
    calls.clear()
    second = load()
    assert calls == [], "the remembered choice is taken, not measured again"
    assert first.chosen == "measured" and second.chosen.startswith("remembered from an earlier start"), second.chosen
    assert second.native is not None and first.native is not None
    assert second.native.choices() == first.native.choices() and second.native_rows == first.native_rows
    assert second.native_chunks == first.native_chunks
    ids = torch.tensor([5, 17, 3, 99, 42])
    assert torch.equal(first.forward(ids, 0, 0, num_logits=5), second.forward(ids, 0, 0, num_logits=5))
    other = load_model(tmp_path / "tiny", device=torch.device("cpu"), dtype=torch.float32, num_slots=2,
                       max_context=64, native_decode=True, remember=True)
    assert isinstance(other, LlamaLM) and other.memo is not None and other.memo.file != first.memo.file
    assert calls, "other slots: measured, not taken from the first load's memo"
    kept = second.memo.file.stat().st_ino
    assert second.recheck(0, lambda: True) == "" and second.memo.file.stat().st_ino == kept, "a request waits: later"
    calls.clear()
    assert "remembered" in second.recheck(0, lambda: False) and calls, "the first idle check measures it as a whole"
    assert second.memo.file.stat().st_ino != kept, "and keeps what it found for the next start"
    calls.clear()
    assert second.recheck(0, lambda: False) == "" and calls == [], "once: later checks look for drift"


@pytest.mark.usefixtures("one_thread")
def test_a_remembered_choice_that_no_longer_times_as_then_is_measured_again(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A memo whose one-token forward took a tenth of today's time, and one that does not parse: measured again, and
    the memo rewritten with today's choice and time; the native step stalled since the memo was made: torch serves
    every forward, the choice the memo held not kept."""
    load = remembered_model(tiny_llama(tmp_path / "tiny"), monkeypatch)
    calls = counting_calibrations(monkeypatch)
    lm = load()
    assert lm.memo is not None
    entry = lm.memo.recall()
    assert entry is not None and lm.native_rows > 0
    lm.memo.file.write_text(json.dumps({**entry, "one_token_s": entry["one_token_s"] / 10}))
    calls.clear()
    assert load().chosen.startswith("measured: the paths an earlier start chose took")
    assert calls, "a forward ten times slower than the memo's: measured again"
    rewritten = lm.memo.recall()
    assert rewritten is not None and rewritten["one_token_s"] > entry["one_token_s"] / 5
    lm.memo.file.write_text("{not json")
    calls.clear()
    load()
    assert calls and lm.memo.recall() is not None, "an unreadable memo: measured and written again"
    fast_run = native_step.NativeStep.run

    def stalled(self: native_step.NativeStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        stall()
        return fast_run(self, *args, **kwargs)

    monkeypatch.setattr(native_step.NativeStep, "run", stalled)
    assert load().native_rows == 0, "the native step stalled since: torch serves, whatever the memo held"


def test_drift_takes_two_checks_in_a_row_off_either_way() -> None:
    """A one-token check off its reference by more than the tolerance, slower or faster, twice in a row, asks for the
    paths to be measured again; one check off alone (a burst) does not, and a check back within resets the count."""
    drift = Drift(tolerance=1.25, confirm=2)
    assert not drift.drifted(1.0)  # the first check sets the reference
    assert not drift.drifted(2.0) and not drift.drifted(1.1) and not drift.drifted(2.0)
    assert drift.drifted(2.0)
    drift.settled(2.0)
    assert not drift.drifted(1.0) and drift.drifted(1.0)  # faster counts too: a neighbour's load went
    drift.settled(1.0)
    assert not drift.drifted(1.2) and not drift.drifted(0.85) and drift.strikes == 0


def slowed_after_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LlamaLM, Callable[[], int]]:
    """A tiny model loaded with its native step, then whichever path serves its one-token forwards slowed by an
    injected stall (the native step, or torch's forward where torch won at load; 4 ms a call, 10-40x a tiny
    forward, but short: a measurement again times every setting); returns the model and a count of the tokens the
    native step served."""
    requires_native()
    lm = load_model(tiny_llama(tmp_path), device=torch.device("cpu"), dtype=torch.float32, num_slots=2,
                    max_context=64, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    served = [0]
    native_run, eager_run = native_step.NativeStep.run, eager.run
    slow_native = lm.native_rows > 0

    def run_native(self: native_step.NativeStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        served[0] += args[0].shape[0]
        if slow_native:
            stall(0.004)
        return native_run(self, *args, **kwargs)

    def run_eager(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not slow_native:
            stall(0.004)
        return eager_run(*args, **kwargs)

    monkeypatch.setattr(native_step.NativeStep, "run", run_native)
    monkeypatch.setattr(eager, "run", run_eager)
    return lm, lambda: served[0]


def cached(lm: LlamaLM, slot: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """What `slot` caches: its length, its K and V."""
    return lm.length(slot), lm.cache.k[:, slot].clone(), lm.cache.v[:, slot].clone()


def same_cache(a: tuple[int, torch.Tensor, torch.Tensor], b: tuple[int, torch.Tensor, torch.Tensor]) -> bool:
    """Whether two `cached` states are the same length and bits."""
    return a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.usefixtures("one_thread")
def test_a_path_slowed_after_load_is_dropped_by_the_idle_checks(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The path serving one-token forwards slowed after load (an injected stall): the first idle check only notes
    it, the second measures again and hands one-token forwards to the other path; the slot the checks borrow keeps
    the prompt it caches, bit for bit."""
    lm, native_tokens = slowed_after_load(tmp_path, monkeypatch)
    was_native = lm.native_rows > 0
    lm.forward(torch.arange(3, 23), 0, 1)  # a prompt cached in the slot the checks borrow
    before = cached(lm, 1)
    assert not lm.recheck(1, lambda: False), "one check off is a burst"
    assert "one-token forwards took" in lm.recheck(1, lambda: False)
    assert (lm.native_rows > 0) != was_native, lm.execution()
    assert same_cache(cached(lm, 1), before)
    served = native_tokens()
    lm.forward(torch.tensor([5]), 20, 1)
    assert (native_tokens() > served) != was_native, "a one-token forward takes the path that won again"


def test_model_info_during_a_re_measure_names_the_settings_served_not_the_ones_timed(tmp_path: Path) -> None:
    """GetModelInfo asks `execution` from another thread while a re-measure times settings on the device thread: it
    names the settings forwards are served with, not the one being timed."""
    requires_native()
    lm = load_model(tiny_llama(tmp_path), device=torch.device("cpu"), dtype=torch.float32, num_slots=1,
                    max_context=64, native_decode=True)
    assert isinstance(lm, LlamaLM) and lm.native is not None
    step, served = lm.native, lm.execution()
    chosen = step.choices()
    timed = next(s for s in native_step.prefetch_settings() if s != (chosen.prefetch_one, chosen.ahead_one))
    seen: list[tuple[list[tuple[str, str]], list[tuple[str, str]]]] = []

    def phase(slot: int) -> None:  # times another prefetch setting, then keeps the one chosen
        step.prefetch_everywhere(*timed)
        seen.append((lm.execution(), lm._execution()))
        step.choose(chosen)

    lm._native_phases = lambda rows, chunks: [phase]  # type: ignore[method-assign]
    lm.drift.settled(1e-9)  # the next two checks read as drifted
    assert not lm.recheck(0, lambda: False) and lm.recheck(0, lambda: False)
    assert len(seen) == 1 and seen[0][1] != served, "the phase timed another setting"
    assert seen[0][0] == served and lm.execution() == served


@pytest.mark.usefixtures("one_thread")
def test_a_check_stops_for_a_request_and_puts_every_setting_back(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A request comes while the paths are measured again: the measurement stops within a round, every setting it was
    timing is put back (the native step's, and the forwards it takes), and so is the borrowed slot; the next idle
    check goes on from there (no new check of the drift first) and completes it."""
    lm, _ = slowed_after_load(tmp_path, monkeypatch)
    assert lm.native is not None
    lm.forward(torch.arange(3, 13), 0, 0)
    before, settings, rows, chunks = cached(lm, 0), lm.native.choices(), lm.native_rows, lm.native_chunks
    assert not lm.recheck(0, lambda: False)
    asked = [0]

    def busy() -> bool:  # a request arrives once the measurement is under way (past the 8 rounds of the check)
        asked[0] += 1
        return asked[0] > 12

    assert not lm.recheck(0, busy)
    assert asked[0] == 13, "stopped at the first round after the request came"
    assert lm.native.choices() == settings and lm.native_rows == rows and lm.native_chunks == chunks
    assert same_cache(cached(lm, 0), before)
    checked = lm.drift.last_s
    assert "one-token forwards took" in lm.recheck(0, lambda: False) and lm.drift.last_s == checked


@pytest.mark.usefixtures("one_thread")
def test_a_stalled_torch_forward_is_chosen_at_no_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch forward slowed by an injected stall: the native step serves every count it can take, 1 to
    MAX_TOKENS."""
    requires_native()
    fast_run = eager.run

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        stall()
        return fast_run(*args, **kwargs)

    monkeypatch.setattr(eager, "run", run)
    lm = load_model(tiny_llama(tmp_path), device=torch.device("cpu"), dtype=torch.float32, num_slots=1,
                    max_context=native_step.MAX_TOKENS + 2, native_decode=True)  # room to compare every count
    assert isinstance(lm, LlamaLM) and lm.native is not None and lm.native_rows == native_step.MAX_TOKENS


@pytest.mark.parametrize("stalled", ["native chunks", "torch"])
@pytest.mark.usefixtures("one_thread")
def test_a_stalled_path_for_long_forwards_is_never_chosen(stalled: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards longer than the native step takes: whichever of its chunks and the torch forward is slowed by an
    injected stall (on those forwards alone) is not chosen at load, the execution table says which serves them, and
    a long forward then calls only the other."""
    requires_native()
    calls: list[str] = []
    fast_chunks, fast_eager = native_step.NativeStep.run_chunks, eager.run

    def chunks(self: native_step.NativeStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("native chunks")
        if stalled == "native chunks":
            stall()
        return fast_chunks(self, *args, **kwargs)

    def whole(*args: Any, **kwargs: Any) -> torch.Tensor:
        if args[2].shape[0] > native_step.MAX_TOKENS:
            calls.append("torch")
            if stalled == "torch":
                stall()
        return fast_eager(*args, **kwargs)

    monkeypatch.setattr(native_step.NativeStep, "run_chunks", chunks)
    monkeypatch.setattr(eager, "run", whole)
    lm = load_model(tiny_llama(tmp_path), device=torch.device("cpu"), dtype=torch.float32, num_slots=1,
                    max_context=native_step.SCRATCH_POSITIONS, native_decode=True)  # room to compare
    assert isinstance(lm, LlamaLM) and lm.native is not None
    assert set(calls) == {"native chunks", "torch"}, "both timed at load"
    assert lm.native_chunks is (stalled == "torch")
    longest = lm.execution()[-1]  # "N+" (N = 65 where the native step takes up to 64 tokens, less where torch won)
    assert longest[0].endswith("+") and int(longest[0][:-1]) <= native_step.MAX_TOKENS + 1 and longest[1].startswith(
        "torch" if stalled == "native chunks" else "native in chunks"), lm.execution()
    calls.clear()
    lm.forward(torch.arange(native_step.MAX_TOKENS + 30) % 101, 0, 0)
    assert calls == ["torch" if stalled == "native chunks" else "native chunks"]


@pytest.mark.parametrize("on_threads", [1, 3], indirect=True)
def test_the_bandwidth_reader_reads_every_value_once_a_pass(on_threads: int) -> None:
    """bandwidth.cpp's reader, what `specrpc bench floor` times: the sum it returns of a buffer of small whole
    numbers (exact in float32 in any order) read 3 times is exactly 3 × torch's sum, for lengths under one block and
    not a multiple of the block or of the threads' shares, from an address off the vector width: a value skipped or
    read twice changes it."""
    requires_native()
    lib = native.library()
    assert lib is not None
    for n in (37, 64 * 3 + 5, 100_003):
        values = torch.randint(1, 8, (n + 1,), generator=torch.Generator().manual_seed(n)).float()  # [n + 1]
        x = values[1:]  # [n], 4 bytes past an aligned start
        assert native.read_sum(lib, x, 3) == 3 * float(x.sum()), n


def cpu_flags() -> set[str]:
    """The feature flags of this CPU, as the native build's key reads them (`native._cpu_flags`)."""
    return set(native._cpu_flags().split())


@pytest.mark.parametrize("on_threads", [1, 3], indirect=True)
def test_the_multiply_loop_counts_the_multiply_adds_of_every_thread(on_threads: int) -> None:
    """multiply.cpp's loops, whose count ÷ time is `specrpc bench floor`'s multiply rate: 10 accumulators of 16
    float lanes (of 64 multiply-adds a VNNI instruction, or two halves of AVX2's byte multiply-adds) a round, on
    every thread; no int8 loop where the int8 products widen their weights to float."""
    requires_native()
    lib = native.library()
    assert lib is not None
    assert native.multiply(lib, "float", 1000) == 1000 * 10 * 16 * on_threads
    assert native.multiply(lib, "int8", 1000) == (1000 * 10 * 64 * on_threads if lib.specrpc_int8_group() > 1 else 0)


def in_variant(args: list[str], timeout: float, **settings: str) -> subprocess.CompletedProcess[str]:
    """`python args` from the repository root, its native library built as `settings` say (SPECRPC_NATIVE_MARCH, a
    SPECRPC_*_EMULATE), in this process's library cache: another variant of the native step, run in its own process."""
    env = {**os.environ, **settings, "SPECRPC_NATIVE_CACHE": str(native.cache_dir())}
    return subprocess.run([sys.executable, *args], cwd=Path(__file__).parents[1], env=env, capture_output=True,
                          text=True, timeout=timeout)


AMX_EMULATED = """
import torch
from specrpc import native
from specrpc.config import ASSETS
from specrpc.models import BatchRow, load_model

assert native.amx_available()  # the tile products checked against VNNI's in a process of their own
lm = load_model(ASSETS / "draft", device=torch.device("cpu"), dtype=torch.float32, num_slots=3, max_context=96,
                int8_weights=True, native_decode=True)
step = lm.native
assert step.model.amx_from == 0, step.model.amx_from  # emulated tiles are far slower: never chosen
ids = torch.tensor([(i * 7919) % 4000 for i in range(96)])
step.run_chunks(ids[:40], 0, 0)
for count in (*range(1, 17), 24, 40):  # more than 16 tokens: the tiles 16 at a time
    vnni_amx = []
    for amx_from in (0, 1, 2):
        step.model.amx_from = amx_from
        vnni_amx.append(step.run(ids[40 : 40 + count], 40, 0, count))
    assert torch.equal(vnni_amx[0], vnni_amx[1]) and torch.equal(vnni_amx[0], vnni_amx[2]), count
rows = [BatchRow(ids[40:45], 40, 0, 5), BatchRow(ids[:7], 0, 1, 2), BatchRow(ids[50:54], 30, 2, 4)]
step.run_chunks(ids[:30], 0, 2)
batches = []
for amx_from in (0, 2):
    step.model.amx_from = amx_from
    batches.append(step.run_batch(rows) + [step.run_chunks(ids[:40], 0, 1, num_logits=16)])
assert all(torch.equal(a, b) for a, b in zip(*batches, strict=True))
print("ok")
"""


def test_amx_products_give_the_vnni_bits_and_a_slower_path_is_never_chosen(tmp_path: Path) -> None:
    """The int8 products on AMX tiles (the tile instructions emulated by SPECRPC_AMX_EMULATE, so any CPU with VNNI
    runs them) give every logit of a decode step, forwards of 2-16, 24 and 40 tokens, a batch of rows on three slots
    and a prompt's chunks the same bits as VNNI's: the C self-check passes in its own process, and `calibrate_amx`
    keeps the emulated tiles (far slower) off at every width."""
    requires_native()
    lib = native.library()
    assert lib is not None
    if not {"avx512f", "avx512_vnni"} <= cpu_flags():
        pytest.skip("no AVX-512 VNNI here: the AMX products are checked against VNNI's")
    done = in_variant(["-c", AMX_EMULATED], 600, SPECRPC_AMX_EMULATE="1")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-2000:]


INT8_BITS = """
import hashlib, tempfile
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from specrpc import native
from specrpc.config import ASSETS
from specrpc.models import BatchRow, load_model

digest = hashlib.sha256()
with tempfile.TemporaryDirectory() as odd:  # rows that leave panels partly empty, head_dim 64 and 18
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=18,
                                 max_position_embeddings=128)).save_pretrained(odd)
    for path in (ASSETS / "target", ASSETS / "draft", odd):
        lm = load_model(path, device=torch.device("cpu"), dtype=torch.float32, num_slots=2, max_context=128,
                        int8_weights=True, native_decode=True)
        step = lm.native
        ids = torch.tensor([(i * 7919) % 100 for i in range(128)])
        step.run_chunks(ids[:40], 0, 0)
        for count in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64):
            digest.update(step.run(ids[40 : 40 + count], 40, 0, count).numpy().tobytes())
        step.run_chunks(ids[:20], 0, 1)
        rows = [BatchRow(ids[40:45], 40, 0, 5), BatchRow(ids[20:23], 20, 1, 3)]
        digest.update(b"".join(t.numpy().tobytes() for t in step.run_batch(rows)))
print(native.library().specrpc_int8_dot(), digest.hexdigest())
"""


def test_avx_vnni_products_give_avx2s_bits() -> None:
    """The int8 products an AVX2 CPU with AVX-VNNI builds (vpdpbusd on 8-lane registers: its instruction emulated by
    SPECRPC_AVXVNNI_EMULATE, so any AVX2 CPU runs them) give every logit of forwards of 1-9, 16, 17, 33 and 64 tokens
    and of a batch of two rows, of the shipped target and draft and of a model whose rows leave panels partly empty,
    the same bits as AVX2's byte multiply-adds (SPECRPC_NATIVE_MARCH=haswell): the same exact integer sums."""
    requires_native()
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    printed = []
    for emulate in ("0", "1"):
        done = in_variant(["-c", INT8_BITS], 600, SPECRPC_NATIVE_MARCH="haswell", SPECRPC_AVXVNNI_EMULATE=emulate)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        printed.append(done.stdout.strip().splitlines()[-1].split())
    (avx2, avx2_bits), (avx_vnni, avx_vnni_bits) = printed
    assert (avx2, avx_vnni) == ("2", "3")  # what each build's products multiply with (`specrpc_int8_dot`)
    assert avx_vnni_bits == avx2_bits


def test_an_avx_vnni_cpus_build_compiles() -> None:
    """The build an AVX2 CPU with AVX-VNNI makes (-march=alderlake: vpdpbusd on 8-lane registers, VEX-encoded) compiles
    with this toolchain, where this CPU cannot run it (`test_avx_vnni_products_give_avx2s_bits` runs its products)."""
    requires_native()
    done = in_variant(["-c", "from specrpc import native; print(native.build())"], 600,
                      SPECRPC_NATIVE_MARCH="alderlake")
    built = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "None"
    assert done.returncode == 0 and built != "None" and Path(built).exists(), done.stdout[-2000:] + done.stderr[-2000:]


NATIVE_NUMERICAL_TESTS = ("(native or panel or prefetch_mode or int8) and not stalled and not amx and not build_is "
                          "and not compiler and not bandwidth and not cannot_take and not need_the_lean and not "
                          "older_cpu and not avx_vnni and not (wide_batches and float32) and not (threads and not "
                          "logits) and not slow_as_served and not slowed_after_load and not remembered and not "
                          "restart_takes and not drift and not re_measure and not served_pick and not check_stops "
                          "and not parts_left_out")
"""The native step's numerical tests (verify = decode bit for bit, batches = solo rows, close to transformers and to
the torch int8 forward, prefetch and threads a hint), not the ones about building other variants, timing and the
choices it makes (the threads each shape takes, the served picks, remembered choices, re-measures, a forward's parts
left out for timing) or AMX, nor the shipped float32 target's wide batches (11 s; the int8 and deterministic cases of
that test run). (`-k native` matches every test of this file by its name: the exclusions keep the rest out.)"""


@pytest.mark.parametrize(("march", "needs"), [("haswell", {"avx2", "fma"}),
                                              ("skylake-avx512", {"avx512f", "avx512bw", "avx512vl"})])
def test_an_older_cpus_build_passes_the_native_steps_numerical_tests(march: str, needs: set[str]) -> None:
    """The native step built for an AVX2 CPU (SPECRPC_NATIVE_MARCH=haswell: 16 registers of 8 lanes, int8 products
    on vpmaddubsw) and for AVX-512 without VNNI (skylake-avx512: 32 registers, int8 weights widened to float) passes
    the same numerical tests as this machine's build, so a CPU older than this one gets an exact step too, not just one
    that compiles."""
    requires_native()
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {march} build")
    if march == "haswell" and "avx512f" not in cpu_flags():
        pytest.skip("this CPU's own build is the AVX2 step (no AVX-512): the rest of the suite runs these tests on it")
    done = in_variant(["-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "tests/test_native.py",
                       "tests/test_models.py", "-k", NATIVE_NUMERICAL_TESTS], 900, SPECRPC_NATIVE_MARCH=march)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    probe = in_variant(["-c", "from specrpc import native; lib = native.library(); print(lib.specrpc_int8_group(), "
                        "lib.specrpc_int8_dot())"], 300, SPECRPC_NATIVE_MARCH=march)
    # int8 activations on AVX2 (groups of 4 columns, byte multiply-adds), int8 weights widened to float on AVX-512
    # without VNNI
    expected = "4 2" if march == "haswell" else "1 0"
    assert probe.stdout.strip().splitlines()[-1] == expected, probe.stdout + probe.stderr
