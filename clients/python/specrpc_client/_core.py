"""What the sync and async clients share: connection settings, channel options, retries, metadata, requests."""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import grpc

from specrpc_client._stubs import pb
from specrpc_client.types import (
    Constraint,
    ExtraFile,
    FimLayout,
    Sampling,
    Speculation,
    Tool,
    ToolCall,
    ToolChoice,
    extra_to_proto,
    json_text,
    tools_to_proto,
)

USER_AGENT = "specrpc-client-python/0.1"
SESSION_HEADER = "x-session-id"
DEFAULT_TARGET = "127.0.0.1:50051"
PemSource = str | Path | bytes | None


class _Unset(enum.Enum):
    UNSET = 0


UNSET = _Unset.UNSET
Timeout = float | None | Literal[_Unset.UNSET]
"""A call's timeout in seconds: UNSET = the client's default, None = no deadline."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff on UNAVAILABLE only, and only before a call's first response has arrived.

    Attempt n (from 1) waits min(max_backoff_s, initial_backoff_s · multiplier^(n-1)) ± jitter before it runs; the
    call's deadline bounds all attempts together.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 = the second attempt)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """One call's deadline across its attempts (None: no deadline)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def retry_delay(self, policy: RetryPolicy, attempts: int) -> float | None:
        """Seconds to sleep before the next attempt, or None when the policy or the deadline says stop."""
        if attempts >= policy.max_attempts:
            return None
        delay = policy.backoff(attempts)
        left = self.remaining()
        if left is not None and delay >= left:
            return None
        return delay


def _read_pem(source: PemSource) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


def _is_ip(host: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == version
    except ValueError:
        return False


def split_endpoints(target: str) -> tuple[str, ...]:
    """`ipv4:a:1,b:2` / `ipv6:[::1]:1,[::1]:2` → its endpoints; any other target is one endpoint."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return tuple(e.strip().removeprefix("//") for e in target[len(scheme):].split(",") if e.strip())
    return (target,)


def balanced_target(endpoints: Sequence[str]) -> str:
    """The gRPC target URI listing several literal IP endpoints (for the round_robin policy)."""
    hosts = [e.rsplit(":", 1)[0] for e in endpoints]
    for version in (4, 6):
        if all(_is_ip(h, version) for h in hosts):
            return f"ipv{version}:" + ",".join(endpoints)
    raise ValueError("several endpoints must all be IPv4 or all IPv6 literals (host:port); for a DNS name with "
                     "several addresses use one target 'dns:///name:port', which round_robin also balances")


@dataclass(frozen=True)
class Connection:
    """Where and how to connect. Several endpoints → one round_robin channel, plus (session affinity) one channel
    per endpoint for calls that carry a session id, picked by rendezvous hashing on it so a session's KV cache stays
    on one server."""

    endpoints: tuple[str, ...]
    target: str
    credentials: grpc.ChannelCredentials | None
    token: str | None
    options: tuple[tuple[str, str | int], ...]
    session_affinity: bool

    @classmethod
    def build(cls, target: str | Sequence[str] = DEFAULT_TARGET, *, token: str | None = None, tls: bool = False,
              root_certificates: PemSource = None, client_cert: PemSource = None, client_key: PemSource = None,
              server_name: str | None = None, retry: RetryPolicy = DEFAULT_RETRY, session_affinity: bool = True,
              options: Sequence[tuple[str, str | int]] = ()) -> Connection:
        if isinstance(target, str):
            endpoints, uri = split_endpoints(target), target
        else:
            endpoints = tuple(target)
            if not endpoints:
                raise ValueError("no endpoint given")
            uri = endpoints[0] if len(endpoints) == 1 else balanced_target(endpoints)
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key go together (mutual TLS)")
        creds = None
        if tls or root_certificates is not None or client_cert is not None:
            creds = grpc.ssl_channel_credentials(_read_pem(root_certificates), _read_pem(client_key),
                                                 _read_pem(client_cert))
        backoff_ms = max(1, int(retry.initial_backoff_s * 1000))
        opts: list[tuple[str, str | int]] = [
            ("grpc.primary_user_agent", USER_AGENT),
            # Reconnect as fast as the retry policy retries: a channel in its reconnect backoff fails calls at once.
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", max(backoff_ms, int(retry.max_backoff_s * 1000))),
        ]
        if server_name:
            opts += [("grpc.ssl_target_name_override", server_name), ("grpc.default_authority", server_name)]
        opts += list(options)
        return cls(endpoints, uri, creds, token, tuple(opts), session_affinity)

    def channel_options(self) -> list[tuple[str, str | int]]:
        # round_robin on every channel: several endpoints (or a DNS name with several addresses) share the calls.
        return [*self.options, ("grpc.lb_policy_name", "round_robin")]

    def route(self, session_id: str, attempt: int) -> str:
        """Channel key for a call: '' is the shared (balanced) channel, else one endpoint. With session affinity and
        several endpoints, a session goes to its highest-ranked endpoint; retries move down the ranking."""
        if not session_id or not self.session_affinity or len(self.endpoints) < 2:
            return ""
        ranked = sorted(self.endpoints, key=lambda e: hashlib.blake2b(f"{session_id}|{e}".encode(),
                                                                       digest_size=8).digest(), reverse=True)
        return ranked[attempt % len(ranked)]

    def target_for(self, key: str) -> str:
        """The gRPC target of a channel key from `route`."""
        return key or self.target

    def metadata(self, session_id: str = "") -> tuple[tuple[str, str], ...]:
        md: list[tuple[str, str]] = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if session_id:
            md.append((SESSION_HEADER, session_id))
        return tuple(md)


# ---- requests --------------------------------------------------------------------------------------------------

def _common(max_new_tokens: int, sampling: Sampling | None, stop: Sequence[str],
            speculation: Speculation | None, constraint: Constraint | None = None) -> dict[str, object]:
    kw: dict[str, object] = {"max_new_tokens": max_new_tokens, "stop": list(stop)}
    if sampling is not None:
        kw["sampling"] = sampling.to_proto()
    if speculation is not None:
        kw["speculation"] = speculation.to_proto()
    if constraint is not None:
        kw["constraint"] = constraint.to_proto()
    return kw


ToolDeclarations = Sequence[Tool | Mapping[str, Any]]
"""Tools, or OpenAI function declarations (Tool.parse)."""
ToolChoiceLike = ToolChoice | str | Mapping[str, Any]
"""A ToolChoice, 'auto' / 'none' / 'required', a function's name, or OpenAI's named-function mapping."""
ToolResultValue = str | Mapping[str, Any] | Sequence[Any]
"""A tool's result: text as given, anything else sent as JSON."""
ToolResults = Sequence[tuple[ToolCall | str, ToolResultValue]]
"""The results of several calls: (the ToolCall or its id, its result) pairs, in order."""


def _tool_fields(tools: ToolDeclarations, tool_choice: ToolChoiceLike | None) -> dict[str, object]:
    kw: dict[str, object] = {"tools": tools_to_proto(tools)}
    if tool_choice is not None:
        kw["tool_choice"] = ToolChoice.parse(tool_choice).to_proto()
    return kw


@dataclass(frozen=True)
class EditorFields:
    """What editors ask a completion server for (Generate and Infill): see `generate_request`."""

    n_indent: int = 0
    max_time_ms: int = 0
    prefill_only: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prediction: str = ""  # the output as the client predicts it: a draft, verified token by token
    stream_interval_ms: int | None = None  # tokens handed over at most this often (None: the server's; 0: each step)

    def fields(self) -> dict[str, object]:
        """The request fields these set (an unset stream interval left out: the server's)."""
        return {k: v for k, v in vars(self).items() if v is not None}


def generate_request(prompt: str | Sequence[int], *, max_new_tokens: int = 0, sampling: Sampling | None = None,
                     stop: Sequence[str] = (), speculation: Speculation | None = None, session_id: str = "",
                     truncate_prompt: bool = False, path: str = "", editor: EditorFields = EditorFields(),
                     constraint: Constraint | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; `prompt` is text or token ids; `path`: the file the prompt text opens. `editor`:
    n_indent (end before a new line indented less), max_time_ms (a time budget from the first token, ended at the
    next newline), prefill_only (only cache the prompt in the session), logprobs and top_logprobs (0..20),
    prediction (the output as predicted, for example the text being rewritten: the server drafts from it; the
    output is the same without it, and the summary counts its accepted and rejected tokens), stream_interval_ms
    (how often at most the server hands tokens over, 0..1000; 0: each step's at once; None: the server's).
    `constraint`: what the output must match (a JSON Schema, a regex, a grammar, any JSON object)."""
    text, ids = (prompt, []) if isinstance(prompt, str) else ("", list(prompt))
    return pb.GenerateRequest(prompt=text, prompt_token_ids=ids, session_id=session_id,
                              truncate_prompt=truncate_prompt, path=path, **editor.fields(),
                              **_common(max_new_tokens, sampling, stop, speculation,
                                        constraint))  # type: ignore[arg-type]


def infill_request(prefix: str, suffix: str = "", *, extra_files: Sequence[ExtraFile | tuple[str, str]] = (),
                   path: str = "", max_new_tokens: int = 0, sampling: Sampling | None = None,
                   stop: Sequence[str] = (), speculation: Speculation | None = None,
                   session_id: str = "", typed_line: str = "", repo_name: str = "", truncate: bool = False,
                   layout: FimLayout | str = FimLayout.UNSPECIFIED, editor: EditorFields = EditorFields(),
                   constraint: Constraint | None = None) -> pb.InfillRequest:
    """An InfillRequest (fill-in-the-middle). `typed_line`: the current line's text before the cursor when sent
    apart from `prefix`; `truncate`: trim the prompt to fit instead of failing; `layout`: a FimLayout or its name;
    `editor` and `constraint` as in `generate_request`."""
    kind = FimLayout.parse(layout) if isinstance(layout, str) else layout
    return pb.InfillRequest(prefix=prefix, suffix=suffix, extra=extra_to_proto(extra_files), path=path,
                            session_id=session_id, typed_line=typed_line, repo_name=repo_name, truncate=truncate,
                            layout=cast("pb.FimLayout.ValueType", int(kind)), **editor.fields(),
                            **_common(max_new_tokens, sampling, stop, speculation,
                                      constraint))  # type: ignore[arg-type]


def rewrite_request(path: str, text: str, region_start: int, region_end: int, cursor: int, *,
                    recent_edits: Sequence[str] = (), max_new_tokens: int = 0, sampling: Sampling | None = None,
                    speculation: Speculation | None = None, session_id: str = "") -> pb.RewriteRequest:
    """A RewriteRequest (next-edit prediction): offsets in characters of `text`, the cursor within the region;
    `recent_edits`: unified diffs, oldest first."""
    request = pb.RewriteRequest(path=path, text=text, region_start=region_start, region_end=region_end,
                                cursor=cursor, recent_edits=list(recent_edits), max_new_tokens=max_new_tokens,
                                session_id=session_id)
    if sampling is not None:
        request.sampling.CopyFrom(sampling.to_proto())
    if speculation is not None:
        request.speculation.CopyFrom(speculation.to_proto())
    return request


def session_start(session_id: str, *, system: str = "", phrase_mode: bool = True, sampling: Sampling | None = None,
                  speculation: Speculation | None = None, max_new_tokens: int = 0, stop: Sequence[str] = (),
                  tools: ToolDeclarations = (), tool_choice: ToolChoiceLike | None = None,
                  parallel_tool_calls: bool | None = None, stream_interval_ms: int | None = None
                  ) -> pb.ConverseRequest:
    """The first message of a Converse stream; `tools` the replies may call, `tool_choice` (unset: auto with tools),
    `parallel_tool_calls` (unset: the server's default, true) and `stream_interval_ms` (unset: the server's) are the
    session's defaults."""
    start = pb.SessionStart(session_id=session_id, system=system, phrase_mode=phrase_mode,
                            **_tool_fields(tools, tool_choice),  # type: ignore[arg-type]
                            **_common(max_new_tokens, sampling, stop, speculation))  # type: ignore[arg-type]
    if parallel_tool_calls is not None:
        start.parallel_tool_calls = parallel_tool_calls
    if stream_interval_ms is not None:
        start.stream_interval_ms = stream_interval_ms
    return pb.ConverseRequest(start=start)


def turn_request(text: str, *, role: str = "", sampling: Sampling | None = None, max_new_tokens: int = 0,
                 speculation: Speculation | None = None, constraint: Constraint | None = None,
                 tools: ToolDeclarations = (), tool_choice: ToolChoiceLike | None = None,
                 tool_call_id: str = "", tool_results: ToolResults = ()) -> pb.ConverseRequest:
    """A turn (role: user by default; "tool" with `tool_call_id` for a call's result, or with empty text and
    `tool_results` for the results of several calls, one reply for all). `constraint`: what the reply must match (not
    with tools in use); `tools` and `tool_choice` replace the session's for this reply when given."""
    turn = pb.Turn(text=text, role=role, max_new_tokens=max_new_tokens, tool_call_id=tool_call_id,
                   tool_results=[pb.ToolResult(tool_call_id=call_id(call), text=json_text(result))
                                 for call, result in tool_results],
                   **_tool_fields(tools, tool_choice))  # type: ignore[arg-type]
    if sampling is not None:
        turn.sampling.CopyFrom(sampling.to_proto())
    if speculation is not None:
        turn.speculation.CopyFrom(speculation.to_proto())
    if constraint is not None:
        turn.constraint.CopyFrom(constraint.to_proto())
    return pb.ConverseRequest(turn=turn)


def call_id(call: ToolCall | str) -> str:
    """The id of a call a result answers: the ToolCall's, or the id given."""
    return call if isinstance(call, str) else call.id
