"""End-to-end tests of specrpc.v1.Generator against a real server on a loopback port (tests/conftest.py).

They hold for any model pair with the shipped tokenizer: expectations come from the server's own outputs (a stop
string is cut from a run without one, greedy outputs are compared across speculation settings), never from
hard-coded generated text.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from conftest import test_config as make_config
from service_helpers import (
    GREEDY_K0,
    LONG_TOKENS,
    Conversation,
    collect,
    first_tokens,
    ids_of,
    long_request,
    read_rest,
    rpc_error,
    text_of,
    wait_until,
)
from transformers import PreTrainedTokenizerBase

from specrpc.edges.server import Running, start_server
from specrpc.engine.generation import GenerationRequest, GenerationStats, StepResult
from specrpc.prompts.fim import declare_fim
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

Stub = pb_grpc.GeneratorStub
CODE_PROMPT = "def add(a, b):\n    return"
REPLACEMENT = "\ufffd"
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def greedy(prompt: str = CODE_PROMPT, n: int = 24, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_new_tokens=n, **fields)


def eos_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()


def plain_history(messages: list[tuple[str, str]]) -> str:
    """The documented plain-text history (no chat template): `Role: text` lines, replies right after `Assistant:`."""
    names = {"system": "System", "user": "User"}
    return "".join(f"Assistant:{text}\n" if role == "assistant" else f"{names[role]}: {text}\n"
                   for role, text in messages)


# ---- Generate ------------------------------------------------------------------------------------------------------


async def test_generate_streams_chunks_then_one_summary_with_counts(
    stub: Stub, tokenizer: PreTrainedTokenizerBase
) -> None:
    chunks, summary = await collect(stub.Generate(greedy(n=24)))
    ids = ids_of(chunks)
    assert chunks and ids
    assert summary.prompt_tokens == len(tokenizer(CODE_PROMPT).input_ids)
    assert summary.completion_tokens == len(ids)
    if summary.finish_reason == pb.FINISH_REASON_LENGTH:
        assert len(ids) == 24
    else:
        assert summary.finish_reason == pb.FINISH_REASON_STOP and ids[-1] in eos_ids(tokenizer)
    assert summary.speculation.draft_tokens_accepted == sum(c.accepted_draft_tokens for c in chunks)
    assert summary.speculation.draft_tokens_accepted <= summary.speculation.draft_tokens_proposed
    assert summary.session_id == "" and summary.stop_sequence == ""
    assert 0 <= summary.timing.queue_ms <= summary.timing.ttft_ms <= summary.timing.total_ms
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if REPLACEMENT not in full:
        assert text_of(chunks) == full

    # the same prompt sent as token ids: the same tokens, text and counts
    by_ids = pb.GenerateRequest(prompt_token_ids=tokenizer(CODE_PROMPT).input_ids, max_new_tokens=24)
    chunks2, summary2 = await collect(stub.Generate(by_ids))
    assert ids_of(chunks2) == ids and text_of(chunks2) == text_of(chunks)
    assert summary2.prompt_tokens == summary.prompt_tokens
    assert summary2.finish_reason == summary.finish_reason


async def test_greedy_is_deterministic_and_exact_whatever_the_speculation(stub: Stub, server: Running) -> None:
    prompt = "import os\nimport sys\n\n\ndef main():\n"
    reference, _ = await collect(stub.Generate(greedy(prompt, 40, speculation=GREEDY_K0)))
    variants: dict[str, pb.SpeculationParams | None] = {
        "adaptive": None,
        "k=0 again": GREEDY_K0,
        "k=4": pb.SpeculationParams(num_draft_tokens=4),
        "prompt lookup": pb.SpeculationParams(proposer=pb.PROPOSER_PROMPT_LOOKUP),
        "prompt lookup k=8": pb.SpeculationParams(num_draft_tokens=8, proposer=pb.PROPOSER_PROMPT_LOOKUP),
    }
    if server.runtime.draft is not None:
        variants["draft k=8"] = pb.SpeculationParams(num_draft_tokens=8, proposer=pb.PROPOSER_DRAFT_MODEL)
        variants["combined"] = pb.SpeculationParams(proposer=pb.PROPOSER_COMBINED)
    for name, speculation in variants.items():
        request = greedy(prompt, 40)
        if speculation is not None:
            request.speculation.CopyFrom(speculation)
        chunks, summary = await collect(stub.Generate(request))
        assert ids_of(chunks) == ids_of(reference), name
        assert text_of(chunks) == text_of(reference), name
        if speculation is not None and speculation.HasField("num_draft_tokens") and speculation.num_draft_tokens == 0:
            assert summary.speculation.draft_tokens_proposed == 0, name


async def test_seeded_sampling_is_reproducible(stub: Stub, server: Running) -> None:
    sampling = pb.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    # the adaptive policy's k follows live timings; the seed must win over it
    variants = [None, pb.SpeculationParams(num_draft_tokens=2)]
    if server.runtime.draft is not None:
        variants.append(pb.SpeculationParams(proposer=pb.PROPOSER_COMBINED))
    for speculation in variants:
        runs = []
        for _ in range(2):
            request = greedy("The weather today is", 32, sampling=sampling)
            if speculation is not None:
                request.speculation.CopyFrom(speculation)
            runs.append(await collect(stub.Generate(request)))
        assert ids_of(runs[0][0]) == ids_of(runs[1][0]), speculation
        assert text_of(runs[0][0]) == text_of(runs[1][0])


TEMPERATURE_FLOOR = 0.01
"""validation.MIN_TEMPERATURE: a smaller positive temperature samples as this one (float32 logits / 1e-40 is inf)."""


async def test_sampling_parameters_at_the_edges_of_float32_behave_as_documented(stub: Stub) -> None:
    async def ids(**sampling: Any) -> list[int]:
        request = greedy("The weather today is", 12, sampling=pb.SamplingParams(seed=7, **sampling),
                         speculation=pb.SpeculationParams(num_draft_tokens=2))
        return ids_of((await collect(stub.Generate(request)))[0])

    floor = await ids(temperature=TEMPERATURE_FLOOR)
    assert len(floor) > 1
    for tiny in (1e-38, 1e-40, 1e-45, TEMPERATURE_FLOOR / 2):
        assert await ids(temperature=tiny) == floor, tiny
    plain = await ids(temperature=0.9)
    for same in ({"top_p": 1 - 1e-9}, {"top_p": 0.0}, {"top_k": 2**31 - 1}, {"top_k": 10**6}):
        assert await ids(temperature=0.9, **same) == plain, same  # top_p within float32 of 1, 0; top_k >= vocab: off


async def test_max_new_tokens_ends_with_length(stub: Stub, long_streams: float) -> None:
    for n in (1, 3):
        chunks, summary = await collect(stub.Generate(greedy(n=n, speculation=GREEDY_K0)))
        assert summary.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(ids_of(chunks)) == summary.completion_tokens == n
    # 0 means the server default
    chunks, summary = await collect(stub.Generate(greedy(n=0)))
    assert summary.finish_reason == pb.FINISH_REASON_LENGTH and summary.completion_tokens == 128


# ---- stop strings --------------------------------------------------------------------------------------------------


async def test_stop_strings_end_the_stream_and_are_not_emitted(stub: Stub, long_streams: float) -> None:
    chunks, _ = await collect(stub.Generate(greedy(n=40, speculation=GREEDY_K0)))
    full = text_of(chunks)
    assert len(full) >= 12, full
    # cut inside the text, and at a chunk boundary crossing (chunks are single tokens at k=0)
    middle = full[len(full) // 2 : len(full) // 2 + 3]
    bounds = [sum(len(c.text) for c in chunks[: i + 1]) for i in range(len(chunks) - 1)]
    crossing = next((b for b in bounds if 2 <= b <= len(full) - 2 and chunks[0].text), None)
    stops = [middle]
    if crossing is not None:
        stops.append(full[crossing - 2 : crossing + 2])
    for stop in stops:
        if not stop.strip(REPLACEMENT):
            continue
        cut = full.index(stop)
        # other chunkings give the same text unless the model wrote invalid UTF-8 (U+FFFD)
        chunkings = [GREEDY_K0] if REPLACEMENT in full else [GREEDY_K0, pb.SpeculationParams(num_draft_tokens=4)]
        for speculation in chunkings:
            stopped, summary = await collect(stub.Generate(greedy(n=40, stop=[stop], speculation=speculation)))
            assert summary.finish_reason == pb.FINISH_REASON_STOP, stop
            assert summary.stop_sequence == stop
            assert text_of(stopped) == full[:cut], (stop, full)
            assert all(stop not in c.text for c in stopped)
            assert summary.completion_tokens == len(ids_of(stopped))
    # with several stop strings the earliest occurrence wins
    early, late = full[1:3], full[-3:]
    chunks3, summary3 = await collect(stub.Generate(greedy(n=40, stop=[late, early], speculation=GREEDY_K0)))
    first = min(full.index(early), full.index(late))
    assert text_of(chunks3) == full[:first]
    assert summary3.stop_sequence in (early, late)


# ---- UTF-8 ---------------------------------------------------------------------------------------------------------


async def test_chunks_never_split_a_character(stub: Stub, tokenizer: PreTrainedTokenizerBase) -> None:
    """Whatever the model writes: chunk texts are valid, and together they are the decode of the chunk ids."""
    prompt = "# 你好，世界！😀😀😀 こんにちは 🎉🎉🎉 ünïcödé — 数据处理\ntext = \"你好😀😀"
    prompt_ids = tokenizer(prompt).input_ids
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in prompt_ids)  # the prompt has split characters
    for sampling in (None, pb.SamplingParams(temperature=1.0, seed=0)):
        request = greedy(prompt, 32, speculation=GREEDY_K0)
        if sampling is not None:
            request.sampling.CopyFrom(sampling)
        chunks, _ = await collect(stub.Generate(request))
        ids = ids_of(chunks)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if REPLACEMENT not in full:  # else the model wrote invalid UTF-8, which no detokenizer can make whole
            assert all(REPLACEMENT not in c.text for c in chunks), [c.text for c in chunks]
            assert text_of(chunks) == full
        # the prompt as token ids gives the same stream (cut into chunks where the stream interval fell)
        by_ids = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=32, speculation=GREEDY_K0)
        if sampling is not None:
            by_ids.sampling.CopyFrom(sampling)
        chunks2, _ = await collect(stub.Generate(by_ids))
        assert ids_of(chunks2) == ids and text_of(chunks2) == text_of(chunks)
        assert all(REPLACEMENT not in c.text for c in chunks2) or REPLACEMENT in full


class ScriptedGeneration:
    """Stands in for the engine's Generation: commits a fixed token script, `per_step` tokens per step; step i
    (from 0) takes `pauses[i]` seconds where given."""

    def __init__(self, request: GenerationRequest, script: list[int], per_step: int,
                 pauses: dict[int, float] | None = None) -> None:
        self.script, self.per_step, self.pauses = script, per_step, pauses or {}
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        self.finish: str | None = None

    def step(self) -> StepResult:
        time.sleep(self.pauses.get(self.stats.verify_steps, 0.0))
        done = self.stats.completion_tokens
        tokens = self.script[done : done + self.per_step]
        self.stats.completion_tokens += len(tokens)
        self.stats.verify_steps += 1
        if self.stats.completion_tokens == len(self.script):
            self.finish = "length"
        return StepResult(tokens, 0, 0, self.finish)


@pytest.fixture
def scripted(server: Running, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Make the engine emit a given token script (to force characters split across chunks, whatever the model):
    use(script, per_step, pauses=None) as `ScriptedGeneration`."""

    def use(script: list[int], per_step: int, pauses: dict[int, float] | None = None) -> None:
        engine = server.runtime.engine
        monkeypatch.setattr(engine, "start",
                            lambda slot, request: ScriptedGeneration(request, script, per_step, pauses))

        def step(gens: list[ScriptedGeneration], on_device: Callable[[], None] | None = None) -> list[StepResult]:
            if on_device is not None:  # the step's forward starts: the scheduler wakes the last step's readers
                on_device()
            return [gen.step() for gen in gens]

        monkeypatch.setattr(engine, "step", step)

    return use


async def test_multibyte_characters_split_across_chunks_arrive_whole(
    stub: Stub, tokenizer: PreTrainedTokenizerBase, scripted: Callable[..., None],
    stream_interval: Callable[[float], None]
) -> None:
    stream_interval(0.0)  # each step's tokens in their own chunk while the reader keeps up
    text = "def 你好():  # 😀 ünï 🎉🎉 数据 — done"
    script = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(script) == text
    for per_step in (1, 2, 3):
        scripted(script, per_step)
        chunks, summary = await collect(stub.Generate(greedy("x", len(script))))
        assert ids_of(chunks) == script and summary.finish_reason == pb.FINISH_REASON_LENGTH
        assert text_of(chunks) == text
        assert all(REPLACEMENT not in c.text for c in chunks), [c.text for c in chunks]
        # the steps split characters (the script's, not the chunks': a reader that falls behind gets steps joined)
        assert any(REPLACEMENT in tokenizer.decode(script[:i]) for i in range(per_step, len(script), per_step))
        # a stop string made of multi-byte characters, met across chunks
        stopped, summary = await collect(stub.Generate(greedy("x", len(script), stop=["🎉🎉"])))
        assert text_of(stopped) == text[: text.index("🎉🎉")]
        assert summary.finish_reason == pb.FINISH_REASON_STOP and summary.stop_sequence == "🎉🎉"
    # Converse streams the same way, and phrases count code points
    scripted(tokenizer(" Ça va? 你好。😀 Oui.", add_special_tokens=False).input_ids, 1)
    conversation = Conversation(stub)
    await conversation.start(phrase_mode=True)
    chunks, phrases, turn = await conversation.turn("hi")
    assert turn.reply_text == text_of(chunks) == " Ça va? 你好。😀 Oui."
    assert [p.text for p in phrases] == [" Ça va? ", "你好。", "😀 Oui."]
    assert [(p.start_char, p.end_char) for p in phrases] == [(0, 8), (8, 11), (11, 17)]
    await conversation.close()


async def test_tokens_wait_for_the_stream_interval_but_the_first_and_the_end_do_not(
    stub: Stub, tokenizer: PreTrainedTokenizerBase, scripted: Callable[..., None],
    stream_interval: Callable[[float], None]
) -> None:
    """A stream's reader is woken at most once per stream interval: its first step's tokens go out at once, what
    follows within the interval waits and goes out as one chunk, and its end goes out at once with what waited."""
    text = "def add(a, b):\n    return a + b\n"
    script = tokenizer(text, add_special_tokens=False).input_ids
    assert len(script) > 4
    scripted(script, 1, dict.fromkeys(range(len(script)), 0.2))  # steps long enough for the reader to keep up
    stream_interval(0.0)
    chunks, _ = await collect(stub.Generate(greedy("x", len(script))))
    assert [list(c.token_ids) for c in chunks] == [[t] for t in script]
    scripted(script, 1, {1: 0.5})
    stream_interval(60.0)
    t0 = time.perf_counter()
    chunks, summary = await collect(stub.Generate(greedy("x", len(script))))
    assert time.perf_counter() - t0 < 30, "the end is not held back"
    assert [list(c.token_ids) for c in chunks] == [script[:1], script[1:]] and text_of(chunks) == text
    assert summary.completion_tokens == len(script)


async def test_a_waiting_chunk_goes_out_when_its_interval_ends_however_long_the_next_step(
    stub: Stub, tokenizer: PreTrainedTokenizerBase, scripted: Callable[..., None],
    stream_interval: Callable[[float], None]
) -> None:
    """The chunk that waits for its interval goes out when the interval ends, not when the next step does (the
    waker thread keeps the deadline while the device thread computes)."""
    script = tokenizer("a b c d", add_special_tokens=False).input_ids
    scripted(script, 1, {1: 0.5, 2: 3.0})  # the third step takes 3 s
    stream_interval(1.0)
    arrival: list[float] = []  # per token, when its chunk arrived
    t0 = time.perf_counter()
    async for response in stub.Generate(greedy("x", len(script))):
        if response.WhichOneof("event") == "chunk":
            arrival += [time.perf_counter() - t0] * len(response.chunk.token_ids)
    assert len(arrival) == len(script)
    assert arrival[0] < 0.5 < arrival[1], arrival  # the first at once; the second waits for the interval
    assert arrival[1] < 3.0 < arrival[2], arrival  # it went out at the interval's end (1 s), not after the 3 s step


async def test_a_request_sets_its_own_stream_interval(
    stub: Stub, tokenizer: PreTrainedTokenizerBase, scripted: Callable[..., None],
    stream_interval: Callable[[float], None]
) -> None:
    """A request's `stream_interval_ms` stands in for the server's, for its own stream: 0 hands each step's tokens
    over at once under a server interval of a minute (Generate, Infill, and a Converse session's replies from its
    start), and 1000 holds them beside a server interval of 0; outside 0..1000 is INVALID_ARGUMENT naming the field."""
    text = "def add(a, b):\n    return a + b\n"
    script = tokenizer(text, add_special_tokens=False).input_ids
    slow = dict.fromkeys(range(len(script)), 0.2)  # steps long enough for the reader to keep up
    stream_interval(60.0)
    scripted(script, 1, slow)
    chunks, _ = await collect(stub.Generate(greedy("x", len(script), stream_interval_ms=0)))
    assert [list(c.token_ids) for c in chunks] == [[t] for t in script]
    scripted(script, 1, slow)
    chunks, _ = await collect(stub.Infill(pb.InfillRequest(prefix="x", suffix="\n", max_new_tokens=len(script),
                                                           stream_interval_ms=0)))
    assert [list(c.token_ids) for c in chunks] == [[t] for t in script]
    scripted(script, 1, slow)
    chat = Conversation(stub)
    await chat.start(stream_interval_ms=0)
    chunks, _, summary = await chat.turn("Write add.", max_new_tokens=len(script))
    assert [list(c.token_ids) for c in chunks] == [[t] for t in script[:summary.generation.completion_tokens]]
    await chat.close()
    stream_interval(0.0)
    scripted(script, 1, dict.fromkeys(range(len(script)), 0.02))
    chunks, _ = await collect(stub.Generate(greedy("x", len(script), stream_interval_ms=1000)))
    assert [list(c.token_ids) for c in chunks] == [script[:1], script[1:]]
    for request in (stub.Generate(greedy("x", 4, stream_interval_ms=1001)),
                    stub.Infill(pb.InfillRequest(prefix="x", stream_interval_ms=5000))):
        error = await rpc_error(request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stream_interval_ms must be in 0..1000" in (error.details() or "")
    call = stub.Converse()
    await call.write(pb.ConverseRequest(start=pb.SessionStart(stream_interval_ms=1001)))
    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "start.stream_interval_ms" in (error.details() or "")


# ---- Infill --------------------------------------------------------------------------------------------------------


def fim_prompt(tokenizer: PreTrainedTokenizerBase, prefix: str, suffix: str, path: str = "",
               extra: tuple[tuple[str, str], ...] = (), typed: str = "") -> list[int]:
    """The documented layout of the shipped pair: [SEP path\\n text EOS]* PRE [SEP path\\n] prefix SUF suffix MID,
    then the typed line (the current line's text before the cursor) in the typed-line layout."""
    pre, suf, mid = tokenizer.convert_tokens_to_ids(list(FIM_TOKENS))
    sep = tokenizer.convert_tokens_to_ids("<|file_sep|>")

    def plain(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    ids: list[int] = []
    for file_path, text in extra:
        ids += [sep, *plain(f"{file_path}\n{text}"), tokenizer.eos_token_id]
    ids.append(pre)
    if path:
        ids += [sep, *plain(f"{path}\n")]
    return [*ids, *plain(prefix), suf, *plain(suffix), mid, *(plain(typed) if typed else [])]


async def test_infill_formats_the_prompt_with_fim_tokens(stub: Stub, tokenizer: PreTrainedTokenizerBase) -> None:
    lines, typed, suffix = "def area(w, h):\n", "    return ", "\n\n\nprint(area(2, 3))\n"
    prefix = lines + typed
    extra = (("geometry/util.py", "def square(x):\n    return x * x\n"), ("README.md", "Area helpers.\n"))
    psm = pb.FIM_LAYOUT_PSM
    cases = [
        (pb.InfillRequest(prefix=prefix, suffix=suffix, max_new_tokens=16, layout=psm),
         fim_prompt(tokenizer, prefix, suffix), psm),
        (pb.InfillRequest(prefix=prefix, suffix=suffix, max_new_tokens=16, path="geometry/area.py", layout=psm,
                          extra=[pb.ExtraFile(path=p, text=t) for p, t in extra]),
         fim_prompt(tokenizer, prefix, suffix, "geometry/area.py", extra), psm),
        # unspecified: this prefix-first pair gets the typed-line layout, split by the server or by the client
        (pb.InfillRequest(prefix=prefix, suffix=suffix, max_new_tokens=16),
         fim_prompt(tokenizer, lines, suffix, typed=typed), pb.FIM_LAYOUT_TYPED_LINE),
        (pb.InfillRequest(prefix=lines, typed_line=typed, suffix=suffix, max_new_tokens=16),
         fim_prompt(tokenizer, lines, suffix, typed=typed), pb.FIM_LAYOUT_TYPED_LINE),
    ]
    for request, expected, layout in cases:
        chunks, summary = await collect(stub.Infill(request))
        assert summary.prompt_tokens == len(expected)
        assert summary.completion_tokens == len(ids_of(chunks))
        assert summary.fim_layout == layout and summary.trimmed_prompt_tokens == 0
        # the same ids through Generate give the same middle: the prompt was exactly this
        same, _ = await collect(stub.Generate(pb.GenerateRequest(prompt_token_ids=expected, max_new_tokens=16)))
        assert ids_of(same) == ids_of(chunks)
        assert text_of(same) == text_of(chunks)


async def test_infill_model_info_and_layouts_the_model_was_not_trained_for(stub: Stub) -> None:
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.supports_infill and info.fim_template == "specrpc" and list(info.fim_orders) == ["psm"]
    assert info.fim_default_layout == pb.FIM_LAYOUT_TYPED_LINE
    error = await rpc_error(stub.Infill(pb.InfillRequest(prefix="def f(", suffix=")\n", layout=pb.FIM_LAYOUT_SPM)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "spm" in (error.details() or "")


def keystroke_requests(session: str, n: int = 10) -> list[pb.InfillRequest]:
    """A line typed character by character in the middle of a small file, one Infill per keystroke."""
    above = "".join(f"def step_{i}(value):\n    return value * {i} + {i * 3}\n\n" for i in range(6))
    below = "".join(f"\n\ndef after_{i}(value):\n    return value - {i}\n" for i in range(4))
    line = "total = step_1(4) + step_2(5)"
    return [pb.InfillRequest(prefix=above + line[:i], suffix=below, max_new_tokens=4, session_id=session)
            for i in range(len(line) - n, len(line) + 1)]


async def assert_a_keystroke_prefills_only_its_own_tokens(stub: Stub, layout: int) -> None:
    session = f"keys-{uuid.uuid4().hex}"
    previous = 0
    for i, request in enumerate(keystroke_requests(session)):
        _, summary = await collect(stub.Infill(request))
        assert summary.fim_layout == layout
        prefilled = summary.prompt_tokens - summary.cached_prompt_tokens
        if i:
            assert prefilled <= max(0, summary.prompt_tokens - previous) + 4, (i, summary)
        previous = summary.prompt_tokens


async def test_infill_keystrokes_prefill_only_their_own_tokens(stub: Stub) -> None:
    await assert_a_keystroke_prefills_only_its_own_tokens(stub, pb.FIM_LAYOUT_TYPED_LINE)


async def test_infill_truncate_fits_the_context_and_reports_the_trim(stub: Stub, server: Running) -> None:
    lines = "".join(f"value_{i} = compute({i}, scale={i * 3})\n" for i in range(120))
    request = pb.InfillRequest(prefix=lines + "result = ", suffix="\n" + lines, max_new_tokens=8)
    error = await rpc_error(stub.Infill(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncate" in (error.details() or "")
    request.truncate = True
    chunks, summary = await collect(stub.Infill(request))
    assert summary.prompt_tokens + 8 <= server.runtime.context_limit
    assert summary.trimmed_prefix_chars > 0 and summary.trimmed_suffix_chars > 0
    assert summary.trimmed_prompt_tokens > 0 and summary.completion_tokens == len(ids_of(chunks)) > 0
    # what was reported as trimmed is what was left out: the rest, sent as is, is the same prompt
    kept = pb.InfillRequest(prefix=request.prefix[summary.trimmed_prefix_chars:], max_new_tokens=8,
                            suffix=request.suffix[:len(request.suffix) - summary.trimmed_suffix_chars])
    same, kept_summary = await collect(stub.Infill(kept))
    assert kept_summary.prompt_tokens == summary.prompt_tokens and ids_of(same) == ids_of(chunks)


async def test_generate_with_a_path_opens_that_file(stub: Stub, tokenizer: PreTrainedTokenizerBase) -> None:
    """`path`: the prompt is the start of that file, framed as in training ([SEP] path\\n text, one tokenization)."""
    prompt, path = "def fibonacci(n):\n", "maths/fib.py"
    sep = tokenizer.convert_tokens_to_ids("<|file_sep|>")
    expected = [sep, *tokenizer(f"{path}\n{prompt}", add_special_tokens=False).input_ids]
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(prompt=prompt, path=path, max_new_tokens=12)))
    assert summary.prompt_tokens == len(expected)
    same, _ = await collect(stub.Generate(pb.GenerateRequest(prompt_token_ids=expected, max_new_tokens=12)))
    assert ids_of(same) == ids_of(chunks) and text_of(same) == text_of(chunks)
    # with token ids the path is ignored: the ids are the prompt
    ignored, summary = await collect(stub.Generate(pb.GenerateRequest(prompt_token_ids=expected[1:], path=path,
                                                                      max_new_tokens=4)))
    assert summary.prompt_tokens == len(expected) - 1 and ids_of(ignored)


def _rename_fim(value: Any) -> Any:
    """JSON with the FIM token names replaced (keys and strings), so that the tokenizer has none."""
    if isinstance(value, dict):
        return {_rename_fim(k): _rename_fim(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rename_fim(v) for v in value]
    if isinstance(value, str) and value in FIM_TOKENS:
        return f"<|reserved_{FIM_TOKENS.index(value)}|>"
    return value


@pytest_asyncio.fixture(scope="module")
async def no_fim_server(server: Running, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """A second server on a copy of the target whose tokenizer has no fill-in-the-middle tokens (no draft)."""
    target = tmp_path_factory.mktemp("no_fim") / "target"
    shutil.copytree(server.runtime.config.engine.target, target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target / name).exists():
            data = json.loads((target / name).read_text())
            (target / name).write_text(json.dumps(_rename_fim(data)))
    config = make_config()
    config = replace(config, engine=replace(config.engine, target=str(target), draft="none", max_sessions=1,
                                            max_context=128),
                     server=replace(config.server, metrics_port=0))
    running = await start_server(config)
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture(scope="module")
async def spm_server(server: Running, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """A second server on a copy of the shipped pair declared trained in both orders (random-quality for SPM until
    the second-generation pair, exact all the same): Infill lays prompts out suffix first."""
    root = tmp_path_factory.mktemp("spm")
    engine = server.runtime.config.engine
    for role, path in (("target", engine.target), ("draft", engine.draft)):
        shutil.copytree(path, root / role)
        declare_fim(root / role, "specrpc", ["psm", "spm"])
    config = make_config()
    config = replace(config, engine=replace(config.engine, target=str(root / "target"), draft=str(root / "draft"),
                                            max_sessions=1),
                     server=replace(config.server, metrics_port=0))
    running = await start_server(config)
    yield running
    await running.stop(0.5)


async def test_spm_infill_appends_per_keystroke_and_is_exact(spm_server: Running,
                                                              tokenizer: PreTrainedTokenizerBase) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{spm_server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert list(info.fim_orders) == ["psm", "spm"] and info.fim_default_layout == pb.FIM_LAYOUT_SPM
        await assert_a_keystroke_prefills_only_its_own_tokens(stub, pb.FIM_LAYOUT_SPM)
        prefix, suffix = "def area(w, h):\n    return ", "\n\nprint(area(2, 3))\n"
        pre, suf, mid = tokenizer.convert_tokens_to_ids(list(FIM_TOKENS))
        plain = tokenizer(suffix, add_special_tokens=False).input_ids
        expected = [suf, *plain, pre, *tokenizer(prefix, add_special_tokens=False).input_ids, mid]
        reference, _ = await collect(stub.Generate(pb.GenerateRequest(prompt_token_ids=expected, max_new_tokens=12,
                                                                      speculation=GREEDY_K0)))
        for speculation in (None, pb.SpeculationParams(num_draft_tokens=6)):
            request = pb.InfillRequest(prefix=prefix, suffix=suffix, max_new_tokens=12)
            if speculation is not None:
                request.speculation.CopyFrom(speculation)
            chunks, summary = await collect(stub.Infill(request))
            assert summary.prompt_tokens == len(expected) and ids_of(chunks) == ids_of(reference)


async def test_infill_without_fim_tokens_is_failed_precondition(no_fim_server: Running) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{no_fim_server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        error = await rpc_error(stub.Infill(pb.InfillRequest(prefix="def f(", suffix=")\n", max_new_tokens=4)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "fill-in-the-middle" in (error.details() or "")
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert not info.supports_infill and not info.HasField("draft")
        assert info.speculation_policy.proposer == pb.PROPOSER_PROMPT_LOOKUP
        error = await rpc_error(stub.Generate(greedy(n=4, speculation=pb.SpeculationParams(
            proposer=pb.PROPOSER_DRAFT_MODEL))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft" in (error.details() or "")
        chunks, summary = await collect(stub.Generate(greedy(n=4)))  # generation still works
        assert summary.completion_tokens == len(ids_of(chunks)) > 0


# ---- editor fields --------------------------------------------------------------------------------------------------

EDITOR_PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


async def test_n_indent_ends_before_the_first_line_indented_less(stub: Stub, long_streams: float) -> None:
    """Whatever the model writes: with n_indent one more than the indentation of its second non-blank line, the
    completion ends before that line, with finish reason INDENT; with n_indent 0 nothing changes."""
    reference, _ = await collect(stub.Generate(greedy(EDITOR_PROMPT, 64, speculation=GREEDY_K0)))
    text = text_of(reference)
    lines = text.split("\n")
    later = [(i, line) for i, line in enumerate(lines) if i > 0 and line.strip()]
    assert later, f"the reference has no second line: {text!r}"
    at, line = later[0]
    n_indent = indent_of(line) + 1
    chunks, summary = await collect(stub.Generate(greedy(EDITOR_PROMPT, 64, n_indent=n_indent)))
    assert summary.finish_reason == pb.FINISH_REASON_INDENT
    assert text_of(chunks) == "\n".join(lines[:at]) + "\n"
    assert summary.completion_tokens == len(ids_of(chunks))
    same, summary = await collect(stub.Generate(greedy(EDITOR_PROMPT, 64, n_indent=0, speculation=GREEDY_K0)))
    assert text_of(same) == text and summary.finish_reason == pb.FINISH_REASON_LENGTH


async def test_max_time_ms_ends_at_the_next_newline(stub: Stub, long_streams: float) -> None:
    """Steps take at least 10 ms here, so a 1 ms budget is spent by the second chunk: the completion ends at the
    first newline after the first chunk, with finish reason TIME_LIMIT."""
    reference, _ = await collect(stub.Generate(greedy(EDITOR_PROMPT, 64, speculation=GREEDY_K0)))
    first, rest = reference[0].text, text_of(reference[1:])
    assert "\n" in rest
    chunks, summary = await collect(stub.Generate(greedy(EDITOR_PROMPT, 64, max_time_ms=1, speculation=GREEDY_K0)))
    assert summary.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert text_of(chunks) == first + rest[: rest.index("\n") + 1]


async def test_prefill_only_warms_the_session_and_answers_with_a_summary(stub: Stub,
                                                                          tokenizer: PreTrainedTokenizerBase) -> None:
    session = f"open-{uuid.uuid4().hex}"
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(prompt=EDITOR_PROMPT, session_id=session,
                                                                     prefill_only=True)))
    prompt_tokens = len(tokenizer(EDITOR_PROMPT).input_ids)
    assert chunks == [] and summary.finish_reason == pb.FINISH_REASON_LENGTH
    assert summary.prompt_tokens == summary.tokens_cached == prompt_tokens and summary.completion_tokens == 0
    assert summary.speculation.verify_steps == 0
    typed = EDITOR_PROMPT + "        self"
    chunks, summary = await collect(stub.Generate(greedy(typed, 8, session_id=session)))
    assert summary.cached_prompt_tokens >= prompt_tokens - 1
    cold, _ = await collect(stub.Generate(greedy(typed, 8)))
    assert ids_of(chunks) == ids_of(cold)


async def test_an_idle_check_of_the_paths_leaves_a_warmed_session_its_cache(stub: Stub, server: Running,
                                                                          tokenizer: PreTrainedTokenizerBase) -> None:
    """An idle check of each model's paths (`--recheck-s`, run here on the device thread as the scheduler does) on
    the slot a warmed session holds: the session's next request still starts from its cached prompt, and gets what
    the same request got from that cache before the check (an anonymous request then, which copied it)."""
    session = f"check-{uuid.uuid4().hex}"
    await collect(stub.Generate(pb.GenerateRequest(prompt=EDITOR_PROMPT, session_id=session, prefill_only=True)))
    typed = EDITOR_PROMPT + "        self"
    before, _ = await collect(stub.Generate(greedy(typed, 16, logprobs=True)))
    runtime = server.runtime
    slot = runtime.registry.sessions[session].slot.index
    models = [m for m in (runtime.target, runtime.draft) if m is not None]
    runtime.scheduler.call(lambda: [m.recheck(slot, lambda: False) for m in models]).result(timeout=60)
    chunks, summary = await collect(stub.Generate(greedy(typed, 16, session_id=session, logprobs=True)))
    assert summary.cached_prompt_tokens >= len(tokenizer(EDITOR_PROMPT).input_ids) - 1
    assert ids_of(chunks) == ids_of(before)
    after_lp, before_lp = ([lp.logprob for c in cs for lp in c.logprobs] for cs in (chunks, before))
    assert after_lp == pytest.approx(before_lp, abs=1e-4)


async def test_logprobs_stream_with_each_token_and_match_target_only(stub: Stub,
                                                                      tokenizer: PreTrainedTokenizerBase) -> None:
    request = greedy(EDITOR_PROMPT, 24, logprobs=True, top_logprobs=3)
    chunks, _ = await collect(stub.Generate(request))
    plain_request = greedy(EDITOR_PROMPT, 24, logprobs=True, top_logprobs=3, speculation=GREEDY_K0)
    plain, _ = await collect(stub.Generate(plain_request))
    assert ids_of(chunks) == ids_of(plain)
    spec = [lp for c in chunks for lp in c.logprobs]
    ref = [lp for c in plain for lp in c.logprobs]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [lp.token_id for lp in spec] == ids_of(chunks)
    for a, b in zip(spec, ref, strict=True):
        assert a.logprob <= 0 and abs(a.logprob - b.logprob) < 1e-4
        assert len(a.top_logprobs) == 3 and a.top_logprobs[0].logprob >= a.logprob - 1e-6  # greedy: the best
        assert a.top_logprobs[0].token_id == a.token_id or abs(a.top_logprobs[0].logprob - a.logprob) < 1e-6
        assert a.text == tokenizer.decode([a.token_id])
    without, _ = await collect(stub.Generate(greedy(EDITOR_PROMPT, 4)))
    assert all(not c.logprobs for c in without)


async def test_the_last_completion_comes_back_as_a_draft(stub: Stub) -> None:
    """Requests on the session that type the first 1..3 chunks of its last completion: the output is the target's
    own (an anonymous request without speculation), and where the target still continues that completion (typed
    text that retokenizes the prompt's end can change what a model this small writes), most of the rest is accepted
    from the suggestion within two verify steps."""
    followed = 0
    for typed_chunks in (1, 2, 3):
        session = f"suggest-{uuid.uuid4().hex}"
        first, _ = await collect(stub.Generate(greedy(EDITOR_PROMPT, 32, session_id=session)))
        typed = EDITOR_PROMPT + text_of(first[:typed_chunks])
        chunks, summary = await collect(stub.Generate(greedy(typed, 24, session_id=session)))
        plain, _ = await collect(stub.Generate(greedy(typed, 24, speculation=GREEDY_K0)))
        assert ids_of(chunks) == ids_of(plain)
        left = len(ids_of(first[typed_chunks:]))
        if text_of(plain).startswith(text_of(first[typed_chunks:])[:40]):  # the target continues the completion
            followed += 1
            assert sum(len(c.token_ids) for c in chunks[:3]) >= 0.8 * min(left, 24), typed_chunks
            assert summary.suggestion_tokens_accepted >= 0.8 * min(left, 24) - 2, typed_chunks
    assert followed >= 1


# ---- sessions ------------------------------------------------------------------------------------------------------


async def test_session_reuses_the_prompt_prefix_across_keystrokes(stub: Stub, tokenizer: PreTrainedTokenizerBase
                                                                  ) -> None:
    session = f"editor-{uuid.uuid4().hex}"
    buffer = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    keystrokes = [buffer[:30], buffer[:44], buffer[:58], buffer]
    previous: list[int] = []
    for i, text in enumerate(keystrokes):
        chunks, summary = await collect(stub.Generate(greedy(text, 8, session_id=session)))
        assert summary.session_id == session
        ids = tokenizer(text).input_ids
        if i:
            shared = next((j for j, (a, b) in enumerate(zip(previous, ids, strict=False)) if a != b),
                          min(len(previous), len(ids)))
            assert summary.cached_prompt_tokens >= min(shared, len(ids) - 1) > 0
        assert summary.cached_prompt_tokens < summary.prompt_tokens
        previous = ids
        # reuse is exact: a cold anonymous request gives the same tokens
        cold, _ = await collect(stub.Generate(greedy(text, 8)))
        assert ids_of(cold) == ids_of(chunks)


async def test_session_id_header_and_field_must_agree(stub: Stub) -> None:
    session = f"hdr-{uuid.uuid4().hex}"
    header = (("x-session-id", session),)
    # the header alone names the session (what a load balancer routes by)
    _, summary = await collect(stub.Generate(greedy("def f(x):\n", 4), metadata=header))
    assert summary.session_id == session
    _, summary = await collect(stub.Generate(greedy("def f(x):\n    return", 4), metadata=header))
    assert summary.session_id == session and summary.cached_prompt_tokens > 0
    # both, equal: fine; both, different: refused with both values named, for every RPC that takes a session
    _, summary = await collect(stub.Generate(greedy("def f(x):\n", 4, session_id=session), metadata=header))
    assert summary.session_id == session
    error = await rpc_error(stub.Generate(greedy("def f(x):\n", 4, session_id="other"), metadata=header))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "other" in (error.details() or "") and session in (error.details() or "")
    error = await rpc_error(stub.Infill(pb.InfillRequest(prefix="def f(", suffix=")\n", max_new_tokens=4,
                                                         session_id="other"), metadata=header))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-session-id" in (error.details() or "")
    call = stub.Converse(metadata=header)
    await call.write(pb.ConverseRequest(start=pb.SessionStart(session_id="other")))
    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "start.session_id" in (error.details() or "")


async def test_new_request_on_a_session_cancels_the_previous_one(stub: Stub, long_streams: float) -> None:
    session = f"keys-{uuid.uuid4().hex}"
    first = stub.Generate(long_request(session_id=session))
    await first_tokens(first)
    second = await collect(stub.Generate(greedy(n=4, session_id=session, speculation=GREEDY_K0)))
    assert second[1].finish_reason == pb.FINISH_REASON_LENGTH and second[1].completion_tokens == 4
    _, summary = await read_rest(first)
    assert summary.finish_reason == pb.FINISH_REASON_CANCELLED
    assert summary.completion_tokens < LONG_TOKENS and summary.session_id == session


async def test_only_the_latest_of_queued_requests_on_a_session_runs(
    stub: Stub, server: Running, long_streams: float
) -> None:
    session = f"burst-{uuid.uuid4().hex}"
    first = stub.Generate(long_request(session_id=session))
    await first_tokens(first)
    # two keystrokes in a burst: the middle one is replaced before (or just after) it starts
    middle = asyncio.ensure_future(collect(stub.Generate(long_request(session_id=session, prompt="Once upon"))))
    # the middle request must reach the server first (two concurrent calls may arrive in either order)
    await wait_until(lambda: server.runtime.registry.sessions[session].latest >= 2, what="the middle request seen")
    last = asyncio.ensure_future(collect(stub.Generate(greedy(n=4, session_id=session, speculation=GREEDY_K0))))
    _, middle_summary = await asyncio.wait_for(middle, timeout=20)
    _, last_summary = await asyncio.wait_for(last, timeout=20)
    _, first_summary = await read_rest(first)
    assert first_summary.finish_reason == pb.FINISH_REASON_CANCELLED
    assert middle_summary.finish_reason == pb.FINISH_REASON_CANCELLED
    assert middle_summary.completion_tokens < LONG_TOKENS // 4
    assert last_summary.finish_reason == pb.FINISH_REASON_LENGTH and last_summary.completion_tokens == 4
    await wait_until(lambda: server.runtime.registry.in_use == 0, what="all slots released")


# ---- cancellation, deadlines, admission ----------------------------------------------------------------------------


async def test_client_cancel_frees_the_slot_while_other_streams_keep_streaming(
    stub: Stub, server: Running, long_streams: float
) -> None:
    registry = server.runtime.registry
    before = registry.in_use
    a, b = stub.Generate(long_request()), stub.Generate(long_request(prompt="It was a dark"))
    await first_tokens(a)
    await first_tokens(b)
    assert registry.in_use == before + 2
    a.cancel()
    received = 0

    async def read_b() -> None:
        nonlocal received
        while True:
            response = await b.read()
            assert response.WhichOneof("event") == "chunk", response
            received += 1

    reader = asyncio.create_task(read_b())
    took = await wait_until(lambda: registry.in_use == before + 1, timeout=3, what="cancelled stream's slot freed")
    await wait_until(lambda: received >= 5, timeout=5, what="the other stream streaming")
    assert took < 1.0
    assert await a.code() == grpc.StatusCode.CANCELLED
    b.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await wait_until(lambda: registry.in_use == before, timeout=3, what="slot freed")


async def test_deadline_mid_stream_frees_the_slot(stub: Stub, server: Running, long_streams: float) -> None:
    registry = server.runtime.registry
    before = registry.in_use
    call = stub.Generate(long_request(), timeout=0.5)
    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: registry.in_use == before, timeout=2, what="slot freed after the deadline")


async def test_resource_exhausted_when_every_slot_has_a_stream(
    stub: Stub, server: Running, long_streams: float
) -> None:
    registry = server.runtime.registry
    calls = [stub.Generate(long_request(prompt=f"Story number {i}:")) for i in range(registry.total)]
    try:
        for call in calls:
            await first_tokens(call)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.kv_slots_in_use == info.kv_slots_total == registry.total
        started = time.perf_counter()
        error = await rpc_error(stub.Generate(greedy(n=4), timeout=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV slots" in (error.details() or "") and "--max-sessions" in (error.details() or "")
        assert time.perf_counter() - started < 2
        # a new named session and a new conversation are refused the same way
        error = await rpc_error(stub.Generate(greedy(n=4, session_id=f"s-{uuid.uuid4().hex}"), timeout=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        conversation = Conversation(stub, timeout=10)
        await conversation.send(start=pb.SessionStart())
        error = await rpc_error(conversation.call.read())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for call in calls:
            call.cancel()
    await wait_until(lambda: registry.in_use == 0, timeout=3, what="every slot freed")
    _, summary = await collect(stub.Generate(greedy(n=2)))
    assert summary.completion_tokens > 0


# ---- Converse ------------------------------------------------------------------------------------------------------


async def test_converse_turns_stream_and_resume(stub: Stub, tokenizer: PreTrainedTokenizerBase,
                                               long_streams: float) -> None:
    conversation = Conversation(stub)
    system = "You answer in one short sentence."
    started = await conversation.start(system=system, max_new_tokens=16)
    assert started.session_id and not started.resumed
    assert started.history_tokens == len(tokenizer(plain_history([("system", system)])).input_ids)
    chunks, phrases, summary = await conversation.turn("What is the capital of France?")
    assert not phrases
    assert summary.turn_index == 0 and summary.reply_text == text_of(chunks)
    assert summary.generation.completion_tokens == len(ids_of(chunks)) > 0
    assert summary.generation.session_id == started.session_id
    assert summary.time_to_first_phrase_ms == 0
    messages = [("system", system), ("user", "What is the capital of France?")]
    assert summary.generation.prompt_tokens == len(tokenizer(plain_history(messages) + "Assistant:").input_ids)
    messages.append(("assistant", summary.reply_text))
    chunks2, _, summary2 = await conversation.turn("And of Spain?", max_new_tokens=4)
    assert summary2.turn_index == 1 and summary2.generation.completion_tokens == len(ids_of(chunks2)) <= 4
    # the second prompt extends the first prompt and reply: their KV cache is reused
    assert summary2.generation.cached_prompt_tokens >= summary.generation.prompt_tokens - 1
    messages += [("user", "And of Spain?"), ("assistant", summary2.reply_text)]
    await conversation.close()

    resumed = Conversation(stub)
    again = await resumed.start(session_id=started.session_id)
    assert again.session_id == started.session_id and again.resumed
    assert again.history_tokens == len(tokenizer(plain_history(messages)).input_ids)
    _, _, summary3 = await resumed.turn("Thanks.", max_new_tokens=2)
    assert summary3.turn_index == 2
    await resumed.close()


async def test_converse_barge_in_cancels_the_reply_quickly(stub: Stub, server: Running, long_streams: float) -> None:
    conversation = Conversation(stub)
    await conversation.start(sampling=pb.SamplingParams(temperature=100.0, seed=3))
    await conversation.send(turn=pb.Turn(text="Tell me a very long story.", max_new_tokens=LONG_TOKENS))
    while (await conversation.read()).WhichOneof("event") != "chunk":
        pass
    await conversation.send(cancel=pb.Cancel())
    cancelled_at = time.perf_counter()
    _, _, summary = await conversation.reply()
    assert time.perf_counter() - cancelled_at < 1.0
    assert summary.generation.finish_reason == pb.FINISH_REASON_CANCELLED
    assert summary.generation.completion_tokens < LONG_TOKENS
    # the session goes on: the next turn runs normally
    _, _, summary2 = await conversation.turn("Short one, please.", max_new_tokens=3)
    assert summary2.turn_index == 1 and summary2.generation.finish_reason == pb.FINISH_REASON_LENGTH
    # a new turn while a reply streams cancels that reply first
    await conversation.send(turn=pb.Turn(text="Another long story.", max_new_tokens=LONG_TOKENS))
    while (await conversation.read()).WhichOneof("event") != "chunk":
        pass
    _, _, summary3 = await conversation.turn("Stop. Just one word.", max_new_tokens=2)
    assert summary3.turn_index == 2 and summary3.generation.finish_reason == pb.FINISH_REASON_CANCELLED
    _, _, summary4 = await conversation.reply()
    assert summary4.turn_index == 3 and summary4.generation.completion_tokens == 2
    await conversation.close()
    await wait_until(lambda: server.runtime.registry.in_use == 0, what="slot released")


@pytest.mark.parametrize("half_closed", [False, True], ids=["open", "half-closed"])
async def test_converse_client_cancel_mid_reply_frees_the_slot(stub: Stub, server: Running, long_streams: float,
                                                                half_closed: bool) -> None:
    registry = server.runtime.registry
    conversation = Conversation(stub)
    await conversation.start(sampling=pb.SamplingParams(temperature=100.0, seed=4))
    await conversation.send(turn=pb.Turn(text="Tell me a very long story.", max_new_tokens=LONG_TOKENS))
    if half_closed:  # the client has nothing more to say and waits for the reply
        await conversation.call.done_writing()
    while (await conversation.read()).WhichOneof("event") != "chunk":
        pass
    assert registry.in_use == 1
    conversation.call.cancel()
    took = await wait_until(lambda: registry.in_use == 0, timeout=3, what="the reply's slot freed")
    assert took < 1.0


async def test_converse_barge_in_works_after_the_idle_session_was_evicted(
    stub: Stub, server: Running, long_streams: float
) -> None:
    registry = server.runtime.registry
    conversation = Conversation(stub)
    started = await conversation.start(sampling=pb.SamplingParams(temperature=100.0, seed=5))
    # a burst of anonymous streams takes every slot: the idle conversation's session is evicted
    calls = [stub.Generate(long_request(prompt=f"Story {i}:")) for i in range(registry.total)]
    for call in calls:
        await first_tokens(call)
    assert started.session_id not in registry.sessions
    for call in calls:
        call.cancel()
    await wait_until(lambda: registry.in_use == 0, timeout=3, what="slots freed")
    # the conversation goes on in a fresh slot, and a barge-in still stops its reply
    await conversation.send(turn=pb.Turn(text="Tell me a very long story.", max_new_tokens=LONG_TOKENS))
    while (await conversation.read()).WhichOneof("event") != "chunk":
        pass
    await conversation.send(cancel=pb.Cancel())
    cancelled_at = time.perf_counter()
    _, _, summary = await conversation.reply()
    assert time.perf_counter() - cancelled_at < 1.0
    assert summary.generation.finish_reason == pb.FINISH_REASON_CANCELLED
    await conversation.close()
    # and its history is kept for a later stream
    resumed = Conversation(stub)
    again = await resumed.start(session_id=started.session_id)
    assert again.resumed and again.history_tokens > 0
    await resumed.close()


async def test_converse_rewind_keeps_only_the_spoken_characters(stub: Stub, tokenizer: PreTrainedTokenizerBase,
                                                                long_streams: float) -> None:
    conversation = Conversation(stub)
    started = await conversation.start(max_new_tokens=24)
    _, _, summary = await conversation.turn("Count to ten.", speculation=GREEDY_K0)
    reply = summary.reply_text
    assert len(reply) >= 2, reply
    spoken = len(reply) // 2
    await conversation.send(rewind=pb.Rewind(spoken_chars=spoken, session_id=started.session_id))
    rewound = (await conversation.read()).rewound
    assert rewound.kept_chars == spoken and rewound.kept_tokens > 0
    messages = [("user", "Count to ten."), ("assistant", reply[:spoken])]
    assert rewound.history_tokens == len(tokenizer(plain_history(messages)).input_ids)
    # the next turn's prompt holds only the spoken part of the reply
    _, _, summary2 = await conversation.turn("Go on.", max_new_tokens=2)
    messages.append(("user", "Go on."))
    assert summary2.generation.prompt_tokens == len(tokenizer(plain_history(messages) + "Assistant:").input_ids)
    assert summary2.generation.cached_prompt_tokens > 0
    # rewinding past the end keeps everything
    await conversation.send(rewind=pb.Rewind(spoken_chars=10_000))
    assert (await conversation.read()).rewound.kept_chars == len(summary2.reply_text)
    await conversation.close()


async def test_converse_phrase_mode(stub: Stub, long_streams: float) -> None:
    conversation = Conversation(stub)
    await conversation.start(phrase_mode=True, max_new_tokens=48, sampling=pb.SamplingParams(temperature=2.0, seed=9))
    await conversation.send(turn=pb.Turn(text="Describe the sea in a few sentences, please."))
    streamed = ""
    phrases: list[pb.Phrase] = []
    while True:
        response = await conversation.read()
        kind = response.WhichOneof("event")
        if kind == "chunk":
            streamed += response.chunk.text
        elif kind == "phrase":
            phrases.append(response.phrase)
            assert response.phrase.end_char <= len(streamed)  # a phrase never runs ahead of the text
        else:
            summary = response.summary
            break
    reply = summary.reply_text
    assert reply == streamed and reply
    assert "".join(p.text for p in phrases) == reply
    offset = 0
    for phrase in phrases:
        assert phrase.start_char == offset and phrase.end_char == offset + len(phrase.text)
        assert reply[phrase.start_char : phrase.end_char] == phrase.text
        offset = phrase.end_char
    assert [p.time_ms for p in phrases] == sorted(p.time_ms for p in phrases)
    assert summary.time_to_first_phrase_ms > 0
    assert math.isclose(summary.time_to_first_phrase_ms, phrases[0].time_ms, rel_tol=0.5, abs_tol=5)
    await conversation.close()


async def test_converse_protocol_errors_are_invalid_argument(stub: Stub) -> None:
    conversation = Conversation(stub)
    await conversation.send(turn=pb.Turn(text="hi"))
    error = await rpc_error(conversation.call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "start" in (error.details() or "")

    conversation = Conversation(stub)
    started = await conversation.start()
    await conversation.send(rewind=pb.Rewind(spoken_chars=1))
    error = await rpc_error(conversation.call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "nothing to rewind" in (error.details() or "")

    for other in (f"unknown-{uuid.uuid4().hex}", started.session_id + "x"):
        conversation = Conversation(stub)
        await conversation.start(max_new_tokens=2)
        await conversation.turn("hi")
        await conversation.send(rewind=pb.Rewind(spoken_chars=1, session_id=other))
        error = await rpc_error(conversation.call.read())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rewind.session_id" in (error.details() or "")

    conversation = Conversation(stub)
    await conversation.start()
    await conversation.send(start=pb.SessionStart())
    error = await rpc_error(conversation.call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "already has a session" in (error.details() or "")

    conversation = Conversation(stub)
    await conversation.start()
    await conversation.send(turn=pb.Turn(text="hi", sampling=pb.SamplingParams(temperature=-1)))
    error = await rpc_error(conversation.call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in (error.details() or "")


async def test_converse_history_is_trimmed_by_whole_messages_and_keeps_the_system_prompt(
    stub: Stub, server: Running, tokenizer: PreTrainedTokenizerBase
) -> None:
    system = "You are a patient assistant who answers every question."
    system_tokens = len(tokenizer(plain_history([("system", system)])).input_ids)
    room = server.runtime.config.engine.max_context - 1
    conversation = Conversation(stub)
    started = await conversation.start(system=system, max_new_tokens=8,
                                       sampling=pb.SamplingParams(temperature=0.0))
    prompts, cached = [], []
    for turn in range(30):
        _, _, summary = await conversation.turn(f"Turn {turn}: " + "tell me about the mountains and the sea. " * 5)
        prompts.append(summary.generation.prompt_tokens)
        cached.append(summary.generation.cached_prompt_tokens)
        messages = server.runtime.registry.sessions[started.session_id].conversation[0]
        assert messages[0][:2] == ("system", system) and len(messages) <= 16, (turn, len(messages))
    await conversation.close()
    assert max(prompts) <= room
    trims = [i for i in range(1, len(prompts)) if prompts[i] < prompts[i - 1]]
    assert trims, prompts
    after = range(trims[0] + 1, len(prompts))
    assert all(cached[i] >= system_tokens for i in after), cached  # the system prompt stays first, and cached
    extended = [i for i in after if cached[i] >= prompts[i - 1] - 1]  # this prompt extends the last one
    assert len(extended) >= len(after) // 2, (prompts, cached)


async def test_converse_system_prompt_over_the_history_bytes_is_invalid_argument(stub: Stub, server: Running) -> None:
    conversation = Conversation(stub)
    await conversation.send(start=pb.SessionStart(system="s" * (server.runtime.config.limits.max_history_bytes + 1)))
    error = await rpc_error(conversation.call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-history-bytes" in (error.details() or "")


async def test_converse_turn_roles_are_checked(stub: Stub) -> None:
    conversation = Conversation(stub)
    await conversation.start(max_new_tokens=2)
    await conversation.send(turn=pb.Turn(text="hi", role="bogus-role"))
    error = await rpc_error(conversation.call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "turn.role" in (error.details() or "") and "system, user, assistant, tool" in (error.details() or "")
    conversation = Conversation(stub)
    await conversation.start(max_new_tokens=2)
    _, _, summary = await conversation.turn("The weather is sunny.", role="tool")
    assert summary.generation.completion_tokens > 0
    await conversation.close()


async def test_a_chat_template_error_is_invalid_argument_and_the_turn_is_rolled_back(chat_server: Running) -> None:
    tokenizer = chat_server.runtime.tokenizer
    async with grpc.aio.insecure_channel(f"127.0.0.1:{chat_server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        conversation = Conversation(stub)
        started = await conversation.start(system="Be brief.", max_new_tokens=3)
        _, _, first = await conversation.turn("Name a colour.")
        await conversation.send(turn=pb.Turn(text="Blue.", role="assistant"))  # two replies in a row
        error = await rpc_error(conversation.call.read())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "roles must alternate" in (error.details() or "")
        await wait_until(lambda: chat_server.runtime.registry.in_use == 0, what="slot released")

        resumed = Conversation(stub)
        assert (await resumed.start(session_id=started.session_id)).resumed
        _, _, second = await resumed.turn("And another?")
        await resumed.close()
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                   {"role": "assistant", "content": first.reply_text}, {"role": "user", "content": "And another?"}]
        expected = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        ids = expected if isinstance(expected, list) else expected["input_ids"]
        assert second.turn_index == 1 and second.generation.prompt_tokens == len(ids)


async def test_a_templated_conversation_starts_without_a_system_prompt(chat_server: Running) -> None:
    # Found by tests/test_fuzz_deep.py: the empty history was rendered through the chat template for
    # SessionStarted.history_tokens, and transformers refuses an empty conversation (INTERNAL).
    async with grpc.aio.insecure_channel(f"127.0.0.1:{chat_server.port}") as channel:
        conversation = Conversation(pb_grpc.GeneratorStub(channel))
        started = await conversation.start(max_new_tokens=2)
        assert started.history_tokens == 0 and not started.resumed
        _, _, summary = await conversation.turn("Name a colour.")
        assert summary.generation.completion_tokens > 0
        await conversation.close()


# ---- GetModelInfo --------------------------------------------------------------------------------------------------


async def test_model_info(stub: Stub, server: Running, tokenizer: PreTrainedTokenizerBase) -> None:
    engine = server.runtime.config.engine
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    target_config = json.loads((Path(engine.target) / "config.json").read_text())
    assert info.target.name == Path(engine.target).name
    assert info.target.architecture == target_config["model_type"]
    assert info.target.vocab_size == target_config["vocab_size"]
    assert info.target.parameters > 0 and info.target.weight_bytes >= 4 * info.target.parameters
    assert info.target.context_length == target_config["max_position_embeddings"]
    assert info.target.lean_forward == server.runtime.target.lean_forward  # the model's own property
    assert info.HasField("draft") == (server.runtime.draft is not None)
    if info.HasField("draft"):
        assert info.draft.name == Path(engine.draft).name and info.draft.parameters > 0
    assert info.device == "cpu" and info.dtype == "float32"
    assert info.max_context == engine.max_context
    assert info.speculation_policy.mode == engine.speculation
    assert info.speculation_policy.max_draft_tokens == engine.max_draft_tokens
    assert info.kv_slots_total == engine.max_sessions and info.kv_slots_in_use == server.runtime.registry.in_use
    assert info.kv_cache_bytes > 0
    assert info.supports_infill
    assert info.tokenizer_vocab_size == len(tokenizer)
    rt = server.runtime  # the path each forward length takes, as chosen at start-up
    assert [(e.tokens, e.path) for e in info.target_execution] == rt.target.execution()
    assert [(e.tokens, e.path) for e in info.draft_execution] == (rt.draft.execution() if rt.draft else [])
    assert info.target_execution[0].tokens in ("1", "any") and not info.deterministic


# ---- invalid requests ----------------------------------------------------------------------------------------------

TOO_LONG = 600  # tokens: more than the test server's 512-position context


def _bad_generate(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(**{"prompt": CODE_PROMPT, "max_new_tokens": 4, **fields})


BAD_GENERATE = {
    "negative temperature": (_bad_generate(sampling=pb.SamplingParams(temperature=-0.5)), "temperature"),
    "NaN temperature": (_bad_generate(sampling=pb.SamplingParams(temperature=math.nan)), "temperature"),
    "huge temperature": (_bad_generate(sampling=pb.SamplingParams(temperature=1e30)), "temperature"),
    "infinite temperature": (_bad_generate(sampling=pb.SamplingParams(temperature=math.inf)), "temperature"),
    "largest float32 temperature": (_bad_generate(sampling=pb.SamplingParams(temperature=3.4e38)), "temperature"),
    "tiny negative top_p": (_bad_generate(sampling=pb.SamplingParams(top_p=-1e-9)), "top_p"),
    "most negative top_k": (_bad_generate(sampling=pb.SamplingParams(top_k=-(2**31))), "top_k"),
    "negative top_p": (_bad_generate(sampling=pb.SamplingParams(top_p=-0.1)), "top_p"),
    "top_p above 1": (_bad_generate(sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    "NaN top_p": (_bad_generate(sampling=pb.SamplingParams(top_p=math.nan)), "top_p"),
    "negative top_k": (_bad_generate(sampling=pb.SamplingParams(top_k=-1)), "top_k"),
    "max_new_tokens above the limit": (_bad_generate(max_new_tokens=257), "max_new_tokens"),
    "empty prompt": (pb.GenerateRequest(max_new_tokens=4), "prompt"),
    "token id outside the vocabulary": (_bad_generate(prompt="", prompt_token_ids=[5, 10**6]), "prompt_token_ids"),
    "largest uint32 token id": (_bad_generate(prompt="", prompt_token_ids=[2**32 - 1]), "prompt_token_ids"),
    "prompt longer than the context": (_bad_generate(prompt="", prompt_token_ids=[5] * TOO_LONG), "truncate_prompt"),
    "too many stop strings": (_bad_generate(stop=[f"s{i}" for i in range(17)]), "stop"),
    "too long stop string": (_bad_generate(stop=["x" * 129]), "stop[0]"),
    "empty stop string": (_bad_generate(stop=["ok", ""]), "stop[1]"),
    "num_draft_tokens above the server max": (
        _bad_generate(speculation=pb.SpeculationParams(num_draft_tokens=9)), "num_draft_tokens"),
    "unknown proposer": (_bad_generate(speculation=pb.SpeculationParams(proposer=42)), "proposer"),  # type: ignore[arg-type]
    "over-long session_id": (_bad_generate(session_id="s" * 129), "session_id"),
    "unprintable session_id": (_bad_generate(session_id="a\nb"), "session_id"),
    "negative n_indent": (_bad_generate(n_indent=-1), "n_indent"),
    "huge n_indent": (_bad_generate(n_indent=10**6), "n_indent"),
    "negative max_time_ms": (_bad_generate(max_time_ms=-5), "max_time_ms"),
    "max_time_ms over ten minutes": (_bad_generate(max_time_ms=600_001), "max_time_ms"),
    "top_logprobs above 20": (_bad_generate(logprobs=True, top_logprobs=21), "top_logprobs"),
    "negative top_logprobs": (_bad_generate(logprobs=True, top_logprobs=-1), "top_logprobs"),
    "top_logprobs without logprobs": (_bad_generate(top_logprobs=3), "logprobs = true"),
    "prefill_only with max_new_tokens": (_bad_generate(prefill_only=True), "max_new_tokens"),
    "prefill_only with logprobs": (_bad_generate(max_new_tokens=0, prefill_only=True, logprobs=True), "logprobs"),
    "prefill_only with stop and n_indent": (
        _bad_generate(max_new_tokens=0, prefill_only=True, stop=["x"], n_indent=4), "stop, n_indent"),
}


@pytest.mark.parametrize("case", list(BAD_GENERATE))
async def test_invalid_generate_requests(stub: Stub, case: str) -> None:
    request, field_name = BAD_GENERATE[case]
    error = await rpc_error(stub.Generate(request, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.details())
    assert field_name in (error.details() or ""), (case, error.details())


async def test_invalid_infill_requests(stub: Stub) -> None:
    too_many = pb.InfillRequest(prefix="a", suffix="b", extra=[pb.ExtraFile(path=f"f{i}", text="x") for i in range(33)])
    error = await rpc_error(stub.Infill(too_many, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "extra" in (error.details() or "")
    too_long = pb.InfillRequest(prefix="word " * 700, suffix="")
    error = await rpc_error(stub.Infill(too_long, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "extra files" in (error.details() or "") and "truncate_prompt" not in (error.details() or "")
    error = await rpc_error(stub.Infill(pb.InfillRequest(prefix="a", session_id="x" * 200), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in (error.details() or "")
    for bad, field_name in ((pb.InfillRequest(prefix="a", layout=99), "layout"),  # type: ignore[arg-type]
                            (pb.InfillRequest(prefix="a", repo_name="org\nrepo"), "repo_name"),
                            (pb.InfillRequest(prefix="a", repo_name="r" * 300), "repo_name")):
        error = await rpc_error(stub.Infill(bad, timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field_name in (error.details() or "")
    for fields, name in (({"n_indent": -4}, "n_indent"), ({"max_time_ms": 10**9}, "max_time_ms"),
                         ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
                         ({"prefill_only": True, "max_new_tokens": 8}, "max_new_tokens")):
        error = await rpc_error(stub.Infill(pb.InfillRequest(prefix="a", suffix="b", **fields), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and name in (error.details() or ""), fields


async def test_truncate_prompt_keeps_the_last_tokens(stub: Stub, server: Running,
                                                     tokenizer: PreTrainedTokenizerBase) -> None:
    ids = (tokenizer("a b c d e f g h ").input_ids * TOO_LONG)[:TOO_LONG]
    chunks, summary = await collect(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=4,
                                                                     truncate_prompt=True)))
    room = server.runtime.config.engine.max_context - 1
    assert summary.prompt_tokens == room
    assert summary.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert 1 <= summary.completion_tokens == len(ids_of(chunks))
    same, _ = await collect(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids[-room:], max_new_tokens=4)))
    assert ids_of(same) == ids_of(chunks)


async def test_after_bad_requests_the_server_still_serves(stub: Stub, server: Running) -> None:
    assert server.runtime.registry.in_use == 0
    chunks, summary = await collect(stub.Generate(greedy(n=4)))
    assert summary.completion_tokens == len(ids_of(chunks)) > 0
    await wait_until(lambda: server.runtime.registry.in_use == 0, what="slot released")


async def test_anonymous_prompts_taking_turns_keep_their_caches() -> None:
    """Two unrelated prompts asked in turn without a session (sharing at most their first characters), on a server
    of three free slots: each finds its own prefix cached, rather than the second taking the first's slot for a
    token or two of shared prefix."""
    config = make_config()
    config = replace(config, engine=replace(config.engine, max_sessions=3),
                     server=replace(config.server, metrics_port=0, http_port=0))
    running = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.GeneratorStub(channel)
            a = EDITOR_PROMPT
            b = "# A different file altogether.\nimport os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n"
            for prompt in (a, b):
                await collect(stub.Generate(greedy(prompt, 4)))
            for prompt in (a, b):
                _, summary = await collect(stub.Generate(greedy(prompt, 4)))
                assert summary.cached_prompt_tokens == summary.prompt_tokens - 1, prompt[:20]
    finally:
        await running.stop(0.5)
