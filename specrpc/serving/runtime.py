"""The service's engine room, without gRPC: loads the pair, owns the scheduler and sessions, formats prompts
(plain, fill-in-the-middle, conversation) and turns requests into event streams."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import PreTrainedTokenizerBase

from specrpc.config import Config
from specrpc.engine.constraint import ConstraintSpec, Grammar, GrammarCompiler, InvalidConstraint
from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest, GenerationStats
from specrpc.engine.policy import CostModel
from specrpc.engine.prediction import PredictionProposer
from specrpc.engine.proposers import SuggestionProposer
from specrpc.engine.sampling import SamplingParams
from specrpc.engine.suffix import SuffixProposer, SuffixStore
from specrpc.models import CausalLM, Memo, checkpoint_identity, execution_line, load_model, load_tokenizer, padded_sizes
from specrpc.models.tokenizer_check import check_tokenizers_match
from specrpc.openmp import release_workers
from specrpc.prompts.fim import FimFormat, InfillInput, InfillPrompt, NoInfillSupport, load_format
from specrpc.prompts.rewrite import RewriteInput, RewritePrompt
from specrpc.prompts.rewrite import render as render_rewrite
from specrpc.prompts.text import IncrementalDetokenizer, LineGuard, StopMatcher
from specrpc.prompts.token_floor import TokenFloor
from specrpc.serving.path_checks import PathChecks
from specrpc.serving.scheduler import FINISH_CANCELLED, Done, Event, Failed, Job, Scheduler
from specrpc.serving.sessions import LastCompletion, Lease, SessionRegistry, Superseded

log = structlog.get_logger(__name__)

FILE_SEP_NAMES = ["<|file_sep|>", "<file_sep>", "<|file_separator|>"]


COMPILE_BUDGET_S = 1.0
"""Seconds a request's schema or grammar may take to compile (in a worker thread, off the device thread); a longer
one is refused as InvalidConstraint, so a hostile schema is served or refused within a second."""

SEEDED_DRAFT_TOKENS = 4
"""Draft tokens per step for seeded sampled requests left to the adaptive policy (see `Runtime._speculation`)."""


@dataclass(frozen=True)
class DecodeParams:
    """How one reply is generated (domain form of the request's parameters)."""

    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop: tuple[str, ...] = ()
    num_draft_tokens: int | None = None
    proposer: str | None = None
    max_draft_tokens: int | None = None  # the most draft tokens a step verifies (None: the server's; 0: none)
    min_draft_tokens: int = 0  # a shorter draft is not verified: that step decodes plainly
    stop_token_ids: frozenset[int] = frozenset()  # end tokens besides the model's own (a FIM family's)
    n_indent: int = 0  # end at a new line indented less than this many characters (spaces and tabs); 0: off
    max_time_ms: int = 0  # from the first token, end at the next newline once this many ms have passed; 0: off
    prefill_only: bool = False  # cache the prompt in the session's slot and generate nothing
    logprobs: bool = False  # each emitted token's log-probability (Chunk.logprobs)
    top_logprobs: int = 0  # with logprobs: this many most likely alternatives per token (at most 20)
    prediction: tuple[int, ...] = ()  # the client's predicted output, tokens of its text (a draft; empty: none)
    constraint: ConstraintSpec | None = None  # what the output must match (JSON schema, regex, grammar)
    shown_tokens: frozenset[int] = frozenset()  # special tokens the text shows (a tool format's call markers)
    stream_interval_ms: int | None = None  # tokens handed over at most this often (None: the server's; 0: each step)


@dataclass(frozen=True)
class CheckpointInfo:
    """What GetModelInfo reports about a loaded model."""

    name: str
    architecture: str
    parameters: int
    vocab_size: int
    weight_bytes: int
    context_length: int
    lean: bool


def checkpoint_info(path: str, model: CausalLM, dtype: torch.dtype, weights: str = "dtype") -> CheckpointInfo:
    """Parameter count from the safetensors headers (no tensor is read), resident bytes at `dtype` (one byte per
    parameter with int8 `weights`, two with bf16; int8 scales and the embedding's float copy not counted)."""
    from safetensors import safe_open

    config = json.loads((Path(path) / "config.json").read_text())
    count = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                count += math.prod(handle.get_slice(key).get_shape())
    return CheckpointInfo(
        name=model.name,
        architecture=str(config.get("model_type", "")),
        parameters=count,
        vocab_size=model.vocab_size,
        weight_bytes=count * {"int8": 1, "bf16": 2}.get(weights, torch.tensor([], dtype=dtype).element_size()),
        context_length=int(config.get("max_position_embeddings", 0)),
        lean=model.lean_forward,
    )


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' → bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class StreamDecoder:
    """What the detokenizers decode with, per streamed token: exactly `tokenizer.decode(ids, ...)`, but computed by
    the Rust backend directly when the tokenizer's class does nothing else (transformers' TokenizersBackend without
    overrides, clean-up off), which skips most of the Python a decode costs on the device thread."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.all_special_ids: list[int] = list(tokenizer.all_special_ids)
        self._backend = plain_backend(tokenizer)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, *,
               clean_up_tokenization_spaces: bool = False) -> str | list[str]:
        """`tokenizer.decode` of one sequence."""
        if self._backend is not None and not clean_up_tokenization_spaces:
            return str(self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                      clean_up_tokenization_spaces=clean_up_tokenization_spaces)


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The `tokenizers.Tokenizer` whose decode is the whole of `tokenizer.decode` of one sequence without clean-up,
    None when the tokenizer's class adds anything to it (or transformers predates TokenizersBackend)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    plain = (cls.decode is PreTrainedTokenizerBase.decode
             and getattr(cls, "_decode", None) is getattr(TokenizersBackend, "_decode", False))
    return getattr(tokenizer, "_tokenizer", None) if plain else None


class Runtime:
    """Models, tokenizer, engine, device thread and sessions for one server."""

    def __init__(self, config: Config) -> None:
        ec = config.engine
        self.config = config
        if ec.threads:
            torch.set_num_threads(ec.threads)
        self.device = resolve_device(ec.device)
        self.dtype = resolve_dtype(ec.dtype, self.device)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(ec.target)
        self.stream_decoder = StreamDecoder(self.tokenizer)
        self.token_floor = TokenFloor.of(self.tokenizer)  # how few tokens a text can have, None: unknown
        capacity = ec.max_context + ec.max_draft_tokens + 1
        int8, bf16 = ec.weights == "int8", ec.weights == "bf16"
        graph_tokens = ec.max_draft_tokens + 1 if ec.cuda_graphs else 0  # a verify step's width at most
        # On CUDA, no shape is met first in a request: prefill chunks and catch-ups longer than the graphs cover are
        # padded to a few sizes run at load, and a greedy draft's k steps replay one captured loop.
        graphed = ec.cuda_graphs and self.device.type == "cuda"
        buckets = padded_sizes(graph_tokens, ec.prefill_chunk) if graphed else ()
        self.target: CausalLM = load_model(ec.target, device=self.device, dtype=self.dtype, num_slots=ec.max_sessions,
                                           max_context=capacity, lean=ec.lean, graph_tokens=graph_tokens,
                                           buckets=buckets, int8_weights=int8, bf16_weights=bf16,
                                           native_decode=ec.native_decode, deterministic=ec.deterministic,
                                           remember=ec.remember_execution)
        self.draft: CausalLM | None = None
        if ec.draft and ec.draft.lower() != "none":
            check_tokenizers_match(self.tokenizer, load_tokenizer(ec.draft), self.target.vocab_size,
                                   self._vocab_rows(ec.draft))
            self.draft = load_model(ec.draft, device=self.device, dtype=self.dtype, num_slots=ec.max_sessions,
                                    max_context=capacity, lean=ec.lean, int8_decode=ec.draft_int8,
                                    graph_tokens=graph_tokens, buckets=buckets,
                                    draft_loop_steps=ec.max_draft_tokens - 1 if graphed else 0, int8_weights=int8,
                                    bf16_weights=bf16, native_decode=ec.native_decode,
                                    remember=ec.remember_execution)
        self.target_info = checkpoint_info(ec.target, self.target, self.dtype, ec.weights)
        self.draft_info = (checkpoint_info(ec.draft, self.draft, self.dtype, ec.weights) if self.draft is not None
                           else None)
        self.models = {name: model for name, model in (("target", self.target), ("draft", self.draft))
                       if model is not None}  # those loaded, by role
        log.info("execution", deterministic=ec.deterministic,
                 **{name: execution_line(model.execution()) for name, model in self.models.items()},
                 chosen={name: model.chosen for name, model in self.models.items() if model.chosen})
        self.engine = Engine(self.target, self.draft, ec)
        self.registry = SessionRegistry(self.engine, ec.max_sessions, config.server.session_ttl_s)
        self.path_checks = PathChecks(self.models, ec.recheck_s)
        self.scheduler = Scheduler(self.engine, batching=ec.batching == "on",
                                   stream_interval_s=config.server.stream_interval_ms / 1e3,
                                   on_idle=self.path_checks.idle if ec.recheck_s > 0 else None)
        self.suffixes = SuffixStore()  # recent outputs per draft scope (the suffix source)
        self.stop_token_ids = self._stop_token_ids()
        file_sep = [self._special_id(n) for n in FILE_SEP_NAMES]
        self.file_sep_id = next((i for i in file_sep if i is not None), None)
        bos = self.tokenizer.bos_token_id
        self.bos_ids = [bos] if bos is not None and self.encode("x")[:1] == [bos] else []  # what encode() prepends
        eos = self.tokenizer.eos_token_id
        self.fim: FimFormat | None
        self.fim, self.no_fim_reason = load_format(
            ec.target, self.tokenizer.get_vocab(), self.encode_plain, self.encode_plain_many, ec.fim_template,
            self.bos_ids, int(eos) if eos is not None else None)
        self.special_ids = frozenset(int(i) for i in self.tokenizer.all_special_ids)
        self._token_texts: dict[int, str] = {}
        self._grammars: GrammarCompiler | None = None
        self.warm = False
        self.costs_chosen = ""  # how the step costs were had at start: measured, or remembered (`_calibrate`)
        release_workers()  # loading ran torch on this thread: leave the device thread the only OpenMP team

    def _vocab_rows(self, path: str) -> int:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])

    def _special_id(self, token: str) -> int | None:
        vocab = self.tokenizer.get_vocab()
        return vocab.get(token)

    def _stop_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_config = Path(self.config.engine.target) / "generation_config.json"
        if gen_config.exists():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return frozenset(ids)

    def start(self) -> None:
        """Start the device thread and warm up on it (which also measures the step costs the policy starts from)."""
        t0 = time.perf_counter()
        self.scheduler.start()
        try:
            costs = self.scheduler.call(self._calibrate).result()
        except BaseException:
            self.scheduler.stop()
            raise
        self.warm = True
        self.path_checks.start()
        # What loading made (tokenizer, models, their tensors' Python objects: ~370,000 for the shipped pair) lives as
        # long as the server: a full collection would traverse it all (0.2 s here, a pause every stream sees).
        # Frozen, the collector only looks at what serving allocates; `stop` hands it back.
        gc.collect()
        gc.freeze()
        log.info("warm", seconds=round(time.perf_counter() - t0, 2), target_step_ms=round(costs.target_step_s * 1e3, 3),
                 d={k: round(costs.d(k), 3) for k in sorted(costs.draft_s)},
                 v={k - 1: round(costs.v(k - 1), 3) for k in sorted(costs.verify_s)},
                 calibration_rounds=self.engine.calibration_rounds, costs=self.costs_chosen)

    def _calibrate(self) -> CostModel:
        """On the device thread: the step costs, an earlier start's where every model took its paths from that start
        and the costs check out (`Engine.recall_costs`), else measured (`Engine.calibrate`) and kept for the next
        start; every slot's policy seeded from them."""
        memo = self._costs_memo()
        entry = memo.recall() if memo is not None else None
        remembered = all(m.remembered for m in self.models.values())
        costs = self.engine.recall_costs(entry) if entry is not None and remembered else None
        self.costs_chosen = "remembered" if costs is not None else "measured"
        if costs is None:
            costs = self.engine.calibrate()
            if memo is not None:
                memo.keep(costs.entry())
        if self.scheduler.batching:
            self.engine.calibrate_batches([slot.index for slot in self.registry.slots])
        for slot in self.registry.slots:
            slot.policy = self.engine.new_policy()
        for model in self.models.values():
            model.serving()  # what start-up timed back to back, checked on the forwards served
        return costs

    def _costs_memo(self) -> Memo | None:
        """Where this start's step costs are kept for the next start of the same pair with the same settings on this
        machine (`Memo`), where every model keeps its paths' choice (`CausalLM.remembered` not None): costs are taken
        back only over paths taken back. None where nothing is kept (`--no-remember-execution`, no native step)."""
        ec = self.config.engine
        if not ec.remember_execution or any(m.remembered is None for m in self.models.values()):
            return None
        draft = checkpoint_identity(Path(ec.draft)) if self.draft is not None else []
        return Memo.for_model(Path(ec.target), {"engine": dataclasses.asdict(ec), "draft": draft},
                              f"{Path(ec.target).name}-costs")

    def stop(self) -> None:
        """Stop the device thread (cancels what is in flight); what loading made is collectable again."""
        self.scheduler.stop()
        gc.unfreeze()

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: known to both the tokenizer and the target's embedding."""
        return min(self.target.vocab_size, len(self.tokenizer))

    @property
    def context_limit(self) -> int:
        """Most committed tokens per slot."""
        return self.config.engine.max_context

    @property
    def prompt_cap(self) -> int:
        """Most prompt tokens a request may have: the context less one, or --max-prompt-tokens when smaller."""
        room = self.context_limit - 1
        return min(room, self.config.limits.max_prompt_tokens or room)

    # ---- prompt formatting -------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Exactly `tokenizer(text).input_ids`."""
        return list(self.tokenizer(text).input_ids)

    def file_prompt(self, path: str, text: str) -> list[int]:
        """`text` as the opening of file `path`, framed as the model saw files in training: the tokenizer's BOS if
        it adds one, then [SEP] path\\n text (tokenized together). Plain `encode(text)` without a path or a file
        separator token."""
        if not path or self.file_sep_id is None:
            return self.encode(text)
        return [*self.bos_ids, *self._file_ids(path, text)]

    def _file_ids(self, path: str, text: str) -> list[int]:
        """A file as the model saw files in training: [SEP] path\\n text, tokenized together ([SEP] left out when
        the tokenizer has none)."""
        sep = [] if self.file_sep_id is None else [self.file_sep_id]
        return [*sep, *self.encode_plain(f"{path}\n{text}")]

    def encode_plain(self, text: str) -> list[int]:
        """Tokens of a piece of text inside a larger prompt (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_plain_many(self, texts: list[str]) -> list[list[int]]:
        """`encode_plain` of each text, in one tokenizer call."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def rewrite_prompt(self, rewrite: RewriteInput) -> tuple[list[int], RewritePrompt]:
        """A next-edit rewrite's prompt tokens (the generic format, `prompts/rewrite.py`) and what frames it (the
        region as the prediction, the stop marker); BadRewrite when its offsets do not fit the file."""
        framed = render_rewrite(rewrite)
        return self.encode(framed.text), framed

    def infill_prompt(self, infill: InfillInput, truncate: bool = False, max_new_tokens: int = 0) -> InfillPrompt:
        """The fill-in-the-middle prompt for `infill` in the loaded model's template (specrpc/fim.py), at most
        `prompt_cap` tokens; with `truncate`, trimmed in coarse steps to also leave `max_new_tokens` of room.
        NoInfillSupport (also UnsupportedLayout) when the model cannot; PromptTooLong when it does not fit."""
        if self.fim is None:
            raise NoInfillSupport(f"{self.no_fim_reason}; load a model trained for fill-in-the-middle, or set "
                                  f"--fim-template if its family's tokens are there")
        budget = self.prompt_cap
        note = f" (context {self.context_limit}, --max-prompt-tokens)"
        if truncate:
            budget = min(budget, self.context_limit - max_new_tokens)
            note = f" (context {self.context_limit} less max_new_tokens {max_new_tokens}, --max-prompt-tokens)"
        return self.fim.prompt(infill, budget, truncate, note)

    # ---- constraints -------------------------------------------------------------------------------------------

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for the loaded tokenizer (built on first use: a large vocabulary takes a second);
        a grammar ends at the model's end-of-sequence tokens."""
        if self._grammars is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise InvalidConstraint("structured output needs a fast (tokenizers) tokenizer; this model's is not")
            self._grammars = GrammarCompiler.from_tokenizer_json(backend.to_str(), self.stop_token_ids,
                                                                 self.target.vocab_size)
        return self._grammars

    async def compile(self, spec: ConstraintSpec) -> Grammar:
        """`spec` compiled in a worker thread within COMPILE_BUDGET_S (cached by content); InvalidConstraint when
        it is invalid or takes longer."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(lambda: self.grammars.compile(spec)), COMPILE_BUDGET_S)
        except TimeoutError:
            raise InvalidConstraint(f"the {spec.kind} took more than {COMPILE_BUDGET_S:g} s to compile; simplify "
                                    f"it") from None

    # ---- generation --------------------------------------------------------------------------------------------

    def _speculation(self, params: DecodeParams) -> tuple[int | None, str | None]:
        """k and proposer for a request. A seeded sampled request must give the same output every time, but how
        many draft tokens a step verifies changes how its random stream is consumed, and the adaptive k and the
        combined proposer's pick follow live timings and acceptance: such a request runs at a fixed k
        (SEEDED_DRAFT_TOKENS unless it set one, within its cap) with a fixed proposer (the draft model for
        `combined`). A cap of 0 is k 0: no draft of any source."""
        k, proposer, limit = params.num_draft_tokens, params.proposer, params.max_draft_tokens
        if limit == 0:
            return 0, proposer
        if params.sampling.greedy or params.sampling.seed is None:
            return k, proposer
        if k is None and self.config.engine.speculation == "adaptive":
            k = min(SEEDED_DRAFT_TOKENS, self.engine.max_k, SEEDED_DRAFT_TOKENS if limit is None else limit)
        if (proposer or self.engine.default_proposer) == "combined":
            proposer = "draft"
        return k, proposer

    def _suggestion(self, lease: Lease, prompt: list[int], params: DecodeParams, num_draft_tokens: int | None,
                    proposer: str | None) -> SuggestionProposer | None:
        """The session's last completion as a draft when the new prompt follows it. Not for a request that pinned
        the draft model or prompt lookup, asked for no speculation, or must repeat its seeded samples (a draft that
        depends on the session's history would change how its random stream is consumed)."""
        last = lease.session.last_completion if lease.session is not None else None
        if (last is None or params.prefill_only or num_draft_tokens == 0 or self.engine.max_k == 0
                or proposer not in (None, "combined")
                or (not params.sampling.greedy and params.sampling.seed is not None)):
            return None
        return SuggestionProposer.follow(last.tokens, last.prompt_len, prompt, self.decode_text, self.special_ids)

    def _prediction(self, prompt: list[int], params: DecodeParams, num_draft_tokens: int | None
                    ) -> PredictionProposer | None:
        """The request's predicted output as a draft, unless it generates nothing or speculates not at all. Unlike
        the suggestion it does not depend on the session's history, so a seeded request may draft from it too, and
        it serves whichever proposer the request pinned (that one drafts where the prediction is not aligned)."""
        if not params.prediction or params.prefill_only or num_draft_tokens == 0 or self.engine.max_k == 0:
            return None
        return PredictionProposer(list(params.prediction), len(prompt), self.decode_text)

    def _suffix(self, scope: str | None, params: DecodeParams, num_draft_tokens: int | None) -> SuffixProposer | None:
        """Drafts from the scope's earlier outputs, unless the request generates nothing, speculates not at all or
        must repeat its seeded samples (a draft that depends on other requests would change how its random stream
        is consumed)."""
        if (scope is None or params.prefill_only or num_draft_tokens == 0 or self.engine.max_k == 0
                or (not params.sampling.greedy and params.sampling.seed is not None)):
            return None
        return SuffixProposer(self.suffixes.trie(scope))

    @staticmethod
    def _index(suffix: SuffixProposer, lease: Lease, job: Job) -> None:
        """Add a request's output to its scope's trie, to draft for the scope's next requests. Called before the
        slot is released, so its context still ends with the output."""
        generated = job.generation.stats.completion_tokens if job.generation is not None else 0
        prompt_len = len(job.request.prompt_ids)
        if generated and len(lease.slot.tokens) == prompt_len + generated:
            suffix.trie.add(lease.slot.tokens[prompt_len:])

    def _remember(self, lease: Lease, job: Job) -> None:
        """Keep a session's completion (its slot's context: the prompt, then what was generated) as the draft for
        its next request. Called before the slot is released, so nothing has changed the context since."""
        generated = job.generation.stats.completion_tokens if job.generation is not None else 0
        if lease.session is None or generated == 0:
            return
        prompt_len = len(job.request.prompt_ids)
        if len(lease.slot.tokens) == prompt_len + generated:
            lease.session.last_completion = LastCompletion(list(lease.slot.tokens), prompt_len)

    def decode_text(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included (`tokenizer.decode` without clean-up)."""
        return str(self.stream_decoder.decode(ids))

    def token_text(self, token_id: int) -> str:
        """Text of one token (log-probability alternatives); partial UTF-8 shows as U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode_text([token_id])
        return text

    async def generate(self, prompt: list[int], params: DecodeParams, session_id: str = "",
                       cancel: asyncio.Event | None = None,
                       on_done: Callable[[Done], None] | None = None,
                       scope: str | None = None) -> AsyncIterator[Event]:
        """Stream events for one request, ending with Done or Failed; the slot is released when the device thread
        has let go of it. Setting `cancel` (or closing the iterator) stops the generation before its next step.
        `on_done` gets the final Done even when the consumer has gone (client cancel), for accounting. `scope`:
        whose earlier outputs draft for it, and whom its output will draft for (None: nobody's)."""
        arrival = time.perf_counter()
        if params.constraint is not None and (params.sampling.min_tokens or params.sampling.ignore_eos):
            raise InvalidConstraint("a constraint decides where the reply ends: min_tokens and ignore_eos cannot "
                                    "apply with one; leave them unset, or drop the constraint")
        grammar = await self.compile(params.constraint) if params.constraint is not None else None
        try:
            lease = await self.registry.acquire(session_id, prompt)
        except Superseded:
            now = time.perf_counter()
            done = Done(FINISH_CANCELLED, GenerationStats(prompt_tokens=len(prompt)), "", "", now, arrival, None)
            if on_done is not None:
                on_done(done)
            yield done
            return
        loop = asyncio.get_running_loop()
        num_draft_tokens, proposer = self._speculation(params)
        request = GenerationRequest(
            prompt_ids=prompt,
            max_new_tokens=params.max_new_tokens,
            sampling=params.sampling,
            num_draft_tokens=num_draft_tokens,
            proposer=proposer,
            stop_token_ids=self.stop_token_ids | params.stop_token_ids,
            max_draft_tokens=params.max_draft_tokens,
            min_draft_tokens=params.min_draft_tokens,
            prefill_only=params.prefill_only,
            logprobs=params.logprobs,
            top_logprobs=params.top_logprobs,
            suggestion=self._suggestion(lease, prompt, params, num_draft_tokens, proposer),
            prediction=self._prediction(prompt, params, num_draft_tokens),
            suffix=self._suffix(scope, params, num_draft_tokens),
            grammar=grammar,
        )
        job = Job(lease.slot, request, IncrementalDetokenizer(self.stream_decoder, prompt, params.shown_tokens),
                  StopMatcher(params.stop), loop, guard=LineGuard(params.n_indent),
                  max_time_s=params.max_time_ms / 1e3, arrival=arrival,
                  interval_s=None if params.stream_interval_ms is None else params.stream_interval_ms / 1e3)

        def finished() -> None:
            try:
                self._remember(lease, job)
                if request.suffix is not None:
                    self._index(request.suffix, lease, job)
            finally:
                self.registry.release(lease)

        job.on_done = finished
        job.on_final = on_done
        lease.job = job
        if lease.session is not None:
            lease.session.job = job
        try:
            self.scheduler.submit(job)
        except BaseException:
            self.registry.release(lease)
            raise
        watcher: asyncio.Task[bool] | None = None
        if cancel is not None:
            watcher = asyncio.create_task(cancel.wait())
            watcher.add_done_callback(lambda _: job.cancel())
        try:
            while True:
                event = await job.get()
                yield event
                if isinstance(event, Done | Failed):
                    return
        finally:
            job.cancel()
            if watcher is not None:
                watcher.cancel()
