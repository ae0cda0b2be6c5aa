"""Structured output at both edges against the live test server (shipped pair, speculation on): gRPC `constraint` on
Generate, Infill and Converse; OpenAI `response_format` (the official SDK) on chat and completions; llama.cpp's
`json_schema` and `grammar` on /completion. Replies validate; bad schemas and grammars are INVALID_ARGUMENT / 400
naming the problem, never INTERNAL / 500."""

from __future__ import annotations

import json
import re

import grpc
import httpx2
import jsonschema
import openai
import pytest
from service_helpers import Conversation, collect, text_of

from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
SAMPLED = pb.SamplingParams(temperature=1.0, seed=7)


# ---- gRPC ------------------------------------------------------------------------------------------------------------


async def test_generate_with_a_json_schema_validates_and_ends_with_stop(stub: pb_grpc.GeneratorStub) -> None:
    for seed in range(3):
        chunks, summary = await collect(stub.Generate(pb.GenerateRequest(
            prompt="A city record: ", max_new_tokens=120, sampling=pb.SamplingParams(temperature=1.0, seed=seed),
            speculation=pb.SpeculationParams(num_draft_tokens=4),
            constraint=pb.Constraint(json_schema=json.dumps(SCHEMA)))))
        jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
        assert summary.finish_reason == pb.FINISH_REASON_STOP


async def test_infill_and_converse_follow_their_constraints(stub: pb_grpc.GeneratorStub) -> None:
    chunks, _ = await collect(stub.Infill(pb.InfillRequest(
        prefix="x = ", suffix="\n", max_new_tokens=30, sampling=SAMPLED,
        constraint=pb.Constraint(regex=r"[0-9]{1,6}"))))
    assert re.fullmatch(r"[0-9]{1,6}", text_of(chunks))
    conversation = Conversation(stub)
    await conversation.start(max_new_tokens=200)
    chunks, _, _ = await conversation.turn("Give me JSON.", sampling=SAMPLED,
                                           constraint=pb.Constraint(json_object=True))
    assert isinstance(json.loads(text_of(chunks)), dict)
    chunks, _, _ = await conversation.turn("Yes or no?", constraint=pb.Constraint(grammar='root ::= "yes" | "no"'))
    assert text_of(chunks) in ("yes", "no")
    await conversation.close()


@pytest.mark.parametrize(("constraint", "words"), [
    (pb.Constraint(json_schema="{"), "not JSON"),
    (pb.Constraint(json_schema=json.dumps({"type": "strange"})), "invalid json_schema"),
    (pb.Constraint(regex="(unclosed"), "invalid regex"),
    (pb.Constraint(regex=""), "constraint.regex is empty"),
    (pb.Constraint(grammar="root ::= ("), "invalid grammar"),
])
async def test_bad_constraints_are_invalid_argument(stub: pb_grpc.GeneratorStub, constraint: pb.Constraint,
                                                    words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=4, constraint=constraint)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (caught.value.details() or "")


WIDE = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}})
"""A schema that compiles but goes past the grammar engine's row limit once its object opens (600 properties at one
level: llguidance's row of 2,000 items): found by the deep fuzz as INTERNAL / 500."""


async def test_a_schema_past_the_parsers_limits_mid_reply_is_invalid_argument(stub: pb_grpc.GeneratorStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=8,
                                                       constraint=pb.Constraint(json_schema=WIDE))))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "limits" in (caught.value.details() or "")
    chunks, _ = await collect(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=3)))
    assert chunks  # the server goes on serving


# ---- HTTP ------------------------------------------------------------------------------------------------------------


async def test_sdk_chat_with_a_json_schema_response_format(client: openai.AsyncOpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "A city?"}],
                                                 max_tokens=120, seed=1, response_format=fmt)  # type: ignore[arg-type]
    content = reply.choices[0].message.content
    assert content is not None and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON?"}],
                                                  max_tokens=200, seed=2, stream=True,
                                                  response_format={"type": "json_object"})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert isinstance(json.loads(text), dict)


async def test_sdk_completion_with_json_object(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model="m", prompt="data = ", max_tokens=200, seed=3,
                                            extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(reply.choices[0].text), dict)


async def test_llama_completion_json_schema_and_gbnf_grammar(http: httpx2.AsyncClient) -> None:
    reply = await http.post("/completion", json={"prompt": "city: ", "n_predict": 120, "json_schema": SCHEMA})
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["content"]), SCHEMA)
    reply = await http.post("/completion", json={"prompt": "answer: ", "n_predict": 10,
                                                  "grammar": 'root ::= ("yes" | "no") "."'})
    assert reply.json()["content"] in ("yes.", "no.")


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "invalid json_schema"),
    ("/completion", {"grammar": "root ::= ("}, "invalid grammar"),
    ("/completion", {"json_schema": [1]}, "json_schema must be a JSON Schema object"),
    ("/completion", {"json_schema": json.loads(WIDE), "temperature": 0}, "limits"),  # greedy: sampled, `{}` may end it
])
async def test_bad_response_formats_and_grammars_are_400(http: httpx2.AsyncClient, path: str, body: dict[str, object],
                                                         words: str) -> None:
    payload = {"messages": [{"role": "user", "content": "x"}]} if path.startswith("/v1") else {"prompt": "x"}
    reply = await http.post(path, json={**payload, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["error"]["message"]
