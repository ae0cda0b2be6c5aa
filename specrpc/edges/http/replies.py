"""How the HTTP edge shapes a generation's events: OpenAI's chat.completion(.chunk) and text_completion, and
llama.cpp's /completion and /infill objects (with `response_fields` flattened as llama.cpp does)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specrpc.engine.generation import FINISH_LENGTH, FINISH_STOP, TokenLogprob
from specrpc.prompts.rewrite import changed_lines
from specrpc.prompts.text import FINISH_INDENT, FINISH_TIME_LIMIT
from specrpc.prompts.tools import ArgumentsPart, CallStarted, ReplyPart, TextPart, ToolCallParser
from specrpc.serving.scheduler import FINISH_CANCELLED, Chunk, Done

OPENAI_FINISH = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CANCELLED: "cancelled",
                 FINISH_INDENT: "stop", FINISH_TIME_LIMIT: "length"}
LLAMA_STOP_TYPE = {FINISH_LENGTH: "limit", FINISH_CANCELLED: "none", FINISH_INDENT: "limit",
                   FINISH_TIME_LIMIT: "limit"}  # FINISH_STOP: "word" or "eos", as llama.cpp says
TokenText = Callable[[int], str]


def openai_logprob(lp: TokenLogprob, text: TokenText) -> dict[str, Any]:
    """One token of OpenAI chat's `logprobs.content`."""
    token = text(lp.token_id)
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": text(a.token_id), "logprob": a.logprob,
                              "bytes": list(text(a.token_id).encode())} for a in lp.top]}


def completion_logprobs(lps: Sequence[TokenLogprob], text: TokenText, offset: int) -> dict[str, Any]:
    """OpenAI completions' `logprobs` for consecutive tokens starting at character `offset` of the reply."""
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(a.token_id): a.logprob for a in lp.top} for lp in lps], "text_offset": offsets}


def llama_probabilities(lps: Sequence[TokenLogprob], text: TokenText) -> list[dict[str, Any]]:
    """llama.cpp's `completion_probabilities` (its n_probs format)."""
    return [{"id": lp.token_id, "token": text(lp.token_id), "logprob": lp.logprob,
             "bytes": list(text(lp.token_id).encode()),
             "top_logprobs": [{"id": a.token_id, "token": text(a.token_id), "logprob": a.logprob,
                               "bytes": list(text(a.token_id).encode())} for a in lp.top]} for lp in lps]


class Reply:
    """How one API family shapes a generation's events."""

    def start(self) -> list[dict[str, Any]]:
        """Streamed events before the first chunk."""
        return []

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        """Streamed events for a chunk of text."""
        raise NotImplementedError

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        """The final streamed events, or (not streaming) the one whole reply."""
        raise NotImplementedError

    done_marker = False  # whether the stream ends with `data: [DONE]`


@dataclass
class OpenAIReply(Reply):
    """chat.completion(.chunk) or text_completion."""

    chat: bool
    model: str
    include_usage: bool
    text: TokenText = str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every token's, when asked for (whole replies)
    offset: int = 0  # characters streamed so far (completions' text_offset)
    index: int = 0  # the choice (OpenAI `n`)
    tools: ToolCallParser | None = None  # reads tool calls out of the reply (chat with tools)
    content: list[str] = field(default_factory=list)  # the reply's text outside tool calls (with tools)
    done_marker = True

    def envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "specrpc", "choices": choices}

    def _logprobs(self, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not lps:
            return None
        if self.chat:
            return {"content": [openai_logprob(lp, self.text) for lp in lps]}
        return completion_logprobs(lps, self.text, offset)

    def choice(self, text: str | None, finish: str | None, stream: bool, role: bool = False,
                lps: Sequence[TokenLogprob] = (), offset: int = 0) -> dict[str, Any]:
        logprobs = self._logprobs(lps, offset)
        if not self.chat:
            return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if stream:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    def start(self) -> list[dict[str, Any]]:
        return [self.envelope([self.choice("", None, True, role=True)], True)] if self.chat else []

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        self.logprobs += chunk.logprobs
        offset, self.offset = self.offset, self.offset + len(text)
        if self.tools is not None:
            return self._tool_deltas(self.tools.feed(text), chunk.logprobs)
        if not text and not chunk.logprobs:
            return []
        return [self.envelope([self.choice(text, None, True, lps=chunk.logprobs, offset=offset)], True)]

    def _tool_deltas(self, parts: Sequence[ReplyPart], lps: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
        """Chunks for parsed parts of a reply with tools, in OpenAI's shape: text as `content`; a call's first
        delta with its index, id, type and name and empty arguments; then its arguments in fragments. A step's
        log-probabilities go with its first chunk (or a chunk of their own when the step completed no part)."""
        events = []
        for part in parts:
            delta: dict[str, Any]
            if isinstance(part, TextPart):
                self.content.append(part.text)
                delta = {"content": part.text}
            elif isinstance(part, CallStarted):
                delta = {"tool_calls": [{"index": part.index, "id": part.id, "type": "function",
                                         "function": {"name": part.name, "arguments": ""}}]}
            elif isinstance(part, ArgumentsPart):
                delta = {"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]}
            else:
                continue
            choice = {"index": self.index, "delta": delta, "logprobs": self._logprobs(lps, 0), "finish_reason": None}
            events.append(self.envelope([choice], True))
            lps = ()
        if lps:
            events.append(self.envelope([self.choice(None, None, True, lps=lps)], True))
        return events

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        finish = OPENAI_FINISH.get(done.finish, done.finish)
        held: list[dict[str, Any]] = []
        if self.tools is not None:
            held = self._tool_deltas(self.tools.finish())
            if self.tools.calls and self.tools.pending is None and finish == "stop":
                finish = "tool_calls"  # not when a stop string cut a call short: that one is incomplete
        if not stream:
            choice = self.choice(text, finish, False, lps=self.logprobs)
            if self.tools is not None:
                choice["message"] = self._tool_message()
            return [{**self.envelope([choice], False), "usage": usage(done)}]
        events = [*held, self.envelope([self.choice(None if self.chat else "", finish, True)], True)]
        if self.include_usage:
            events.append({**self.envelope([], True), "usage": usage(done)})
        return events

    def _tool_message(self) -> dict[str, Any]:
        """The whole reply's message with tools: its text (null when it only calls), and its calls, a call cut short
        (by the token limit or a stop string) included as far as it was written, as streaming gives it."""
        assert self.tools is not None
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        calls = self.tools.written
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message


@dataclass
class ChoicesReply:
    """OpenAI's reply with `n` choices: one OpenAIReply per choice (one id), the whole reply's usage counting the
    prompt once, with the cached tokens its one prefill found, and each choice's own (`choice_cached_tokens`:
    the prompt's KV prefix each choice copied rather than computed)."""

    replies: list[OpenAIReply]
    prefill: Done | None = None
    dones: dict[int, Done] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, reply: OpenAIReply, n: int) -> ChoicesReply:
        return cls([dataclasses.replace(reply, index=i, logprobs=[], offset=0) for i in range(n)])

    def start(self) -> list[dict[str, Any]]:
        return [event for reply in self.replies for event in reply.start()]

    def chunk(self, index: int, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        self.texts.setdefault(index, []).append(text)
        return self.replies[index].chunk(text, chunk)

    def end(self, index: int, done: Done, stream: bool) -> list[dict[str, Any]]:
        """A choice's final streamed event (with `stream`), or nothing until `whole`."""
        self.dones[index] = done
        if not stream:
            return []
        reply = self.replies[index]
        finish = OPENAI_FINISH.get(done.finish, done.finish)
        return [reply.envelope([reply.choice(None if reply.chat else "", finish, True)], True)]

    def whole(self, stream: bool) -> list[dict[str, Any]]:
        """After every choice: the usage event (streamed, when asked for) or the whole reply."""
        first = self.replies[0]
        dones = [self.dones[i] for i in range(len(self.replies))]
        total = usage_of(self.prefill, dones)
        if stream:
            return [{**first.envelope([], True), "usage": total}] if first.include_usage else []
        choices = []
        for i, reply in enumerate(self.replies):
            finish = OPENAI_FINISH.get(dones[i].finish, dones[i].finish)
            choices.append(reply.choice("".join(self.texts.get(i, [])), finish, False, lps=reply.logprobs))
        return [{**first.envelope(choices, False), "usage": total}]


def usage_of(prefill: Done | None, dones: Sequence[Done]) -> dict[str, Any]:
    """Usage of `n` choices of one prompt: the prompt counted once, as its one prefill (`prefill`) computed it."""
    prompt = dones[0].stats.prompt_tokens
    cached = prefill.stats.cached_prompt_tokens if prefill is not None else 0
    completion = sum(d.stats.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "choice_cached_tokens": [d.stats.cached_prompt_tokens for d in dones]}


def usage(done: Done) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens found in the session's (or a free slot's) KV cache and the
    prediction's tokens that did and did not appear in the completion (0 without a prediction, as OpenAI's)."""
    s = done.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": s.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": s.rejected_prediction_tokens}}


@dataclass
class RewriteReply(Reply):
    """POST /v1/rewrite: streamed `{"text": …}` events, then (or, without streaming, only) `{"region": the rewrite,
    "changes": the changed line ranges, "finish_reason", "usage"}`, usage as OpenAI's (the prediction counted)."""

    region: str  # the editable region before the rewrite

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        return [{"text": text}] if text else []

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        rewritten = text.removesuffix("\n")  # the line break before the end marker
        return [{"region": rewritten,
                 "changes": [dataclasses.asdict(c) for c in changed_lines(self.region, rewritten)],
                 "finish_reason": OPENAI_FINISH.get(done.finish, done.finish), "usage": usage(done)}]


@dataclass
class LlamaReply(Reply):
    """llama.cpp's /completion and /infill shape: partial `{content, stop: false}` events, then the final object
    with `stop: true`, `timings`, `tokens_cached`, `truncated`; `response_fields` flattens the final object to the
    listed `a/b` paths, keyed by the path (as llama.cpp's json_get_nested_values does)."""

    model: str
    fields: list[str]
    prefill_only: bool
    settings: dict[str, Any]
    prompt_ids: int
    text: TokenText = str
    truncated: bool = False
    predicted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def chunk(self, text: str, chunk: Chunk) -> list[dict[str, Any]]:
        self.predicted += len(chunk.token_ids)
        self.logprobs += chunk.logprobs
        if self.prefill_only or not (text or chunk.logprobs):
            return []
        event = {"index": 0, "content": text, "tokens": chunk.token_ids, "stop": False, "id_slot": -1,
                 "tokens_predicted": self.predicted, "tokens_evaluated": self.prompt_ids}
        if chunk.logprobs:
            event["completion_probabilities"] = llama_probabilities(chunk.logprobs, self.text)
        return [event]

    def end(self, done: Done, text: str, stream: bool) -> list[dict[str, Any]]:
        s = done.stats
        predicted = s.completion_tokens
        content = "" if self.prefill_only else ("" if stream else text)
        started = done.started_at or done.arrival
        first = done.first_token_at or done.at
        prompt_n = s.prompt_tokens - s.cached_prompt_tokens
        prompt_ms = (first - started) * 1e3
        predicted_ms = (done.at - first) * 1e3
        stop_type = LLAMA_STOP_TYPE.get(done.finish) or ("word" if done.stop_sequence else "eos")
        final: dict[str, Any] = {
            "index": 0, "content": content, "tokens": [], "id_slot": -1, "stop": True, "model": self.model,
            "tokens_predicted": predicted, "tokens_evaluated": s.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": "", "has_new_line": "\n" in text, "truncated": self.truncated, "stop_type": stop_type,
            "stopping_word": done.stop_sequence, "tokens_cached": s.tokens_cached,
            "timings": {
                "cache_n": s.cached_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                "predicted_per_second": predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            },
        }
        if s.proposed:  # as llama.cpp: the draft tokens verified and accepted, where any were drafted
            final["timings"] |= {"draft_n": s.proposed, "draft_n_accepted": s.accepted}
        if self.logprobs and not stream:
            final["completion_probabilities"] = llama_probabilities(self.logprobs, self.text)
        return [flatten(final, self.fields) if self.fields else final]


def flatten(obj: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: each `a/b` path that exists, keyed by the path itself; others left out."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = obj
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out
