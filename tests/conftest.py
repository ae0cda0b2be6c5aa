"""Shared fixtures: a real server on a loopback port serving the shipped models on CPU."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
import pytest_asyncio
import torch
from service_helpers import base_url
from transformers import PreTrainedTokenizerBase

from specrpc.config import Config, Limits, ServerConfig, build_config
from specrpc.edges.server import Running, start_server
from specrpc.v1 import generator_pb2_grpc as pb_grpc

# The suite's bench, soak and fuzz runs are smoke runs whose figures nobody reads: they may run beside a training.
os.environ.setdefault("SPECRPC_BESIDE_TRAINING", "1")


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_config(**engine: object) -> Config:
    """Small slots and context so the suite stays fast on a 2-core CPU (SPECRPC_TARGET/SPECRPC_DRAFT override the
    shipped models, as for `specrpc serve`). No idle checks of the paths chosen at load (`--recheck-s 0`) unless
    asked: a server lives through the whole suite, whose load is the drift they look for, and a new choice would
    move a shape to another path (other rounding) between a test's reference run and its run."""
    base = build_config(None).engine
    engine = {"recheck_s": 0.0, **engine}
    return Config(
        engine=replace(base, max_sessions=4, max_context=512, threads=1, **engine),  # type: ignore[arg-type]
        server=ServerConfig(host="127.0.0.1", port=0, metrics_port=free_port(), http_port=free_port(),
                            log_format="console", session_ttl_s=60.0, grace_s=2.0),
        limits=Limits(max_new_tokens=256),
    )


def models_missing() -> str | None:
    """Why the configured models cannot be served yet (None when they can)."""
    engine = build_config(None).engine
    for role, path in (("target", engine.target), ("draft", engine.draft)):
        if role == "draft" and path.lower() == "none":
            continue
        if not (Path(path) / "config.json").exists():
            return f"{role} model {path} not there yet (still training? set SPECRPC_TARGET/SPECRPC_DRAFT)"
    return None


@pytest_asyncio.fixture(scope="session")
async def server() -> AsyncIterator[Running]:
    """One real server for the session's service tests."""
    missing = models_missing()
    if missing:
        pytest.skip(missing)
    running = await start_server(test_config())
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture(scope="session")
async def channel(server: Running) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.GeneratorStub:
    return pb_grpc.GeneratorStub(channel)


@pytest.fixture
def stream_interval(server: Running) -> Iterator[Callable[[float], None]]:
    """Set the server's stream interval (seconds; 0: each step's tokens in their own chunk) for one test."""
    scheduler = server.runtime.scheduler
    old = scheduler.stream_interval_s

    def use(seconds: float) -> None:
        scheduler.call(lambda: setattr(scheduler, "stream_interval_s", seconds)).result()

    yield use
    use(old)


@pytest.fixture
def tokenizer(server: Running) -> PreTrainedTokenizerBase:
    """The served target's tokenizer."""
    return server.runtime.tokenizer


@pytest.fixture
def long_streams(server: Running) -> Iterator[float]:
    """Make streams last: every engine step also sleeps (yields the step time) and the end-of-sequence token does
    not end generation, so a 256-token request is still running when a test cancels it or fills every slot,
    whatever the model would generate."""
    step_s = 0.01
    scheduler, runtime = server.runtime.scheduler, server.runtime
    old_hook, old_stops = scheduler.on_step, runtime.stop_token_ids
    scheduler.on_step = lambda job, result, seconds: time.sleep(step_s)
    runtime.stop_token_ids = frozenset()
    try:
        yield step_s
    finally:
        scheduler.on_step = old_hook
        runtime.stop_token_ids = old_stops


@pytest_asyncio.fixture
async def extra_server(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Awaitable[int]]]:
    """Start more grpc.aio servers on loopback, by default around the running server's Generator service (same
    models, same sessions), with optional interceptors, credentials, port or servicer: for client tests (request
    metadata, TLS, load balancing, a server that starts late). `await extra_server(...)` returns the port."""
    started: list[grpc.aio.Server] = []

    async def start(*, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                    credentials: grpc.ServerCredentials | None = None, port: int = 0,
                    servicer: pb_grpc.GeneratorServicer | None = None) -> int:
        if servicer is None:
            servicer = request.getfixturevalue("server").service
        srv = grpc.aio.server(interceptors=list(interceptors), options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GeneratorServicer_to_server(servicer, srv)
        address = f"127.0.0.1:{port}"
        bound = srv.add_secure_port(address, credentials) if credentials else srv.add_insecure_port(address)
        await srv.start()
        started.append(srv)
        return int(bound)

    yield start
    for srv in started:
        await srv.stop(0)


ALTERNATING_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.first and system %}"
    "{{- '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}{%- endif %}{%- endfor %}"
)
"""Mistral-7B-Instruct's chat template (an optional system prompt, then user and assistant alternating; anything else
raises), as the chat templates of Mistral and Gemma refuse histories."""


@pytest_asyncio.fixture(scope="session")
async def chat_server(server: Running, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """A second server on the shipped target (no draft) whose tokenizer brings ALTERNATING_TEMPLATE."""
    source = Path(server.runtime.config.engine.target)
    target = tmp_path_factory.mktemp("chat") / "target"
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).symlink_to(item)
    (target / "tokenizer_config.json").unlink()
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = ALTERNATING_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    base = test_config()
    config = replace(base, engine=replace(base.engine, target=str(target), draft="none", max_sessions=2),
                     server=replace(base.server, metrics_port=0))
    running = await start_server(config)
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture
async def client(server: Running) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official openai SDK on the in-process server's HTTP edge."""
    async with openai.AsyncOpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest_asyncio.fixture
async def http(server: Running) -> AsyncIterator[httpx2.AsyncClient]:
    """A plain HTTP client on the in-process server's HTTP edge."""
    async with httpx2.AsyncClient(base_url=base_url(server), timeout=60) as c:
        yield c


QWEN_TEMPLATE = Path(__file__).parent / "data" / "qwen2.5-instruct-chat-template.json"
"""Qwen2.5-Instruct's published chat template (with tools: Hermes `<tool_call>` tags)."""

MISTRAL_TEMPLATE = Path(__file__).parent / "data" / "mistral-7b-instruct-v0.3-chat-template.json"
"""Mistral-7B-Instruct-v0.3's published chat template (with tools: `[AVAILABLE_TOOLS]`, `[TOOL_CALLS] [...]` lists,
`[TOOL_RESULTS]`, call ids of nine letters and digits)."""

LLAMA3_TOOLS_TEMPLATE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.\\n\\n' }}{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}{%- for message in messages %}{%- if 'tool_calls' in message %}"
    "{%- if message.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at "
    "once!') }}{%- endif %}{%- set call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call.name + '\", \"parameters\": ' }}"
    "{{- call.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim "
    "+ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""A chat template in Llama 3.1's layout, rendering tools, calls (`{"name": …, "parameters": …}`, one per message) and
results (the `ipython` role) as its published template does; written here, since Meta's template is under the Llama
3.1 Community License."""


def write_tool_checkpoint(path: Path, shipped_tokenizer: Path, template: str, special: list[str], plain: list[str],
                          eos: str, bos: str | None = None) -> Path:
    """A small random-weight Llama-family checkpoint whose tokenizer is the shipped pair's with a family's chat and
    call tokens added (`special` as special tokens, `plain` as plain text tokens) and whose tokenizer_config brings
    `template`. Random weights write noise, which is what a grammar must turn into valid calls."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from specrpc.models.random_weights import write_checkpoint

    tok = Tokenizer.from_file(str(shipped_tokenizer / "tokenizer.json"))
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "initializer_range": 0.02, "hidden_act": "silu",
           "eos_token_id": tok.token_to_id(eos), "bos_token_id": tok.token_to_id(bos) if bos else None}
    write_checkpoint(cfg, path, seed=32, dtype=torch.float32)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,  # type: ignore[no-untyped-call]
                            pad_token="<|endoftext|>").save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["chat_template"] = template
    config_file.write_text(json.dumps(tokenizer_config, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(eos), tok.token_to_id("<|endoftext|>")]}))
    return path


def write_qwen_tool_checkpoint(path: Path, shipped_tokenizer: Path) -> Path:
    """write_tool_checkpoint with Qwen's chat tokens (`<|im_start|>`, `<|im_end|>` special; `<tool_call>`,
    `</tool_call>` plain text tokens, as in Qwen2.5) and Qwen2.5's chat template."""
    return write_tool_checkpoint(path, shipped_tokenizer, json.loads(QWEN_TEMPLATE.read_text())["chat_template"],
                                 ["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], "<|im_end|>")


def write_llama3_tool_checkpoint(path: Path, shipped_tokenizer: Path) -> Path:
    """write_tool_checkpoint with Llama 3's header, end and `<|python_tag|>` special tokens and a template in Llama
    3.1's layout (LLAMA3_TOOLS_TEMPLATE)."""
    return write_tool_checkpoint(path, shipped_tokenizer, LLAMA3_TOOLS_TEMPLATE,
                                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                  "<|python_tag|>"], [], "<|eot_id|>", "<|begin_of_text|>")


def write_mistral_tool_checkpoint(path: Path, shipped_tokenizer: Path) -> Path:
    """write_tool_checkpoint with Mistral v3's control tokens (`[INST]`, `[TOOL_CALLS]`, …, all special) and
    Mistral-7B-Instruct-v0.3's chat template."""
    return write_tool_checkpoint(path, shipped_tokenizer, json.loads(MISTRAL_TEMPLATE.read_text())["chat_template"],
                                 ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "</s>", "<s>")


async def start_tool_server(path: Path) -> Running:
    """A server on the checkpoint at `path`, the same checkpoint as its draft, so speculation accepts several tokens
    a step and a call streams in pieces."""
    base = test_config()
    config = replace(base, engine=replace(base.engine, target=str(path), draft=str(path), max_sessions=2,
                                          max_context=1024),
                     server=replace(base.server, metrics_port=0), limits=replace(base.limits, max_new_tokens=512))
    return await start_server(config)


@pytest_asyncio.fixture(scope="session")
async def tool_server(server: Running, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """A server on a random-weight Qwen2 checkpoint with Qwen2.5's chat template (write_qwen_tool_checkpoint)."""
    running = await start_tool_server(write_qwen_tool_checkpoint(tmp_path_factory.mktemp("qwen-tools") / "model",
                                                                 Path(server.runtime.config.engine.target)))
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture(scope="session")
async def llama3_tool_server(server: Running, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """A server on a random-weight checkpoint with Llama 3's tokens and a template in Llama 3.1's layout."""
    running = await start_tool_server(write_llama3_tool_checkpoint(
        tmp_path_factory.mktemp("llama3-tools") / "model", Path(server.runtime.config.engine.target)))
    yield running
    await running.stop(0.5)


@pytest_asyncio.fixture(scope="session")
async def mistral_tool_server(server: Running, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """A server on a random-weight checkpoint with Mistral v3's control tokens and Mistral-7B-Instruct-v0.3's
    template."""
    running = await start_tool_server(write_mistral_tool_checkpoint(
        tmp_path_factory.mktemp("mistral-tools") / "model", Path(server.runtime.config.engine.target)))
    yield running
    await running.stop(0.5)
