"""Typed results and parameters: frozen dataclasses that mirror the proto, and their conversions."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, cast

from specrpc_client._stubs import pb


class FinishReason(enum.IntEnum):
    """Why generation ended."""

    UNSPECIFIED = 0
    LENGTH = 1
    STOP = 2
    CANCELLED = 3
    INDENT = 4
    TIME_LIMIT = 5


class Proposer(enum.IntEnum):
    """Which proposer drafts tokens."""

    UNSPECIFIED = 0
    DRAFT_MODEL = 1
    PROMPT_LOOKUP = 2
    COMBINED = 3

    @classmethod
    def parse(cls, name: str) -> Proposer:
        """'draft', 'lookup', 'combined' (the server's --proposer names) or an enum name."""
        short = {"draft": cls.DRAFT_MODEL, "lookup": cls.PROMPT_LOOKUP, "combined": cls.COMBINED, "": cls.UNSPECIFIED}
        key = name.strip().lower()
        if key in short:
            return short[key]
        return cls[key.upper().removeprefix("PROPOSER_")]


class FimLayout(enum.IntEnum):
    """How an Infill prompt is laid out (UNSPECIFIED: the server's choice, ModelInfo.fim_default_layout)."""

    UNSPECIFIED = 0
    PSM = 1
    SPM = 2
    TYPED_LINE = 3

    @classmethod
    def parse(cls, name: str) -> FimLayout:
        """'psm', 'spm', 'typed_line' (or 'typed-line'), '' / 'auto' for unspecified, or an enum name."""
        key = name.strip().upper().replace("-", "_").removeprefix("FIM_LAYOUT_")
        return cls.UNSPECIFIED if key in ("", "AUTO") else cls[key]


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen; the defaults mean greedy."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 0.0  # 0 or 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 0  # 0: the generated tokens; n: the context's last n; -1: all of it
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_keep: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False

    def to_proto(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                                frequency_penalty=self.frequency_penalty, penalty_last_n=self.penalty_last_n,
                                logit_bias=dict(self.logit_bias), min_p=self.min_p, min_keep=self.min_keep,
                                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)
        if self.seed is not None:
            msg.seed = self.seed
        return msg


@dataclass(frozen=True)
class Speculation:
    """Per-request speculation: None = the server's adaptive policy, 0 = off, n = at most n draft tokens."""

    num_draft_tokens: int | None = None
    proposer: Proposer = Proposer.UNSPECIFIED

    def to_proto(self) -> pb.SpeculationParams:
        msg = pb.SpeculationParams(proposer=cast("pb.Proposer.ValueType", int(self.proposer)))
        if self.num_draft_tokens is not None:
            msg.num_draft_tokens = self.num_draft_tokens
        return msg


def json_text(value: str | Mapping[str, Any] | Sequence[Any]) -> str:
    """A JSON document as text: a mapping or a list is serialized, text is sent as given (the server parses it, or
    it is a tool's result as the tool wrote it)."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class Constraint:
    """What a reply must match (Generate, Infill, a Converse turn): exactly one of a JSON Schema (a mapping or its
    JSON text), a regular expression (Rust `regex` syntax) the whole reply matches, a grammar (Lark, or llama.cpp's
    GBNF `root ::= ...`), or any JSON object. The server masks what the grammar forbids on the draft and the target
    alike, so speculation stays exact; the reply ends (STOP) when the grammar is complete, and one cut by a length
    or time limit or a stop string may be incomplete. A bad schema or grammar is InvalidArgument.

    `lenient` (json_schema only): ignore keywords the compiler does not implement instead of refusing the schema
    (OpenAI's `strict: false`); the reply may then not validate in full.
    """

    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    lenient: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            given = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"a Constraint takes exactly one of json_schema, regex, grammar, json_object "
                             f"(given: {given})")
        if self.lenient and self.json_schema is None:
            raise ValueError("Constraint.lenient applies to json_schema only")

    def to_proto(self) -> pb.Constraint:
        if self.json_schema is not None:
            return pb.Constraint(json_schema=json_text(self.json_schema), lenient=self.lenient)
        if self.regex is not None:
            return pb.Constraint(regex=self.regex)
        if self.grammar is not None:
            return pb.Constraint(grammar=self.grammar)
        return pb.Constraint(json_object=True)


@dataclass(frozen=True)
class Tool:
    """A function a Converse reply may call. `parameters`: a JSON Schema object (a mapping or its JSON text; None:
    no parameters); a call's arguments are grammar-constrained to it. `strict`: refuse schema keywords the compiler
    does not implement instead of ignoring them."""

    name: str
    description: str = ""
    parameters: str | Mapping[str, Any] | None = None
    strict: bool = False

    @classmethod
    def parse(cls, declaration: Tool | Mapping[str, Any]) -> Tool:
        """A Tool, an OpenAI function declaration (`{"type": "function", "function": {"name", "description",
        "parameters", "strict"}}`) or its inner `{"name", "description", "parameters"}` mapping."""
        if isinstance(declaration, Tool):
            return declaration
        inner = declaration.get("function", declaration)
        if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
            raise ValueError(f"a tool declaration needs a name: {json.dumps(declaration)[:200]}")
        return cls(inner["name"], inner.get("description") or "", inner.get("parameters"),
                   bool(inner.get("strict", False)))

    def to_proto(self) -> pb.Tool:
        parameters = "" if self.parameters is None else json_text(self.parameters)
        return pb.Tool(name=self.name, description=self.description, parameters_json=parameters, strict=self.strict)


class ToolChoiceMode(enum.IntEnum):
    """How a reply uses the declared tools (UNSPECIFIED: auto with tools, none without)."""

    UNSPECIFIED = 0
    AUTO = 1  # text, or calls once the model writes the format's call marker
    NONE = 2  # text only (the tools stay in the prompt)
    REQUIRED = 3  # calls only (at least one)


@dataclass(frozen=True)
class ToolChoice:
    """Whether and which tool a reply calls: a mode, or one declared function by name (the mode is then ignored)."""

    mode: ToolChoiceMode = ToolChoiceMode.UNSPECIFIED
    function: str = ""

    @classmethod
    def parse(cls, value: ToolChoice | str | Mapping[str, Any]) -> ToolChoice:
        """A ToolChoice; 'auto', 'none' or 'required'; any other string names the function to call; or OpenAI's
        `{"type": "function", "function": {"name": ...}}`."""
        if isinstance(value, ToolChoice):
            return value
        if isinstance(value, Mapping):
            function = value.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
            if not isinstance(name, str):
                raise ValueError(f"a tool choice mapping names a function: {json.dumps(value)[:200]}")
            return cls(function=name)
        if value.upper() in ("AUTO", "NONE", "REQUIRED"):
            return cls(ToolChoiceMode[value.upper()])
        return cls(function=value)

    def to_proto(self) -> pb.ToolChoice:
        return pb.ToolChoice(mode=cast("pb.ToolChoiceMode.ValueType", int(self.mode)), function=self.function)


@dataclass(frozen=True)
class ToolCall:
    """A call a Converse reply made: its id (a tool-result turn names it), the function, and its arguments as the
    model wrote them (a JSON object that validates against the function's parameters unless the reply was cut)."""

    id: str
    name: str
    arguments: str
    index: int = 0
    """Its position among the reply's calls, from 0."""

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict (json.JSONDecodeError, a ValueError, when a cut reply left them incomplete)."""
        value = json.loads(self.arguments) if self.arguments.strip() else {}
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.id} arguments are not a JSON object: {self.arguments[:200]}")
        return value


@dataclass(frozen=True)
class ExtraFile:
    """A file given as context to Infill (for example an open tab)."""

    path: str
    text: str


@dataclass(frozen=True)
class TokenAlternative:
    """One of the most likely tokens at a position, with its log-probability under the target."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability (the target's log-softmax of its raw logits, before temperature, top-k and
    top-p) and the `top_logprobs` most likely tokens at its position, best first."""

    token_id: int
    text: str
    logprob: float
    top_logprobs: tuple[TokenAlternative, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """The tokens of one verify step and the text they complete (`logprobs`: one per token when asked for)."""

    text: str
    token_ids: tuple[int, ...]
    accepted_draft_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class SpeculationStats:
    """Speculation figures of one request."""

    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    verify_steps: int = 0
    mean_accepted_length: float = 0.0
    num_draft_tokens: int = 0
    acceptance_rate: float = 0.0


@dataclass(frozen=True)
class Timing:
    """Server-side timings in milliseconds from the request's arrival."""

    ttft_ms: float = 0.0
    total_ms: float = 0.0
    queue_ms: float = 0.0


@dataclass(frozen=True)
class Summary:
    """The last event of a generation."""

    finish_reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    timing: Timing = field(default_factory=Timing)
    session_id: str = ""
    stop_sequence: str = ""
    trimmed_prefix_chars: int = 0
    trimmed_suffix_chars: int = 0
    trimmed_extra_files: int = 0
    trimmed_prompt_tokens: int = 0
    fim_layout: FimLayout = FimLayout.UNSPECIFIED
    tokens_cached: int = 0
    suggestion_tokens_accepted: int = 0
    accepted_prediction_tokens: int = 0
    """With a prediction: its tokens that appear in the completion (OpenAI's accepted_prediction_tokens)."""
    rejected_prediction_tokens: int = 0
    """With a prediction: its tokens that do not."""


@dataclass(frozen=True)
class Phrase:
    """A complete sentence or clause of a reply, ready for text-to-speech."""

    text: str
    start_char: int
    end_char: int
    time_ms: float
    """Server: milliseconds from the turn's start to this phrase."""
    received_ms: float = 0.0
    """Client: milliseconds from `say()` to this phrase's arrival (includes the network)."""


@dataclass(frozen=True)
class TurnSummary:
    """The end of one reply."""

    turn_index: int
    generation: Summary
    time_to_first_phrase_ms: float
    reply_text: str
    """The reply's text outside tool calls."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The reply's tool calls, each complete one also a ToolCall event; a call the token limit or a stop string cut
    short comes last, as far as it was written (its arguments may not parse), with no event."""


@dataclass(frozen=True)
class SessionStarted:
    """A Converse session is open."""

    session_id: str
    resumed: bool
    history_tokens: int


@dataclass(frozen=True)
class Rewound:
    """A rewind was applied."""

    kept_chars: int
    kept_tokens: int
    history_tokens: int


@dataclass(frozen=True)
class ModelDescription:
    """One loaded model."""

    name: str = ""
    architecture: str = ""
    parameters: int = 0
    vocab_size: int = 0
    weight_bytes: int = 0
    context_length: int = 0
    lean_forward: bool = False


@dataclass(frozen=True)
class SpeculationPolicy:
    """How the server runs speculation."""

    mode: str = ""
    max_draft_tokens: int = 0
    proposer: Proposer = Proposer.UNSPECIFIED


@dataclass(frozen=True)
class ModelInfo:
    """What the server has loaded (`draft` is None without a draft model)."""

    target: ModelDescription
    draft: ModelDescription | None
    device: str
    dtype: str
    max_context: int
    speculation_policy: SpeculationPolicy
    kv_slots_total: int
    kv_slots_in_use: int
    kv_cache_bytes: int
    supports_infill: bool
    tokenizer_vocab_size: int
    fim_template: str = ""
    fim_orders: tuple[str, ...] = ()
    fim_default_layout: FimLayout = FimLayout.UNSPECIFIED


# ---- proto → dataclass ----------------------------------------------------------------------------------------

D = TypeVar("D")


def _flat(cls: type[D], msg: Any, **override: Any) -> D:
    """Copy the scalar fields a dataclass shares with a message (by name); `override` wins."""
    values = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name not in override}  # type: ignore[arg-type]
    return cls(**values, **override)


def chunk_from(msg: pb.TokenChunk) -> Chunk:
    logprobs = tuple(_flat(TokenLogprob, lp, top_logprobs=tuple(_flat(TokenAlternative, a) for a in lp.top_logprobs))
                     for lp in msg.logprobs)
    return Chunk(text=msg.text, token_ids=tuple(msg.token_ids), accepted_draft_tokens=msg.accepted_draft_tokens,
                 logprobs=logprobs)


def summary_from(msg: pb.GenerationSummary) -> Summary:
    return _flat(Summary, msg, finish_reason=FinishReason(msg.finish_reason),
                 speculation=_flat(SpeculationStats, msg.speculation), timing=_flat(Timing, msg.timing),
                 fim_layout=FimLayout(msg.fim_layout))


@dataclass(frozen=True)
class LineChange:
    """Lines [old_start, old_end) of a rewritten region became lines [new_start, new_end) of the rewrite."""

    old_start: int
    old_end: int
    new_start: int
    new_end: int


@dataclass(frozen=True)
class RewriteResult:
    """What a Rewrite ended with besides its summary: the rewritten region, whole, and the lines it changed."""

    region: str
    changes: tuple[LineChange, ...]


def ended(msg: pb.GenerationSummary | pb.RewriteSummary) -> tuple[Summary, RewriteResult | None]:
    """A stream's last event: its summary, and a Rewrite's result (None for Generate and Infill)."""
    if isinstance(msg, pb.RewriteSummary):
        changes = tuple(_flat(LineChange, change) for change in msg.changes)
        return summary_from(msg.generation), RewriteResult(msg.region, changes)
    return summary_from(msg), None


def phrase_from(msg: pb.Phrase, received_ms: float = 0.0) -> Phrase:
    return _flat(Phrase, msg, received_ms=received_ms)


def tool_call_from(msg: pb.ToolCall) -> ToolCall:
    return ToolCall(msg.id, msg.name, msg.arguments_json, msg.index)


def turn_summary_from(msg: pb.TurnSummary) -> TurnSummary:
    return _flat(TurnSummary, msg, generation=summary_from(msg.generation),
                 tool_calls=tuple(tool_call_from(call) for call in msg.tool_calls))


def model_info_from(msg: pb.ModelInfo) -> ModelInfo:
    policy = msg.speculation_policy
    return _flat(
        ModelInfo, msg,
        target=_flat(ModelDescription, msg.target),
        draft=_flat(ModelDescription, msg.draft) if msg.HasField("draft") else None,
        speculation_policy=_flat(SpeculationPolicy, policy, proposer=Proposer(policy.proposer)),
        fim_orders=tuple(msg.fim_orders), fim_default_layout=FimLayout(msg.fim_default_layout),
    )


def tools_to_proto(tools: Sequence[Tool | Mapping[str, Any]]) -> list[pb.Tool]:
    return [Tool.parse(t).to_proto() for t in tools]


def extra_to_proto(files: Sequence[ExtraFile | tuple[str, str]]) -> list[pb.ExtraFile]:
    out = []
    for f in files:
        path, text = (f.path, f.text) if isinstance(f, ExtraFile) else f
        out.append(pb.ExtraFile(path=path, text=text))
    return out
