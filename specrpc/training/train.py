"""Train the default target and draft: `python -m specrpc.training.train` (what `make models` runs).

Phases, each resumable: tokenizer → encoded corpus (`corpus.build_corpus`, with its manifest) → joint training
(target on next-token loss, draft distilled from the target's current distributions) → draft-only distillation from
the final target → export as Hugging Face directories in bfloat16, sharded at 16 MiB, the manifest beside them.
Rows mix plain windows and fill-in-the-middle layouts (`layouts`). Plans: `gpu` trains from scratch with a tokenizer
of its own; `cpu` continues the shipped pair (warm start from `--init-from`, by default the shipped assets, keeping
its tokenizer); `smoke` is the test suite's tiny run. Work files live in `--work-dir` (git-ignored); a checkpoint is
written every `--checkpoint-every` steps and the run resumes from it when restarted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specrpc.prompts.fim import declare_fim
from specrpc.training.corpus import Corpus, SourceFile, build_corpus, split_sources
from specrpc.training.layouts import LAYOUTS, Documents, RowBuilder, folder_groups
from specrpc.training.lock import hold
from specrpc.training.manifest import encode_files, manifest
from specrpc.training.tokenizer import EOT, FILE_SEP, SPECIAL_TOKENS, train_tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
VAL_BATCHES = 8
PROBE_STEPS = 20  # steps timed before a time budget fixes a phase's length; inside the warm-up, so the LR is exact
FIM_TEMPLATE, FIM_ORDERS = "specrpc", ("psm", "spm")  # what the export declares in tokenizer_config.json "fim"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # copied in this order: tokenizer.json marks it done


@dataclass(frozen=True)
class ModelShape:
    """Llama dimensions."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int


@dataclass(frozen=True)
class TrainPlan:
    """Everything that decides the result of a training run."""

    target: ModelShape
    draft: ModelShape
    vocab_size: int = 8192
    seq_len: int = 2048
    batch: int = 16
    joint_steps: int = 1500
    draft_steps: int = 300
    lr_target: float = 1.5e-3
    lr_draft: float = 2e-3
    warmup: int = 100
    mix: tuple[float, float, float, float] = (0.4, 0.2, 0.2, 0.2)  # rows per layout: plain, psm, spm, repo
    seed: int = 1234
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    val_fraction: float = 0.015
    eval_every: int = 100
    dropout: float = 0.0  # on the target's attention and MLP outputs while training
    warm_start: bool = False  # the joint phase starts from --init-from's pair (default: the shipped one), its tokenizer
    corpus_max_files: int = 0  # a fixed subset of the corpus candidates (0: all)


# The shipped pair's shapes: 25.2M + 3.6M parameters, 58.6 MB in bf16 with both tokenizer copies (60 MB budget).
TARGET_SHAPE = ModelShape(hidden=512, layers=8, heads=8, kv_heads=2, ffn=1280)
DRAFT_SHAPE = ModelShape(hidden=256, layers=2, heads=4, kv_heads=1, ffn=768)
PLANS: dict[str, TrainPlan] = {
    # Continue the shipped pair on the broad corpus: 2048-token windows, the new layouts, a restarted cosine schedule
    # at a third of the from-scratch peak, no dropout (the corpus is seen about once). 3000 joint steps of 4 × 2048
    # tokens = 24.6M tokens; then 400 draft-only steps against the final target.
    "cpu": TrainPlan(
        target=TARGET_SHAPE, draft=DRAFT_SHAPE, batch=4, joint_steps=3000, draft_steps=400,
        lr_target=5e-4, lr_draft=6e-4, warmup=30, eval_every=100, warm_start=True,
    ),
    # From scratch on the device's own installed sources, with its own tokenizer: 16 × 2048 tokens a step (as many as
    # the first pair's 32 × 1024), 4000 steps = 131M tokens, a few epochs of the broad corpus. The first pair's draft
    # needed the long distillation (4500 draft-only steps raised its agreement from 0.48 to 0.59 there).
    "gpu": TrainPlan(
        target=TARGET_SHAPE, draft=DRAFT_SHAPE, batch=16, joint_steps=4000, draft_steps=4500,
        dropout=0.05, warmup=200, eval_every=250,
    ),
    "smoke": TrainPlan(
        target=ModelShape(hidden=64, layers=2, heads=2, kv_heads=1, ffn=128),
        draft=ModelShape(hidden=32, layers=1, heads=1, kv_heads=1, ffn=64),
        batch=2, seq_len=256, joint_steps=4, draft_steps=2, warmup=1, dropout=0.1, corpus_max_files=150,
    ),
}


def llama_config(shape: ModelShape, plan: TrainPlan, special: dict[str, int]) -> LlamaConfig:
    """A LlamaConfig for one of the pair."""
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=plan.vocab_size,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.ffn,
        max_position_embeddings=plan.max_position_embeddings,
        rope_theta=plan.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special[EOT],
        eos_token_id=special[EOT],
        pad_token_id=special[EOT],
        attn_implementation="sdpa",
    )


def add_residual_dropout(model: LlamaForCausalLM, p: float) -> None:
    """Dropout on every attention and MLP output before it joins the residual stream (active in train mode only).
    The corpus is small (8M tokens), so the target sees it many times; this keeps it from memorising it."""
    if p <= 0:
        return

    def hook(module: torch.nn.Module, _inputs: object, output: object) -> object:
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)  # type: ignore[arg-type]

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def stream_of(ids: list[np.ndarray], special: dict[str, int]) -> np.ndarray:
    """Files' ids joined as `<|file_sep|>` ids `<|endoftext|>` into one uint16 token stream. # [T]"""
    sep, eot = np.array([special[FILE_SEP]], np.uint16), np.array([special[EOT]], np.uint16)
    return np.concatenate([part for file_ids in ids for part in (sep, file_ids, eot)] or [sep[:0]])


def sample_batch(builder: RowBuilder, plan: TrainPlan, step: int, fim: bool = True, stream: int = 0) -> torch.Tensor:
    """A deterministic batch for `step` (resume-safe: no RNG state to save), each row's layout drawn from the plan's
    mix (all plain when not `fim`). Returns [B, L+1] int64."""
    rng = np.random.default_rng([plan.seed, stream, step])
    mix = np.asarray(plan.mix, dtype=np.float64)
    rows = []
    for _ in range(plan.batch):
        layout = LAYOUTS[int(rng.choice(len(LAYOUTS), p=mix / mix.sum()))] if fim else "plain"
        rows.append(builder.row(layout, plan.seq_len + 1, rng))  # [L+1]
    return torch.from_numpy(np.stack(rows))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft against the target's distribution (= KL up to a constant)."""
    t = F.softmax(target_logits.float(), dim=-1)  # [B, L, V]
    return -(t * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1).mean()


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (the fused kernel on CUDA)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


@torch.no_grad()
def validation_loss(model: LlamaForCausalLM, val: RowBuilder, plan: TrainPlan, device: torch.device) -> float:
    """Mean next-token loss (nats) on fixed plain (non-FIM) windows of the validation tokens."""
    was_training = model.training
    model.eval()
    losses = []
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(VAL_BATCHES):
            batch = sample_batch(val, plan, i, fim=False, stream=1).to(device)  # [B, L+1]
            logits = model(input_ids=batch[:, :-1]).logits  # [B, L, V]
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def hardware(device: torch.device) -> str:
    """What trained the pair, for the model card."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def steps_for(seconds: float, done: int, per_step_s: float) -> int:
    """How many steps in total fit when `done` steps are done and `seconds` remain at `per_step_s` each."""
    return done + max(1, int(seconds / per_step_s))


def save_checkpoint(path: Path, state: dict[str, object]) -> None:
    """Atomic write: a crash mid-save never leaves a broken checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def export(model: LlamaForCausalLM, tokenizer_dir: Path, out_dir: Path, special: dict[str, int]) -> None:
    """Save as a Hugging Face directory: bf16 safetensors in 16 MiB shards, tokenizer (declaring its FIM template and
    orders), generation config."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(
        bos_token_id=special[EOT], eos_token_id=special[EOT], pad_token_id=special[EOT]
    )
    model.save_pretrained(str(out_dir), max_shard_size=16 * 1024 * 1024)
    PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out_dir))
    declare_fim(out_dir, FIM_TEMPLATE, FIM_ORDERS)
    model.to(torch.float32)  # type: ignore[arg-type]


def fit_phase(plan: TrainPlan, joint: bool, budget_s: float, step: int, per_step_s: float) -> TrainPlan:
    """`plan` with the current phase's step count cut to what `budget_s` more seconds allow from `step` (never
    raised above the plan's own count)."""
    if joint:
        fit = steps_for(budget_s * 0.97, step, per_step_s)  # 3 %: evaluations
        return replace(plan, joint_steps=min(plan.joint_steps, fit))
    fit = steps_for(budget_s, step, per_step_s) - plan.joint_steps
    return replace(plan, draft_steps=min(plan.draft_steps, fit))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/models"), help="checkpoints, the encoded "
                        "corpus and the tokenizer (delete it to start over)")
    parser.add_argument("--out-dir", type=Path, default=ASSETS, help="where the target/ and draft/ folders go")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--plan", default="auto", choices=["auto", *PLANS], help="model sizes and step counts")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--joint-steps", type=int, default=0,
                        help="override the plan's joint steps (0: keep); on resume, re-plans the schedule's rest")
    parser.add_argument("--draft-steps", type=int, default=0,
                        help="override the plan's draft-only steps (0: keep; likewise on resume)")
    parser.add_argument("--joint-seconds", type=float, default=0, help="fit the joint phase into this wall time, "
                        "timed from its first steps, the plan's step count as a cap (0: the step count)")
    parser.add_argument("--draft-seconds", type=float, default=0, help="likewise for the draft-only phase")
    parser.add_argument("--batch", type=int, default=0, help="override the plan's batch size (0: keep)")
    parser.add_argument("--seq-len", type=int, default=0, help="override the plan's window length (0: keep)")
    parser.add_argument("--lr-draft", type=float, default=0, help="override the plan's draft learning rate (0: keep)")
    parser.add_argument("--stop-after", type=int, default=0, help="leave a checkpoint and exit after this many "
                        "steps of this run (0: run to the end); the next run resumes there")
    parser.add_argument("--init-from", type=Path, help="a folder with target/ and draft/ exported by an earlier run: "
                        "start from those weights and their tokenizer, at the joint phase on a warm-start plan (cpu; "
                        "default there: the shipped pair), else at the draft-only phase (distil the draft further)")
    parser.add_argument("--warm-start", action="store_true", help="make any plan a warm-start plan (as cpu is): "
                        "continue --init-from's pair from the joint phase")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Data:
    """What the training loop reads: the tokenizer folder, its special ids, and row builders over the training
    files and over the validation files."""

    tokenizer_dir: Path
    special: dict[str, int]
    train: RowBuilder
    val: RowBuilder


def stream_order(f: SourceFile) -> str:
    """Files enter the stream ordered by a hash of source and path: validation (the stream's tail) is a mixed sample."""
    return hashlib.sha1(f"{f.source}/{f.relpath}".encode()).hexdigest()


def encode_corpus(work: Path, plan: TrainPlan, tok: Tokenizer, special: dict[str, int], corpus: Corpus) -> None:
    """Encode the training split once into work/: the manifest (corpus.json), the validation stream (val.npy: the
    last files in stream order, `val_fraction` of the tokens, never trained on), the training files' texts
    (documents.bin/.json) and their stream (train.npy, written last: its presence marks this phase done)."""
    files = sorted(split_sources(corpus.files)[0], key=stream_order)
    ids = encode_files(tok, files)
    counts = {(f.source, f.relpath): len(i) for f, i in zip(files, ids, strict=True)}
    (work / "corpus.json").write_text(json.dumps(manifest(corpus, counts), indent=1) + "\n")
    total, n_val, held = sum(len(i) + 2 for i in ids), 0, 0
    while held < total * plan.val_fraction and n_val < len(files) - 1:
        n_val += 1
        held += len(ids[-n_val]) + 2
    fit = len(files) - n_val
    np.save(work / "val.npy", stream_of(ids[fit:], special))
    texts = [f.text.encode() for f in files[:fit]]
    (work / "documents.bin").write_bytes(b"".join(texts))
    (work / "documents.json").write_text(json.dumps({
        "relpaths": [f.relpath for f in files[:fit]], "sources": [f.source for f in files[:fit]],
        "tokens": [len(i) + 2 for i in ids[:fit]], "offsets": np.cumsum([0, *map(len, texts)]).tolist(),
    }))
    np.save(work / "train.npy", stream_of(ids[:fit], special))


def prepare_data(work: Path, plan: TrainPlan, init_from: Path | None) -> Data:
    """The tokenizer (into work/tokenizer once: `init_from`'s when given, else trained on the training split) and the
    encoded corpus (`encode_corpus`, once), loaded for the training loop."""
    tok_dir = work / "tokenizer"
    corpus: Corpus | None = None
    if not (tok_dir / "tokenizer.json").exists():
        tok_dir.mkdir(parents=True, exist_ok=True)
        if init_from is not None:
            for name in TOKENIZER_FILES:
                shutil.copyfile(init_from / "target" / name, tok_dir / name)
        else:
            corpus = build_corpus(plan.corpus_max_files)
            train_files = split_sources(corpus.files)[0]
            print(f"training tokenizer on {len(train_files)} files", flush=True)
            train_tokenizer((f.text for f in train_files), plan.vocab_size, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    special: dict[str, int] = {}
    for name in SPECIAL_TOKENS:
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise SystemExit(f"{tok_dir} lacks the special token {name}: delete it to retrain the tokenizer")
        special[name] = token_id
    if not (work / "train.npy").exists():
        encode_corpus(work, plan, tok, special, corpus or build_corpus(plan.corpus_max_files))
    index = json.loads((work / "documents.json").read_text())
    docs = Documents((work / "documents.bin").read_bytes(), np.asarray(index["offsets"], dtype=np.int64),
                     index["relpaths"], np.asarray(index["tokens"], dtype=np.int64),
                     folder_groups(list(zip(index["sources"], index["relpaths"], strict=True))))
    data, val = np.load(work / "train.npy"), np.load(work / "val.npy")
    print(f"corpus: {len(data):,} training tokens in {len(docs.relpaths):,} files, {len(val):,} validation tokens",
          flush=True)
    return Data(tok_dir, special, RowBuilder(tok, special, data, docs), RowBuilder(tok, special, val, docs))


def write_training_record(out_dir: Path, plan: TrainPlan, device: torch.device, elapsed: float, tokens_seen: int,
                          data: Data, best_val: float) -> None:
    """training.json beside the exported models: what the model card reports about the run."""
    (out_dir / "training.json").write_text(json.dumps({
        "plan": asdict(plan), "layouts": list(LAYOUTS), "device": str(device), "hardware": hardware(device),
        "threads": torch.get_num_threads(), "training_seconds": round(elapsed),
        "tokens_seen_target": plan.joint_steps * plan.batch * plan.seq_len, "tokens_seen_draft": tokens_seen,
        "corpus_train_tokens": len(data.train.stream), "validation_tokens": len(data.val.stream),
        "best_validation_loss": best_val, "python": platform.python_version(),
    }, indent=2))


def main() -> None:
    args = parse_args()

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    plan = PLANS[args.plan if args.plan != "auto" else ("gpu" if device.type == "cuda" else "cpu")]
    plan = replace(plan, joint_steps=args.joint_steps or plan.joint_steps,
                   draft_steps=args.draft_steps or plan.draft_steps, batch=args.batch or plan.batch,
                   seq_len=args.seq_len or plan.seq_len, lr_draft=args.lr_draft or plan.lr_draft,
                   warm_start=plan.warm_start or args.warm_start)
    if plan.seq_len > plan.max_position_embeddings:
        raise SystemExit(f"--seq-len {plan.seq_len} exceeds the models' {plan.max_position_embeddings} positions")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)

    init_from: Path | None = args.init_from or (ASSETS if plan.warm_start else None)
    data = prepare_data(work, plan, init_from)
    special = data.special

    torch.manual_seed(plan.seed)
    target = LlamaForCausalLM(llama_config(plan.target, plan, special)).to(device)  # type: ignore[arg-type]
    draft = LlamaForCausalLM(llama_config(plan.draft, plan, special)).to(device)  # type: ignore[arg-type]
    add_residual_dropout(target, plan.dropout)
    opt_t, opt_d = make_optimizer(target, plan.lr_target), make_optimizer(draft, plan.lr_draft)
    step, elapsed, tokens_seen = 0, 0.0, 0
    best_val, best_target = math.inf, None
    sized = {"joint": not args.joint_seconds, "draft": not args.draft_seconds}
    ckpt_path = work / "checkpoint.pt"
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        target.load_state_dict(state["target"])
        draft.load_state_dict(state["draft"])
        opt_t.load_state_dict(state["opt_target"])
        opt_d.load_state_dict(state["opt_draft"])
        step, elapsed, tokens_seen = state["step"], state["elapsed_s"], state["tokens_seen"]
        best_val, best_target = state.get("best_val", math.inf), state.get("best_target")
        if "plan" in state:  # the step counts a time budget fixed stay fixed, unless given again explicitly
            plan = replace(plan, joint_steps=args.joint_steps or state["plan"]["joint_steps"],
                           draft_steps=args.draft_steps or state["plan"]["draft_steps"])
            sized = state.get("sized", sized)
            replanned = args.joint_steps and args.joint_steps != state["plan"]["joint_steps"]
            if step > plan.joint_steps + plan.draft_steps or (replanned and step > plan.joint_steps):
                raise SystemExit(f"the checkpoint is at step {step}, past the steps asked for")
        print(f"resumed at step {step}", flush=True)
    elif init_from is not None:
        for model, name in ((target, "target"), (draft, "draft")):
            loaded = LlamaForCausalLM.from_pretrained(str(init_from / name), dtype=torch.float32)
            model.load_state_dict(loaded.state_dict())
        if not plan.warm_start:
            step, sized["joint"] = plan.joint_steps, True
        print(f"initialised from {init_from}: {'joint training' if plan.warm_start else 'draft-only distillation'}",
              flush=True)
    (work / "plan.json").write_text(json.dumps(asdict(plan), indent=2))

    log = (work / "train_log.jsonl").open("a")

    def checkpoint() -> None:
        """The log up to this step first, then the state: the log is never behind the checkpoint."""
        log.flush()
        save_checkpoint(ckpt_path, {
            "step": step, "elapsed_s": elapsed, "tokens_seen": tokens_seen, "plan": asdict(plan), "sized": sized,
            "best_val": best_val, "best_target": best_target,
            "target": target.state_dict(), "draft": draft.state_dict(),
            "opt_target": opt_t.state_dict(), "opt_draft": opt_d.state_dict(),
        })

    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    bar = tqdm(total=plan.joint_steps + plan.draft_steps, initial=step, desc="train", dynamic_ncols=True)
    phase_t0, phase_step0 = time.time(), step
    run_start = step
    while step < plan.joint_steps + plan.draft_steps:
        if args.stop_after and step - run_start >= args.stop_after:
            checkpoint()
            print(f"\nstopped at step {step} (--stop-after); run again to resume", flush=True)
            return
        t0 = time.time()
        batch = sample_batch(data.train, plan, step).to(device)  # [B, L+1]
        x, y = batch[:, :-1], batch[:, 1:]
        joint = step < plan.joint_steps
        record: dict[str, float] = {"step": step}
        if joint:
            target.train()
            for g in opt_t.param_groups:
                g["lr"] = lr_at(step, plan.joint_steps, plan.lr_target, plan.warmup)
            with amp:
                t_logits = target(input_ids=x).logits  # [B, L, V]
            loss_t = F.cross_entropy(t_logits.float().flatten(0, 1), y.flatten())
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            opt_t.step()
            opt_t.zero_grad(set_to_none=True)
            teacher = t_logits.detach()
            record["target_loss"] = loss_t.item()
            d_lr = lr_at(step, plan.joint_steps, plan.lr_draft, plan.warmup)
        else:
            target.eval()
            with torch.no_grad(), amp:
                teacher = target(input_ids=x).logits  # [B, L, V]
            d_lr = lr_at(step - plan.joint_steps, plan.draft_steps, plan.lr_draft * 0.3, 10)
        for g in opt_d.param_groups:
            g["lr"] = d_lr
        with amp:
            d_logits = draft(input_ids=x).logits  # [B, L, V]
        loss_d = distill_loss(d_logits, teacher)
        loss_d.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        record["draft_loss"] = loss_d.item()
        step += 1
        tokens_seen += x.numel()
        elapsed += time.time() - t0

        # A time budget fixes a phase's step count from its first steps (3 untimed, then PROBE_STEPS timed).
        phase = "joint" if joint else "draft"
        done_in_phase = step - phase_step0
        if done_in_phase == 3:
            phase_t0 = time.time()
        probe = PROBE_STEPS if joint else 6
        if not sized[phase] and done_in_phase == 3 + probe:
            per_step = (time.time() - phase_t0) / probe
            budget = (args.joint_seconds if joint else args.draft_seconds) - (3 + probe) * per_step
            plan = fit_phase(plan, joint, budget, step, per_step)
            sized[phase] = True
            bar.total = plan.joint_steps + plan.draft_steps
            print(f"\n{phase} phase: {per_step * 1000:.1f} ms/step, {bar.total} steps in all", flush=True)

        if joint and (step % plan.eval_every == 0 or step == plan.joint_steps):
            record["val_loss"] = validation_loss(target, data.val, plan, device)
            if record["val_loss"] < best_val:
                best_val = record["val_loss"]
                best_target = {k: v.detach().to("cpu", copy=True) for k, v in target.state_dict().items()}
                record["best"] = 1
        if step == plan.joint_steps and best_target is not None:
            target.load_state_dict(best_target)  # the draft-only phase distils from the target that ships
        if step == plan.joint_steps:
            phase_t0, phase_step0 = time.time(), step
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in record.items() if k != "step"})
        log.write(json.dumps(record) + "\n")
        if step % args.checkpoint_every == 0 or step == plan.joint_steps + plan.draft_steps:
            checkpoint()
    bar.close()

    export(target.cpu(), data.tokenizer_dir, args.out_dir / "target", special)
    export(draft.cpu(), data.tokenizer_dir, args.out_dir / "draft", special)
    shutil.copyfile(work / "corpus.json", args.out_dir / "corpus.json")
    write_training_record(args.out_dir, plan, device, elapsed, tokens_seen, data, best_val)
    print(f"exported to {args.out_dir} after {elapsed / 60:.1f} min of training", flush=True)


if __name__ == "__main__":
    with hold():  # benchmarks, the soak and the long fuzz refuse to start beside a running training
        main()
