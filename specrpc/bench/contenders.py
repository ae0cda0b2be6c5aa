"""In-process contenders on the same pair and prompts: this engine (adaptive, fixed k, prompt lookup, target-only),
transformers `generate` with the target alone, and transformers assisted generation with the draft."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from specrpc.engine.engine import Engine
from specrpc.engine.generation import GenerationRequest
from specrpc.engine.policy import AdaptivePolicy
from specrpc.engine.sampling import SamplingParams


@dataclass
class Run:
    """One request's measurements."""

    tokens: list[int]
    ttft_s: float
    total_s: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    ks: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    trials: int = 0  # draft tokens tested: accepted ones plus the first rejection of each step
    server_ttft_s: float = 0.0  # through gRPC: the server's own TTFT (request at the engine → first token)
    prefilled: int = 0  # through gRPC: prompt tokens the server prefilled (its prompt less those it found cached)
    prompt_tokens: int = 0  # through gRPC: the prompt's tokens as the server counted them
    reported_tokens_per_s: float = 0.0  # another server's own decode rate as it reports it (llama.cpp's timings)
    mask_s: float = 0.0  # host seconds in the grammar matcher (`Constraint.work_s`)
    transform_s: float = 0.0  # host seconds in the logits transform (`LogitsTransform.work_s`)


Runner = Callable[[list[int], int, SamplingParams], Run]


def decode_rate(run: Run) -> float:
    """One request's decode tokens/s (after the first token); 0 when it made fewer than two."""
    return (len(run.tokens) - 1) / (run.total_s - run.ttft_s) if len(run.tokens) > 1 and run.total_s > run.ttft_s \
        else 0.0


def engine_runner(engine: Engine, k: int | None, proposer: str, stop_token_ids: frozenset[int] = frozenset(),
                  slot_index: int = 0, draft_window: int | None = None) -> Runner:
    """This engine with a fixed k (None: adaptive policy) and proposer, on a slot emptied per request. Its policy
    carries over from request to request, as a server slot's does. Without `stop_token_ids` it decodes all n
    tokens (like `generate` with min_new_tokens); with the server's, it stops where the server would.
    `draft_window`: the draft's window during its requests (`--draft-window`; None: the engine's)."""
    policy = engine.new_policy(shared=False)  # judged by its own steps: contenders do not judge by each other's

    def run(prompt: list[int], n: int, params: SamplingParams) -> Run:
        request = GenerationRequest(prompt, n, params, num_draft_tokens=k, proposer=proposer,
                                    stop_token_ids=stop_token_ids)
        if draft_window is None or engine.draft is None:
            return measure(engine, slot_index, policy, request)
        kept, engine.draft.window = engine.draft.window, draft_window
        try:
            return measure(engine, slot_index, policy, request)
        finally:
            engine.draft.window = kept

    return run


def measure(engine: Engine, slot_index: int, policy: AdaptivePolicy, request: GenerationRequest) -> Run:
    """One request on slot `slot_index` emptied first, with `policy` (carried over by the caller), timed per step."""
    slot = engine.new_slot(slot_index, policy)
    t0 = time.perf_counter()
    gen = engine.start(slot, request)
    out: list[int] = []
    times: list[float] = []
    sizes: list[int] = []
    ks: list[int] = []
    trials = 0
    while not gen.finished:
        result = engine.step_one(gen)
        if result.token_ids:
            out += result.token_ids
            times.append(time.perf_counter() - t0)
            sizes.append(len(result.token_ids))
            ks.append(result.proposed)
            trials += result.accepted + (1 if result.accepted < result.proposed else 0)
    s = gen.stats
    return Run(out, times[0], times[-1], times, sizes, s.proposed, s.accepted, s.verify_steps, ks[1:],
               s.accepted_lengths, trials,
               mask_s=gen.constraint.work_s if gen.constraint is not None else 0.0,
               transform_s=gen.transform.work_s if gen.transform is not None else 0.0)


class _Clock(BaseStreamer):
    """Records when transformers emits each new token (the first `put` is the prompt)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def hf_runner(target: torch.nn.Module, assistant: torch.nn.Module | None, eos: int | None) -> Runner:
    """transformers `generate` on the target alone, or with `assistant_model=` the draft."""

    def run(prompt: list[int], n: int, params: SamplingParams) -> Run:
        ids = torch.tensor([prompt], device=target.device)  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n, "pad_token_id": eos,
                                  "eos_token_id": None}
        if params.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or None)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        t0 = time.perf_counter()
        clock = _Clock(t0)
        with torch.inference_mode():
            out = target.generate(ids, streamer=clock, **kwargs)  # type: ignore[operator]
        total = time.perf_counter() - t0
        tokens = out[0, len(prompt) :].tolist()
        times = clock.times or [total]
        return Run(tokens, times[0], total, times, [1] * len(times))

    return run
