"""Configuration: frozen dataclasses built once from defaults < config file (TOML) < environment < CLI flags."""

from __future__ import annotations

import argparse
import ipaddress
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specrpc.prompts.fim import template_names
from specrpc.prompts.tool_formats import FORMAT_NAMES

ASSETS = Path(__file__).resolve().parent / "assets"
ENV_PREFIX = "SPECRPC_"
MAX_STREAM_INTERVAL_MS = 1000
"""The longest stream interval, the server's or a request's: a second without tokens reads as a stall."""


@dataclass(frozen=True)
class EngineConfig:
    """What is loaded where, and how speculation is run."""

    target: str = str(ASSETS / "target")
    draft: str = str(ASSETS / "draft")
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "dtype"
    max_sessions: int = 8
    max_context: int = 2048
    max_draft_tokens: int = 8
    speculation: str = "adaptive"
    proposer: str = "combined"
    prefill_chunk: int = 512
    draft_window: int = 256
    batching: str = "on"  # off: round-robin, one stream's step at a time (docs/benchmarks.md, issue 18)
    lean: bool = True
    threads: int = 0
    draft_int8: bool = True
    native_decode: bool = True
    recheck_s: float = 60.0
    remember_execution: bool = True
    deterministic: bool = False
    cuda_graphs: bool = True
    fim_template: str = ""
    tool_format: str = "auto"


@dataclass(frozen=True)
class Limits:
    """Request limits; over one, the request fails with a message naming the limit and its value."""

    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 0
    max_new_tokens: int = 1024
    default_max_new_tokens: int = 128
    max_stop_strings: int = 16
    max_stop_chars: int = 128
    max_extra_files: int = 32
    max_streams_per_client: int = 16
    max_temperature: float = 100.0
    max_choices: int = 8
    max_history_messages: int = 256
    max_history_bytes: int = 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """Network, operations and sessions."""

    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 0
    http_user_session: bool = True
    event_loop: str = "asyncio"
    metrics_port: int = 0
    log_format: str = "json"
    log_level: str = "info"
    log_prompts: bool = False
    session_ttl_s: float = 600.0
    grace_s: float = 10.0
    stream_interval_ms: float = 16.0
    reflection: bool = True
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens_file: str = ""
    auth_exempt_health: bool = True
    trusted_proxies: str = ""
    shared_suffix_drafts: bool = False


@dataclass(frozen=True)
class Config:
    """The whole configuration."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: Limits = field(default_factory=Limits)


HELP: dict[str, str] = {
    "target": "target model: a Hugging Face model directory (default: the shipped pair's target)",
    "draft": "draft model directory sharing the target's tokenizer; 'none' runs without a draft",
    "device": "auto (cuda when available), cpu, cuda or cuda:N",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16",
    "weights": "dtype (weights stored at --dtype), int8 (int8 weights for target and draft, like llama.cpp's "
               "q8_0: every matrix product of both models reads int8 weights, no float copy is kept; on CPUs with "
               "AVX-512 VNNI, or AVX2 without AVX-512, the decode step's products also quantize their activations to "
               "int8 per 32 columns, as q8_0's do) or bf16 "
               "(weight-only bf16, activations at --dtype); CPU only; greedy speculation still equals greedy "
               "target-only decoding at that precision",
    "max_sessions": "KV-cache slots preallocated per model: the most sessions/streams resident at once",
    "max_context": "positions per slot (prompt + generated tokens)",
    "max_draft_tokens": "largest k, draft tokens per verify step",
    "speculation": "adaptive (choose k from measured acceptance and costs), fixed (always max_draft_tokens), off",
    "proposer": "default proposer: combined (prompt lookup when it matches, else the draft model), draft or lookup",
    "prefill_chunk": "prompt tokens per prefill forward (long prompts are prefilled in chunks; while other streams "
                     "decode, fewer: their step stays within 4x its plain cost)",
    "draft_window": "the draft model catches up on at most the last this many tokens of a context (a new prompt, "
                    "steps it sat out): what it sees changes only the speed, since the target verifies every token; "
                    "0: all of it",
    "batching": "on: each device step runs every runnable stream together (one batched draft and target forward, "
                "prefill chunks mixed in); off: one stream's step at a time, round-robin",
    "lean": "use specrpc's lean Llama-family forward when the architecture allows (else transformers)",
    "threads": "CPU threads for torch (0: torch's default)",
    "draft_int8": "on CPU, run the draft's decode steps on int8 weight copies (drafting is bound by reading weights; "
                  "the output stays the target's, since every token is verified)",
    "native_decode": "on CPU at float32, run one-token steps of the lean forward as one native OpenMP step "
                     "(specrpc/native/decode.cpp, built with the machine's C++ compiler on first use and cached; "
                     "without a compiler the torch forward runs them)",
    "recheck_s": "at most this often, once the device has been idle for a second, time a one-token forward through "
                 "the paths the native step chose at load; where it runs over 1.25x slower or faster than right after "
                 "the choice on two checks in a row (a neighbour's load came or went), measure every choice again as "
                 "at load, in the gaps between requests; 0: never",
    "remember_execution": "keep what the native step chose at load on this machine (under its build cache), and the "
                          "step costs calibrated over it, and take them at the next start of the same models, "
                          "settings, CPU and sources once a one-token forward through them takes within 1.25x of its "
                          "time then (else measure again): a start was warm in 1.5 s instead of 8.1 on a 2-core AMD "
                          "EPYC (tools/start_cost.py); off: measure at every start",
    "deterministic": "run every target forward through the native step's per-token products (CPU, float32 or int8 "
                     "weights), so a stream's tokens never depend on its draft length, its batchmates or how its "
                     "prompt was split: greedy speculation equals greedy target-only bit for bit (docs/how-it-works.md"
                     "; the speed it costs: docs/benchmarks.md); off: the fastest path per shape, equal except at "
                     "floating-point near-ties",
    "cuda_graphs": "on CUDA, replay draft and verify steps (up to max_draft_tokens+1 tokens) from CUDA graphs, "
                   "captured per slot and width at load",
    "fim_template": "fill-in-the-middle template (specrpc/fim.py): "
                    + ", ".join(template_names())
                    + "; empty: what the model's tokenizer_config.json declares, else its family's by its tokens",
    "tool_format": "how the model writes tool calls: auto (recognised from its chat template: Hermes/Qwen "
                   "<tool_call> tags, Llama 3 JSON, Mistral [TOOL_CALLS]; else plain), hermes, llama3, mistral or "
                   "plain (Hermes tags described in the system prompt) (docs/http.md)",
    "max_message_bytes": "largest gRPC message accepted",
    "max_prompt_tokens": "largest prompt in tokens (0: the context length)",
    "max_new_tokens": "largest max_new_tokens a request may ask for",
    "default_max_new_tokens": "max_new_tokens when a request leaves it 0",
    "max_stop_strings": "most stop strings per request",
    "max_stop_chars": "longest stop string in characters",
    "max_extra_files": "most extra files per Infill request",
    "max_streams_per_client": "most concurrent Generate/Infill/Converse streams per client (its bearer token with "
                              "--auth-tokens-file, else its address); 0: unlimited",
    "max_temperature": "largest temperature accepted",
    "max_choices": "most choices (OpenAI `n`) one HTTP request may ask for; each runs in its own KV slot",
    "max_history_messages": "most messages a conversation keeps (a Converse session's history, an HTTP chat's "
                            "messages): past it the oldest after the system prompt are dropped, eight at a time",
    "max_history_bytes": "most bytes of message text a conversation keeps: past it the oldest messages after the "
                         "system prompt are dropped; a newest message that does not fit beside the system prompt "
                         "is refused",
    "host": "address to listen on",
    "port": "gRPC port (0 picks a free one)",
    "http_port": "port of the OpenAI- and llama.cpp-compatible HTTP API, served beside gRPC (0: off)",
    "http_user_session": "over HTTP, take the session id from the OpenAI `user` field when no x-session-id header "
                         "is sent",
    "event_loop": "asyncio, or uvloop: its socket writes keep the GIL, so HTTP streaming costs about what gRPC's does "
                  "instead of slowing the device thread (docs/benchmarks.md)",
    "metrics_port": "Prometheus metrics HTTP port (0: off)",
    "log_format": "json or console",
    "log_level": "debug, info, warning or error",
    "log_prompts": "include prompt and output text in logs (debug only; off by default)",
    "session_ttl_s": "seconds an idle session keeps its KV slot",
    "grace_s": "seconds in-flight streams get to finish after SIGTERM",
    "stream_interval_ms": "hand a stream's tokens to its client at most once per this many ms (its first tokens and "
                          "its end at once; what comes between waits and goes out as one chunk): each hand-over "
                          "costs the event loop and the client CPU time the device step shares (docs/benchmarks.md)"
                          "; 0: each step's tokens at once",
    "reflection": "serve gRPC server reflection (for grpcurl / buf curl)",
    "tls_cert": "server certificate (PEM) to enable TLS",
    "tls_key": "server private key (PEM)",
    "tls_client_ca": "CA bundle (PEM) to require client certificates (mutual TLS)",
    "auth_tokens_file": "file of accepted bearer tokens, one per line (reloaded on SIGHUP); empty: no auth",
    "auth_exempt_health": "let health checks and reflection through without a token",
    "shared_suffix_drafts": "without auth tokens, let every client's outputs draft for every other's (the suffix "
                            "source across sessions); off: each session drafts from its own, since shared drafts "
                            "leak timing between clients (with tokens, each token's clients share theirs)",
    "trusted_proxies": "comma-separated addresses/CIDRs of proxies (nginx, Envoy) whose x-forwarded-for names the "
                       "client for --max-streams-per-client; empty: the peer address counts",
}

SECTIONS: dict[str, type] = {"engine": EngineConfig, "server": ServerConfig, "limits": Limits}


def _coerce(value: Any, kind: type) -> Any:
    """Convert a string (env/CLI) or TOML value to the field's type."""
    if kind is bool and isinstance(value, str):
        if value.lower() in {"1", "true", "yes", "on"}:
            return True
        if value.lower() in {"0", "false", "no", "off"}:
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    return kind(value)


def _field_types(cls: type) -> dict[str, type]:
    defaults = cls()
    return {f.name: type(getattr(defaults, f.name)) for f in fields(cls)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (--max-context ...), plus --config FILE."""
    parser.add_argument("--config", type=Path, help="TOML file with [engine], [server] and [limits] tables")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for name, kind in _field_types(cls).items():
            flag = "--" + name.replace("_", "-")
            env = ENV_PREFIX + name.upper()
            default = getattr(cls(), name)
            extra = f" [env {env}; default {default!r}]"
            if kind is bool:
                group.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                   help=HELP[name] + extra)
            else:
                group.add_argument(flag, dest=name, default=None, type=str, help=HELP[name] + extra)


def build_config(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> Config:
    """defaults < --config file < SPECRPC_* environment < flags."""
    environ = os.environ if env is None else env
    file_values: dict[str, dict[str, Any]] = {}
    path = getattr(args, "config", None) if args else None
    if path:
        with open(path, "rb") as fh:
            file_values = tomllib.load(fh)
        unknown = set(file_values) - set(SECTIONS)
        if unknown:
            raise ValueError(f"config file {path}: unknown table(s) {sorted(unknown)}; use {sorted(SECTIONS)}")
    parts: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        types = _field_types(cls)
        values: dict[str, Any] = {}
        for key, value in file_values.get(section, {}).items():
            if key not in types:
                raise ValueError(f"config file {path}: unknown key {section}.{key}")
            values[key] = _coerce(value, types[key])
        for name, kind in types.items():
            if ENV_PREFIX + name.upper() in environ:
                values[name] = _coerce(environ[ENV_PREFIX + name.upper()], kind)
            flag_value = getattr(args, name, None) if args else None
            if flag_value is not None:
                values[name] = _coerce(flag_value, kind)
        parts[section] = replace(cls(), **values)
    config = Config(**parts)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Reject impossible settings at start-up with a message that says what to change."""
    e, s = config.engine, config.server
    checks: Sequence[tuple[bool, str]] = [
        (e.max_sessions >= 1, "--max-sessions must be >= 1"),
        (e.max_context >= 16, "--max-context must be >= 16"),
        (0 <= e.max_draft_tokens <= 32, "--max-draft-tokens must be in 0..32"),
        (e.weights in {"dtype", "int8", "bf16"}, "--weights must be dtype, int8 or bf16"),
        (e.speculation in {"adaptive", "fixed", "off"}, "--speculation must be adaptive, fixed or off"),
        (e.proposer in {"draft", "lookup", "combined"}, "--proposer must be draft, lookup or combined"),
        (e.prefill_chunk >= 16, "--prefill-chunk must be >= 16"),
        (e.draft_window == 0 or e.draft_window >= 16, "--draft-window must be 0 (the whole context) or >= 16"),
        (e.batching in {"on", "off"}, "--batching must be on or off"),
        (e.recheck_s >= 0, "--recheck-s must be >= 0 (0: never)"),
        (e.fim_template in ("", *template_names()),
         f"--fim-template must be one of {', '.join(template_names())} (or empty: the model's own)"),
        (e.tool_format in FORMAT_NAMES, f"--tool-format must be one of {', '.join(FORMAT_NAMES)}"),
        (s.log_format in {"json", "console"}, "--log-format must be json or console"),
        (0 <= s.port <= 65535, "--port must be in 0..65535"),
        (0 <= s.stream_interval_ms <= MAX_STREAM_INTERVAL_MS,
         f"--stream-interval-ms must be in 0..{MAX_STREAM_INTERVAL_MS}"),
        (0 <= s.http_port <= 65535, "--http-port must be in 0..65535 (0: no HTTP API)"),
        (s.event_loop in {"asyncio", "uvloop"}, "--event-loop must be asyncio or uvloop"),
        (bool(s.tls_cert) == bool(s.tls_key), "--tls-cert and --tls-key go together"),
        (not s.tls_client_ca or bool(s.tls_cert), "--tls-client-ca needs --tls-cert and --tls-key"),
        (config.limits.default_max_new_tokens <= config.limits.max_new_tokens,
         "--default-max-new-tokens must be <= --max-new-tokens"),
        (config.limits.max_message_bytes >= 1024, "--max-message-bytes must be >= 1024"),
        (config.limits.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (min(config.limits.max_prompt_tokens, config.limits.max_stop_strings, config.limits.max_stop_chars,
             config.limits.max_extra_files, config.limits.max_streams_per_client) >= 0,
         "--max-prompt-tokens, --max-stop-strings, --max-stop-chars, --max-extra-files and "
         "--max-streams-per-client must be >= 0"),
        (config.limits.max_temperature >= 0, "--max-temperature must be >= 0"),
        (config.limits.max_choices >= 1, "--max-choices must be >= 1"),
        (config.limits.max_history_messages >= 2, "--max-history-messages must be >= 2 (a system prompt and a turn)"),
        (config.limits.max_history_bytes >= 1024, "--max-history-bytes must be >= 1024"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    parse_networks(s.trusted_proxies)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> list[IPNetwork]:
    """`10.0.0.0/8, ::1` → networks; ValueError naming the flag and the bad entry."""
    networks: list[IPNetwork] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"--trusted-proxies: {item!r} is not an IP address or CIDR (e.g. 10.0.0.0/8)") from None
    return networks
