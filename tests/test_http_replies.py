"""Reply shapes of the HTTP edge, without a server."""

from __future__ import annotations

from specrpc.edges.http.replies import LlamaReply, OpenAIReply, flatten
from specrpc.engine.generation import FINISH_LENGTH, FINISH_STOP, GenerationStats, Logprob, TokenLogprob
from specrpc.prompts.tool_formats import HERMES
from specrpc.prompts.tools import ToolCallParser
from specrpc.serving.scheduler import Chunk, Done


def done(finish: str = FINISH_LENGTH, prompt: int = 10, cached: int = 4, completion: int = 3) -> Done:
    stats = GenerationStats(prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=completion,
                            tokens_cached=prompt + completion)
    return Done(finish, stats, "", "abc", at=2.0, arrival=1.0, first_token_at=1.5, started_at=1.1)


def test_response_fields_flatten_like_llama_cpp() -> None:
    obj = {"content": "x", "timings": {"prompt_n": 3}, "truncated": False}
    assert flatten(obj, ["content", "timings/prompt_n", "timings/nope", "", "truncated"]) == {
        "content": "x", "timings/prompt_n": 3, "truncated": False}


def test_openai_chat_stream_opens_with_the_role_and_ends_with_usage() -> None:
    reply = OpenAIReply(chat=True, model="m", include_usage=True)
    [opening] = reply.start()
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    [piece] = reply.chunk("ab", Chunk("ab", [1, 2], 0, 1.6))
    assert piece["object"] == "chat.completion.chunk" and piece["choices"][0]["delta"] == {"content": "ab"}
    last, usage = reply.end(done(), "ab", stream=True)
    assert last["choices"][0]["finish_reason"] == "length" and usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                              "prompt_tokens_details": {"cached_tokens": 4},
                              "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                                            "rejected_prediction_tokens": 0}}
    [whole] = reply.end(done(), "ab", stream=False)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "ab"


def test_llama_reply_reports_timings_and_a_warmup_reports_nothing_generated() -> None:
    reply = LlamaReply(model="m", fields=[], prefill_only=False, settings={}, prompt_ids=10)
    [final] = reply.end(done(), "abc", stream=False)
    assert final["content"] == "abc" and final["stop"] is True and final["stop_type"] == "limit"
    timings = final["timings"]
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (4, 6, 3)
    assert final["tokens_cached"] == 13 and abs(timings["prompt_ms"] - 400.0) < 1e-6
    warm = LlamaReply(model="m", fields=["content", "timings/predicted_n"], prefill_only=True, settings={},
                      prompt_ids=10)
    assert warm.end(done(completion=0), "", stream=False) == [{"content": "", "timings/predicted_n": 0}]


def test_log_probabilities_in_each_shape() -> None:
    lps = (TokenLogprob(5, -0.1, (Logprob(5, -0.1), Logprob(6, -2.5))), TokenLogprob(7, -0.3))
    text = {5: "de", 6: "do", 7: "f"}.__getitem__
    chunk = Chunk("def", [5, 7], 0, 1.6, lps)
    chat = OpenAIReply(chat=True, model="m", include_usage=False, text=text)
    [event] = chat.chunk("def", chunk)
    content = event["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["de", "f"] and content[0]["top_logprobs"][1] == {
        "token": "do", "logprob": -2.5, "bytes": [100, 111]}
    plain = OpenAIReply(chat=False, model="m", include_usage=False, text=text)
    plain.chunk("x", Chunk("x", [6], 0, 1.5, (TokenLogprob(6, -1.0),)))
    [event] = plain.chunk("def", chunk)
    assert event["choices"][0]["logprobs"] == {"tokens": ["de", "f"], "token_logprobs": [-0.1, -0.3],
                                               "top_logprobs": [{"de": -0.1, "do": -2.5}, {}], "text_offset": [1, 3]}
    llama = LlamaReply(model="m", fields=["completion_probabilities"], prefill_only=False, settings={}, prompt_ids=3,
                       text=text)
    [partial] = llama.chunk("def", chunk)
    assert [p["id"] for p in partial["completion_probabilities"]] == [5, 7]
    [final] = llama.end(done(), "def", stream=False)
    assert final["completion_probabilities"][0]["top_logprobs"][1]["token"] == "do"


CALLED = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_calls_end_with_tool_calls_unless_a_stop_string_cut_the_last_one() -> None:
    """A reply whose calls are complete ends with `tool_calls`; one a stop string cut inside its last call ends with
    `stop`, so no client runs that call's incomplete arguments as if the reply were done with it."""
    for text, finish, arguments in ((CALLED, "tool_calls", ["{}"]),
                                    (CALLED + '\n<tool_call>\n{"name": "g", "arguments": {"a', "stop", ["{}", '{"a'])):
        for stream in (False, True):
            reply = OpenAIReply(chat=True, model="m", include_usage=False, tools=ToolCallParser(HERMES))
            reply.chunk(text, Chunk(text, [1], 0, 1.6))
            last = reply.end(done(FINISH_STOP), text, stream)[-1]["choices"][0]
            assert last["finish_reason"] == finish
            if not stream:
                assert [c["function"]["arguments"] for c in last["message"]["tool_calls"]] == arguments
