"""Grammar-constrained decoding (specrpc/engine/constraint.py) is exact under speculation: greedy output equals
masked target-only decoding token for token, alone and in a batch, whatever drafts; sampled output follows the
masked target distribution (χ², with a negative control that fails); on the shipped pair every JSON reply
validates against its schema; bad schemas and grammars are refused by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg
import pytest
import torch
from engine_helpers import decode, decode_together, requires_native
from test_engine import VOCAB, chi_square_pvalue, make_engine, tiny_llama
from transformers import LlamaForCausalLM

from specrpc.bench.controls import JSON_TASKS, json_cases
from specrpc.bench.controls import SCHEMA as CONTROLS_SCHEMA
from specrpc.config import ASSETS, EngineConfig
from specrpc.engine.constraint import (
    Constraint,
    ConstraintSpec,
    Grammar,
    GrammarCompiler,
    GrammarLimit,
    InvalidConstraint,
    apply_words,
    unpack_mask,
)
from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.plan import allowed, plan
from specrpc.engine.prediction import PredictionProposer
from specrpc.engine.proposers import Proposal
from specrpc.engine.sampling import SamplingParams, logits_to_probs, mask_logits
from specrpc.engine.suffix import SuffixProposer, SuffixTrie
from specrpc.engine.verify import verify
from specrpc.models import load_model

GREEDY = SamplingParams(temperature=0.0)
UNITS = "(ab|ba|c[de])"
"""A grammar whose mask depends on what came before: after `a` only `b`, after `b` only `a`, after `c` `d` or `e`."""


class Letters:
    """The tiny models' tokenizer: id 0 ends a sequence, ids 1..5 are the letters a..e."""

    def __init__(self) -> None:
        self.eos_token_id = 0
        self.bos_token_id = None
        self.tokens = [b"</s>", b"a", b"b", b"c", b"d", b"e"]
        self.special_token_ids = [0]

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [self.tokens.index(bytes([c])) for c in data]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    return tiny_llama(root / "target", seed=1), tiny_llama(root / "draft", seed=2, hidden=16, layers=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> object:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def letters() -> GrammarCompiler:
    return GrammarCompiler(llg.LLTokenizer(llg.TokenizerWrapper(Letters())))


def masked_reference(path: Path, prompt: list[int], grammar: Grammar, n: int) -> list[int]:
    """Target-only greedy decoding under the grammar with Hugging Face's model: the argmax of the masked logits,
    one token at a time, until the grammar ends or `n` tokens."""
    hf = LlamaForCausalLM.from_pretrained(str(path)).eval()
    constraint = grammar.start()
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]  # [V]
            out.append(int(mask_logits(logits, constraint.allowed()).argmax()))
            if constraint.commit(out[-1]):
                break
    return out


@pytest.mark.parametrize(("k", "proposer"), [(1, "draft"), (4, "draft"), (8, "draft"), (4, "lookup"),
                                             (4, "combined"), (None, "draft"), (None, "combined")])
def test_greedy_constrained_speculation_equals_masked_target_only(pair: tuple[Path, Path], letters: GrammarCompiler,
                                                                  k: int | None, proposer: str) -> None:
    """k None: the policy's k, with the grammar's forced runs riding along up to the cap (`plan._most`)."""
    engine = make_engine(pair)
    for text, pattern in [("cab", f"{UNITS}{{6}}"), ("bba", f"{UNITS}+"), ("abab", "(abab|cc)(a|b)*e")]:
        grammar = letters.compile(ConstraintSpec("regex", pattern))
        prompt = Letters()(text)
        request = GenerationRequest(prompt, 20, GREEDY, num_draft_tokens=k, proposer=proposer, grammar=grammar)
        spec = decode(engine, engine.new_slot(0), request)
        plain = decode(engine, engine.new_slot(0), replace(request, num_draft_tokens=0))
        assert spec == plain == masked_reference(pair[0], prompt, grammar, 20)
        assert all(t in range(1, VOCAB) for t in spec if t)


def test_greedy_constrained_rows_verified_on_the_host_equal_the_verifiers_path(pair: tuple[Path, Path],
                                                                              letters: GrammarCompiler) -> None:
    """The engine verifies greedy rows under a grammar on the host from the rows' masked argmaxes
    (`Generation.greedy_ids`); a verifier that reads logits gets the rows masked where they are read
    (`Constraint.greedy_rows`): the same steps, the same figures."""
    engine = make_engine(pair)
    grammar = letters.compile(ConstraintSpec("regex", f"{UNITS}+e"))
    runs = []
    for verifier in (engine.verifier, lambda *args: verify(*args)):
        engine.verifier = verifier
        gen = engine.start(engine.new_slot(0), GenerationRequest(Letters()("cab"), 20, GREEDY, num_draft_tokens=4,
                                                                 proposer="draft", grammar=grammar))
        steps = []
        while not gen.finished:
            steps.append(engine.step_one(gen))
        runs.append((steps, gen.stats))
    assert runs[0] == runs[1]
    assert sum(s.proposed for s in runs[0][0]) > 0


def test_constrained_streams_in_a_batch_equal_their_solo_runs(pair: tuple[Path, Path],
                                                              letters: GrammarCompiler) -> None:
    """Each row of a batched draft and verify carries its own stream's mask: a constrained stream beside an
    unconstrained one and another under a different grammar decodes as alone."""
    engine = make_engine(pair, slots=3)
    requests = [GenerationRequest([1, 2, 3], 16, GREEDY, 4, "draft", grammar=letters.compile(
                    ConstraintSpec("regex", f"{UNITS}+"))),
                GenerationRequest([3, 1, 4], 16, GREEDY, 3, "draft"),
                GenerationRequest([2, 2], 16, GREEDY, 5, "draft", grammar=letters.compile(
                    ConstraintSpec("regex", "(c|d)+e(a|b)+")))]
    solo = [decode(engine, engine.new_slot(0), r) for r in requests]
    together, _ = decode_together(engine, [(engine.new_slot(i), r, 0) for i, r in enumerate(requests)])
    assert together == solo


def test_forced_tokens_are_drafted_without_draft_forwards(pair: tuple[Path, Path], letters: GrammarCompiler,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `((a|b)cdeab)+` the grammar forces five letters after each a or b. A k = 8 draft after the first token
    takes the forced run, draws one letter, takes the next run's first two: one draft forward (the catch-up with
    the run after it) for eight tokens, not eight; the output stays masked target-only's."""
    engine = make_engine(pair)
    grammar = letters.compile(ConstraintSpec("regex", "((a|b)cdeab)+"))
    prompt = Letters()("cab")
    request = GenerationRequest(prompt, 24, GREEDY, num_draft_tokens=8, proposer="draft", grammar=grammar)
    gen = engine.start(engine.new_slot(0), request)
    assert spell(engine.step_one(gen).token_ids) in ("a", "b")  # the prefill's token: a choice
    assert engine.draft is not None and engine.drafter is not None
    forward = engine.draft.forward
    fed: list[int] = []  # tokens per draft forward

    def counted(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fed.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(engine.draft, "forward", counted)
    assert gen.constraint is not None
    drafted = engine.drafter.propose(gen.slot.tokens, gen.slot.index, 8, GREEDY, None, gen.constraint).token_ids
    assert spell(drafted[:5]) == "cdeab" and spell(drafted[5:6]) in ("a", "b") and spell(drafted[6:]) == "cd"
    assert fed == [len(prompt) + 1 + 5], "the catch-up and the forced run in one forward, nothing per token"
    monkeypatch.undo()
    assert decode(engine, engine.new_slot(0), request) == masked_reference(pair[0], prompt, grammar, 24)


def test_forced_tokens_ride_along_beyond_the_drawn_k(pair: tuple[Path, Path], letters: GrammarCompiler) -> None:
    """Under `((a|b)cdeab)+` the grammar forces five letters after each a or b. A draft of k = 1 drawn token may
    verify up to `most` = 8: the forced run at the start, the one letter drawn, and no run after the last draw
    (its tokens would leave the draft's cache behind); the policy's acceptance counts the drawn token alone. With
    `most` = k, the forced run counts against k, as a request's own k does."""
    engine = make_engine(pair)
    grammar = letters.compile(ConstraintSpec("regex", "((a|b)cdeab)+"))
    request = GenerationRequest(Letters()("cab"), 24, GREEDY, num_draft_tokens=1, proposer="draft", grammar=grammar)
    gen = engine.start(engine.new_slot(0), request)
    engine.step_one(gen)  # the prefill's token: a or b
    assert engine.drafter is not None and gen.constraint is not None
    args = (gen.slot.tokens, gen.slot.index, 1, GREEDY, None, gen.constraint)
    riding = engine.drafter.propose(*args, most=8)
    assert spell(riding.token_ids[:5]) == "cdeab" and spell(riding.token_ids[5:]) in ("a", "b")
    assert riding.forced == frozenset(range(5)) and riding.drawn == 1
    assert riding.drawn_outcome(6) == (1, 1) and riding.drawn_outcome(5) == (1, 0)
    assert riding.drawn_outcome(3) == (0, 0), "a rejection at a forced token tests no drawn one"
    engine.reset_slot(gen.slot)
    gen = engine.start(engine.new_slot(0), request)
    engine.step_one(gen)
    counted = engine.drafter.propose(gen.slot.tokens, gen.slot.index, 1, GREEDY, None, gen.constraint)
    assert spell(counted.token_ids) == "c" and counted.drawn == 0


def test_greedy_rows_are_masked_only_where_the_grammar_overrules_the_argmax(letters: GrammarCompiler) -> None:
    """A greedy verify's rows along the draft `ab` under `(ab|ba|c[de])+`: where each row's argmax is allowed the
    logits come back as they are; where the grammar forbids it, that row is masked, and every row the verify reads
    has the fully masked logits' argmax."""
    constraint = letters.compile(ConstraintSpec("regex", f"{UNITS}+")).start()
    draft = Letters()("ab")
    agreeing = torch.full((3, 6), -5.0)
    agreeing[0, 1] = agreeing[1, 2] = agreeing[2, 3] = 5.0  # a, then b (forced), then c: all allowed
    assert constraint.greedy_rows(agreeing, draft) is agreeing  # no row masked
    assert constraint.greedy_ids(agreeing, draft) == [1, 2, 3]
    overruled = agreeing.clone()
    overruled[1, 5] = 9.0  # e after a: forbidden, the masked argmax is b (accepted)
    overruled[2, 4] = 9.0  # d after ab: forbidden, the masked argmax is c
    shaped = constraint.greedy_rows(overruled, draft)
    assert shaped.argmax(dim=-1).tolist() == [1, 2, 3] == constraint.greedy_ids(overruled, draft)
    assert shaped.argmax(dim=-1).tolist() == mask_logits(overruled, constraint.masks(draft)).argmax(dim=-1).tolist()
    assert overruled[1, 5] == 9.0, "the caller's logits are not changed"


@pytest.mark.parametrize(("vocab", "mask_vocab"), [(4096, 4096), (100, 70), (50, 70), (8192, 8000)])
def test_the_native_mask_has_the_torch_masks_bits(vocab: int, mask_vocab: int) -> None:
    """`apply_words` (one native pass over the bitmask words, where the library is built) gives `mask_logits` of
    `unpack_mask` bit for bit: rows gathered out of order and repeated, words all clear, all set and random, a NaN
    and a -0.0 copied as they are, ids beyond the mask's vocabulary forbidden and its bits beyond the logits' dropped
    (logits wider and narrower than the mask)."""
    requires_native()
    g = torch.Generator().manual_seed(vocab)
    words = torch.randint(-(2**31), 2**31, (5, (mask_vocab + 31) // 32), dtype=torch.int64, generator=g)
    words = words.to(torch.int32)  # [5, W]
    words[1], words[2] = 0, -1
    logits = torch.randn(4, vocab, generator=g)  # [4, V]
    logits[0, 3], logits[2, 5] = float("nan"), -0.0
    before = logits.clone()
    rows = [4, 1, 2, 4]
    got = apply_words(logits, words, rows, mask_vocab)  # [4, V]
    want = mask_logits(logits, unpack_mask(words[rows], mask_vocab))  # [4, V]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32)), "the caller's logits are not changed"
    assert got[0].isfinite().any() and got[0].isinf().any() and got[1].isinf().all()


def test_prompt_lookup_drafts_are_cut_at_the_first_forbidden_token(pair: tuple[Path, Path],
                                                                   letters: GrammarCompiler) -> None:
    engine = make_engine(pair)
    gen = engine.start(engine.new_slot(0), GenerationRequest([1, 2], 8, GREEDY, 4, "lookup",
                                                             grammar=letters.compile(ConstraintSpec("regex",
                                                                                                    "ab(c|d)+"))))
    found = Proposal([1, 2, 3, 5, 4], None, "lookup")
    assert allowed(gen, found).token_ids == [1, 2, 3]  # e is not allowed after abc
    assert allowed(gen, Proposal([2], None, "lookup")).token_ids == []


def spell(ids: list[int]) -> str:
    """The tiny models' tokens as text, one character each (`_` for the end token)."""
    return "".join("_abcde"[t] for t in ids)


@pytest.mark.parametrize("source", ["prediction", "suffix"])
def test_predicted_and_suffix_drafts_are_cut_at_the_first_forbidden_token(pair: tuple[Path, Path],
                                                                          letters: GrammarCompiler,
                                                                          source: str) -> None:
    """A client's prediction, and an earlier output in the suffix trie, that are the constrained output with its
    fourth token swapped for one the grammar forbids there: the plan after the first token drafts the two tokens
    before it and stops (the source alone offers more), and greedy output is the constrained output without them.
    The prompt `dd` gives prompt lookup nothing to copy at that step (the grammar starts with a, b or c), so the
    suffix source's draft is the one planned."""
    engine = make_engine(pair)
    grammar = letters.compile(ConstraintSpec("regex", f"{UNITS}{{6}}"))
    prompt = Letters()("dd")
    base = GenerationRequest(prompt, 20, GREEDY, num_draft_tokens=8, proposer="lookup", grammar=grammar)
    alone = decode(engine, engine.new_slot(0), replace(base, num_draft_tokens=0))
    assert alone == masked_reference(pair[0], prompt, grammar, 20)
    constraint = grammar.start()
    for t in alone[:3]:
        constraint.commit(t)
    forbidden = next(t for t in range(1, VOCAB) if not constraint.allowed()[t])
    predicted = [*alone[:3], forbidden, *alone[4:]]

    def request() -> GenerationRequest:
        if source == "prediction":
            return replace(base, prediction=PredictionProposer(predicted, len(prompt), spell))
        trie = SuffixTrie()
        trie.add(prompt + predicted)  # an earlier request's output, as the runtime indexes it
        return replace(base, suffix=SuffixProposer(trie))

    gen = engine.start(engine.new_slot(0), request())
    engine.step_one(gen)  # the prefill's first token: alone[0]
    given = gen.request.prediction if source == "prediction" else gen.request.suffix
    assert given is not None
    offered = given.propose(gen.slot.tokens, gen.slot.index, 8, GREEDY, None).token_ids
    assert offered[:3] == [*alone[1:3], forbidden], "the source alone drafts past the forbidden token"
    planned = plan(engine.drafting, gen, None).proposal
    assert (planned.source, planned.token_ids) == (source, alone[1:3])
    assert decode(engine, engine.new_slot(0), request()) == alone


def masked_sequence_probs(path: Path, prompt: list[int], grammar: Grammar, length: int,
                          params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every `length`-token continuation the grammar allows, under the masked model."""
    hf = LlamaForCausalLM.from_pretrained(str(path)).eval()
    probs: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(length):
        grown = []
        for seq in frontier:
            constraint = grammar.start()
            for t in seq:
                constraint.commit(t)
            grown += [(*seq, t) for t in torch.nonzero(constraint.allowed()).flatten().tolist()]
        frontier = grown
    with torch.no_grad():
        for seq in frontier:
            logits = hf(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1]  # [length, V]
            masks = grammar.start().masks(list(seq[:-1]))  # [length, V]
            p = logits_to_probs(mask_logits(logits, masks), params)  # [length, V]
            probs[seq] = float(torch.prod(p[torch.arange(length), torch.tensor(seq)]))
    return probs


def admit_a_refused_letter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mask the matcher fills also admits `e` (id 5), which the grammar forbids after `a` and `b`: the parser
    then refuses it, as llguidance's masks admit a merged quote-colon token its parser refuses
    (guidance-ai/llguidance#366)."""
    fill = Constraint._row

    def row(self: Constraint) -> int:
        new = tuple(self._drafted) not in self._rows
        index = fill(self)
        if new:
            self._bits[index, 0] |= 1 << 5
        return index

    monkeypatch.setattr(Constraint, "_row", row)


@pytest.mark.parametrize(("params", "refused", "drawn"), [(SamplingParams(temperature=1.0), False, 4),
                                                          (SamplingParams(temperature=0.8, top_k=2), False, 4),
                                                          (SamplingParams(temperature=1.0), True, 4),
                                                          (SamplingParams(temperature=1.0), False, 2)],
                         ids=["t1", "t0.8-k2", "t1-mask-admits-what-the-parser-refuses", "t1-forced-ride-along"])
def test_constrained_sampling_follows_the_masked_target_distribution(pair: tuple[Path, Path],
                                                                     letters: GrammarCompiler,
                                                                     params: SamplingParams, refused: bool,
                                                                     drawn: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """4-token continuations under a grammar whose mask depends on the path (16 cells), sampled with forced k = 4
    speculation: the first token from the prefill, the next four drafted under the mask and verified in one step
    against the target masked at each drafted position. They follow the masked target (p > 1e-4) and not the
    masked draft (p < 1e-4), so the test can fail. `refused`: every mask also admits a token the parser refuses
    (`admit_a_refused_letter`); each draw of it is made again without it, so the replies still follow the true
    mask's distribution and never fail. `drawn` 2: two drawn tokens and the forced ones riding along up to four
    (`plan._most`, as the policy's k has them)."""
    engine = make_engine(pair)
    grammar = letters.compile(ConstraintSpec("regex", f"{UNITS}{{3}}"))
    prompt = [3, 1, 4]
    target = masked_sequence_probs(pair[0], prompt, grammar, 4, params)
    draft = masked_sequence_probs(pair[1], prompt, grammar, 4, params)
    if refused:
        admit_a_refused_letter(monkeypatch)
    if drawn < 4:
        monkeypatch.setattr("specrpc.engine.plan._most", lambda *_: 4)
    n = 4000
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        gen = engine.start(engine.new_slot(0), GenerationRequest(prompt, 6, replace(params, seed=i), drawn, "draft",
                                                                 grammar=grammar))
        steps = [engine.step_one(gen) for _ in range(2)]
        assert steps[0].proposed == 0 and drawn <= steps[1].proposed <= 4, "the step after the first token drafts"
        tokens = steps[0].token_ids + steps[1].token_ids
        while len(tokens) < 4:
            tokens += engine.step_one(gen).token_ids
        counts[tuple(tokens[:4])] = counts.get(tuple(tokens[:4]), 0) + 1
    assert set(counts) <= set(target), "only continuations the grammar allows"
    assert chi_square_pvalue(counts, target, n) > 1e-4
    assert chi_square_pvalue(counts, draft, n) < 1e-4


@pytest.mark.parametrize(("spec", "problem"), [
    (ConstraintSpec("regex", "[a-"), "invalid regex"),
    (ConstraintSpec("json_schema", "{not json"), "not JSON"),
    (ConstraintSpec("json_schema", "[1, 2]"), "a JSON schema is a JSON object"),
    (ConstraintSpec("json_schema", json.dumps({"type": "strange"})), "invalid json_schema"),
    (ConstraintSpec("json_schema", json.dumps({"$ref": "#/$defs/missing"})), "invalid json_schema"),
    (ConstraintSpec("grammar", "root ::= ( "), "invalid grammar"),
    (ConstraintSpec("regex", "a" * (2 << 20)), "at most"),
])
def test_bad_constraints_are_refused_naming_the_problem(letters: GrammarCompiler, spec: ConstraintSpec,
                                                       problem: str) -> None:
    with pytest.raises(InvalidConstraint, match=problem):
        letters.compile(spec)


def test_a_grammar_past_the_parsers_limits_is_the_requests_fault(letters: GrammarCompiler) -> None:
    """A schema that compiles but whose parser row outgrows llguidance's limit once the object opens: the
    constraint reports GrammarLimit, an InvalidConstraint (the request's fault), not an engine error."""
    compiler = GrammarCompiler.from_tokenizer_json((ASSETS / "target" / "tokenizer.json").read_text(), [0], 8192)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    constraint = compiler.compile(ConstraintSpec("json_schema", json.dumps(wide))).start()
    with pytest.raises(GrammarLimit, match="limits"):
        constraint.advance_all(compiler.tokenizer.tokenize_str("{"))
    fine = letters.compile(ConstraintSpec("regex", "(a|b)+c")).start()
    with pytest.raises(RuntimeError, match="grammar matcher"):  # a forbidden token stays an engine error
        fine.advance_all(letters.tokenizer.tokenize_str("c"))


def test_json_is_laid_out_as_json_dumps_does_so_the_text_between_values_is_forced() -> None:
    """A schema's and json_object's JSON has `", "` between items and `": "` after keys, no other whitespace
    (prompts/json_layout.py): the text between two values is forced, drafted without a draft forward, and no reply
    pads itself with whitespace."""
    compiler = GrammarCompiler.from_tokenizer_json((ASSETS / "target" / "tokenizer.json").read_text(), [0], 8192)
    tokenize, spell_ids = compiler.tokenizer.tokenize_str, compiler.tokenizer.decode_str
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    for spec in (ConstraintSpec("json_schema", json.dumps(schema)), ConstraintSpec("json_object")):
        grammar = compiler.compile(spec)
        for text, laid_out in (('{"city": "Paris", "days": 2}', True), ('{"city":"Paris","days":2}', False),
                               ('{"city": "Paris",  "days": 2}', False), ('{\n  "city": "Paris"', False),
                               ('{"city" : "Paris"', False)):
            ids = tokenize(text)
            assert (grammar.start().valid_prefix(ids) == len(ids)) == laid_out, (spec.kind, text)
    constraint = compiler.compile(ConstraintSpec("json_schema", json.dumps(schema))).start()
    constraint.advance_all(tokenize('{"city": "Paris"'))
    assert spell_ids(constraint.forced()).startswith(', "days":')


def test_a_verified_token_after_the_grammars_end_is_dropped_not_drawn_again(
        shipped: tuple[Engine, GrammarCompiler], monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify whose drafts close the JSON ends with a token after the end (the row after the closing brace):
    `Generation.commit` drops it, so it is no refusal of the parser's. Taken for one, it was drawn again from the
    same row, unchanged, up to MAX_REFUSED times a reply. Greedy output stays masked target-only's."""
    engine, compiler = shipped
    grammar = compiler.compile(ConstraintSpec("json_schema", json.dumps(CONTROLS_SCHEMA)))
    refused_after_end: list[int] = []
    refuse = Constraint.refuse

    def spy(self: Constraint, token: int, path: list[int] | tuple[int, ...] = ()) -> None:
        after = self._matcher.deep_copy()
        after.consume_tokens(list(path))
        if after.is_stopped():
            refused_after_end.append(token)
        refuse(self, token, path)

    monkeypatch.setattr(Constraint, "refuse", spy)
    closed = 0
    for task in JSON_TASKS[:4]:
        prompt = [int(t) for t in compiler.tokenizer.tokenize_str(json_cases(len(JSON_TASKS), 96)[
            JSON_TASKS.index(task)].prompt)]
        base = GenerationRequest(prompt, 96, GREEDY, grammar=grammar)
        spec = decode(engine, engine.new_slot(0), replace(base, num_draft_tokens=6, proposer="draft"))
        assert spec == decode(engine, engine.new_slot(0), replace(base, num_draft_tokens=0))
        closed += compiler.tokenizer.decode_str([t for t in spec if t]).endswith("}")
    assert closed == 4 and refused_after_end == []


def test_compiled_grammars_are_cached_by_content(letters: GrammarCompiler) -> None:
    spec = ConstraintSpec("regex", "(a|b)+c")
    assert letters.compile(spec) is letters.compile(ConstraintSpec("regex", "(a|b)+c"))
    assert letters.compile(spec) is not letters.compile(ConstraintSpec("regex", "(a|b)+d"))


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def shipped() -> tuple[Engine, GrammarCompiler]:
    if not (ASSETS / "target" / "config.json").exists():
        pytest.skip("default models not trained yet")
    cpu = torch.device("cpu")
    target = load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=1, max_context=600)
    draft = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=1, max_context=600)
    engine = Engine(target, draft, EngineConfig(max_sessions=1, max_context=580, max_draft_tokens=6,
                                                prefill_chunk=128))
    compiler = GrammarCompiler.from_tokenizer_json((ASSETS / "target" / "tokenizer.json").read_text(), [0],
                                                   target.vocab_size)
    return engine, compiler


def test_json_schema_on_the_shipped_pair_is_exact_greedy_and_always_valid(
        shipped: tuple[Engine, GrammarCompiler]) -> None:
    """Greedy: speculation (draft model, prompt lookup) equals target-only decoding, both under the mask (fp32, one
    reduction order per shape on this CPU). Sampled at T = 1 with speculation: 100 of 100 replies parse and
    validate against the schema."""
    engine, compiler = shipped
    grammar = compiler.compile(ConstraintSpec("json_schema", json.dumps(SCHEMA)))
    prompt = [int(t) for t in llg.LLTokenizer((ASSETS / "target" / "tokenizer.json").read_text()).tokenize_str(
        "def person_record():\n    return ")]
    base = GenerationRequest(prompt, 200, GREEDY, grammar=grammar)
    plain = decode(engine, engine.new_slot(0), replace(base, num_draft_tokens=0))
    for k, proposer in ((4, "draft"), (6, "lookup")):
        assert decode(engine, engine.new_slot(0), replace(base, num_draft_tokens=k, proposer=proposer)) == plain
    valid = 0
    for seed in range(100):
        request = replace(base, sampling=SamplingParams(temperature=1.0, seed=seed), num_draft_tokens=4,
                          proposer="draft")
        out = decode(engine, engine.new_slot(0), request)
        text = compiler.tokenizer.decode_str([t for t in out if t != 0])
        jsonschema.validate(json.loads(text), SCHEMA)
        valid += 1
    assert valid == 100
