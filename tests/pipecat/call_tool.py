"""Pipecat's OpenAILLMService against a specrpc server: run in Pipecat's own environment (.venv-pipecat, see
requirements.txt: pipecat-ai pins protobuf < 7, which the gRPC toolchain here is past), it sends a context with a
tool and `tool_choice: required`, lets the service stream the reply, and prints one JSON line per function call its
registered handler received: {"name", "tool_call_id", "arguments"}. Usage: call_tool.py BASE_URL (…/v1)."""

from __future__ import annotations

import asyncio
import json
import sys

from pipecat.adapters.schemas.function_schema import FunctionSchema
from pipecat.adapters.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import FunctionCallResultProperties, LLMContextFrame
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.tests.utils import run_test


async def main(base_url: str) -> None:
    received: list[dict[str, object]] = []

    async def get_weather(params: FunctionCallParams) -> None:
        received.append({"name": params.function_name, "tool_call_id": params.tool_call_id,
                         "arguments": params.arguments})
        await params.result_callback({"temperature": 21}, properties=FunctionCallResultProperties(run_llm=False))

    llm = OpenAILLMService(api_key="unused", base_url=base_url,
                           settings=OpenAILLMService.Settings(model="served", temperature=1.0, seed=1,
                                                              max_completion_tokens=400,
                                                              extra={"parallel_tool_calls": False}))
    llm.register_function("get_weather", get_weather)
    weather = FunctionSchema(name="get_weather", description="Weather in a city",
                             properties={"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
                             required=["city", "unit"])
    context = LLMContext(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                         tools=ToolsSchema(standard_tools=[weather]), tool_choice="required")
    await run_test(llm, frames_to_send=[LLMContextFrame(context)])
    for call in received:
        print(json.dumps(call))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
