"""llama.cpp's `llama-server` as a contender in `specrpc bench`: the peer a CPU user would run, on the same pair
converted to GGUF by llama.cpp's own converter (tools/convert_gguf.py), fed the same prompt token ids, greedy, the
same number of threads. Per target: plain (the target alone) and a sweep of llama.cpp's speculative settings
(`SWEEP`), each its own contender, so the comparison is against llama.cpp tuned, not left at its defaults: the
draft model (`-md`, `--spec-type draft-simple`) at `--spec-draft-n-max` 3, 8 and 16 with `--spec-draft-p-min` 0
and 0.5 (llama.cpp's defaults are 3 and 0), and the model-free `ngram-mod` and `ngram-cache` types at their own
defaults (spellings from this llama.cpp's common/arg.cpp and common/speculative.cpp).

Each request is a non-streamed `/completion` with `cache_prompt` off (the whole prompt is processed, as the engine
contenders' emptied slots do) and `ignore_eos` (all n tokens are decoded, as theirs are). Its figures come from the
server's own `timings`: the first token at `prompt_ms`, the rest over `predicted_ms`, so the decode rate
(n - 1) / predicted_ms is measured the way the engine contenders' is (llama.cpp's `predicted_per_second` counts the
first token too, which its prompt pass produced; it is kept in the run as reported).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrpc.bench.common import free_port
from specrpc.bench.contenders import Run, Runner
from specrpc.engine.sampling import SamplingParams

SKIP_LINE = ("llama.cpp: skipped (no --llama-server binary given; build llama.cpp's llama-server and convert the "
             "pair with tools/convert_gguf.py, see docs/benchmarks.md)")


@dataclass(frozen=True)
class SpecSetting:
    """One speculative setting of llama-server: `draft-simple` (the draft model) with its draft length and minimum
    draft probability, or a model-free n-gram type at its own defaults."""

    kind: str  # a `--spec-type` value: draft-simple, ngram-mod or ngram-cache
    n_max: int = 0  # draft-simple: --spec-draft-n-max
    p_min: float = 0.0  # draft-simple: --spec-draft-p-min (greedy: stop drafting below this draft probability)

    @property
    def key(self) -> str:
        """The name `--llama-spec` takes, e.g. `draft-8-0.5`, `ngram-mod`."""
        return f"draft-{self.n_max}-{self.p_min:g}" if self.uses_draft else self.kind

    @property
    def uses_draft(self) -> bool:
        """Whether the setting drafts with the draft model (needs a --gguf-draft)."""
        return self.kind == "draft-simple"

    def args(self) -> list[str]:
        """Its llama-server flags (the draft model's path and threads come from `LlamaServerSpec.command`)."""
        out = ["--spec-type", self.kind]
        if self.uses_draft:
            out += ["--spec-draft-n-max", str(self.n_max), "--spec-draft-p-min", f"{self.p_min:g}"]
        return out


SWEEP = tuple([SpecSetting("draft-simple", n, p) for n in (3, 8, 16) for p in (0.0, 0.5)]
              + [SpecSetting("ngram-mod"), SpecSetting("ngram-cache")])
"""llama.cpp's speculative settings each target runs under (draft-3-0 is llama.cpp's own default)."""


def sweep(keys: str) -> list[SpecSetting]:
    """The `SWEEP` settings named in `keys` (comma-separated `SpecSetting.key`s; `all`: every one; `none`: plain
    only). ValueError naming the unknown key."""
    if keys == "all":
        return list(SWEEP)
    if keys == "none":
        return []
    by_key = {s.key: s for s in SWEEP}
    out = []
    for key in (k.strip() for k in keys.split(",") if k.strip()):
        if key not in by_key:
            raise ValueError(f"--llama-spec {key}: not one of all, none, {', '.join(by_key)}")
        out.append(by_key[key])
    return out


@dataclass(frozen=True)
class LlamaServerSpec:
    """One llama-server contender: a target GGUF, plain or under one speculative setting (with the draft GGUF when
    the setting drafts with a model)."""

    binary: Path
    target: Path
    draft: Path | None
    threads: int
    setting: SpecSetting | None = None
    context: int = 2048

    @property
    def name(self) -> str:
        """Contender name, e.g. `llama.cpp target-f32`, `llama.cpp target-f32 + draft-f32 draft-8-0.5` or
        `llama.cpp target-f32 ngram-mod`."""
        plain = f"llama.cpp {self.target.stem}"
        if self.setting is None:
            return plain
        return f"{plain} + {self.draft.stem} {self.setting.key}" if self.draft else f"{plain} {self.setting.key}"

    def command(self, port: int) -> list[str]:
        """The command line: loopback, one slot, no web UI, `threads` for prompt and decode, target, and the
        setting's speculation (with -md alone this llama.cpp drafts nothing: its default type is none)."""
        cmd = [str(self.binary), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(self.context), "-np", "1", "--no-webui"]
        if self.threads:
            cmd += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.draft is not None:
            cmd += ["-md", str(self.draft)]
            if self.threads:
                cmd += ["-td", str(self.threads), "-tbd", str(self.threads)]
        if self.setting is not None:
            cmd += self.setting.args()
        return cmd


def specs(binary: str | None, targets: list[str], drafts: list[str], threads: int,
          settings: Sequence[SpecSetting] = SWEEP) -> list[LlamaServerSpec]:
    """Per target GGUF: a plain contender, one per draft setting of `settings` with the draft GGUF at the same
    position (when given), and one per model-free setting. Empty without a binary; ValueError naming the flag when a
    file is missing or counts disagree."""
    if not binary:
        return []
    path = Path(binary)
    if not path.is_file():
        raise ValueError(f"--llama-server {binary}: no such file (give the llama-server binary)")
    if not targets:
        raise ValueError("--llama-server needs at least one --gguf-target")
    if drafts and len(drafts) != len(targets):
        raise ValueError(f"--gguf-draft given {len(drafts)} times for {len(targets)} --gguf-target: one per target, "
                         "in the same order")
    for flag, f in [*(("--gguf-target", t) for t in targets), *(("--gguf-draft", d) for d in drafts)]:
        if not Path(f).is_file():
            raise ValueError(f"{flag} {f}: no such file")
    out: list[LlamaServerSpec] = []
    for i, target in enumerate(targets):
        out.append(LlamaServerSpec(path, Path(target), None, threads))
        for s in settings:
            if not s.uses_draft:
                out.append(LlamaServerSpec(path, Path(target), None, threads, s))
            elif drafts:
                out.append(LlamaServerSpec(path, Path(target), Path(drafts[i]), threads, s))
    return out


class LlamaServer:
    """A running llama-server process (a context manager: started on enter, terminated on exit)."""

    def __init__(self, spec: LlamaServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until /health answers 200 (the models are loaded)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.spec.name}: llama-server exited with {self.process.returncode} "
                                   f"(see {self.log_path})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.spec.name}: llama-server not ready after {timeout_s:.0f} s (see {self.log_path})")

    def complete(self, prompt: list[int], n: int) -> dict[str, Any]:
        """One greedy, non-streamed /completion of `n` tokens after the token ids `prompt`."""
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            result: dict[str, Any] = json.loads(reply.read())
        return result

    def runner(self) -> Runner:
        """A bench Runner (greedy only: llama-server's sampling differs from ours, so only greedy compares)."""

        def run(prompt: list[int], n: int, params: SamplingParams) -> Run:
            if not params.greedy:
                raise ValueError("the llama.cpp contenders run greedy only (--temperature 0)")
            return to_run(self.complete(prompt, n))

        return run


def to_run(reply: dict[str, Any]) -> Run:
    """A /completion reply as a Run: the first token at prompt_ms, the last at prompt_ms + predicted_ms (the
    server's own clock), draft counts when it speculated."""
    t = reply["timings"]
    tokens = [int(i) for i in reply.get("tokens", [])]
    ttft = float(t["prompt_ms"]) / 1e3
    total = ttft + float(t["predicted_ms"]) / 1e3
    rest = max(0, len(tokens) - 1)
    proposed, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
    return Run(tokens, ttft, total, [ttft, total] if rest else [ttft], [1, rest] if rest else [1], proposed, accepted,
               server_ttft_s=ttft, reported_tokens_per_s=float(t.get("predicted_per_second", 0.0)))
