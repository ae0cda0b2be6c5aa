"""Request checks both edges (gRPC, HTTP) share: sampling ranges, token budgets, stop strings, session ids and prompt
length. Each check raises InvalidRequest with a message naming the field (as the edge spells it) and what to change."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from specrpc.config import MAX_STREAM_INTERVAL_MS, Config, Limits
from specrpc.engine.constraint import MAX_GRAMMAR_BYTES, ConstraintKind, ConstraintSpec
from specrpc.engine.generation import MAX_TOP_LOGPROBS
from specrpc.engine.sampling import SamplingParams
from specrpc.prompts.tool_formats import ToolFormat
from specrpc.prompts.tools import InvalidTools, Tool, ToolChoice, check_tools, grammar_text, tool_grammar
from specrpc.serving.runtime import DecodeParams

MAX_SESSION_ID = 128
MAX_REPO_NAME = 256
MAX_N_INDENT = 1024  # characters of indentation; deeper is no editor's indentation
MAX_TIME_MS = 600_000  # ten minutes: a longer budget for one completion is a mistake, not a wish
SESSION_HEADER = "x-session-id"  # request metadata / HTTP header that load balancers hash on (deploy/README.md)
MIN_TEMPERATURE = 0.01
"""A positive temperature below this samples at this one, as vLLM's floor: float32 logits divided by 1e-40 overflow
to inf and the softmax to NaN. Editors send tiny values to mean "almost greedy"; 0 is greedy."""

MAX_PENALTY = 2.0
"""Presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI documents them."""
MAX_REPETITION_PENALTY = 10.0
"""Largest repetition penalty (llama.cpp's repeat_penalty; 1 = off): a seen token's logit divided by it."""
MAX_LOGIT_BIAS = 100.0
"""logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI documents them."""
MAX_BIASED_TOKENS = 1024
"""Most tokens one request's logit_bias may name."""

log = structlog.get_logger(__name__)


class InvalidRequest(ValueError):
    """A request the client must change: INVALID_ARGUMENT over gRPC, 400 over HTTP, with this message."""


def sampling_params(limits: Limits, temperature: float, top_p: float, top_k: int = 0, seed: int | None = None,
                    prefix: str = "sampling.") -> SamplingParams:
    """Checked sampling parameters (temperature 0 = greedy, below MIN_TEMPERATURE = MIN_TEMPERATURE; top_p 0, 1 or
    within float32 rounding of 1 and top_k 0 or >= the vocabulary = off). `prefix` is how the edge names the fields'
    parent (`sampling.` over gRPC, nothing over HTTP)."""
    t, p, k = temperature, top_p, top_k
    if not math.isfinite(t) or t < 0 or t > limits.max_temperature:
        raise InvalidRequest(f"{prefix}temperature must be in [0, {limits.max_temperature}] "
                             f"(0 = greedy; server --max-temperature); got {t}")
    if 0 < t < MIN_TEMPERATURE:
        log.warning("temperature raised to the floor", field=f"{prefix}temperature", requested=t,
                    used=MIN_TEMPERATURE)
        t = MIN_TEMPERATURE
    if not math.isfinite(p) or p < 0 or p > 1:
        raise InvalidRequest(f"{prefix}top_p must be in (0, 1] (0 or 1 = off); got {p}")
    if k < 0:
        raise InvalidRequest(f"{prefix}top_k must be >= 0 (0 = off); got {k}")
    off = p == 0 or float32(p) == 1.0  # the probabilities are float32: a mass of 1 - 1e-9 is a mass of 1
    return SamplingParams(temperature=float(t), top_p=1.0 if off else float(p), top_k=int(k), seed=seed)


@dataclass(frozen=True)
class Controls:
    """The sampling controls beyond temperature, top-k and top-p, as an edge read them (unchecked); defaults: off."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 0  # 0: the generated tokens; N: the context's last N tokens; -1: the whole context
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_keep: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def sampling_controls(params: DecodeParams, controls: Controls, vocab: int, prefix: str = "",
                      names: Mapping[str, str] | None = None) -> DecodeParams:
    """`params` with the controls, checked: penalties in [-2, 2] (OpenAI's range; the repetition penalty in
    (0, 10]), logit_bias values in [-100, 100] on token ids of the vocabulary, min_p in [0, 1], min_tokens at most
    the request's token budget, stop token ids in the vocabulary. `prefix` and `names` spell the fields as the
    edge does (e.g. repetition_penalty → repeat_penalty over llama.cpp's routes)."""
    spelled = dict(names or {})
    c, lim = controls, MAX_PENALTY

    def name(field: str) -> str:
        return prefix + spelled.get(field, field)

    for field, value in (("presence_penalty", c.presence_penalty), ("frequency_penalty", c.frequency_penalty)):
        if not math.isfinite(value) or not -lim <= value <= lim:
            raise InvalidRequest(f"{name(field)} must be in [-{lim:g}, {lim:g}] (0 = off); got {value}")
    r = c.repetition_penalty
    if not math.isfinite(r) or not 0 < r <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(f"{name('repetition_penalty')} must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off); "
                             f"got {r}")
    if c.penalty_last_n < -1:
        raise InvalidRequest(f"{name('penalty_last_n')} must be >= -1 (-1 = the whole context); "
                             f"got {c.penalty_last_n}")
    if len(c.logit_bias) > MAX_BIASED_TOKENS:
        raise InvalidRequest(f"{name('logit_bias')}: at most {MAX_BIASED_TOKENS} tokens; got {len(c.logit_bias)}")
    for token, bias in c.logit_bias:
        if not 0 <= token < vocab:
            raise InvalidRequest(f"{name('logit_bias')}: token id {token} is not in the vocabulary (0..{vocab - 1})")
        if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"{name('logit_bias')}[{token}] must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}]; got {bias}")
    if len({t for t, _ in c.logit_bias}) != len(c.logit_bias):
        raise InvalidRequest(f"{name('logit_bias')} names a token twice; give each token once")
    if not math.isfinite(c.min_p) or not 0 <= c.min_p <= 1:
        raise InvalidRequest(f"{name('min_p')} must be in [0, 1] (0 = off); got {c.min_p}")
    if c.min_keep < 0:
        raise InvalidRequest(f"{name('min_keep')} must be >= 0; got {c.min_keep}")
    if not 0 <= c.min_tokens <= params.max_new_tokens:
        raise InvalidRequest(f"{name('min_tokens')} must be in [0, {params.max_new_tokens}] (at most the reply's "
                             f"token budget); got {c.min_tokens}")
    for i, token in enumerate(c.stop_token_ids):
        if not 0 <= token < vocab:
            raise InvalidRequest(f"{name('stop')}[{i}]: token id {token} is not in the vocabulary (0..{vocab - 1})")
    sampling = replace(params.sampling, repetition_penalty=float(r), presence_penalty=float(c.presence_penalty),
                       frequency_penalty=float(c.frequency_penalty), penalty_last_n=int(c.penalty_last_n),
                       logit_bias=tuple((int(t), float(b)) for t, b in c.logit_bias if b != 0),
                       min_p=float(c.min_p), min_keep=int(min(c.min_keep, vocab)), min_tokens=int(c.min_tokens),
                       ignore_eos=bool(c.ignore_eos))
    return replace(params, sampling=sampling, stop_token_ids=params.stop_token_ids | frozenset(c.stop_token_ids))


def float32(x: float) -> float:
    """`x` rounded to the nearest float32 (finite, within float32's range)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def decode_params(config: Config, proposers: Collection[str], max_new_tokens: int, sampling: SamplingParams,
                  stop: Sequence[str], num_draft_tokens: int | None = None, proposer: str | None = None,
                  max_tokens_name: str = "max_new_tokens", speculation_name: str = "speculation.") -> DecodeParams:
    """DecodeParams after checking the token budget, the stop strings and the speculation settings against the
    server's limits (`proposers`: the proposers this server can run). max_new_tokens 0 takes the server default."""
    lim = config.limits
    if max_new_tokens < 0 or max_new_tokens > lim.max_new_tokens:
        raise InvalidRequest(f"{max_tokens_name} must be <= {lim.max_new_tokens} (server --max-new-tokens); "
                             f"got {max_new_tokens}")
    if len(stop) > lim.max_stop_strings:
        raise InvalidRequest(f"stop: at most {lim.max_stop_strings} stop strings allowed (--max-stop-strings); "
                             f"got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"stop[{i}] is empty: stop strings must be non-empty; remove it")
        if len(s) > lim.max_stop_chars:
            raise InvalidRequest(f"stop[{i}] has {len(s)} characters; stop strings must be at most "
                                 f"{lim.max_stop_chars} (--max-stop-chars)")
    if num_draft_tokens is not None:
        cap = config.engine.max_draft_tokens
        if num_draft_tokens < 0 or num_draft_tokens > cap:
            raise InvalidRequest(f"{speculation_name}num_draft_tokens must be <= {cap} (server --max-draft-tokens); "
                                 f"got {num_draft_tokens}")
    if proposer is not None and proposer not in proposers:
        raise InvalidRequest(f"{speculation_name}proposer {proposer!r} needs a draft model, and this server runs "
                             f"without one; use PROPOSER_PROMPT_LOOKUP or leave it unspecified")
    return DecodeParams(
        max_new_tokens=max_new_tokens or lim.default_max_new_tokens,
        sampling=sampling,
        stop=tuple(stop),
        num_draft_tokens=num_draft_tokens,
        proposer=proposer,
    )


def draft_lengths(params: DecodeParams, config: Config, most: int | None, least: int,
                  names: tuple[str, str] = ("speculative.n_max", "speculative.n_min")) -> DecodeParams:
    """DecodeParams with the request's cap on any step's draft (`most`; None: the server's; 0: target-only) and the
    shortest draft worth verifying (`least`: a step whose draft would be shorter decodes plainly, as llama.cpp's
    speculative.n_min), after checking both against the server's --max-draft-tokens and least <= most. `names`: how
    the edge spells them."""
    cap = config.engine.max_draft_tokens
    most_name, least_name = names
    if most is not None and not 0 <= most <= cap:
        raise InvalidRequest(f"{most_name} must be in [0, {cap}] (server --max-draft-tokens; 0 turns speculation "
                             f"off); got {most}")
    upper = cap if most is None else most
    if not 0 <= least <= upper:
        bound = most_name if most is not None else "server --max-draft-tokens"
        raise InvalidRequest(f"{least_name} must be in [0, {upper}] (at most {bound}); got {least}")
    return replace(params, max_draft_tokens=most, min_draft_tokens=least)


def constraint(kind: ConstraintKind, text: str, strict: bool, name: str) -> ConstraintSpec:
    """A request's output constraint, checked for what needs no compiling: a schema, regex or grammar is given and at
    most MAX_GRAMMAR_BYTES (whether it compiles is the runtime's check, in a worker thread). `name`: how the edge
    spells the field."""
    if kind != "json_object" and not text:
        raise InvalidRequest(f"{name} is empty: give the {kind.replace('_', ' ')}")
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"{name} is {len(text.encode())} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    return ConstraintSpec(kind, text, strict)


def tool_constraint(tools: Sequence[Tool], choice: ToolChoice, parallel: bool, fmt: ToolFormat,
                    name: str = "tools") -> ConstraintSpec | None:
    """The grammar a reply with tools must match (prompts/tools.py), after checking the declarations and the choice;
    None for free text (no tools, or `none`). `name`: how the edge spells the tools field."""
    try:
        check_tools(tools, choice, name)
    except InvalidTools as exc:
        raise InvalidRequest(str(exc)) from None
    lines = tool_grammar(tools, choice, parallel, fmt)
    if lines is None:
        return None
    return replace(constraint("grammar", grammar_text(lines), True, name),  # a call's rule: its function's parameters
                   lines=tuple("" if i is None else f"{name}[{i}].function.parameters" for _, i in lines))


def session_id(value: str, name: str = "session_id", header: str = "", header_name: str = SESSION_HEADER) -> str:
    """The request's session id: `value`, or the `x-session-id` header when `value` is empty. Both set and different
    is refused: a load balancer routes by the header and this server caches by the id."""
    if header and value and header != value:
        raise InvalidRequest(f"{name} {value[:MAX_SESSION_ID]!r} differs from the {header_name} "
                             f"{header[:MAX_SESSION_ID]!r}: send the same id in both (or only one)")
    value = value or header
    if len(value) > MAX_SESSION_ID or not value.isprintable():
        raise InvalidRequest(f"{name} must be at most {MAX_SESSION_ID} printable characters; got "
                             f"{len(value)} characters")
    return value


def fit_prompt(ids: list[int], context_limit: int, limits: Limits, truncate: bool,
               too_long: str = "shorten it or set truncate_prompt", empty: str = "set prompt or prompt_token_ids"
               ) -> list[int]:
    """The prompt if it fits the context (less one position to generate into) and --max-prompt-tokens; its tail when
    `truncate`; else InvalidRequest saying how long it may be."""
    if not ids:
        raise InvalidRequest(f"the prompt is empty: {empty}")
    cap = prompt_room(context_limit, limits)
    if len(ids) > cap:
        if not truncate:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens but at most {cap} fit (context "
                                 f"{context_limit}, --max-prompt-tokens); {too_long}")
        ids = ids[-cap:]
    return ids


def prompt_room(context_limit: int, limits: Limits) -> int:
    """The most prompt tokens a request may have: the context less one position to generate into, and at most
    --max-prompt-tokens."""
    room = context_limit - 1
    return min(room, limits.max_prompt_tokens or room)


def extra_files(count: int, limits: Limits, name: str = "extra") -> None:
    """At most --max-extra-files context files per request."""
    if count > limits.max_extra_files:
        raise InvalidRequest(f"{name}: at most {limits.max_extra_files} extra files allowed "
                             f"(--max-extra-files); got {count}")


def repo_name(value: str, name: str = "repo_name") -> str:
    """A repository name for the FIM template's repository token: one line, at most MAX_REPO_NAME characters."""
    if len(value) > MAX_REPO_NAME or "\n" in value:
        raise InvalidRequest(f"{name} must be one line of at most {MAX_REPO_NAME} characters; got "
                             f"{len(value)} characters")
    return value


def stream_interval(params: DecodeParams, value: int | None, name: str = "stream_interval_ms") -> DecodeParams:
    """`params` with the request's stream interval (None: the server's), checked."""
    if value is not None and not 0 <= value <= MAX_STREAM_INTERVAL_MS:
        raise InvalidRequest(f"{name} must be in 0..{MAX_STREAM_INTERVAL_MS} (milliseconds between hand-overs of a "
                             f"stream's tokens; 0 = each step's at once; unset = the server's); got {value}")
    return replace(params, stream_interval_ms=value)


def editor_params(params: DecodeParams, *, n_indent: int, max_time_ms: int, prefill_only: bool, logprobs: bool,
                  top_logprobs: int, max_new_tokens: int, stop_count: int, names: Mapping[str, str] | None = None
                  ) -> DecodeParams:
    """`params` with the editor fields (n_indent, max_time_ms, prefill_only, logprobs, top_logprobs), checked.
    `names` maps a field to how the edge spells it (e.g. max_time_ms → t_max_predict_ms over llama.cpp's HTTP)."""
    spelled = dict(names or {})

    def name(field: str) -> str:
        return spelled.get(field, field)

    if not 0 <= n_indent <= MAX_N_INDENT:
        raise InvalidRequest(f"{name('n_indent')} must be in 0..{MAX_N_INDENT} (the indentation, in characters, a new "
                             f"line needs to go on; 0 = off); got {n_indent}")
    if not 0 <= max_time_ms <= MAX_TIME_MS:
        raise InvalidRequest(f"{name('max_time_ms')} must be in 0..{MAX_TIME_MS} (milliseconds from the first token, "
                             f"ended at the next newline; 0 = no budget); got {max_time_ms}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{name('top_logprobs')} must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token); "
                             f"got {top_logprobs}")
    if top_logprobs and not logprobs:
        raise InvalidRequest(f"{name('top_logprobs')} needs {name('logprobs')}: set {name('logprobs')} = true, or "
                             f"leave {name('top_logprobs')} 0")
    if prefill_only:
        wanted = [name(field) for field, value in (("max_new_tokens", max_new_tokens), ("stop", stop_count),
                                                    ("n_indent", n_indent), ("max_time_ms", max_time_ms),
                                                    ("logprobs", logprobs)) if value]
        if wanted:
            raise InvalidRequest(f"{name('prefill_only')} generates nothing, so {', '.join(wanted)} cannot apply: "
                                 f"leave {'it' if len(wanted) == 1 else 'them'} unset, or turn "
                                 f"{name('prefill_only')} off")
    return replace(params, n_indent=n_indent, max_time_ms=max_time_ms, prefill_only=prefill_only, logprobs=logprobs,
                   top_logprobs=top_logprobs)


def prediction(params: DecodeParams, text: str, encode: Callable[[str], list[int]], context_limit: int,
               name: str = "prediction") -> DecodeParams:
    """`params` with the predicted output `text` as tokens (empty: none), at most the context length: more could
    never be generated, so it is a mistake, not a prediction."""
    if not text:
        return params
    ids = encode(text)
    if len(ids) > context_limit:
        raise InvalidRequest(f"{name} has {len(ids)} tokens; at most {context_limit} (the context length) can be "
                             f"generated: send only the output you predict")
    return replace(params, prediction=tuple(ids))
