"""Proposers: the session's last suggestion as a draft (alignment by text across retokenized keystrokes, and on the
shipped pair, a keystroke that types along the last completion gets it back in one or two verify steps, exactly as
the target alone would generate)."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from specrpc.config import ASSETS, EngineConfig
from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.proposers import EMPTY, PromptLookupProposer, SuggestionProposer
from specrpc.engine.sampling import SamplingParams
from specrpc.models import load_model, load_tokenizer

pytestmark = pytest.mark.skipif(not (ASSETS / "target" / "config.json").exists(), reason="default models not trained")
GREEDY = SamplingParams(temperature=0.0)


@cache
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(str(ASSETS / "target"))


def encode(text: str) -> list[int]:
    return list(tokenizer()(text).input_ids)


def decode(ids: list[int]) -> str:
    return str(tokenizer().decode(ids, clean_up_tokenization_spaces=False))


def special() -> frozenset[int]:
    return frozenset(tokenizer().all_special_ids)


def test_follow_aligns_typed_characters_by_text() -> None:
    prompt = encode("def area(width, height):\n    return")
    completion = encode(" width * height\n\n\ndef perimeter(width, height):")
    previous = prompt + completion
    typed = encode("def area(width, height):\n    return wi")  # inside the token " width": retokenized
    proposer = SuggestionProposer.follow(previous, len(prompt), typed, decode, special())
    assert proposer is not None and proposer.typed == decode(typed[len(prompt) - 1 :])[-len(proposer.typed):]
    assert proposer.propose(typed, 0, 8, GREEDY, None) is EMPTY or proposer.typed == ""  # ends inside a token
    # the target completes the token: "dth" (any tokens whose text does); the suggestion resumes after " width"
    after = typed + encode("dth")[len(encode("")):]
    found = proposer.propose(after, 0, 3, GREEDY, None)
    assert decode(found.token_ids) == decode(completion[1:])[: len(decode(found.token_ids))]
    assert found.token_ids == completion[1:4] and found.probs is None and found.source == "suggestion"
    assert proposer.propose(after + encode(" +"), 0, 3, GREEDY, None) is EMPTY, "left the suggestion"
    assert not proposer.alive
    assert proposer.propose(after, 0, 3, GREEDY, None) is EMPTY, "dropped for the rest of the request"


def test_follow_refuses_a_prompt_that_does_not_type_along() -> None:
    prompt = encode("x = compute(")
    completion = encode("a, b)\nprint(x)")
    previous = prompt + completion
    assert SuggestionProposer.follow(previous, len(prompt), encode("x = compute(c"), decode, special()) is None
    assert SuggestionProposer.follow(previous, len(prompt), encode("y = other("), decode, special()) is None
    assert SuggestionProposer.follow(previous, len(prompt), previous, decode, special()) is None, "nothing left"
    same = SuggestionProposer.follow(previous, len(prompt), prompt, decode, special())
    assert same is not None and same.propose(prompt + completion[:1], 0, 64, GREEDY, None).token_ids == completion[1:]


def test_follow_sets_aside_special_tokens_that_end_both_prompts() -> None:
    """Suffix-first FIM: typed characters go before the middle token; the completion followed it."""
    suf, pre, mid = (tokenizer().convert_tokens_to_ids(t) for t in ("<|fim_suffix|>", "<|fim_prefix|>",
                                                                        "<|fim_middle|>"))

    def spm(prefix: str) -> list[int]:
        return [suf, *tokenizer()("\n\nprint(total)\n", add_special_tokens=False).input_ids, pre,
                *tokenizer()(prefix, add_special_tokens=False).input_ids, mid]

    prompt = spm("total = 0\nfor x in items:\n    ")
    completion = encode("total += x\n")
    proposer = SuggestionProposer.follow(prompt + completion, len(prompt), spm("total = 0\nfor x in items:\n    to"),
                                         decode, special())
    assert proposer is not None and proposer.typed.endswith("to")
    new = spm("total = 0\nfor x in items:\n    to")
    generated = encode("tal")
    found = proposer.propose(new + generated, 0, 8, GREEDY, None)
    assert decode(found.token_ids) == " += x\n"


@cache
def shipped_engine() -> Engine:
    cpu = torch.device("cpu")
    target = load_model(ASSETS / "target", device=cpu, dtype=torch.float32, num_slots=2, max_context=400)
    draft = load_model(ASSETS / "draft", device=cpu, dtype=torch.float32, num_slots=2, max_context=400)
    return Engine(target, draft, EngineConfig(max_sessions=2, max_context=380, max_draft_tokens=4, prefill_chunk=128))


def generate(engine: Engine, slot: int, prompt: list[int], n: int, k: int | None,
             suggestion: SuggestionProposer | None = None) -> tuple[list[list[int]], list[int]]:
    """(token ids of each step, draft tokens proposed at each step) on a fresh slot."""
    gen = engine.start(engine.new_slot(slot), GenerationRequest(prompt, n, GREEDY, k, suggestion=suggestion))
    steps, proposed = [], []
    while not gen.finished:
        result = engine.step_one(gen)
        if result.token_ids:
            steps.append(result.token_ids)
            proposed.append(result.proposed)
    return steps, proposed


@pytest.mark.parametrize("text", ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"])
def test_typing_along_the_last_completion_gets_it_back_in_two_verify_steps(text: str) -> None:
    """Keystrokes that type the last completion's first 1..3 tokens, or stop inside its first tokens: the output
    is always the target's own greedy output. Where the target still continues the completion (typed characters
    that retokenize the prompt's end can change what a model this small continues with), the first two verify
    steps commit at least 80 % of what is left of it."""
    engine = shipped_engine()
    prompt = encode(text)
    steps, _ = generate(engine, 0, prompt, 30, 0)
    completion = [t for s in steps for t in s]
    completion_text = decode(completion)
    boundaries = [len(decode(completion[:i])) for i in range(1, 4)]
    followed = 0
    for typed_chars in sorted({*boundaries, 1, boundaries[1] - 1} - {0}):
        new_prompt = encode(text + completion_text[:typed_chars])
        suggestion = SuggestionProposer.follow(prompt + completion, len(prompt), new_prompt, decode, special())
        assert suggestion is not None
        plain, _ = generate(engine, 1, new_prompt, 30, 0)
        fast, proposed = generate(engine, 1, new_prompt, 30, None, suggestion)
        plain_ids = [t for s in plain for t in s]
        assert [t for s in fast for t in s] == plain_ids
        left = completion_text[typed_chars:]
        if not decode(plain_ids).startswith(left):
            continue
        followed += 1
        left_tokens = next(i for i in range(len(plain_ids) + 1) if len(decode(plain_ids[:i])) >= len(left))
        within_two = sum(len(s) for s in fast[:3])  # the prefill's first token, then two verify steps
        assert within_two >= 0.8 * left_tokens, (typed_chars, within_two, left_tokens, proposed)
    assert followed >= 2


def lookup_by_search(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup by brute force: the longest suffix n-gram (max_ngram..1) with an earlier occurrence ending
    before the last token, its most recent occurrence, the k tokens after it."""
    n = len(tokens)
    for size in range(min(max_ngram, n - 1), 0, -1):
        starts = [i for i in range(n - size) if tokens[i : i + size] == tokens[n - size :]]
        if starts:
            return tokens[starts[-1] + size : starts[-1] + size + k]
    return []


def test_prompt_lookup_index_proposes_what_a_search_of_the_whole_context_finds() -> None:
    """Contexts that grow step by step (in place, as a request's does, or as a new list), restart with a new prompt,
    shrink (a reset slot) and alternate between slots: the incremental index always proposes what searching the
    whole context does."""
    rng = torch.Generator().manual_seed(0)
    lookup = PromptLookupProposer()
    greedy = SamplingParams(temperature=0.0)
    contexts: dict[int, list[int]] = {0: [], 1: []}
    for step in range(600):
        slot = int(torch.randint(0, 2, (1,), generator=rng))
        tokens = contexts[slot]
        event = int(torch.randint(0, 40, (1,), generator=rng))
        if event == 0:  # a new prompt sharing a prefix
            tokens = tokens[: int(torch.randint(0, len(tokens) + 1, (1,), generator=rng))]
        elif event == 1:  # a reset slot: a new, empty context
            tokens = []
        more = torch.randint(0, 6, (int(torch.randint(1, 4, (1,), generator=rng)),), generator=rng).tolist()
        if event % 2:
            tokens.extend(more)  # in place, as `Generation.commit` grows a request's context
        else:
            tokens = tokens + more
        contexts[slot] = tokens
        k = int(torch.randint(1, 6, (1,), generator=rng))
        proposal = lookup.propose(tokens, slot, k, greedy, None)
        assert proposal.token_ids == lookup_by_search(tokens, k), step
        assert proposal is EMPTY or proposal.source == "lookup"
