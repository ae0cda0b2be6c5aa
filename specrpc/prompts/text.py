"""Streaming text handling: incremental UTF-8-safe detokenizing, stop strings, editor line limits (n_indent, time
budget), phrase chunks for TTS.

Pure text: no torch, no grpc. Each class is fed in order by one stream and is not thread-safe.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Collection, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
"""What decoders print for bytes that are not (yet) a complete UTF-8 character."""

CONTEXT_TOKENS = 5
"""Already-emitted tokens decoded again in front of new ones (vLLM's initial detokenization offset)."""

WINDOW_TOKENS = 2 * CONTEXT_TOKENS
"""Tokens a decoded window may reach before it restarts on a fresh context (a restart costs extra decodes)."""


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens (EOS, FIM markers, …)."""
        ...

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = ..., *, clean_up_tokenization_spaces: bool = ...
    ) -> str | list[str]:
        """Text of `token_ids` (a batch, a list of lists, gives a list)."""
        ...


class IncrementalDetokenizer:
    """Turns generated token ids, pushed in bursts, into text deltas that never end inside a character.

    Special tokens (those `decode(..., skip_special_tokens=True)` drops) are not emitted: the deltas of all
    pushes plus `flush()` equal `tokenizer.decode(generated, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)` when no prompt ids are given, and with prompt ids the text the
    generated ids add after the prompt, `decode(prompt + generated)[len(decode(prompt)):]` (what a
    SentencePiece-style tokenizer needs for a correct leading space). `shown` tokens (a tool format's call
    markers, such as Mistral's special `[TOOL_CALLS]`) are the exception: each appears as its own text where it
    was generated, the text around it decoded as above on either side.

    Text is held back only while the decoded window ends in U+FFFD (a character split across tokens); what
    comes before it is emitted at once. (A byte-fallback decoder turns a whole run of byte tokens into U+FFFD
    when an invalid byte joins it; only for such invalid UTF-8 can text already emitted differ from a full
    decode.) Each push decodes a short window: up to `CONTEXT_TOKENS` emitted tokens (the tokens since the last
    restart when no shorter tail starts on a character boundary), the tokens pushed since, and the new ones (the
    vLLM/TGI prefix/read-offset scheme), so its cost does not grow with the length of the stream. The window
    restarts on a fresh context only once it holds more than `WINDOW_TOKENS`, so a push of one token usually
    costs one decode, not two.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), shown: Collection[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._shown = frozenset(shown)
        self._skip = frozenset(i for i in tokenizer.all_special_ids if not self._decode([i])) - self._shown
        self._ids: list[int] = []  # the window: context, then tokens not fully emitted
        self._read = 0  # self._ids[:self._read] is context, its text is self._prefix_text
        self._prefix_text = ""
        self._sent = 0  # characters of the window's text already emitted (or context)
        prompt = [i for i in prompt_ids if i not in self._skip]
        # a window that starts inside a character decodes differently from the same ids seen in a longer one
        self._set_context(prompt, self._decode(prompt[-2 * CONTEXT_TOKENS :]), fallback=[])

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty)."""
        at = next((n for n, i in enumerate(ids) if i in self._shown), -1)
        if at >= 0:  # a shown token: the text before it, all of it, then its own text; it starts the next window
            marker = ids[at]
            before = self.push(ids[:at]) + self.flush()
            text = self._tokenizer.decode([marker], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._reset([marker], self._decode([marker]))
            return before + str(text) + self.push(ids[at + 1:])
        new = [i for i in ids if i not in self._skip]
        if not new:
            return ""
        self._ids.extend(new)
        text = self._decode(self._ids)
        safe = len(text.rstrip(REPLACEMENT))
        delta = text[self._sent : safe]
        self._sent = max(self._sent, safe)  # safe < _sent when the context itself ends in U+FFFD
        if safe == len(text) and len(self._ids) > WINDOW_TOKENS and len(text) > len(self._prefix_text):
            self._set_context(self._ids, text, fallback=self._ids[self._read :])
        return delta

    def flush(self) -> str:
        """The held-back tail at the end of the stream (an unfinished character shows as U+FFFD)."""
        text = self._decode(self._ids)
        delta = text[self._sent :]
        self._sent = len(text)
        return delta

    def _set_context(self, ids: list[int], text: str, fallback: list[int]) -> None:
        """Restart the window on the longest tail of `ids` (at most CONTEXT_TOKENS) whose decode ends `text`
        (the decode of a longer tail), i.e. that starts on a character boundary; else on `fallback`."""
        for k in range(min(len(ids), CONTEXT_TOKENS), 0, -1):
            context = ids[-k:]
            context_text = self._decode(context)
            if text.endswith(context_text):
                self._reset(context, context_text)
                return
        self._reset(fallback, self._decode(fallback))

    def _reset(self, context: list[int], context_text: str) -> None:
        """Make `context`, whose decode is `context_text`, the whole window."""
        self._ids = list(context)
        self._read = len(context)
        self._prefix_text = context_text
        self._sent = len(context_text)

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
        return text


class StopMatcher:
    """Cuts a text stream at the earliest occurrence of any stop string; stop strings are not emitted.

    Text that could still become the start of a stop string is held back (at most the longest stop's length
    minus one character) until the next feed settles it or `flush()` releases it.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._max_held = max((len(stop) for stop in self._stops), default=1) - 1
        self._first_chars = frozenset(stop[0] for stop in self._stops)
        self._held = ""
        self.matched: str | None = None
        """The stop string that ended the stream, None while it runs."""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string ended the stream)."""
        if self.matched is not None:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        hit = self._first_stop(buf)
        partial = self._partial_start(buf)
        if hit is not None and hit[0] <= partial:
            self.matched = hit[1]
            self._held = ""
            return buf[: hit[0]], True
        self._held = buf[partial:]
        return buf[:partial], False

    def flush(self) -> str:
        """Release the held-back text at the end of the stream ("" once stopped). A stop string inside it (one that
        waited on a longer stop starting earlier, which the end of the stream leaves incomplete) still ends the
        stream there: `matched` is set and only the text before it is returned."""
        held, self._held = self._held, ""
        hit = self._first_stop(held)
        if hit is None:
            return held
        self.matched = hit[1]
        return held[: hit[0]]

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """(start, stop) of the earliest stop string in `buf`, None if none. At equal starts the shortest wins: it
        is the one that completes first, however the text is chunked."""
        hits = [(i, len(stop), stop) for stop in self._stops if (i := buf.find(stop)) >= 0]
        if not hits:
            return None
        start, _, stop = min(hits)
        return start, stop

    def _partial_start(self, buf: str) -> int:
        """Earliest index from which `buf` is a proper prefix of some stop; len(buf) if none."""
        for i in range(max(0, len(buf) - self._max_held), len(buf)):
            if buf[i] in self._first_chars:
                tail = buf[i:]
                if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self._stops):
                    return i
        return len(buf)


FINISH_INDENT = "indent"
FINISH_TIME_LIMIT = "time_limit"

_INDENT_CHARS = " \t"  # leading whitespace counted by n_indent (llama.cpp counts spaces and tabs, one each)


class LineGuard:
    """Ends an editor completion on a line boundary: at a new line indented less than `n_indent` characters (that
    line, its leading whitespace included, is not emitted), and at the first newline once the caller says the time
    budget is spent (the newline is emitted, nothing after it).

    The first line (the rest of the cursor's line) is never judged, nor is a blank line (whitespace only). A new
    line's leading whitespace is held back while it is shorter than `n_indent`: until the line's first other
    character settles it, or `flush()` releases it at the end of the stream.
    """

    def __init__(self, n_indent: int = 0) -> None:
        if n_indent < 0:
            raise ValueError(f"n_indent must be >= 0, got {n_indent}")
        self._n_indent = n_indent
        self._judging = False  # inside the leading whitespace of a line that starts after a generated newline
        self._held = ""  # that whitespace (and a carriage return), not emitted yet
        self.finish: str | None = None
        """FINISH_INDENT or FINISH_TIME_LIMIT once the guard ended the stream, else None."""

    def feed(self, text: str, out_of_time: bool = False) -> tuple[str, str | None]:
        """Return (text safe to emit now, the finish reason when the guard ended the stream here)."""
        if self.finish is not None:
            return "", self.finish
        out: list[str] = []
        for char in text:
            if self._judging:
                if char in _INDENT_CHARS or char == "\r":
                    self._held += char
                    if sum(c in _INDENT_CHARS for c in self._held) >= self._n_indent:
                        out.append(self._held)
                        self._held, self._judging = "", False
                    continue
                if char != "\n":  # the line's first character: it is indented less than n_indent
                    self._held = ""
                    self.finish = FINISH_INDENT
                    return "".join(out), self.finish
                out.append(self._held)  # a blank line: not judged
                self._held = ""
            out.append(char)
            if char == "\n":
                if out_of_time:
                    self._held = ""
                    self.finish = FINISH_TIME_LIMIT
                    return "".join(out), self.finish
                self._judging = self._n_indent > 0
        return "".join(out), None

    def flush(self) -> str:
        """The held-back whitespace at the end of the stream ("" once the guard ended it)."""
        held, self._held = self._held, ""
        return held


_SENTENCE_END = frozenset(".!?…。！？")
_CJK_END = frozenset("。！？，；：、")  # end a phrase without a following space (CJK text has none)
_CLAUSE_END = frozenset(",;:，；：、")
_CLOSERS = frozenset("\"')]}”’»」』）】")
_OPENERS = "\"'([{“‘«「『（【"
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "etc", "cf", "al", "fig", "figs", "approx",
    "inc", "ltd", "corp", "dept", "est", "vol", "ch", "sec", "eq", "ref", "viz",
})  # fmt: skip
_JOINERS = frozenset("\u200d\u200c\u034f") | frozenset(chr(c) for c in range(0xFE00, 0xFE10))
_NEED_MORE = -1


class PhraseSegmenter:
    """Splits a text stream into phrases for text-to-speech; phrases keep every input character.

    A phrase ends after sentence punctuation (. ! ? … and 。！？) followed by whitespace, at a newline, or at a
    clause mark (, ; : and ，；：、) followed by whitespace once the phrase has more than `min_chars`
    characters. The whitespace that confirms the end belongs to the phrase; CJK marks need none. Closing
    quotes and brackets stay with their phrase. No split after decimals ("3.14"), list numbers ("1."),
    abbreviations ("Dr.", "e.g.", "U.S.") and initials ("J."). A phrase longer than `max_chars` is cut at
    its last whitespace, or anywhere but inside a combining sequence when it has none.
    """

    def __init__(self, min_chars: int = 20, max_chars: int = 200) -> None:
        if not 0 <= min_chars < max_chars:
            raise ValueError(f"need 0 <= min_chars < max_chars, got {min_chars}, {max_chars}")
        self._min_chars = min_chars
        self._max_chars = max_chars
        self._buf = ""
        self._scan = 0  # self._buf[:self._scan] holds no phrase end

    def feed(self, text: str) -> list[str]:
        """Add text; return the phrases it completes."""
        self._buf += text
        phrases: list[str] = []
        while (cut := self._next_cut()) is not None:
            phrases.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            self._scan = 0
        return phrases

    def flush(self) -> str | None:
        """The unfinished last phrase at the end of the stream, None when nothing is left."""
        rest, self._buf, self._scan = self._buf, "", 0
        return rest or None

    def _next_cut(self) -> int | None:
        """Length of the next complete phrase in the buffer, None until more text arrives."""
        end = self._find_end()
        if end is not None and end <= self._max_chars:
            return end
        if len(self._buf) > self._max_chars:
            return self._forced_cut()
        return None

    def _find_end(self) -> int | None:
        """End of the first phrase found from self._scan on; remembers where to resume."""
        limit = min(len(self._buf), self._max_chars)
        i = self._scan
        while i < limit:
            end = self._end_at(i)
            if end == _NEED_MORE:
                break
            if end is not None:
                return end
            i += 1
        self._scan = i
        return None

    def _end_at(self, i: int) -> int | None:
        """End of a phrase that ends at the mark self._buf[i]; None if it does not, _NEED_MORE if unknown yet."""
        buf = self._buf
        char = buf[i]
        if char == "\n":
            return i + 1 if buf[:i].strip() else None
        is_sentence = char in _SENTENCE_END
        if not is_sentence and not (char in _CLAUSE_END and len(buf[: i + 1].lstrip()) > self._min_chars):
            return None
        marks_end = i + 1
        while is_sentence and marks_end < len(buf) and buf[marks_end] in _SENTENCE_END:
            marks_end += 1
        j = marks_end
        while j < len(buf) and buf[j] in _CLOSERS:
            j += 1
        if j == len(buf):
            return _NEED_MORE
        if buf[marks_end - 1] in _CJK_END:
            return j
        if not buf[j].isspace() or (marks_end == i + 1 and char == "." and self._is_abbreviation(i)):
            return None
        return j + 1

    def _is_abbreviation(self, dot: int) -> bool:
        """True when the '.' at `dot` closes an abbreviation, an initial or a list number."""
        start = dot
        while start > 0 and not self._buf[start - 1].isspace():
            start -= 1
        word = self._buf[start:dot].lstrip(_OPENERS)
        return (
            word.lower() in _ABBREVIATIONS
            or "." in word
            or (len(word) == 1 and word.isupper())
            or self._buf[:dot].strip().isdigit()
        )

    def _forced_cut(self) -> int:
        """Cut for an over-long phrase: after its last whitespace within max_chars, else at max_chars."""
        head = self._buf[: self._max_chars]
        content = len(head) - len(head.lstrip())  # index of the first non-space character
        for i in range(len(head) - 1, content, -1):
            if head[i].isspace():
                return i + 1
        cut = self._max_chars
        while cut > 1 and (_extends(self._buf[cut]) or self._buf[cut - 1] in _JOINERS):
            cut -= 1
        return cut


def _extends(char: str) -> bool:
    """True for a character that belongs to the one before it (combining mark, joiner, variation selector)."""
    return char in _JOINERS or unicodedata.combining(char) != 0 or "\U0001f3fb" <= char <= "\U0001f3ff"
