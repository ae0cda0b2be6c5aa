"""Tests for specrpc/text.py: the incremental detokenizer against full decodes of real tokenizers (a byte-level
BPE and a Llama-style byte-fallback BPE trained here on a small multilingual/emoji corpus, plus the shipped one
when it exists), stop strings against a reference, and phrase segmentation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specrpc.prompts.text import CONTEXT_TOKENS, IncrementalDetokenizer, LineGuard, PhraseSegmenter, StopMatcher

SHIPPED = Path(__file__).resolve().parent.parent / "specrpc" / "assets" / "target"
SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>"]
CORPUS = [
    "Hello world, how are you today? I'm fine, thanks!",
    "def add(a, b):\n    return a + b  # 3.14 e.g. Dr. Smith\n",
    "Grüße aus Köln — naïve café, smörgåsbord, façade. Ça va?",
    "你好，世界！今天天气很好。我们去公园吧。",
    "日本語のテキストです。カタカナとひらがな。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم. كيف حالك؟",
    "שלום עולם, מה שלומך?",
    "😀😀😀 😂🤣 🤖🔥✨ 👩\u200d👩\u200d👧 🇺🇸🇯🇵 👍🏽👍🏿 🧑\u200d💻🧑\u200d💻",
    "e\u0301 n\u0303 a\u0308 o\u0302 — combining marks; zero\u200bwidth; \u202eRTL override\u202c",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ∑∫√∞ ≤≥ ±",
]
ODD = [
    "😀", "😀😀", "👩\u200d👩\u200d👧", "🇺🇸", "👍🏽", "🧑\u200d💻", "e\u0301", "\u200d", "\u200b", "\u202e",
    "你好", "世界。", "日本語", "שלום", "مرحبا", "\ufffd", "é", "ß", "ﬁ", "𝔘", "ñ", " ", "  ", "\n", "\t",
    "a", "the ", "Hello", ", ", ". ", "3.14", "<|endoftext|>",
]  # fmt: skip
TEXTS = st.lists(st.one_of(st.sampled_from(ODD), st.text(max_size=3)), max_size=30).map("".join)
BURSTS = st.lists(st.integers(1, 7), min_size=1, max_size=8)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def byte_level() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE, built like specrpc/training/tokenizer.py; merges straddle emoji."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIALS[0],
        additional_special_tokens=SPECIALS[1:],
        clean_up_tokenization_spaces=False,
    )


@cache
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-2-style BPE: '▁' for spaces, byte fallback, and a decoder that strips the first leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"], limit_alphabet=100)
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = trained["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [(a, b) for a, b in (m.split(" ") if isinstance(m, str) else m for m in trained["merges"])]
    tok.model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


@cache
def shipped() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(SHIPPED))


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def decode(tok: PreTrainedTokenizerFast, ids: Sequence[int]) -> str:
    text = tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cut `ids` into bursts, cycling through `sizes`."""
    bursts, start, k = [], 0, 0
    while start < len(ids):
        size = sizes[k % len(sizes)]
        bursts.append(list(ids[start : start + size]))
        start, k = start + size, k + 1
    return bursts


def stream(tok: PreTrainedTokenizerFast, gen: Sequence[int], sizes: Sequence[int], prompt: Sequence[int] = ()) -> str:
    """Push `gen` in bursts; check every prefix of the output is a prefix of the true text; return the output."""
    if prompt:
        full, head = decode(tok, [*prompt, *gen]), decode(tok, prompt)
        assert full.startswith(head)
        expected = full[len(head) :]
    else:
        expected = decode(tok, gen)
    detok = IncrementalDetokenizer(tok, prompt)
    out = ""
    for burst in split(gen, sizes):
        out += detok.push(burst)
        # a partial character would show as U+FFFD where the true text has the whole character
        assert expected.startswith(out), (out, expected)
    out += detok.flush()
    assert out == expected
    return out


# --- IncrementalDetokenizer ------------------------------------------------------------------------------------


@FAST
@given(text=TEXTS, sizes=BURSTS)
def test_byte_level_deltas_concatenate_to_decode(text: str, sizes: list[int]) -> None:
    tok = byte_level()
    stream(tok, encode(tok, text), sizes)


@FAST
@given(prompt=TEXTS, text=TEXTS, sizes=BURSTS)
def test_byte_level_with_prompt_context(prompt: str, text: str, sizes: list[int]) -> None:
    tok = byte_level()
    gen = encode(tok, text)
    assert stream(tok, gen, sizes, encode(tok, prompt)) == decode(tok, gen)


@FAST
@given(ids=st.lists(st.integers(0, 599), max_size=40), sizes=BURSTS)
def test_byte_level_arbitrary_ids_including_invalid_utf8_and_specials(ids: list[int], sizes: list[int]) -> None:
    stream(byte_level(), ids, sizes)


@FAST
@given(text=TEXTS, sizes=BURSTS)
def test_sentencepiece_like_deltas_concatenate_to_decode(text: str, sizes: list[int]) -> None:
    tok = sentencepiece_like()
    stream(tok, encode(tok, text), sizes)


@FAST
@given(prompt=TEXTS, text=TEXTS, sizes=BURSTS)
def test_sentencepiece_like_with_prompt_context(prompt: str, text: str, sizes: list[int]) -> None:
    tok = sentencepiece_like()
    stream(tok, encode(tok, text), sizes, encode(tok, prompt))


NOT_BYTES = sorted(i for t, i in sentencepiece_like().get_vocab().items() if not t.startswith("<0x"))


@FAST
@given(ids=st.lists(st.sampled_from(NOT_BYTES), max_size=40), sizes=BURSTS)
def test_sentencepiece_like_arbitrary_ids(ids: list[int], sizes: list[int]) -> None:
    # byte tokens excluded: ByteFallback turns a whole run of them into U+FFFD once an invalid byte joins it,
    # rewriting text that was already valid (and emitted); only invalid UTF-8 does that
    stream(sentencepiece_like(), ids, sizes)


def test_sentencepiece_like_valid_byte_runs() -> None:
    # 𝄞 is in no text of CORPUS, so no training keeps it in the alphabet and it always falls back to bytes (which of
    # the corpus's rarer characters the trainer's 100-letter alphabet keeps varies from run to run)
    tok = sentencepiece_like()
    ids = encode(tok, "ok 😀🤖 你好世界 naïve 𝄞")
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    stream(tok, ids, [1])


@pytest.mark.skipif(not SHIPPED.exists(), reason="the shipped tokenizer is not trained yet")
@FAST
@given(prompt=TEXTS, text=TEXTS, sizes=BURSTS)
def test_shipped_tokenizer(prompt: str, text: str, sizes: list[int]) -> None:
    tok = shipped()
    stream(tok, encode(tok, text), sizes)
    stream(tok, encode(tok, text), sizes, encode(tok, prompt))


def test_leading_space_needs_the_prompt() -> None:
    tok = sentencepiece_like()
    ids = encode(tok, "Hello world")
    cut = next(k for k in range(1, len(ids)) if decode(tok, ids[k:]) == "world")
    assert stream(tok, ids[cut:], [1]) == "world"  # alone, the decoder strips the first space
    assert stream(tok, ids[cut:], [1], ids[:cut]) == " world"


def test_special_tokens_are_not_emitted() -> None:
    tok = byte_level()
    eot, fim = (tok.get_vocab()[t] for t in SPECIALS[:2])
    detok = IncrementalDetokenizer(tok, [fim, *encode(tok, "x = ")])
    out = detok.push(encode(tok, "1")) + detok.push([eot]) + detok.flush()
    assert out == "1"


@pytest.mark.parametrize("make", ["byte_level", "sentencepiece_like"])
def test_shown_special_tokens_appear_where_they_were_generated(make: str) -> None:
    """A tool format's marker (Mistral's special `[TOOL_CALLS]`) shows in the text, in pushes split anywhere, with
    the text on either side as a full decode gives it; other special tokens stay hidden."""
    tok, (hidden, marker) = ((byte_level(), SPECIALS[:2]) if make == "byte_level"
                             else (sentencepiece_like(), ["<unk>", "</s>"]))
    shown = tok.get_vocab()[marker]
    before, after = encode(tok, "Let me look."), encode(tok, ' [{"name": "f"}] 😀')
    ids = [*before, shown, *after, tok.get_vocab()[hidden]]
    expected = decode(tok, before) + marker + decode(tok, after)
    assert marker not in decode(tok, ids)  # a plain decode drops it
    for cut in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tok, shown=[shown])
        assert detok.push(ids[:cut]) + detok.push(ids[cut:]) + detok.flush() == expected
    detok = IncrementalDetokenizer(tok, shown=[shown])
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == expected


def test_split_emoji_is_held_until_complete() -> None:
    tok = byte_level()
    ids = encode(tok, "ok 👍🏽 fine")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == "ok 👍🏽 fine"


def test_unfinished_character_is_flushed_as_replacement() -> None:
    tok = byte_level()
    emoji = [tok.get_vocab()[t] for t in ("ð", "Ł")]  # bytes F0 9F: the start of a four-byte character
    detok = IncrementalDetokenizer(tok)
    assert detok.push(encode(tok, "hi") + emoji) == "hi"
    assert detok.flush() == decode(tok, emoji) == "\ufffd"


class CountingTokenizer:
    """Counts the ids the detokenizer decodes."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.decoded = 0

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.inner.all_special_ids)

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False, *, clean_up_tokenization_spaces: bool = False
    ) -> str:
        assert skip_special_tokens and not clean_up_tokenization_spaces
        self.decoded += len(token_ids)
        return decode(self.inner, token_ids)


@pytest.mark.parametrize("burst", [1, 3, 17])
def test_work_per_push_does_not_grow_with_the_stream(burst: int) -> None:
    tok = CountingTokenizer(byte_level())
    ids = encode(byte_level(), " ".join(CORPUS) * 8)
    detok = IncrementalDetokenizer(tok, ids[:50])
    tok.decoded = 0
    for chunk in split(ids, [burst]):
        detok.push(chunk)
    # each push decodes the context, the held tokens and the new ones, and then a new context
    assert tok.decoded <= len(ids) * 2 + (len(ids) // burst + 1) * (3 * CONTEXT_TOKENS + 8)


# --- StopMatcher -----------------------------------------------------------------------------------------------


def run_stops(stops: Sequence[str], chunks: Sequence[str]) -> tuple[str, bool, StopMatcher]:
    matcher = StopMatcher(stops)
    out, stopped = "", False
    for chunk in chunks:
        safe, stopped = matcher.feed(chunk)
        out += safe
        if stopped:
            break
    else:
        out += matcher.flush()
    return out, stopped, matcher


def test_stop_across_chunks() -> None:
    out, stopped, matcher = run_stops(["\nUser:"], ["Sure, here", " it is.\nUs", "er", ": more", " text"])
    assert (out, stopped, matcher.matched) == ("Sure, here it is.", True, "\nUser:")


def test_stop_fed_one_character_at_a_time() -> None:
    text = "abc STOP def"
    matcher = StopMatcher(["STOP"])
    outs = [matcher.feed(c) for c in text]
    assert "".join(o for o, _ in outs) == "abc "
    assert [s for _, s in outs].index(True) == text.index("STOP") + 3
    assert matcher.feed("more") == ("", True) and matcher.flush() == ""


def test_stop_at_the_very_start() -> None:
    assert StopMatcher(["</s>"]).feed("</s>rest") == ("", True)
    assert run_stops(["</s>"], ["<", "/s", ">"])[:2] == ("", True)


def test_earliest_match_wins_even_when_a_shorter_stop_completes_first() -> None:
    matcher = StopMatcher(["abcd", "c"])
    assert matcher.feed("xabc") == ("x", False)  # "abcd" may still start at 'a'
    assert matcher.feed("d") == ("", True) and matcher.matched == "abcd"
    matcher = StopMatcher(["abcd", "c"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.feed("e") == ("ab", True) and matcher.matched == "c"


def test_same_start_shortest_wins_regardless_of_chunking() -> None:
    assert run_stops(["abc", "ab"], ["xabc"])[2].matched == "ab"
    assert run_stops(["abc", "ab"], list("xabc"))[2].matched == "ab"


def test_no_false_positives() -> None:
    text = "ST STO STOx S T O P STOp"
    out, stopped, _ = run_stops(["STOP", "\n\n"], [text[i : i + 2] for i in range(0, len(text), 2)])
    assert (out, stopped) == (text, False)


def test_no_stops_passes_text_through_and_empty_stop_is_rejected() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    sizes=BURSTS,
)
def test_stops_match_reference(text: str, stops: list[str], sizes: list[int]) -> None:
    hits = [(i, len(s), s) for s in stops if (i := text.find(s)) >= 0]
    matcher = StopMatcher(stops)
    out, fed, stopped = "", 0, False
    for size in sizes * len(text):
        if fed >= len(text):
            break
        safe, stopped = matcher.feed(text[fed : fed + size])
        fed, out = fed + size, out + safe
        if stopped:
            break
        assert len(text[:fed]) - len(out) <= max(map(len, stops), default=1) - 1  # bounded hold
    if not stopped:
        out += matcher.flush()
        stopped = matcher.matched is not None  # a stop that waited on a longer one the stream never completed
    if hits:
        first = min(hits)
        assert (out, stopped, matcher.matched) == (text[: first[0]], True, first[2])
    else:
        assert (out, stopped, matcher.matched) == (text, False, None)


# --- PhraseSegmenter -------------------------------------------------------------------------------------------


def segment(text: str, chunks: Sequence[int] = (1_000_000,), min_chars: int = 20, max_chars: int = 200) -> list[str]:
    """All phrases of `text` fed in chunks of the given sizes, the flushed rest last."""
    seg = PhraseSegmenter(min_chars, max_chars)
    phrases: list[str] = []
    start, k = 0, 0
    while start < len(text):
        size = chunks[k % len(chunks)]
        phrases += seg.feed(text[start : start + size])
        start, k = start + size, k + 1
    rest = seg.flush()
    return phrases + ([rest] if rest is not None else [])


def test_sentences() -> None:
    assert segment("Hello world. How are you? I'm fine!") == ["Hello world. ", "How are you? ", "I'm fine!"]


def test_sentence_end_waits_for_the_next_character() -> None:
    seg = PhraseSegmenter()
    assert seg.feed("It works.") == []
    assert seg.feed(" Next") == ["It works. "]
    assert seg.flush() == "Next" and seg.flush() is None


def test_numbers_abbreviations_initials_and_lists_do_not_split() -> None:
    text = "Pi is 3.14 and Dr. Smith met Mr. Jones, e.g. at the U.S. office with J. Doe. Then"
    assert segment(text, min_chars=200, max_chars=400) == [text[:-4], "Then"]
    assert segment("1. First item\n2. Second") == ["1. First item\n", "2. Second"]


def test_ellipsis() -> None:
    assert segment("Wait...what? Well… okay. So...") == ["Wait...what? ", "Well… ", "okay. ", "So..."]


def test_newlines() -> None:
    assert segment("Title\n\nBody text\nlast") == ["Title\n", "\nBody text\n", "last"]


def test_cjk_needs_no_space() -> None:
    assert segment("你好。今天很好！好") == ["你好。", "今天很好！", "好"]
    assert segment("「你好。」他说") == ["「你好。」", "他说"]


def test_closing_quotes_stay_with_the_sentence() -> None:
    assert segment('He said "Hi." Then (he left.) Ok') == ['He said "Hi." ', "Then (he left.) ", "Ok"]


def test_clause_boundaries_after_min_chars() -> None:
    text = "Short, then a much longer clause goes on here, and one more; fin"
    assert segment(text, min_chars=20) == ["Short, then a much longer clause goes on here, ", "and one more; fin"]
    assert segment("Numbers like 1,000,000 stay whole, ok", min_chars=5) == [
        "Numbers like 1,000,000 stay whole, ",
        "ok",
    ]


def test_max_chars_forces_a_split_at_whitespace() -> None:
    phrases = segment("word " * 40, max_chars=23)
    assert all(len(p) <= 23 and p.endswith(" ") for p in phrases)
    assert "".join(phrases) == "word " * 40


def test_max_chars_without_whitespace_keeps_combining_marks_attached() -> None:
    phrases = segment("e\u0301" * 40, max_chars=25)
    assert all(len(p) <= 25 and p[0] == "e" for p in phrases)
    assert "".join(phrases) == "e\u0301" * 40


PHRASE_TEXTS = st.lists(
    st.sampled_from(
        ["Hello", "world", " ", "  ", ".", "!", "?", "…", ",", ";", ":", "\n", "3.14", "1,000", "Dr.", "e.g.",
         "你好", "。", "，", "”", "\"", ")", "e\u0301", "👍🏽", "\t", "x" * 9, "...", "A."]
    ),
    max_size=60,
).map("".join)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(text=PHRASE_TEXTS, chunks=BURSTS, min_chars=st.integers(0, 30), extra=st.integers(1, 60))
def test_phrases_keep_every_character_and_ignore_chunking(
    text: str, chunks: list[int], min_chars: int, extra: int
) -> None:
    max_chars = min_chars + extra
    phrases = segment(text, chunks, min_chars, max_chars)
    assert "".join(phrases) == text
    assert all(phrases) and all(len(p) <= max_chars for p in phrases)
    assert phrases == segment(text, min_chars=min_chars, max_chars=max_chars)


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError):
        PhraseSegmenter(min_chars=50, max_chars=50)


# ---- LineGuard ------------------------------------------------------------------------------------------------------

def guarded(pieces: Sequence[str], n_indent: int, out_of_time_from: int | None = None) -> tuple[str, str | None]:
    """Feed `pieces` to a LineGuard (out of time from piece `out_of_time_from` on); the text out and the finish."""
    guard = LineGuard(n_indent)
    out: list[str] = []
    for i, piece in enumerate(pieces):
        text, finish = guard.feed(piece, out_of_time_from is not None and i >= out_of_time_from)
        out.append(text)
        if finish is not None:
            return "".join(out), finish
    return "".join(out) + guard.flush(), None


def test_n_indent_drops_the_first_line_indented_less() -> None:
    text = "x = 1\n    y = 2\n\n    return y\ndef g():\n    pass\n"
    assert guarded([text], 4) == ("x = 1\n    y = 2\n\n    return y\n", "indent")
    assert guarded(list(text), 4) == ("x = 1\n    y = 2\n\n    return y\n", "indent")  # one character at a time
    assert guarded([text], 0) == (text, None)
    assert guarded(["  z\n", "a"], 4) == ("  z\n", "indent"), "the first line continues the cursor's line"
    assert guarded(["a\n\tb\n  c"], 1) == ("a\n\tb\n  c", None), "a tab is one character"
    assert guarded(["a\n  \n    b"], 4) == ("a\n  \n    b", None), "blank lines are not judged"
    assert guarded(["a\r\n\r\n    b\r\n  c"], 4) == ("a\r\n\r\n    b\r\n", "indent")


def test_n_indent_holds_short_leading_whitespace_until_the_line_settles_it() -> None:
    guard = LineGuard(4)
    assert guard.feed("a\n  ") == ("a\n", None)
    assert guard.feed(" ") == ("", None)
    assert guard.feed(" b") == ("    b", None)
    assert guard.feed("\n  ") == ("\n", None)
    assert guard.flush() == "  ", "the end of the stream releases held whitespace"
    assert guarded(["a\n", "  ", "x"], 4) == ("a\n", "indent"), "the dropped line's whitespace is dropped too"


def test_time_limit_ends_at_the_next_newline() -> None:
    assert guarded(["a", "b\nc", "d\ne\nf"], 0, out_of_time_from=1) == ("ab\n", "time_limit")
    assert guarded(["ab", "cd", "e\nf"], 0, out_of_time_from=1) == ("abcde\n", "time_limit")
    assert guarded(["a\nb", "c"], 0, out_of_time_from=None) == ("a\nbc", None)
    assert guarded(["a\n", "    b\n", "c"], 4, out_of_time_from=1) == ("a\n    b\n", "time_limit")
    guard = LineGuard()
    assert guard.feed("x\n", out_of_time=True) == ("x\n", "time_limit")
    assert guard.feed("more") == ("", "time_limit")
    with pytest.raises(ValueError, match="n_indent"):
        LineGuard(-1)
