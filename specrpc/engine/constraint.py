"""Grammar constraints: a request's JSON schema, regular expression or grammar, compiled once (llguidance) into a
matcher that says which tokens may come next. Speculation advances a matcher along a draft to mask each of its
positions and rolls it back; committing advances it for good. Compilation is cached by content and bounded by the
library's fuel and grammar-size limits; `GrammarCompiler.compile` is meant to run off the device thread.

llguidance rather than xgrammar: a Rust wheel without a torch dependency (xgrammar's pins torch builds), it reads
JSON Schema, regular expressions, Lark and llama.cpp's GBNF, rolls back any number of tokens, and reports a bad
grammar through `is_error()` with a message instead of failing the process."""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

import llguidance as llg
import torch

from specrpc import native
from specrpc.engine.sampling import argmax_ids, mask_logits
from specrpc.prompts.json_layout import json_layout

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar"]

MAX_GRAMMAR_BYTES = 1 << 20
"""Largest schema or grammar text compiled (1 MiB); longer ones are refused before any work."""

MAX_REFUSED = 8
"""Tokens a grammar's mask may admit and its parser refuse at one position before the step fails (each is cleared
from the mask and the position drawn again: `Constraint.refuse`)."""


def parser_limits() -> llg.LLParserLimits:
    """llguidance's budgets (its fuel: ~50k per ms to build the lexer, ~14k per ms per mask): a hostile schema is
    refused with an error, not compiled for seconds, and no mask computation runs away."""
    return llg.LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                              max_grammar_size=200_000, verbose_errors=False)

FORBIDDEN_TOKEN = "doesn't satisfy the grammar"
"""How llguidance's error for a consumed token the grammar forbids reads (every other error a matcher reaches after
compiling is one of its limits)."""

_BITS = torch.tensor([1 << b for b in range(32)], dtype=torch.int64).to(torch.int32)  # [32] a mask word's bits


class InvalidConstraint(ValueError):
    """A schema, regular expression or grammar that cannot be compiled (the edges answer INVALID_ARGUMENT / 400)."""


class GrammarLimit(InvalidConstraint):
    """A constraint that compiled but went past the parser's limits while a reply followed it (`parser_limits`: a
    row of more alternatives than it holds, more Earley items or lexer fuel than one mask may take), e.g. an object
    of hundreds of properties once its brace opens. The request's fault, not the engine's: the same status as a
    schema refused at compile time."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request's output must match: `text` is the JSON schema, the regular expression or the grammar (Lark
    or GBNF), empty for `json_object` (any JSON object). `strict` False compiles a schema leniently: keywords the
    library does not implement are ignored rather than refused (OpenAI's `strict: false`)."""

    kind: ConstraintKind
    text: str = ""
    strict: bool = True
    lines: tuple[str, ...] = field(default=(), compare=False)
    """What each line of a generated grammar stands for, where the client wrote it (a tool's parameters): a compile
    error at such a line names it instead of the grammar's line (not part of the cache key)."""


def unpack_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's bitmask words [..., W] int32 (bit i % 32 of word i // 32: token i allowed) → bool [..., vocab]."""
    return words.unsqueeze(-1).bitwise_and(_BITS).ne(0).flatten(-2)[..., :vocab]  # [..., V]


def gather_rows(words: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of bitmask words [R, W] → [len(rows), W]: a view where they are successive (as drafting fills
    them), else a gather."""
    first = rows[0]
    return words[first : first + len(rows)] if rows == list(range(first, first + len(rows))) else words[rows]


def apply_words(logits: torch.Tensor, words: torch.Tensor, rows: list[int], vocab: int) -> torch.Tensor:
    """Logits [R, V] with -inf where the bitmask words[rows[r]] (int32 [W] over `vocab` tokens) forbids, a copy:
    `mask_logits` of `unpack_mask`. On float32 CPU logits, where the native library is built, one pass in C reads
    the words (the same values: each logit copied or -inf), not a dozen torch ops building and applying bool masks;
    elsewhere those torch ops."""
    lib = native.library() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None:
        return mask_logits(logits, unpack_mask(gather_rows(words, rows), vocab))  # [R, V]
    assert words.is_contiguous() and words.dtype == torch.int32 and vocab <= 32 * words.shape[-1]
    assert logits.dim() == 2 and logits.shape[0] == len(rows) and all(0 <= r < words.shape[0] for r in rows)
    src = logits.contiguous()  # [R, V]
    out = torch.empty_like(src)  # [R, V]
    index = (ctypes.c_int64 * len(rows))(*rows)
    lib.specrpc_mask(src.data_ptr(), out.data_ptr(), len(rows), src.shape[1], words.data_ptr(), index,
                     words.shape[-1], vocab)
    return out


class Constraint:
    """One request's matcher, at its committed tokens between steps. Drafting advances it token by token
    (`advance`, `take`) and rewinds (`rewind`); `mask_next` masks the draft's logits at its position, `mask_rows` a
    verify's at each position along a draft (`allowed` and `masks`: the same masks as bool).

    Masks are filled in place into one preallocated int32 bitmask, a row per state since the last commit (by its
    drafted path), and applied from those words (`apply_words`: one native pass on the CPU, no bool mask): the
    verify's rows along a draft reuse the ones drafting filled, so a sampled step fills k + 1 masks, not 2k + 1. A
    greedy step fills one only where the grammar overrules the model (`take`, `greedy_rows`): an argmax the grammar
    allows is the masked argmax. `work_s` counts the host seconds spent in the matcher (mask fills and applying
    them, advances, rollbacks, checks, forced tokens): `specrpc bench controls` reports its share of a step."""

    def __init__(self, matcher: llg.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self.vocab = vocab
        self.work_s = 0.0
        self._drafted: list[int] = []  # tokens taken beyond the committed state
        self._words = (vocab + 31) // 32
        self._bits = torch.empty(16, self._words, dtype=torch.int32)  # [R, W] masks filled since the last commit
        self._rows: dict[tuple[int, ...], int] = {}  # drafted path → the row of _bits holding its state's mask

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (or only the end-of-sequence token it just took)."""
        return bool(self._matcher.is_stopped())

    def allowed(self) -> torch.Tensor:
        """Tokens allowed next: bool [V]; all of them once the grammar is done (what follows is never committed)."""
        row = self._row()
        t0 = time.perf_counter()
        mask = unpack_mask(self._bits[row], self.vocab)  # [V]
        self.work_s += time.perf_counter() - t0
        return mask

    def mask_next(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] at the current state with -inf where the grammar forbids (a masked copy)."""
        return self._apply(logits, [self._row()])  # [1, V]

    def advance(self, token: int) -> None:
        """Take a drafted token (one the mask allowed)."""
        self.advance_all([token])

    def advance_all(self, tokens: list[int]) -> None:
        """Take drafted tokens (ones the grammar allows, in order)."""
        if tokens:
            t0 = time.perf_counter()
            ok = self._matcher.consume_tokens(tokens)
            self.work_s += time.perf_counter() - t0
            self._check(ok)
            self._drafted.extend(tokens)

    def take(self, token: int) -> bool:
        """Take `token` where the grammar allows it here (True), else change nothing (False): a check of one
        token, not a mask."""
        t0 = time.perf_counter()
        ok = token < self.vocab and self._matcher.try_consume_tokens([token]) == 1
        self.work_s += time.perf_counter() - t0
        if ok:
            self._drafted.append(token)
        return ok

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (llguidance's fast-forward tokens: its tokenization of the bytes
        that must come next, e.g. a JSON key after its opening quote); none once the grammar is done."""
        t0 = time.perf_counter()
        tokens = [] if self._matcher.is_stopped() else list(self._matcher.compute_ff_tokens())
        self.work_s += time.perf_counter() - t0
        return tokens

    def rewind(self, n: int) -> None:
        """Undo the last `n` drafted tokens."""
        if n:
            t0 = time.perf_counter()
            ok = self._matcher.rollback(n)
            self.work_s += time.perf_counter() - t0
            self._check(ok)
            del self._drafted[-n:]

    def refuse(self, token: int, path: list[int] | tuple[int, ...] = ()) -> None:
        """Clear `token` from the filled mask of the state `path` drafts beyond the current one (where filled): the
        library's mask can admit a token its parser then refuses (guidance-ai/llguidance#366: a merged quote-colon
        token), and that position is then drawn again from its mask without it."""
        row = self._rows.get(tuple(self._drafted) + tuple(path))
        if row is None or not 0 <= token < self.vocab:
            return
        word = (int(self._bits[row, token // 32]) & 0xFFFFFFFF) & ~(1 << (token % 32))
        self._bits[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def takes(self, tokens: list[int]) -> bool:
        """Whether the grammar takes `tokens` from here, or ends before the first it refuses: what follows its end is
        never committed (`Generation.commit` stops there), so a verify's token after the end is no refusal (taken as
        one, it was drawn again from the same row, and again, up to `MAX_REFUSED` times for nothing)."""
        t0 = time.perf_counter()
        m = self._matcher
        n = int(m.validate_tokens(tokens))
        ok = n == len(tokens)
        if not ok and n:
            self._check(m.consume_tokens(tokens[:n]))
            ok = bool(m.is_stopped())
            self._check(m.rollback(n))
        self.work_s += time.perf_counter() - t0
        return ok

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows (a point-mass draft is cut there)."""
        t0 = time.perf_counter()
        n = int(self._matcher.validate_tokens(tokens))
        self.work_s += time.perf_counter() - t0
        return n

    def masks(self, draft: list[int]) -> torch.Tensor:
        """Allowed tokens at each position of a verify along `draft` (which the grammar allows): bool [k+1, V], row
        i before draft token i, row k after the last; the matcher ends where it started."""
        rows = self._path_rows(draft)
        t0 = time.perf_counter()
        out = unpack_mask(gather_rows(self._bits, rows), self.vocab)  # [k+1, V]
        self.work_s += time.perf_counter() - t0
        return out

    def mask_rows(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """A verify's logits [k+1, V] along `draft` (which the grammar allows) with -inf where the grammar forbids
        at each position (`masks`), a masked copy; the matcher ends where it started."""
        return self._apply(logits, self._path_rows(draft))  # [k+1, V]

    def _path_rows(self, draft: list[int]) -> list[int]:
        """The rows of `_bits` holding the masks at each position along `draft` ([k+1]: before each drafted token
        and after the last), filled where new; the matcher ends where it started."""
        base, taken = tuple(self._drafted), 0
        rows: list[int] = []
        for i in range(len(draft) + 1):
            row = self._rows.get(base + tuple(draft[:i]))
            if row is None:  # advance as far as a new mask needs
                self.advance_all(draft[taken:i])
                taken = i
                row = self._row()
            rows.append(row)
        self.rewind(taken)
        return rows

    def _apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits [R, V] masked by the filled rows `rows` of `_bits` (`apply_words`), its seconds counted."""
        t0 = time.perf_counter()
        out = apply_words(logits, self._bits, rows, self.vocab)  # [R, V]
        self.work_s += time.perf_counter() - t0
        return out

    def greedy_ids(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """Each row's argmax of a greedy verify's logits [k+1, V] along `draft` (transformed already, which commutes
        with the mask: every transform keeps -inf), under the grammar's mask on every row the verify reads: what
        `greedy_rows`' rows give, without building them. A drafted token the grammar allows that is the row's argmax
        is accepted as it is; at the first row where it is not, a check of its argmax decides (allowed: it is the
        masked argmax, ties too, as the first maximum), and a mask is filled only where the grammar overrules the
        model, as llama.cpp samples before applying its grammar. The matcher ends where it started."""
        return self._greedy_walk(logits, draft)[0]

    def greedy_rows(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """A greedy verify's logits [k+1, V] along `draft` with the grammar's mask on the rows whose argmax the verify
        reads and the grammar forbids (`greedy_ids`' rows, for a verifier that reads logits): each row the verify
        reads then has the masked argmax. `logits` is not changed (a masked copy is returned, or `logits` itself
        where no row is masked)."""
        masked = self._greedy_walk(logits, draft)[1]
        if not masked:
            return logits
        out = logits.clone()  # [k+1, V]
        for i, row in masked.items():
            out[i] = row
        return out

    def _greedy_walk(self, logits: torch.Tensor, draft: list[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
        """`greedy_ids`' argmaxes [k+1] and the masked rows [V] it filled, by row."""
        t0 = time.perf_counter()
        top = argmax_ids(logits)  # [k+1]
        self.work_s += time.perf_counter() - t0
        masked: dict[int, torch.Tensor] = {}
        taken, k = 0, len(draft)
        for i in range(k + 1):
            if i < k and top[i] == draft[i]:
                continue
            self.advance_all(draft[taken:i])
            taken = i
            if self._matcher.is_stopped() or (top[i] < self.vocab and self.valid_prefix([top[i]]) == 1):
                break  # the argmax is allowed: the verify's decision at this row is the masked one
            row = self.mask_next(logits[i : i + 1])  # [1, V]
            t0 = time.perf_counter()
            masked[i] = row[0]
            top[i] = argmax_ids(row)[0]
            self.work_s += time.perf_counter() - t0
            if i == k or top[i] != draft[i]:
                break  # rejected here, or the bonus row
        self.rewind(taken)
        return top, masked

    def commit(self, token: int) -> bool:
        """Take a committed token; True when the grammar is done after it."""
        self.advance(token)
        self._drafted.clear()  # the new committed state: the masks filled were of the old one's paths
        self._rows.clear()
        return self.done

    def _row(self) -> int:
        """The row of `_bits` holding the current state's mask, filled in place now if it is new."""
        path = tuple(self._drafted)
        row = self._rows.get(path)
        if row is not None:
            return row
        t0 = time.perf_counter()
        row = len(self._rows)
        if row == self._bits.shape[0]:
            self._bits = torch.cat([self._bits, torch.empty_like(self._bits)])  # [2R, W]
        target = self._bits[row]  # [W], contiguous
        if self._matcher.is_stopped():
            target.fill_(-1)
        else:
            self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)
            self._check(True)  # a mask that ran out of its budget is empty: fail here, not on the token it gives
        self._rows[path] = row
        self.work_s += time.perf_counter() - t0
        return row

    def _check(self, ok: bool) -> None:
        """Raise if the matcher is in its error state: GrammarLimit where a limit stopped it, RuntimeError where it
        was handed a token the grammar forbids (the engine's fault: tokens come from its masks)."""
        if not ok or self._matcher.is_error():
            error = first_line(self._matcher.get_error())
            if FORBIDDEN_TOKEN in error:
                raise RuntimeError(f"grammar matcher: {error}")
            raise GrammarLimit(f"the constraint went past the grammar engine's limits on this reply ({error}); "
                               "simplify it: fewer properties, alternatives or enum values at one level")


class Grammar:
    """A compiled constraint, its matcher at the start; each request gets its own copy (`start`)."""

    def __init__(self, matcher: llg.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self.vocab = vocab

    def start(self) -> Constraint:
        """A fresh matcher for one request."""
        return Constraint(self._matcher.deep_copy(), self.vocab)


class GrammarCompiler:
    """Compiles ConstraintSpecs for one tokenizer, caching the most recent `cache_size` by content. Thread-safe:
    compilation runs in a worker thread (the library releases the GIL while it builds)."""

    def __init__(self, tokenizer: llg.LLTokenizer, cache_size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab = int(tokenizer.vocab_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[ConstraintSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._limits = parser_limits()

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str, end_ids: Collection[int], vocab: int) -> GrammarCompiler:
        """A compiler for a Hugging Face `tokenizers` tokenizer (its JSON), whose end-of-sequence tokens are
        `end_ids` (what a grammar allows once complete), over `vocab` token ids."""
        ends = sorted(end_ids)
        return cls(llg.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=ends or None))

    def compile(self, spec: ConstraintSpec) -> Grammar:
        """The compiled grammar for `spec` (cached); InvalidConstraint naming the problem when it cannot be."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        grammar = Grammar(self._build(spec), self.vocab)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: ConstraintSpec) -> llg.LLMatcher:
        if len(spec.text.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidConstraint(f"the {spec.kind} is {len(spec.text.encode())} bytes; at most "
                                    f"{MAX_GRAMMAR_BYTES} are compiled")
        try:
            source = self._source(spec)
        except ValueError as exc:
            raise InvalidConstraint(f"invalid {spec.kind}: {exc}") from exc
        matcher = llg.LLMatcher(self.tokenizer, source, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise InvalidConstraint(located(spec, first_line(matcher.get_error())))
        return matcher

    @staticmethod
    def _source(spec: ConstraintSpec) -> str:
        """The llguidance grammar for `spec`."""
        options: JsonCompileOptions = cast("JsonCompileOptions", json_layout(lenient=not spec.strict))
        if spec.kind == "json_object":
            return str(llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options))
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
            return str(llg.LLMatcher.grammar_from_json_schema(schema, overrides=options))
        if spec.kind == "regex":
            return str(llg.LLMatcher.grammar_from_regex(spec.text))
        return str(llg.grammar_from("grammar", spec.text))  # Lark, or GBNF converted to Lark


AT_LINE = re.compile(r"at (\d+)\(\d+\): ")
"""Where llguidance's error places a problem in a Lark grammar: `at <line>(<column>): `."""


def located(spec: ConstraintSpec, error: str) -> str:
    """A compile error as the client reads it: against what the failing line stands for (`spec.lines`) where the
    grammar was generated from the client's input, else against the constraint's kind."""
    at = AT_LINE.match(error)
    line = int(at.group(1)) if at else 0
    if at and 1 <= line <= len(spec.lines) and spec.lines[line - 1]:
        return f"{spec.lines[line - 1]}: {error[at.end():]}"
    return f"invalid {spec.kind}: {error}"


def first_line(message: str) -> str:
    """An llguidance error's first line (the rest is a trace of the parser's state)."""
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar compiler"
