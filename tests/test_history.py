"""specrpc/edges/history.py: histories trimmed by whole messages, the system prompt kept, the cut stable across a
growing history, and the limits on messages and bytes."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import pytest

from specrpc.config import Limits
from specrpc.edges.history import Message, bounded, check_role, fit, newest_results
from specrpc.edges.validation import InvalidRequest
from specrpc.prompts.tools import ToolCall


def render(messages: Sequence[Message]) -> list[int]:
    """A stand-in template: two tokens of markup per message, then one token per byte of its text."""
    return [t for m in messages for t in [len(m.role), 0, *m.text.encode()]]


def history(turns: int, text: str = "x" * 20) -> list[Message]:
    out: list[Message] = [Message("system", "Be brief.")]
    for i in range(turns):
        out += [Message("user", f"{i}{text}"), Message("assistant", f"reply {i}")]
    return out


def test_roles_are_system_user_assistant_and_tool() -> None:
    for role in ("system", "user", "assistant", "tool"):
        assert check_role(role, "turn.role") == role
    with pytest.raises(InvalidRequest, match=r"turn.role 'bogus-role' .* system, user, assistant, tool"):
        check_role("bogus-role", "turn.role")


def test_a_history_that_fits_is_kept_whole() -> None:
    messages = [*history(3), Message("user", "next")]
    assert fit(messages, render, 10_000) == (messages, render(messages))


def test_trimming_drops_whole_messages_oldest_first_keeping_the_system_prompt_and_the_newest() -> None:
    messages = [*history(40), Message("tool", "sunny"), Message("user", "next?")]
    kept, ids = fit(messages, render, 300)
    assert len(ids) <= 300 and ids == render(kept)
    assert kept[0] == Message("system", "Be brief.") and kept[1][0] == "user" and kept[-1] == Message("user", "next?")
    assert kept[1:] == messages[-(len(kept) - 1):]  # a suffix of the history: whole messages, none cut


def test_the_cut_stays_put_for_several_turns_so_the_cached_prefix_survives() -> None:
    firsts = []
    for turns in range(10, 60):
        kept, _ = fit([*history(turns), Message("user", "now")], render, 400)
        firsts.append(kept[1])
    changes = sum(a != b for a, b in pairwise(firsts))
    assert 0 < changes <= len(firsts) // 2


def test_a_long_history_is_rendered_a_few_times_not_once_per_step() -> None:
    calls = []

    def counting(messages: Sequence[Message]) -> list[int]:
        calls.append(len(messages))
        return render(messages)

    _, ids = fit([*history(200), Message("user", "now")], counting, 300)
    assert len(ids) <= 300 and len(calls) <= 4, calls


def test_when_the_newest_message_alone_is_too_long_its_prompt_keeps_the_last_tokens() -> None:
    messages = [*history(2), Message("user", "y" * 500)]
    kept, ids = fit(messages, render, 100)
    assert kept == [messages[0], messages[-1]] and ids == render(kept)[-100:]


def test_a_prompt_declaring_tools_is_refused_rather_than_cut() -> None:
    """Cutting the front of a prompt that declares tools would drop declarations (a 20,000-value enum renders to
    131,000 tokens): refused, naming `tools`, where a plain prompt keeps its last tokens."""
    messages = [*history(2), Message("user", "y" * 500)]
    with pytest.raises(InvalidRequest, match=r"^tools: .* take \d+ prompt tokens, over the 100"):
        fit(messages, render, 100, tools=True)
    assert fit(messages, render, 10_000, tools=True) == (messages, render(messages))


def half(messages: Sequence[Message]) -> int:
    """A true floor of the stand-in template's prompt: half its tokens."""
    return len(render(messages)) // 2


def test_a_prompt_declaring_tools_whose_floor_is_over_the_cap_is_refused_without_rendering_it() -> None:
    """Where nothing more can be dropped and even the floor is over the cap, the refusal needs no tokens: the
    shortest prompt is never rendered (the full history was, to decide how much to drop, as before)."""
    rendered = []

    def counting(messages: Sequence[Message]) -> list[int]:
        rendered.append(len(messages))
        return render(messages)

    messages = [*history(2), Message("user", "y" * 500)]
    with pytest.raises(InvalidRequest, match=r"^tools: .* take at least 2\d\d prompt tokens, over the 100"):
        fit(messages, counting, 100, tools=True, floor=half)
    assert rendered == [len(messages)]


def test_the_floor_changes_nothing_for_prompts_it_does_not_refuse() -> None:
    """A floor under the cap, a floor over it while older messages can still go, and a prompt without tools: the
    same messages and ids as without a floor."""
    messages = [*history(2), Message("user", "y" * 500)]
    assert fit(messages, render, 10_000, tools=True, floor=half) == (messages, render(messages))
    assert fit(messages, render, 100, floor=half) == fit(messages, render, 100)
    long = [*history(40), Message("user", "now")]
    assert half(long) > 300
    assert fit(long, render, 300, tools=True, floor=half) == fit(long, render, 300, tools=True)


def test_limits_on_messages_and_bytes() -> None:
    messages = [*history(100), Message("user", "now")]
    kept = bounded(messages, Limits(max_history_messages=50), "turn.text")
    assert len(kept) <= 50 and kept[0][0] == "system" and kept[1][0] == "user" and kept[-1] == messages[-1]
    kept = bounded(messages, Limits(max_history_bytes=1024), "turn.text")
    assert sum(m.size for m in kept) <= 1024 and kept[-1] == messages[-1]
    with pytest.raises(InvalidRequest, match=r"turn.text .* --max-history-bytes"):
        bounded([*messages, Message("user", "z" * 2000)], Limits(max_history_bytes=1024), "turn.text")


def test_a_turns_several_results_are_kept_together_or_refused_naming_their_field() -> None:
    """A Converse turn adding several tool results (`keep` newest messages): trimming never drops one of them, even
    where a single newest message would resume the history at a later one; over the limits with the system prompt
    alone, INVALID_ARGUMENT names the turn's field."""
    results = [Message("tool", f"result {i}", tool_call_id=f"call_{i}") for i in range(12)]
    messages = [*history(40), Message("assistant", "", ()), *results]
    kept = bounded(messages, Limits(max_history_messages=20), "turn.tool_results", keep=len(results))
    assert kept[0].role == "system" and kept[-len(results):] == results and len(kept) <= 20
    kept, ids = fit(messages, render, 200, keep=len(results))
    assert kept[-len(results):] == results and ids == render(kept)[-200:]
    with pytest.raises(InvalidRequest, match=r"^turn.tool_results and the system prompt are 13 messages, over the 12"):
        bounded(messages, Limits(max_history_messages=12), "turn.tool_results", keep=len(results))
    with pytest.raises(InvalidRequest, match=r"^turn.tool_results and the system prompt have \d+ bytes, over the 1024"):
        bounded([*messages[:-1], Message("tool", "z" * 2000)], Limits(max_history_bytes=1024), "turn.tool_results",
                keep=len(results))


def test_a_chat_historys_newest_results_stay_together() -> None:
    """A history ending in a reply's tool results (an HTTP chat resending them all): trimming keeps every one of
    them, as a Converse turn's `tool_results`, where the newest message alone would let the earlier ones go; the
    assistant message that made the calls may go, as any older message (a refusal would end the conversation)."""
    calls = tuple(ToolCall(f"call_{i}", "f", "{}") for i in range(3))
    results = [Message("tool", f"result {i}", tool_call_id=f"call_{i}") for i in range(3)]
    messages = [Message("system", "s"), Message("user", "u" * 600), Message("assistant", "", calls), *results]
    assert newest_results(messages) == 3 and newest_results(messages[:-3]) == 1
    kept = bounded(messages, Limits(max_history_bytes=300), "messages[3:]", keep=newest_results(messages))
    assert kept == [messages[0], *results]
    assert bounded(messages, Limits(max_history_bytes=300), "messages[5].content") == [messages[0], results[-1]]
