"""Fill-in-the-middle prompts per model family: each family's special tokens, the orders it was trained with
(PSM: prefix, suffix, middle; SPM: suffix first), its repository context, the layouts in which a keystroke only
appends to the prompt, and trimming to fit. Domain values only: a vocabulary and an encode function in, token ids
out (no protobuf, no torch), so both edges share it through the runtime."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYOUTS = ("auto", "psm", "spm", "typed_line")
"""Prompt layouts a request may ask for. `auto`: `spm` when the model was trained suffix-first, else `typed_line`.
`psm`: the whole text before the cursor before the suffix (every keystroke re-prefills the suffix). `spm`: suffix
first, so a keystroke only appends. `typed_line`: prefix-first with the lines above the cursor as the prefix and the
current line's text before the cursor after the middle token, so a keystroke within a line only appends."""

TRIM_STEP_TOKENS = 256
"""Truncation trims in steps of about this many tokens (whole lines), so a trimmed prompt's start stays put while
the user types and the session's cache keeps serving it."""

BARE_SENTINEL = "\u263a"
"""A character prepended and then stripped to encode text without a SentencePiece tokenizer's implicit leading space
(CodeLlama's `encode_infilling`, mistral-common's `_encode_infilling` use the same one)."""


class NoInfillSupport(Exception):
    """The loaded model has no fill-in-the-middle template (no FIM tokens): Infill cannot be served."""


class UnsupportedLayout(NoInfillSupport):
    """The requested layout needs an order the loaded model was not trained with."""


class PromptTooLong(ValueError):
    """The infill prompt does not fit and truncation was not asked for (or cannot make it fit)."""


@dataclass(frozen=True)
class ExtraFile:
    """A file given as context to Infill (repository context, for example an open tab)."""

    path: str
    text: str


@dataclass(frozen=True)
class InfillInput:
    """One fill-in-the-middle request, in domain terms. The text before the cursor is `prefix + typed_line`:
    `typed_line` is for clients that send the current line apart (llama.cpp's `/infill` `prompt`)."""

    prefix: str
    suffix: str = ""
    extra: tuple[ExtraFile, ...] = ()
    path: str = ""
    repo_name: str = ""
    typed_line: str = ""
    layout: str = "auto"


@dataclass(frozen=True)
class Trimmed:
    """What truncation cut to fit the context."""

    prefix_chars: int = 0
    suffix_chars: int = 0
    extra_files: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class InfillPrompt:
    """The prompt ids for one infill request, the layout used, what was trimmed, and the family's end tokens."""

    ids: list[int]
    layout: str
    trimmed: Trimmed = Trimmed()
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Part:
    """One item of a template: a special token (`role`, upper case) or a text format, tokenized on its own; left
    out when one of the fields in `needs` is empty."""

    item: str
    needs: tuple[str, ...] = ()

    @property
    def is_token(self) -> bool:
        """A special token's role (PRE, SUF, MID, SEP, REPO, EOT) rather than text."""
        return self.item.isupper() and "{" not in self.item


def parts(*items: str) -> tuple[Part, ...]:
    """`"SEP@path"` → Part("SEP", ("path",)): `@a,b` lists the fields that must be non-empty."""
    out = []
    for spec in items:
        item, _, needs = spec.partition("@")
        out.append(Part(item, tuple(n for n in needs.split(",") if n)))
    return tuple(out)


@dataclass(frozen=True)
class FimTemplate:
    """A family's fill-in-the-middle spelling. `tokens` maps roles to token texts; `layouts` gives the FIM block
    per order; `repository` is what opens a prompt with repository context (`{repo}` is the repository name) and
    `extra` one extra file (`{path}`, `{text}`). Fields: {prefix}, {suffix}, {path}, {repo}, {text}; `ctx` is set
    when the request carries any repository context (path, repository name or extra files). `bare`: the suffix and
    the text after the middle token are encoded without SentencePiece's implicit leading space."""

    name: str
    tokens: Mapping[str, str]
    orders: tuple[str, ...]
    layouts: Mapping[str, tuple[Part, ...]]
    extra: tuple[Part, ...]
    repository: tuple[Part, ...] = ()
    bare: bool = False
    stops: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()  # further tokens that tell this family from another with the same FIM tokens

    @property
    def required(self) -> tuple[str, ...]:
        """Roles every layout of this template needs (PRE, SUF and MID when used)."""
        used = {p.item for layout in self.layouts.values() for p in layout if p.is_token and not p.needs}
        return tuple(r for r in ("PRE", "SUF", "MID") if r in used)


# Sources, per family (looked up, not guessed):
TEMPLATES: dict[str, FimTemplate] = {t.name: t for t in (
    # The shipped pair (specrpc/training/train.py `fim_permute`, specrpc/assets/MODEL_CARD.md): files are
    # `<|file_sep|>path\n text <|endoftext|>`; PSM `<|fim_prefix|>` [`<|file_sep|>`path\n] prefix `<|fim_suffix|>`
    # suffix `<|fim_middle|>` middle `<|endoftext|>`; SPM in llama.cpp's `--spm-infill` order (server
    # `format_infill`): `<|fim_suffix|>` suffix `<|fim_prefix|>` [`<|file_sep|>`path\n] prefix `<|fim_middle|>`.
    # Orders come from the model's tokenizer_config.json `fim` entry (today's pair: psm only).
    FimTemplate(
        name="specrpc",
        tokens={"PRE": "<|fim_prefix|>", "SUF": "<|fim_suffix|>", "MID": "<|fim_middle|>", "SEP": "<|file_sep|>",
                "EOT": "<|endoftext|>"},
        orders=("psm",),
        layouts={"psm": parts("PRE", "SEP@path", "{path}\n@path", "{prefix}", "SUF", "{suffix}", "MID"),
                 "spm": parts("SUF", "{suffix}", "PRE", "SEP@path", "{path}\n@path", "{prefix}", "MID")},
        extra=parts("SEP", "{path}\n{text}", "EOT"),
    ),
    # Qwen2.5-Coder: QwenLM/Qwen2.5-Coder examples/Qwen2.5-Coder-fim.py and -repolevel-fim.py, and the technical
    # report (arXiv 2409.12186 §3): file-level `<|fim_prefix|>pre<|fim_suffix|>suf<|fim_middle|>mid<|endoftext|>`;
    # repo-level `<|repo_name|>name\n<|file_sep|>path\ntext\n ... <|file_sep|>path\n<|fim_prefix|>...`; PSM only.
    # End tokens: the eos_token_ids list of those examples.
    FimTemplate(
        name="qwen2.5-coder",
        tokens={"PRE": "<|fim_prefix|>", "SUF": "<|fim_suffix|>", "MID": "<|fim_middle|>", "SEP": "<|file_sep|>",
                "REPO": "<|repo_name|>"},
        orders=("psm",),
        layouts={"psm": parts("SEP@path", "{path}\n@path", "PRE", "{prefix}", "SUF", "{suffix}", "MID")},
        repository=parts("REPO@repo", "{repo}\n@repo"),
        extra=parts("SEP", "{path}\n{text}\n"),
        stops=("<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<|im_end|>"),
    ),
    # StarCoder2: "StarCoder 2 and The Stack v2" (arXiv 2402.19173 §5, repository context):
    # `<repo_name>name<file_sep>path0\ncode0<file_sep><fim_prefix>path1\npre<fim_suffix>suf<fim_middle>mid`;
    # the FIM tokens alone for file-level use and `<file_sep>` as an end token (maintainer, bigcode-project/
    # starcoder2 issue #10). Both orders: bigcode's Megatron-LM `permute` trains PSM and SPM ("variant 2 of the FIM
    # paper": `<fim_prefix><fim_suffix>suf<fim_middle>pre mid`) at `--fim-spm-rate`.
    FimTemplate(
        name="starcoder2",
        tokens={"PRE": "<fim_prefix>", "SUF": "<fim_suffix>", "MID": "<fim_middle>", "SEP": "<file_sep>",
                "REPO": "<repo_name>", "EOT": "<|endoftext|>"},
        orders=("psm", "spm"),
        layouts={"psm": parts("SEP@ctx", "PRE", "{path}\n@path", "{prefix}", "SUF", "{suffix}", "MID"),
                 "spm": parts("SEP@ctx", "PRE", "SUF", "{suffix}", "MID", "{path}\n@path", "{prefix}")},
        repository=parts("REPO@repo", "{repo}@repo"),
        extra=parts("SEP", "{path}\n{text}"),
        stops=("<file_sep>", "<|endoftext|>"),
        marks=("<file_sep>",),
    ),
    # StarCoder / StarCoderBase: the model card's FIM example (`<fim_prefix>pre<fim_suffix>suf<fim_middle>`) and
    # the playground's pretraining formats (`<reponame>REPO<filename>FILE<gh_stars>STARS\ncode<|endoftext|>`, one
    # document per file); PSM and SPM as bigcode's Megatron-LM `permute` (see StarCoder2). The file header is put
    # inside the FIM block, where FIM over a whole formatted document puts it.
    FimTemplate(
        name="starcoder",
        tokens={"PRE": "<fim_prefix>", "SUF": "<fim_suffix>", "MID": "<fim_middle>", "SEP": "<filename>",
                "REPO": "<reponame>", "EOT": "<|endoftext|>"},
        orders=("psm", "spm"),
        layouts={"psm": parts("PRE", "REPO@repo,path", "{repo}@repo,path", "SEP@path", "{path}\n@path", "{prefix}",
                              "SUF", "{suffix}", "MID"),
                 "spm": parts("PRE", "SUF", "{suffix}", "MID", "REPO@repo,path", "{repo}@repo,path", "SEP@path",
                              "{path}\n@path", "{prefix}")},
        extra=parts("SEP", "{path}\n{text}", "EOT"),
        stops=("<|endoftext|>",),
    ),
    # DeepSeek-Coder: deepseek-ai/DeepSeek-Coder README "Code Insertion" (`<｜fim▁begin｜>pre<｜fim▁hole｜>suf
    # <｜fim▁end｜>`, full-width bars U+FF5C and U+2581, BOS from the tokenizer) and "Repository Level Code
    # Completion" (files as `#path\ntext`, no file token); the paper (arXiv 2401.14196 §3) trains PSM only.
    FimTemplate(
        name="deepseek-coder",
        tokens={"PRE": "<\uff5cfim\u2581begin\uff5c>", "SUF": "<\uff5cfim\u2581hole\uff5c>",
                "MID": "<\uff5cfim\u2581end\uff5c>"},
        orders=("psm",),
        layouts={"psm": parts("PRE", "{prefix}", "SUF", "{suffix}", "MID")},
        extra=parts("#{path}\n{text}\n"),
        stops=("<\uff5cend\u2581of\u2581sentence\uff5c>", "<|EOT|>"),
    ),
    # CodeLlama: facebookresearch/codellama llama/generation.py `infilling_prompt_tokens` and tokenizer.py
    # (`encode_infilling` strips the implicit leading space): PSM `<s>▁<PRE>` enc(pre) `▁<SUF>` bare(suf)
    # `▁<MID>`, SPM `<s>▁<PRE>▁<SUF>` bare(suf) `▁<MID>` enc(pre); the paper (arXiv 2308.12950 §2.3) trains both and
    # encodes the middle without the leading space; generation ends at `▁<EOT>`. No repository format published.
    FimTemplate(
        name="codellama",
        tokens={"PRE": "\u2581<PRE>", "SUF": "\u2581<SUF>", "MID": "\u2581<MID>", "EOT": "\u2581<EOT>"},
        orders=("psm", "spm"),
        layouts={"psm": parts("PRE", "{prefix}", "SUF", "{suffix}", "MID"),
                 "spm": parts("PRE", "SUF", "{suffix}", "MID", "{prefix}")},
        extra=parts("#{path}\n{text}\n"),
        bare=True,
        stops=("\u2581<EOT>",),
    ),
    # Codestral: mistral-common InstructTokenizerV2.encode_fim: `<s>[SUFFIX]` bare(suffix) `[PREFIX]` enc(prefix),
    # no middle token (generation follows the prefix): suffix-first only. No repository format published.
    FimTemplate(
        name="codestral",
        tokens={"PRE": "[PREFIX]", "SUF": "[SUFFIX]"},
        orders=("spm",),
        layouts={"spm": parts("SUF", "{suffix}", "PRE", "{prefix}")},
        extra=parts("#{path}\n{text}\n"),
        bare=True,
    ),
)}

DETECTION_ORDER = ("qwen2.5-coder", "starcoder2", "starcoder", "deepseek-coder", "codellama", "codestral")
"""Families recognised by their tokens when a model declares no template (the shipped pair's tokens are a subset of
Qwen's, so it declares `specrpc`). StarCoder2 before StarCoder: both have `<fim_prefix>`; only StarCoder2 has
`<file_sep>`."""


def template_names() -> tuple[str, ...]:
    """Names `--fim-template` accepts."""
    return tuple(TEMPLATES)


@dataclass(frozen=True)
class Choice:
    """The template chosen for a model and the orders it was trained with (None: no FIM, `reason` says why)."""

    template: FimTemplate | None
    orders: tuple[str, ...] = ()
    reason: str = ""


def declared_fim(model_dir: str | Path) -> Mapping[str, Any] | None:
    """The `fim` entry of the model's tokenizer_config.json ({"template": NAME, "orders": [...]}), if any."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    entry = json.loads(path.read_text()).get("fim")
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: `fim` must be an object like {{\"template\": \"specrpc\", \"orders\": [\"psm\"]}}")
    return entry


def declare_fim(model_dir: str | Path, template: str, orders: Sequence[str]) -> None:
    """Write the `fim` entry into a model's tokenizer_config.json (what a training run exports)."""
    if template not in TEMPLATES or not orders or any(o not in TEMPLATES[template].layouts for o in orders):
        raise ValueError(f"cannot declare template {template!r} with orders {list(orders)}")
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["fim"] = {"template": template, "orders": list(orders)}
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _orders(value: Any, template: FimTemplate, where: str) -> tuple[str, ...]:
    if value is None:
        return template.orders
    if not isinstance(value, list) or not value or any(o not in template.layouts for o in value):
        raise ValueError(f"{where}: `fim.orders` must be a non-empty list of {sorted(template.layouts)} (the orders "
                         f"template {template.name!r} defines); got {value!r}")
    return tuple(dict.fromkeys(value))


def missing_tokens(template: FimTemplate, vocab: Mapping[str, int]) -> list[str]:
    """The template's required tokens the vocabulary lacks."""
    return [template.tokens[r] for r in template.required if template.tokens[r] not in vocab]


def choose(vocab: Mapping[str, int], declared: Mapping[str, Any] | None, override: str = "",
           where: str = "tokenizer_config.json") -> Choice:
    """`override` (--fim-template) first, then the model's own declaration, then the first family whose tokens the
    vocabulary has. An override the vocabulary cannot spell, or a malformed declaration, is a ValueError (the server
    does not start); a declared template without its tokens leaves the model without infill."""
    if override:
        template = TEMPLATES.get(override)
        if template is None:
            raise ValueError(f"--fim-template {override!r} is not a known template; use one of {template_names()}")
        missing = missing_tokens(template, vocab)
        if missing:
            raise ValueError(f"--fim-template {override}: the tokenizer has no {missing}; choose the template of "
                             f"this model's family or leave --fim-template empty")
        same = declared is not None and declared.get("template") == override
        orders = _orders(declared.get("orders") if same and declared else None, template, where)
        return Choice(template, orders)
    if declared is not None:
        name = declared.get("template")
        template = TEMPLATES.get(name) if isinstance(name, str) else None
        if template is None:
            raise ValueError(f"{where}: `fim.template` {name!r} is not a known template; use one of "
                             f"{template_names()} (or override it with --fim-template)")
        orders = _orders(declared.get("orders"), template, where)
        missing = missing_tokens(template, vocab)
        if missing:
            return Choice(None, reason=f"the model declares the {name!r} fill-in-the-middle template but its "
                                       f"tokenizer has no {missing}")
        return Choice(template, orders)
    for name in DETECTION_ORDER:
        template = TEMPLATES[name]
        if not missing_tokens(template, vocab) and all(m in vocab for m in template.marks):
            return Choice(template, template.orders)
    return Choice(None, reason="the loaded tokenizer has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                               "<fim_prefix>, <\uff5cfim\u2581begin\uff5c>, \u2581<PRE> or [SUFFIX])")


Encode = Callable[[str], list[int]]
EncodeMany = Callable[[list[str]], list[list[int]]]


class EncodeCache:
    """`encode` with the token ids of recently encoded long texts kept: the extra files, the suffix and the lines
    above the cursor come back unchanged from one keystroke to the next, and encoding them again would cost the
    event loop milliseconds per keystroke. Holds at most `max_chars` characters of text; callers must not mutate the
    lists it returns."""

    MIN_CHARS = 64

    def __init__(self, encode: Encode, max_chars: int = 4_000_000) -> None:
        self._encode = encode
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        if len(text) < self.MIN_CHARS or len(text) > self._max_chars:
            return self._encode(text)
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
                return ids
        ids = self._encode(text)
        with self._lock:
            if text not in self._entries:
                self._entries[text] = ids
                self._chars += len(text)
                while self._chars > self._max_chars:
                    old, _ = self._entries.popitem(last=False)
                    self._chars -= len(old)
        return ids


@dataclass
class Segments:
    """A prompt as separately tokenized pieces, by what they hold, so trimming can count each."""

    head: list[int] = field(default_factory=list)  # BOS and the repository opening
    extras: list[list[int]] = field(default_factory=list)  # one entry per extra file
    block: list[list[int]] = field(default_factory=list)  # the FIM block, one entry per part

    def ids(self) -> list[int]:
        """The prompt: head, extra files, then the FIM block in its template order."""
        out = list(self.head)
        for extra in self.extras:
            out += extra
        for piece in self.block:
            out += piece
        return out


class FimFormat:
    """A template bound to one tokenizer: token ids resolved, text encoded, layouts chosen, prompts fitted."""

    def __init__(self, template: FimTemplate, orders: Sequence[str], vocab: Mapping[str, int], encode: Encode,
                 encode_many: EncodeMany, bos_ids: Sequence[int] = (), eos_id: int | None = None) -> None:
        self.template = template
        self.orders = tuple(orders)
        self.ids = {role: vocab[text] for role, text in template.tokens.items() if text in vocab}
        if "EOT" not in self.ids and eos_id is not None:
            self.ids["EOT"] = eos_id
        self.stop_ids = frozenset(vocab[t] for t in template.stops if t in vocab)
        self._encode = EncodeCache(encode)
        self._encode_many = encode_many
        self.bos_ids = list(bos_ids)
        self._sentinel = encode(BARE_SENTINEL) if template.bare else []

    @property
    def name(self) -> str:
        """The template's name."""
        return self.template.name

    @property
    def default_layout(self) -> str:
        """`spm` when the model was trained suffix-first, else `typed_line`."""
        return "spm" if "spm" in self.orders else "typed_line"

    def layout(self, requested: str) -> str:
        """The layout to use for `requested` (one of LAYOUTS); UnsupportedLayout when the model lacks its order."""
        if requested not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}; got {requested!r}")
        layout = self.default_layout if requested == "auto" else requested
        order = "spm" if layout == "spm" else "psm"
        if order not in self.orders:
            raise UnsupportedLayout(f"layout {layout!r} needs a model trained in the {order.upper()} order; the "
                                    f"loaded model ({self.name} template) was trained with {list(self.orders)}: ask "
                                    f"for {'spm' if 'spm' in self.orders else 'psm or typed_line'}, or leave it unset")
        return layout

    def bare(self, text: str) -> list[int]:
        """`text` without the implicit leading space a SentencePiece tokenizer adds (the family's `bare` rule)."""
        if not text or not self.template.bare:
            return self._encode(text) if text else []
        ids = self._encode(BARE_SENTINEL + text)
        n = len(self._sentinel)
        return ids[n:] if ids[:n] == self._sentinel else self._encode(text)

    def _text(self, text: str, bare: bool) -> list[int]:
        return self.bare(text) if bare else (self._encode(text) if text else [])

    def _render(self, items: Sequence[Part], fields: Mapping[str, str]) -> list[list[int]]:
        """Each part's ids (a token the vocabulary lacks, or a part whose needs are unmet, is left out); the suffix
        is encoded bare in a `bare` family."""
        out: list[list[int]] = []
        for part in items:
            if any(not fields.get(n) for n in part.needs):
                continue
            if part.is_token:
                if part.item in self.ids:
                    out.append([self.ids[part.item]])
                continue
            out.append(self._text(part.item.format(**fields), self.template.bare and part.item == "{suffix}"))
        return out

    def segments(self, infill: InfillInput, layout: str, extra: Sequence[ExtraFile], prefix: str, suffix: str,
                 typed: str) -> Segments:
        """The prompt's pieces for an already split request (`prefix` and `typed` as the layout places them)."""
        ctx = "1" if (infill.path or infill.repo_name or extra) else ""
        fields = {"path": infill.path, "repo": infill.repo_name, "ctx": ctx, "prefix": prefix, "suffix": suffix}
        seg = Segments(head=list(self.bos_ids))
        for ids in self._render(self.template.repository, fields):
            seg.head += ids
        for f in extra:
            seg.extras.append([i for piece in self._render(self.template.extra, {**fields, "path": f.path,
                                                                                 "text": f.text}) for i in piece])
        seg.block = self._render(self.template.layouts["spm" if layout == "spm" else "psm"], fields)
        if layout == "typed_line" and typed:
            seg.block.append(self._text(typed, self.template.bare))
        return seg

    def prompt(self, infill: InfillInput, budget: int, truncate: bool = False, limit_note: str = "") -> InfillPrompt:
        """The prompt ids for `infill` in at most `budget` tokens: trimmed in coarse steps when `truncate` (start of
        the prefix, end of the suffix, then whole extra files, first ones first), else PromptTooLong."""
        layout = self.layout(infill.layout)
        before_cursor = infill.prefix + infill.typed_line
        if layout == "typed_line":
            cut = before_cursor.rfind("\n") + 1
            prefix, typed = before_cursor[:cut], before_cursor[cut:]
        else:
            prefix, typed = before_cursor, ""
        suffix, extra = infill.suffix, list(infill.extra)
        seg = self.segments(infill, layout, extra, prefix, suffix, typed)
        ids = seg.ids()
        if len(ids) <= budget:
            return InfillPrompt(ids, layout, Trimmed(), self.stop_ids)
        if not truncate:
            raise PromptTooLong(f"the infill prompt has {len(ids)} tokens but at most {budget} fit{limit_note}; set "
                                f"truncate, or send a shorter prefix and suffix or fewer extra files")
        trimmer = Trimmer(self, infill, layout, prefix, suffix, typed, extra, budget)
        fitted, trimmed = trimmer.fit(len(ids))
        if fitted is None:
            raise PromptTooLong(f"the infill prompt cannot fit {budget} tokens{limit_note} even with the prefix, "
                                f"suffix and extra files trimmed: shorten typed_line or lower max_new_tokens")
        return InfillPrompt(fitted, layout, trimmed, self.stop_ids)


def round_up(n: int, step: int) -> int:
    """n rounded up to a multiple of step (0 for n <= 0)."""
    return max(0, math.ceil(n / step) * step)


_LINE = re.compile(r"[^\n]*\n|[^\n]+$")


def lines_of(text: str) -> list[str]:
    """`text` split after each newline (the concatenation is `text`)."""
    return _LINE.findall(text)


class Trimmer:
    """Fits one request by cutting whole lines from the far ends of the prefix and suffix in steps of about
    TRIM_STEP_TOKENS, then whole extra files, first ones first. Every amount is rounded up to a step, so from one
    keystroke to the next the cut stays where it was until the text outgrows a whole step."""

    def __init__(self, fmt: FimFormat, infill: InfillInput, layout: str, prefix: str, suffix: str, typed: str,
                 extra: list[ExtraFile], budget: int) -> None:
        self.fmt, self.infill, self.layout = fmt, infill, layout
        self.prefix, self.suffix, self.typed, self.extra, self.budget = prefix, suffix, typed, extra, budget
        # never cut: the prefix's cursor line (after its last newline) and the suffix's first line (its rest)
        pre_lines = lines_of(prefix)
        self.pre_lines = pre_lines if prefix.endswith("\n") else pre_lines[:-1]
        self.suf_lines = lines_of(suffix)[1:]
        self.pre_counts = self._counts(self.pre_lines, bare=False)  # estimates: each line tokenized alone
        self.suf_counts = self._counts(self.suf_lines, bare=fmt.template.bare)
        self.extra_sizes = [len(e) for e in fmt.segments(infill, layout, extra, "", "", "").extras]

    def _counts(self, lines: list[str], bare: bool) -> list[int]:
        if not lines:
            return []
        if bare:
            return [len(self.fmt.bare(x)) for x in lines]
        return [len(ids) for ids in self.fmt._encode_many(lines)]

    @staticmethod
    def _lines_holding(counts: Sequence[int], tokens: int, from_end: bool) -> int:
        """How many lines from the start (or the end) hold at least `tokens` tokens (all of them at most)."""
        total = 0
        for n, count in enumerate(reversed(counts) if from_end else counts):
            if total >= tokens:
                return n
            total += count
        return len(counts)

    def _plan(self, over: int, pre_floor: int, suf_floor: int) -> tuple[int, int, int]:
        """(prefix lines cut from the start, suffix lines cut from the end, extra files dropped) for `over` tokens."""
        step = TRIM_STEP_TOKENS
        pre, suf = self.pre_counts, self.suf_counts
        cut_pre = self._lines_holding(pre, min(round_up(over, step), max(0, sum(pre) - pre_floor)), False)
        over -= sum(pre[:cut_pre])
        cut_suf = self._lines_holding(suf, min(round_up(over, step), max(0, sum(suf) - suf_floor)), True)
        over -= sum(suf[len(suf) - cut_suf:])
        drop = 0
        while over > 0 and drop < len(self.extra):
            over -= self.extra_sizes[drop]
            drop += 1
        if over > 0:  # below the floors: more of the prefix's lines, then of the suffix's
            more = self._lines_holding(pre[cut_pre:], round_up(over, step), False)
            over -= sum(pre[cut_pre:cut_pre + more])
            cut_pre += more
            cut_suf += self._lines_holding(suf[: len(suf) - cut_suf], round_up(over, step), True)
        return cut_pre, cut_suf, drop

    def fit(self, total: int) -> tuple[list[int] | None, Trimmed]:
        """The trimmed prompt of at most `budget` tokens (None when cutting everything cuttable is not enough) and
        what was cut; `total` is the untrimmed prompt's length."""
        lines_and_extra = sum(self.pre_counts) + sum(self.suf_counts) + sum(self.extra_sizes)
        room = max(0, self.budget - (total - lines_and_extra))
        step = TRIM_STEP_TOKENS
        # before extra files go, the prefix keeps half of the room and the suffix a quarter (in whole steps)
        pre_floor, suf_floor = (room // 2) // step * step, (room // 4) // step * step
        margin = 0
        trimmed = Trimmed()
        for _ in range(8):
            cut_pre, cut_suf, drop = self._plan(total - self.budget + margin, pre_floor, suf_floor)
            pre_chars = sum(len(x) for x in self.pre_lines[:cut_pre])
            suf_chars = sum(len(x) for x in self.suf_lines[len(self.suf_lines) - cut_suf:])
            seg = self.fmt.segments(self.infill, self.layout, self.extra[drop:], self.prefix[pre_chars:],
                                    self.suffix[: len(self.suffix) - suf_chars], self.typed)
            ids = seg.ids()
            trimmed = Trimmed(pre_chars, suf_chars, drop, total - len(ids))
            if len(ids) <= self.budget:
                return ids, trimmed
            if (cut_pre, cut_suf, drop) == (len(self.pre_lines), len(self.suf_lines), len(self.extra)):
                break
            margin += len(ids) - self.budget  # the line counts were estimates: cut that much more
        return None, trimmed


def load_format(model_dir: str | Path, vocab: Mapping[str, int], encode: Encode, encode_many: EncodeMany,
                override: str = "", bos_ids: Sequence[int] = (), eos_id: int | None = None
                ) -> tuple[FimFormat | None, str]:
    """The model's FIM format (None and the reason when it has none), chosen as `choose` says."""
    where = str(Path(model_dir) / "tokenizer_config.json")
    choice = choose(vocab, declared_fim(model_dir), override, where)
    if choice.template is None:
        return None, choice.reason
    return FimFormat(choice.template, choice.orders, vocab, encode, encode_many, bos_ids, eos_id), ""
