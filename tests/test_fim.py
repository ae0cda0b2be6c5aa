"""Fill-in-the-middle templates (specrpc/prompts/fim.py): each family's exact token sequence built from a small
tokenizer that has its tokens, template selection, the append-only property of the keystroke layouts, trimming that
stays put from keystroke to keystroke, and greedy exactness of Infill prompts through the engine on the shipped pair."""

from __future__ import annotations

import itertools
import shutil
import string
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import decode
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from specrpc.config import ASSETS, EngineConfig, build_config
from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest
from specrpc.models import load_model, load_tokenizer
from specrpc.prompts.fim import (
    TRIM_STEP_TOKENS,
    EncodeCache,
    ExtraFile,
    FimFormat,
    InfillInput,
    PromptTooLong,
    UnsupportedLayout,
    choose,
    declare_fim,
    declared_fim,
    lines_of,
    load_format,
)

FULL_WIDTH = ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>")


# ---- small tokenizers with a family's tokens -------------------------------------------------------------------------


def byte_level(specials: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) with `specials` as special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def sentencepiece_like(specials: list[str]) -> PreTrainedTokenizerFast:
    """Characters with SentencePiece's implicit leading space (Metaspace, prepended to the first word)."""
    alphabet = ["<unk>", *sorted(set(string.printable) | {"\u2581", "\u263a"})]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


Family = tuple[FimFormat, dict[str, int], Callable[[str], list[int]]]


def family(tokenizer: PreTrainedTokenizerFast, declared: dict[str, object] | None = None, override: str = "",
           bos_ids: tuple[int, ...] = ()) -> Family:
    """The FIM format chosen for `tokenizer`, its vocabulary and its plain encode."""
    vocab = tokenizer.get_vocab()

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    def many(texts: list[str]) -> list[list[int]]:
        return [enc(t) for t in texts]

    choice = choose(vocab, declared, override)
    assert choice.template is not None, choice.reason
    return FimFormat(choice.template, choice.orders, vocab, enc, many, bos_ids), vocab, enc


PREFIX, SUFFIX = "def area(w, h):\n    return ", "\n\nprint(area(2, 3))\n"
EXTRA = (ExtraFile("geometry/util.py", "def square(x):\n    return x * x\n"),)


def ids(fmt: FimFormat, **fields: object) -> list[int]:
    fields.setdefault("prefix", PREFIX)
    fields.setdefault("suffix", SUFFIX)
    return fmt.prompt(InfillInput(**fields), budget=100_000).ids  # type: ignore[arg-type]


# ---- layouts per family: exact sequences -----------------------------------------------------------------------------


def test_shipped_template_psm_spm_and_typed_line() -> None:
    specials = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]
    fmt, t, enc = family(byte_level(specials), {"template": "specrpc", "orders": ["psm", "spm"]})
    pre, suf, mid, sep, eot = (t[n] for n in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
                                              "<|endoftext|>"))
    extra = [sep, *enc("geometry/util.py\ndef square(x):\n    return x * x\n"), eot]
    head = [sep, *enc("geometry/area.py\n")]
    assert ids(fmt, extra=EXTRA, path="geometry/area.py", layout="psm") == [
        *extra, pre, *head, *enc(PREFIX), suf, *enc(SUFFIX), mid]
    assert ids(fmt, extra=EXTRA, path="geometry/area.py", layout="spm") == [
        *extra, suf, *enc(SUFFIX), pre, *head, *enc(PREFIX), mid]
    lines, typed = "def area(w, h):\n", "    return "
    assert ids(fmt, path="geometry/area.py", layout="typed_line") == [
        pre, *head, *enc(lines), suf, *enc(SUFFIX), mid, *enc(typed)]
    # the typed line sent apart gives the same prompt as the server's own split
    assert ids(fmt, prefix=lines, typed_line=typed, layout="typed_line") == ids(fmt, layout="typed_line")
    assert ids(fmt, layout="auto") == ids(fmt, layout="spm")  # trained suffix-first: auto is SPM
    assert fmt.stop_ids == frozenset()


def test_qwen25_coder_repository_layout() -> None:
    specials = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>", "<|im_end|>"]
    fmt, t, enc = family(byte_level(specials))
    assert fmt.name == "qwen2.5-coder" and fmt.orders == ("psm",) and fmt.default_layout == "typed_line"
    pre, suf, mid, sep, repo = (t[n] for n in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
                                               "<|repo_name|>"))
    assert ids(fmt, extra=EXTRA, path="geometry/area.py", repo_name="library-system", layout="psm") == [
        repo, *enc("library-system\n"), sep, *enc("geometry/util.py\ndef square(x):\n    return x * x\n\n"),
        sep, *enc("geometry/area.py\n"), pre, *enc(PREFIX), suf, *enc(SUFFIX), mid]
    assert ids(fmt, layout="psm") == [pre, *enc(PREFIX), suf, *enc(SUFFIX), mid]  # file-level
    assert ids(fmt) == [pre, *enc("def area(w, h):\n"), suf, *enc(SUFFIX), mid, *enc("    return ")]
    assert fmt.stop_ids == {t[n] for n in specials}
    with pytest.raises(UnsupportedLayout, match="SPM order"):
        ids(fmt, layout="spm")


def test_starcoder2_and_starcoder() -> None:
    specials = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>",
                "<file_sep>"]
    fmt, t, enc = family(byte_level(specials))
    assert fmt.name == "starcoder2" and fmt.default_layout == "spm"
    pre, suf, mid, sep, repo = (t[n] for n in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>",
                                               "<repo_name>"))
    extra = [repo, *enc("lib"), sep, *enc("geometry/util.py\ndef square(x):\n    return x * x\n")]
    assert ids(fmt, extra=EXTRA, path="area.py", repo_name="lib", layout="psm") == [
        *extra, sep, pre, *enc("area.py\n"), *enc(PREFIX), suf, *enc(SUFFIX), mid]
    assert ids(fmt, extra=EXTRA, path="area.py", repo_name="lib", layout="spm") == [
        *extra, sep, pre, suf, *enc(SUFFIX), mid, *enc("area.py\n"), *enc(PREFIX)]
    assert ids(fmt, layout="psm") == [pre, *enc(PREFIX), suf, *enc(SUFFIX), mid]
    assert fmt.stop_ids == {t["<file_sep>"], t["<|endoftext|>"]}

    specials = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<reponame>", "<filename>",
                "<gh_stars>"]
    fmt, t, enc = family(byte_level(specials))
    assert fmt.name == "starcoder"
    pre, suf, mid, fname, repo, eot = (t[n] for n in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<filename>",
                                                      "<reponame>", "<|endoftext|>"))
    assert ids(fmt, extra=EXTRA, path="area.py", repo_name="lib", layout="psm") == [
        fname, *enc("geometry/util.py\ndef square(x):\n    return x * x\n"), eot,
        pre, repo, *enc("lib"), fname, *enc("area.py\n"), *enc(PREFIX), suf, *enc(SUFFIX), mid]
    assert ids(fmt, layout="spm") == [pre, suf, *enc(SUFFIX), mid, *enc(PREFIX)]


def test_deepseek_coder_full_width_tokens() -> None:
    fmt, t, enc = family(byte_level(["<\uff5cbegin\u2581of\u2581sentence\uff5c>", *FULL_WIDTH,
                                     "<\uff5cend\u2581of\u2581sentence\uff5c>"]), bos_ids=(0,))
    assert fmt.name == "deepseek-coder" and fmt.orders == ("psm",)
    begin, hole, end = (t[n] for n in FULL_WIDTH)
    assert ids(fmt, extra=EXTRA, layout="psm") == [
        0, *enc("#geometry/util.py\ndef square(x):\n    return x * x\n\n"), begin, *enc(PREFIX), hole,
        *enc(SUFFIX), end]
    assert ids(fmt) == [0, begin, *enc("def area(w, h):\n"), hole, *enc(SUFFIX), end, *enc("    return ")]
    # today's ASCII-bar spelling is another token: it does not make a DeepSeek vocabulary
    ascii_bars = [n.replace("\uff5c", "|") for n in FULL_WIDTH]
    assert choose(byte_level(ascii_bars).get_vocab(), None).template is None


def test_codellama_spacing_rules() -> None:
    tokenizer = sentencepiece_like(["<s>", "\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"])
    t_bos = tokenizer.get_vocab()["<s>"]
    fmt, t, enc = family(tokenizer, bos_ids=(t_bos,))
    assert fmt.name == "codellama" and fmt.orders == ("psm", "spm")
    pre, suf, mid = (t[n] for n in ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"))

    def bare(text: str) -> list[int]:  # codellama's encode_infilling
        return enc("\u263a" + text)[2:]

    assert enc("x")[0] == t["\u2581"] and bare("x") == [t["x"]]  # the implicit leading space, and without it
    # "<PRE> {pre} <SUF>{suf} <MID>": the prefix with its leading space, the suffix without
    assert ids(fmt, layout="psm") == [t_bos, pre, *enc(PREFIX), suf, *bare(SUFFIX), mid]
    # "<PRE> <SUF>{suf} <MID> {pre}"
    assert ids(fmt, layout="spm") == [t_bos, pre, suf, *bare(SUFFIX), mid, *enc(PREFIX)]
    # the middle is encoded without the leading space, so is the typed line placed there
    assert ids(fmt, layout="typed_line") == [t_bos, pre, *enc("def area(w, h):\n"), suf, *bare(SUFFIX), mid,
                                             *bare("    return ")]
    assert fmt.stop_ids == {t["\u2581<EOT>"]}


def test_codestral_suffix_first_without_a_middle_token() -> None:
    tokenizer = sentencepiece_like(["<s>", "</s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"])
    fmt, t, enc = family(tokenizer, bos_ids=(tokenizer.get_vocab()["<s>"],))
    assert fmt.name == "codestral" and fmt.orders == ("spm",) and fmt.default_layout == "spm"
    assert ids(fmt) == [t["<s>"], t["[SUFFIX]"], *enc("\u263a" + SUFFIX)[2:], t["[PREFIX]"], *enc(PREFIX)]
    with pytest.raises(UnsupportedLayout):
        ids(fmt, layout="typed_line")


# ---- choosing a template ---------------------------------------------------------------------------------------------


def test_template_choice_declared_detected_overridden_or_none() -> None:
    vocab = byte_level(["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                        "<|file_sep|>"]).get_vocab()
    # the shipped pair's tokens are a subset of Qwen's: undeclared, they are read as Qwen's
    assert choose(vocab, None).template.name == "qwen2.5-coder"  # type: ignore[union-attr]
    declared = choose(vocab, {"template": "specrpc", "orders": ["psm", "spm"]})
    assert declared.template is not None and declared.template.name == "specrpc"
    assert declared.orders == ("psm", "spm")
    assert choose(vocab, {"template": "specrpc"}).orders == ("psm",)  # the template's published orders
    overridden = choose(vocab, {"template": "specrpc", "orders": ["psm", "spm"]}, override="qwen2.5-coder")
    assert overridden.template is not None and overridden.template.name == "qwen2.5-coder"
    assert overridden.orders == ("psm",)
    with pytest.raises(ValueError, match="not a known template"):
        choose(vocab, {"template": "nope"})
    with pytest.raises(ValueError, match=r"fim\.orders"):
        choose(vocab, {"template": "qwen2.5-coder", "orders": ["spm"]})  # Qwen's template has no SPM spelling
    with pytest.raises(ValueError, match="--fim-template codellama"):
        choose(vocab, None, override="codellama")
    # a model declaring a template its tokenizer cannot spell, or a tokenizer without FIM tokens: no infill
    plain = byte_level(["<|endoftext|>"]).get_vocab()
    missing = choose(plain, {"template": "specrpc"})
    assert missing.template is None and "<|fim_prefix|>" in missing.reason
    none = choose(plain, None)
    assert none.template is None and "fill-in-the-middle" in none.reason


def test_fim_template_setting_is_validated() -> None:
    assert build_config(None, env={"SPECRPC_FIM_TEMPLATE": "codellama"}).engine.fim_template == "codellama"
    assert build_config(None, env={}).engine.fim_template == ""
    with pytest.raises(ValueError, match="--fim-template must be one of"):
        build_config(None, env={"SPECRPC_FIM_TEMPLATE": "llama"})


def test_shipped_pair_declares_prefix_first(tmp_path: Path) -> None:
    for role in ("target", "draft"):
        assert declared_fim(ASSETS / role) == {"template": "specrpc", "orders": ["psm"]}
    shutil.copy(ASSETS / "target" / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    declare_fim(tmp_path, "specrpc", ["psm", "spm"])
    assert declared_fim(tmp_path) == {"template": "specrpc", "orders": ["psm", "spm"]}
    with pytest.raises(ValueError):
        declare_fim(tmp_path, "qwen2.5-coder", ["spm"])


# ---- keystrokes: only appends ----------------------------------------------------------------------------------------


def shipped_format(tmp_path: Path, orders: list[str]) -> tuple[FimFormat, PreTrainedTokenizerBase]:
    """The shipped tokenizer with a `fim` declaration of `orders`."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "target" / name, tmp_path / name)
    declare_fim(tmp_path, "specrpc", orders)
    tokenizer = load_tokenizer(tmp_path)

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    def many(texts: list[str]) -> list[list[int]]:
        return [list(x) for x in tokenizer(texts, add_special_tokens=False).input_ids]

    fmt, reason = load_format(tmp_path, tokenizer.get_vocab(), enc, many)
    assert fmt is not None, reason
    return fmt, tokenizer


SOURCE = Path(string.__file__).read_text()  # code the models may have seen; these tests are about token layout


def keystrokes(line_index: int, line: str, lines: list[str]) -> list[tuple[str, str]]:
    """(text before the cursor, text after it) while `line` is typed as a new line before lines[line_index]."""
    above, below = "".join(lines[:line_index]), "".join(lines[line_index:])
    return [(above + line[:i], "\n" + below) for i in range(1, len(line) + 1)]


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(("layout", "slack"), [("typed_line", 3), ("spm", 4)])
def test_a_keystroke_only_appends(tmp_path: Path, layout: str, slack: int) -> None:
    fmt, _ = shipped_format(tmp_path, ["psm", "spm"])
    lines = lines_of(SOURCE)
    keys = keystrokes(len(lines) // 2, "    result = helper(value, limit=3) or default", lines)
    prompts = [fmt.prompt(InfillInput(before, after, path="string.py", layout=layout), 100_000).ids
               for before, after in keys]
    for previous, current in itertools.pairwise(prompts):
        assert shared(previous, current) >= len(previous) - slack, "a keystroke changed more than the last tokens"
    # prefix-first with the whole line in the prefix: every keystroke changes the prompt before the whole suffix
    psm = [fmt.prompt(InfillInput(b, a, layout="psm"), 100_000).ids for b, a in keys[:5]]
    suffix_tokens = len(fmt._encode(keys[0][1]))
    assert all(shared(p, c) < len(p) - suffix_tokens for p, c in itertools.pairwise(psm))


# ---- truncation ------------------------------------------------------------------------------------------------------


def test_truncation_trims_far_ends_in_steps_that_stay_put(tmp_path: Path) -> None:
    fmt, _ = shipped_format(tmp_path, ["psm", "spm"])
    lines = lines_of(SOURCE)
    middle = len(lines) // 2
    keys = keystrokes(middle, "    total = first_value + second_value * factor", lines)
    budget = 1500
    for layout in ("typed_line", "spm"):
        results = [fmt.prompt(InfillInput(b, a, layout=layout), budget, truncate=True) for b, a in keys]
        assert all(len(r.ids) <= budget for r in results)
        cuts = [(r.trimmed.prefix_chars, r.trimmed.suffix_chars) for r in results]
        assert all(p > 0 and s > 0 for p, s in cuts)  # both far ends were cut ...
        assert len(set(cuts)) <= 2, cuts  # ... and the cut moved at most once while the line was typed
        for (before, after), r in zip(keys, results, strict=True):
            assert r.trimmed.prefix_chars == 0 or before[r.trimmed.prefix_chars - 1] == "\n"  # whole lines
            assert after[len(after) - r.trimmed.suffix_chars - 1] == "\n"
            assert r.trimmed.tokens > 0
        reused = sum(shared(p.ids, c.ids) >= len(p.ids) - 4 for p, c in itertools.pairwise(results))
        assert reused >= len(results) - 2, layout
        # trimmed in coarse steps, not token by token
        untrimmed = len(fmt.prompt(InfillInput(*keys[0], layout=layout), 100_000).ids)
        assert results[0].trimmed.tokens >= min(TRIM_STEP_TOKENS, untrimmed - budget)


def test_truncation_drops_extra_files_after_the_floors_first_ones_first(tmp_path: Path) -> None:
    fmt, _ = shipped_format(tmp_path, ["psm"])
    code = "".join(f"value_{i} = compute({i}, factor={i * 7})\n" for i in range(60))
    extra = tuple(ExtraFile(f"mod{i}.py", code) for i in range(4))
    infill = InfillInput(code + "x = ", "\n" + code, extra=extra)
    full = fmt.prompt(infill, 100_000)
    budget = len(full.ids) - 900
    fitted = fmt.prompt(infill, budget, truncate=True)
    assert len(fitted.ids) <= budget and fitted.trimmed.extra_files >= 1
    kept = extra[fitted.trimmed.extra_files:]
    assert fmt.prompt(replace(infill, extra=kept, prefix=infill.prefix[fitted.trimmed.prefix_chars:],
                              suffix=infill.suffix[:len(infill.suffix) - fitted.trimmed.suffix_chars]),
                      100_000).ids == fitted.ids  # exactly the request with what was reported as trimmed removed


def test_too_long_without_truncate_or_untrimmable_is_refused(tmp_path: Path) -> None:
    fmt, _ = shipped_format(tmp_path, ["psm"])
    long = "".join(f"line_{i} = {i}\n" for i in range(400))
    with pytest.raises(PromptTooLong, match="set truncate"):
        fmt.prompt(InfillInput(long, long), 512, limit_note=" (context 512)")
    with pytest.raises(PromptTooLong, match="typed_line"):  # one line being typed cannot be trimmed
        fmt.prompt(InfillInput("x = " + " + ".join(f"v{i}" for i in range(600)), ""), 512, truncate=True)


def test_encode_cache_returns_the_same_ids_and_stays_within_its_size() -> None:
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    cache = EncodeCache(encode, max_chars=300)
    texts = [chr(97 + i) * 100 for i in range(4)]
    assert [cache(t) for t in texts[:2]] == [encode(t) for t in texts[:2]]
    calls.clear()
    assert cache(texts[0]) == encode(texts[0]) and len(calls) == 1  # a hit: only the reference call above
    cache(texts[2])
    cache(texts[3])  # 400 characters held would be over 300: the least recently used (texts[1]) went
    calls.clear()
    cache(texts[1])
    assert calls == [texts[1]]
    assert cache("short") == encode("short")  # short texts are not kept


# ---- exactness through the engine on the shipped pair ----------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_engines() -> tuple[Engine, Engine]:
    """The shipped pair: target alone, and target with its draft."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    config = EngineConfig(max_sessions=1, max_context=1024, max_draft_tokens=8)
    target = load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=1, max_context=1040)
    draft = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=1040)
    return Engine(target, None, replace(config, speculation="off")), Engine(target, draft, config)


@pytest.mark.parametrize("layout", ["psm", "typed_line", "spm"])
def test_greedy_infill_is_exact_with_and_without_speculation(tmp_path: Path, shipped_engines: tuple[Engine, Engine],
                                                             layout: str) -> None:
    fmt, tokenizer = shipped_format(tmp_path, ["psm", "spm"])
    lines = lines_of(SOURCE)
    before, after = keystrokes(len(lines) // 3, "    if not ", lines)[-1]
    prompt = fmt.prompt(InfillInput(before[-2500:], after[:1200], path="string.py", layout=layout), 1000).ids
    alone, spec = shipped_engines
    stops = frozenset({int(tokenizer.eos_token_id)})

    def run(engine: Engine, k: int | None, proposer: str | None) -> list[int]:
        return decode(engine, engine.new_slot(0), GenerationRequest(prompt, 24, num_draft_tokens=k,
                                                                    proposer=proposer, stop_token_ids=stops))

    reference = run(alone, 0, None)
    assert reference
    for k, proposer in ((4, "draft"), (8, "draft"), (None, "combined"), (6, "lookup")):
        assert run(spec, k, proposer) == reference, (k, proposer)
