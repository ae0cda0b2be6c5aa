"""The sampling controls against the live test server: the openai SDK's presence/frequency penalties, logit_bias,
min_p, stop token ids and `n` choices (prefilled once, each equal to a separate request with its seed), llama.vim's
/infill body with llama.cpp's penalty fields equal to gRPC Infill with the same SamplingParams, and bad values
refused naming the field on both edges."""

from __future__ import annotations

from typing import Any

import grpc
import httpx2
import openai
import pytest
from service_helpers import collect
from test_http_api import LLAMA_VIM_FIELDS, assert_openai_error, llama_vim_request

from specrpc.edges.server import Running
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

Stub = pb_grpc.GeneratorStub
PROMPT = "def fibonacci(n):\n"


async def test_logit_bias_forces_and_bans_tokens(client: openai.AsyncOpenAI, server: Running) -> None:
    rt = server.runtime
    forced = rt.encode_plain(" banana")[0]
    reply = await client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0,
                                            logit_bias={str(forced): 100})
    assert reply.choices[0].text == rt.decode_text([forced] * 6)
    plain = await client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0)
    first = rt.encode_plain(plain.choices[0].text)[0]
    banned = await client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0,
                                             logit_bias={str(first): -100})
    assert first not in rt.encode_plain(banned.choices[0].text)[:1]


async def test_sdk_penalties_equal_grpc_with_the_same_sampling_params(client: openai.AsyncOpenAI,
                                                                      stub: Stub) -> None:
    """A repetition-prone prompt: the penalties change the greedy reply, and the HTTP reply equals gRPC Generate's
    with the same SamplingParams (one transform below both edges)."""
    prompt = "one two one two one two one two"
    plain = await client.completions.create(model="any", prompt=prompt, max_tokens=24, temperature=0)
    penalized = await client.completions.create(model="any", prompt=prompt, max_tokens=24, temperature=0,
                                                presence_penalty=1.5, frequency_penalty=1.0)
    assert penalized.choices[0].text != plain.choices[0].text
    sampling = pb.SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=1.0)
    chunks, _ = await collect(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=24, sampling=sampling)))
    assert "".join(c.text for c in chunks) == penalized.choices[0].text


async def test_min_p_of_one_is_greedy_and_stop_token_ids_end_the_reply(client: openai.AsyncOpenAI,
                                                                       server: Running) -> None:
    greedy = await client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
    only_best = await client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                                extra_body={"min_p": 1.0})
    assert only_best.choices[0].text == greedy.choices[0].text
    ids = server.runtime.encode_plain(greedy.choices[0].text)
    stop_at = ids[3]
    stopped = await client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0,
                                              stop=[stop_at])  # type: ignore[arg-type]  # token ids, as vLLM
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == server.runtime.decode_text(ids[: ids.index(stop_at) + 1])


async def test_n_choices_share_one_prefill_and_equal_separate_seeded_requests(client: openai.AsyncOpenAI) -> None:
    """n = 4: four choices; the prompt is prefilled once (each choice found it in the KV cache, all but the last
    token it recomputes); choice i equals a separate request with seed + i; streamed, each index carries the same
    text."""
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    fields: dict[str, Any] = {"model": "any", "messages": messages, "max_tokens": 16, "temperature": 0.9,
                              "seed": 41, "presence_penalty": 0.5}
    reply = await client.chat.completions.create(n=4, **fields)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    usage = reply.usage
    assert usage is not None and usage.model_extra is not None
    cached = usage.model_extra["choice_cached_tokens"]
    assert cached == [usage.prompt_tokens - 1] * 4, "every choice copied the prompt's KV prefix"
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, "the choices sample independently"
    separate = [await client.chat.completions.create(**{**fields, "seed": 41 + i}) for i in range(4)]
    assert texts == [s.choices[0].message.content for s in separate]
    assert usage.completion_tokens == sum(s.usage.completion_tokens for s in separate if s.usage)
    stream = await client.chat.completions.create(n=4, stream=True, stream_options={"include_usage": True},
                                                  **fields)
    streamed = ["", "", "", ""]
    finished = [0, 0, 0, 0]
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finished[choice.index] += choice.finish_reason is not None
    assert streamed == texts and finished == [1, 1, 1, 1]


async def test_llama_vim_infill_with_llama_cpp_penalties_equals_grpc_infill(http: httpx2.AsyncClient, stub: Stub,
                                                                            server: Running) -> None:
    if server.runtime.fim is None:
        pytest.skip("the served model has no FIM tokens")
    prefix, middle, suffix = "def total(xs):\n    s = 0\n", "    for x in ", "\n    return s\n"
    controls = {"repeat_penalty": 1.3, "repeat_last_n": 32, "presence_penalty": 0.4, "frequency_penalty": 0.2,
                "min_p": 0.05, "min_keep": 2, "ignore_eos": True, "temperature": 0}
    body = {**llama_vim_request([], prefix, middle, suffix), **controls, "n_indent": 0, "t_max_predict_ms": 0,
            "n_predict": 12, "response_fields": [*LLAMA_VIM_FIELDS, "generation_settings"]}
    response = await http.post("/infill", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    settings = reply["generation_settings"]
    assert {k: settings[k] for k in controls if k != "temperature"} == {k: v for k, v in controls.items()
                                                                         if k != "temperature"}
    assert reply["timings/predicted_n"] == 12, "ignore_eos: the reply runs to n_predict"
    sampling = pb.SamplingParams(temperature=0, top_k=40, top_p=0.99, repetition_penalty=1.3, penalty_last_n=32,
                                 presence_penalty=0.4, frequency_penalty=0.2, min_p=0.05, min_keep=2, ignore_eos=True)
    chunks, _ = await collect(stub.Infill(pb.InfillRequest(prefix=prefix, suffix=suffix, typed_line=middle,
                                                           max_new_tokens=12, sampling=sampling, truncate=True)))
    assert "".join(c.text for c in chunks) == reply["content"]


@pytest.mark.parametrize(("path", "fields", "named"), [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 10_000}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ("/v1/completions", {"stop": [-1]}, "stop"),
    ("/v1/completions", {"stop": [1, "x"]}, "stop"),
    ("/v1/chat/completions", {"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
    ("/completion", {"repeat_penalty": 0}, "repeat_penalty"),
    ("/completion", {"repeat_last_n": -2}, "repeat_last_n"),
    ("/completion", {"min_keep": -1}, "min_keep"),
])
async def test_bad_controls_are_refused_naming_the_field(http: httpx2.AsyncClient, path: str, fields: dict[str, Any],
                                                         named: str) -> None:
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                            else {"prompt": "hi"})
    response = await http.post(path, json={**base, "max_tokens": 10, **fields})
    assert_openai_error(response, 400, named)


@pytest.mark.parametrize(("sampling", "named"), [
    (pb.SamplingParams(presence_penalty=2.5), "sampling.presence_penalty"),
    (pb.SamplingParams(repetition_penalty=-1), "sampling.repetition_penalty"),
    (pb.SamplingParams(logit_bias={10**9: 1.0}), "sampling.logit_bias"),
    (pb.SamplingParams(logit_bias={5: 1000.0}), "sampling.logit_bias"),
    (pb.SamplingParams(min_p=2), "sampling.min_p"),
    (pb.SamplingParams(min_tokens=100), "sampling.min_tokens"),
    (pb.SamplingParams(penalty_last_n=-5), "sampling.penalty_last_n"),
])
async def test_grpc_refuses_bad_controls_naming_the_field(stub: Stub, sampling: pb.SamplingParams,
                                                          named: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=10, sampling=sampling)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (caught.value.details() or "")
