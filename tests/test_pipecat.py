"""Pipecat's OpenAILLMService (the voice framework's default LLM service) receives a function call from the server:
tests/pipecat/call_tool.py runs in Pipecat's own environment (.venv-pipecat, built by `make install` from
tests/pipecat/requirements.txt) against the live `tool_server` (a random-weight Qwen2 checkpoint with Qwen2.5's chat
template), with `tools` and `tool_choice: required` at temperature 1."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import jsonschema
from service_helpers import base_url

from specrpc.edges.server import Running

ROOT = Path(__file__).resolve().parent.parent
PIPECAT_PYTHON = ROOT / ".venv-pipecat" / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}


async def test_pipecat_openai_service_receives_a_function_call(tool_server: Running) -> None:
    assert PIPECAT_PYTHON.exists(), "Pipecat's environment is missing: run `make install` (it builds .venv-pipecat)"
    process = await asyncio.create_subprocess_exec(
        str(PIPECAT_PYTHON), str(ROOT / "tests" / "pipecat" / "call_tool.py"), base_url(tool_server) + "/v1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=240)
    assert process.returncode == 0, err.decode()[-3000:]
    calls = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert calls, f"Pipecat's handler received no call; its log:\n{err.decode()[-3000:]}"
    for call in calls:
        assert call["name"] == "get_weather" and call["tool_call_id"].startswith("call_")
        jsonschema.validate(call["arguments"], WEATHER)
