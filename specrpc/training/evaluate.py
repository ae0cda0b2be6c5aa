"""Measure the shipped pair and write its model card: `python -m specrpc.training.evaluate` (run by `make models`).

Sets: the held-out standard-library files, and each evaluation package (`corpus.EVALUATION_PACKAGES`, never in the
corpus). Figures (teacher-forced over held-out text, windows of `--window` tokens):
- bits per byte = total negative log-likelihood in bits ÷ UTF-8 bytes of the predicted tokens (tokenizer-independent);
- greedy agreement = fraction of positions where the draft's argmax equals the target's;
- acceptance at temperature 1 = mean over positions of Σ_x min(p(x), q(x)), the exact probability that speculative
  sampling accepts a draft token there;
- FIM next-line exact match, per order (PSM, SPM): `fim_eval`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specrpc.prompts.fim import declared_fim
from specrpc.training.corpus import EVALUATION_PACKAGES, SourceFile, evaluation_sources, is_heldout, iter_sources
from specrpc.training.fim_eval import fim_exact_match
from specrpc.training.tokenizer import FILE_SEP
from specrpc.training.train import ASSETS


def third_party_sources(limit_files: int = 60) -> list[SourceFile]:
    """Third-party code the pair never saw: up to `limit_files` files of each evaluation package."""
    return [f for name in EVALUATION_PACKAGES for f in evaluation_sources(name, limit_files)]


def token_stream(tok: PreTrainedTokenizerBase, files: list[SourceFile], max_tokens: int) -> list[int]:
    """Files joined as in training (`<|file_sep|>path\\n text <|endoftext|>`), cut at max_tokens."""
    sep = int(tok.convert_tokens_to_ids("<|file_sep|>"))  # type: ignore[arg-type]
    ids: list[int] = []
    for f in files:
        ids += [sep, *tok(f"{f.relpath}\n{f.text}", add_special_tokens=False).input_ids, tok.eos_token_id]
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


@torch.inference_mode()
def measure(target: torch.nn.Module, draft: torch.nn.Module, tok: PreTrainedTokenizerBase, ids: list[int],
            window: int) -> dict[str, float]:
    """bpb of both models, greedy agreement and T=1 acceptance over non-overlapping windows."""
    byte_len = np.array([len(tok.convert_tokens_to_string([t]).encode("utf-8")) if t not in tok.all_special_tokens
                         else 0 for t in tok.convert_ids_to_tokens(list(range(len(tok))))])
    nll_t = nll_d = 0.0
    nbytes = 0
    agree = accept = 0.0
    count = 0
    for lo in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[lo : lo + window + 1]).unsqueeze(0)  # [1, W+1]
        x, y = chunk[:, :-1], chunk[:, 1:]
        lt = target(input_ids=x).logits.float()[0]  # [W, V]
        ld = draft(input_ids=x).logits.float()[0]  # [W, V]
        nll_t += F.cross_entropy(lt, y[0], reduction="sum").item()
        nll_d += F.cross_entropy(ld, y[0], reduction="sum").item()
        nbytes += int(byte_len[y[0].numpy()].sum())
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        accept += torch.minimum(lt.softmax(-1), ld.softmax(-1)).sum(-1).sum().item()
        count += y.shape[1]
    ln2 = float(np.log(2))
    return {
        "tokens": count,
        "bytes": nbytes,
        "target_bits_per_byte": nll_t / ln2 / nbytes,
        "draft_bits_per_byte": nll_d / ln2 / nbytes,
        "target_loss_nats_per_token": nll_t / count,
        "greedy_agreement": agree / count,
        "acceptance_t1": accept / count,
    }


def sample_completion(model: torch.nn.Module, tok: PreTrainedTokenizerBase, prompt: str, path: str = "",
                      n: int = 48) -> str:
    """Greedy continuation, for the card; with `path`, the prompt opens that file (`<|file_sep|>path\\n` first, as
    the service's Generate frames it)."""
    if path:
        ids = torch.tensor([[tok.convert_tokens_to_ids(FILE_SEP), *tok(f"{path}\n{prompt}",
                                                                        add_special_tokens=False).input_ids]])
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False,  # type: ignore[operator]
                         pad_token_id=tok.eos_token_id)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def params(model: torch.nn.Module) -> int:
    """Parameter count (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", type=Path, default=ASSETS)
    parser.add_argument("--max-tokens", type=int, default=120_000, help="held-out tokens per evaluation set")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--fim-cases", type=int, default=48, help="held-out lines to complete per FIM order and "
                        "cursor kind (line start, mid-line)")
    args = parser.parse_args()
    tdir, ddir = args.assets / "target", args.assets / "draft"
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(tdir, local_files_only=True, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(ddir, local_files_only=True, dtype=torch.float32).eval()
    heldout = [f for f in iter_sources() if is_heldout(f.relpath)]
    sets = {"stdlib_heldout": heldout, **{f"third_party_{name}": evaluation_sources(name)
                                          for name in EVALUATION_PACKAGES}}
    results = {name: measure(target, draft, tok, token_stream(tok, files, args.max_tokens), args.window)
               for name, files in sets.items()}
    fim = {order: fim_exact_match(target, tok, [f for files in sets.values() for f in files], args.fim_cases, order)
           for order in ("psm", "spm")}
    training = json.loads((args.assets / "training.json").read_text())
    sample = sample_completion(target, tok, "def fibonacci(n):", path="fibonacci.py")
    sample_bare = sample_completion(target, tok, "def fibonacci(n):")
    weight_bytes = sum(p.stat().st_size for d in (tdir, ddir) for p in d.glob("*.safetensors"))
    manifest_path = args.assets / "corpus.json"
    card = {
        "results": results, "fim_next_line": fim, "training": training, "target_parameters": params(target),
        "draft_parameters": params(draft), "weight_bytes_on_disk": weight_bytes, "sample": sample,
        "sample_bare": sample_bare,
        "python": platform.python_version(), "heldout_files": len(heldout), "window": args.window,
        "corpus": json.loads(manifest_path.read_text()) if manifest_path.exists() else None,
        "fim_orders": list((declared_fim(tdir) or {}).get("orders", [])),
    }
    (args.assets / "model_card.json").write_text(json.dumps(card, indent=2))
    (args.assets / "MODEL_CARD.md").write_text(render(card))
    print(json.dumps({"results": results, "fim_next_line": fim}, indent=2))
    return 0


def shape_row(name: str, shape: dict[str, int], parameters: int) -> str:
    """One model's row of the card's size table."""
    return (f"| {name} | {shape['layers']} | {shape['hidden']} | {shape['heads']} ({shape['kv_heads']}) | "
            f"{shape['ffn']} | {parameters:,} |")


def provenance(training: dict[str, Any]) -> str:
    """The training run's own notes (where the shipped pair came from), as a list; empty when there are none."""
    notes = training.get("notes", [])
    return "".join(f"\n- {note}" for note in notes) + ("\n" if notes else "")


MIX_TEXT = {
    "plain": "plain windows of the stream",
    "psm": "prefix-suffix-middle",
    "spm": "suffix-prefix-middle",
    "repo": "repository form (1-2 files of the same folder first, then PSM or SPM at even odds)",
}


def corpus_section(card: dict[str, Any]) -> str:
    """The card's corpus section: the manifest's table when the run recorded its layouts (second-generation runs),
    else the first pair's standard-library-only description."""
    t: dict[str, Any] = card["training"]
    plan = t["plan"]
    manifest = card.get("corpus")
    if "layouts" not in t or not manifest:
        return f"""Only the Python standard library sources of the interpreter that ran the training
(Python {card['python']}): every `*.py` file outside `site-packages`/`dist-packages`, at most 400 kB, valid
UTF-8. Held out: files whose SHA-1 of the relative path is divisible by 40 ({card['heldout_files']} files). Each
file is one document:
`<|file_sep|>path\\n` + text + `<|endoftext|>`; training windows of {plan['seq_len']} tokens are drawn at random, and
{plan.get('fim_rate', 0.5):.0%} of them are rearranged prefix-suffix-middle (token level) for infilling.
"""
    rows = "\n".join(f"| {e['name']} | {e['version']} | {e['license']} | {e['files']:,} | {e['bytes']:,} | "
                     f"{e['tokens']:,} | {e['heldout_files']:,} |" for e in manifest["sources"])
    tot = manifest["totals"]
    excluded = "; ".join(f"{e['name']} {e['version']} ({e['reason']})" for e in manifest["excluded"])
    dropped = ", ".join(f"{v:,} {k}" for k, v in manifest["dropped_files"].items())
    mix = ", ".join(f"{share:.0%} {MIX_TEXT[name]}" for name, share in zip(t["layouts"], plan["mix"], strict=True))
    evaluation = ", ".join(f"`{name}`" for name in manifest["evaluation_packages"])
    return f"""The Python standard library and the Python sources of the distributions installed beside the training run
(Python {card['python']}), under permissive or file-level licenses only (`specrpc/training/licenses.py`), selected by
`specrpc/training/corpus.py`: no generated files, no exact or near duplicates (MinHash over line shingles), no file
over {manifest['rules']['max_file_bytes']:,} bytes. Files whose SHA-1 of the relative path is divisible by
{manifest['rules']['heldout_modulus']} are held out. The evaluation packages {evaluation} are kept out entirely
(and files nearly duplicating theirs). Manifest: `specrpc/assets/corpus.json` (training split; tokens with this
pair's tokenizer, two special tokens per file).

| distribution | version | license | files | bytes | tokens | held-out files |
| --- | --- | --- | --- | --- | --- | --- |
{rows}
| **total** | | | {tot['files']:,} | {tot['bytes']:,} | {tot['tokens']:,} | {tot['heldout_files']:,} |

Left out: {excluded or 'nothing'}. Files dropped: {dropped or 'none'}.

Layouts (`specrpc/training/layouts.py`), rows of {plan['seq_len']} tokens: {mix}. Spellings:
- PSM: `<|fim_prefix|>` [`<|file_sep|>`path`\\n`] prefix `<|fim_suffix|>` suffix `<|fim_middle|>` middle `<|endoftext|>`
- SPM (llama.cpp `--spm-infill`): `<|fim_suffix|>` suffix `<|fim_prefix|>` [`<|file_sep|>`path`\\n`] prefix
  `<|fim_middle|>` middle `<|endoftext|>`
- repository: extra files first, each `<|file_sep|>`path`\\n`text`<|endoftext|>`, then the FIM block.
FIM examples are cut from a file's text before tokenization, the cursor at any character (middles may start after a
partial line); the path header is there when the prefix starts the file, in half of the other examples, and always
in the repository form. `tokenizer_config.json` declares `"fim": {{"template": "specrpc", "orders": ["psm", "spm"]}}`.
"""


def reproduce_section(t: dict[str, Any]) -> str:
    """The exact commands."""
    if "layouts" not in t:
        return """`make models` (= `python -m specrpc.training.train` then `python -m specrpc.training.evaluate`):
trains from scratch with progress bars, checkpoints every 50 steps to `.cache/models/` and resumes from there when
restarted. On a CUDA machine the same command trains the larger `gpu` plan.
"""
    return """- Corpus manifest only: `python -m specrpc.training.manifest` (rewrites `specrpc/assets/corpus.json`).
- CPU (continue the shipped pair): `make models ARGS="--plan cpu"`; stop it at any time, the same command resumes from
  `.cache/models/` (`--work-dir` for another folder, `--stop-after N` to stop after N steps).
- GPU (from scratch on that machine's own installed sources, its own tokenizer): `make models ARGS="--plan gpu"`,
  then bring back `specrpc/assets/{target,draft,training.json,corpus.json}`.
- The card alone: `python -m specrpc.training.evaluate`.
"""


def render(card: dict[str, Any]) -> str:
    """The Markdown model card."""
    r: dict[str, dict[str, float]] = card["results"]
    t: dict[str, Any] = card["training"]
    plan = t["plan"]
    rows = "\n".join(
        f"| {name} | {v['tokens']:,} | {v['target_bits_per_byte']:.3f} | {v['draft_bits_per_byte']:.3f} | "
        f"{v['greedy_agreement']:.3f} | {v['acceptance_t1']:.3f} |"
        for name, v in r.items()
    )
    fim = card.get("fim_next_line") or {}
    fim_orders = card.get("fim_orders") or []
    fim_rows = "\n".join(f"| {order.upper()} | {v['cases']} | {v['line_start']:.3f} | {v['mid_line']:.3f} |"
                         for order, v in fim.items())
    fim_table = (f"""
Fill-in-the-middle, next-line exact match of the target on held-out code (`specrpc/training/fim_eval.py`):

| order | cases of each kind | exact match, cursor at line start | exact match, cursor mid-line |
| --- | --- | --- | --- |
{fim_rows}
""" if fim else "")
    warm = " Continued from the previous pair's weights (warm start)." if plan.get("warm_start") else ""
    return f"""# specrpc default models: model card

A byte-level BPE tokenizer ({plan['vocab_size']} tokens, with `<|endoftext|>`, `<|fim_prefix|>`, `<|fim_suffix|>`,
`<|fim_middle|>` and `<|file_sep|>`), a Llama-architecture **target** and a Llama-architecture **draft** sharing it.
The embedded default of `specrpc serve` and the fixture of its tests; not a general-purpose model.

## Fill-in-the-middle spelling
Both orders, as `specrpc/fim.py` (template `specrpc`) builds them and the training layouts write them:
- prefix-suffix-middle: `<|fim_prefix|>` [`<|file_sep|>`path`\n`] prefix `<|fim_suffix|>` suffix `<|fim_middle|>`
  middle `<|endoftext|>`;
- suffix-prefix-middle (llama.cpp's `--spm-infill` order): `<|fim_suffix|>` suffix `<|fim_prefix|>`
  [`<|file_sep|>`path`\n`] prefix `<|fim_middle|>` middle `<|endoftext|>`;
- repository form: extra files first, each `<|file_sep|>`path`\n`text`<|endoftext|>`, then the block above.

This pair declares the orders it was trained with in `tokenizer_config.json`: `"fim": {{"template": "specrpc",
"orders": {json.dumps(fim_orders)}}}`.

## Corpus
{corpus_section(card)}
## Models
| | layers | hidden | heads (kv) | ffn | parameters |
| --- | --- | --- | --- | --- | --- |
{shape_row("target", plan["target"], card["target_parameters"])}
{shape_row("draft", plan["draft"], card["draft_parameters"])}

Weights are bfloat16 safetensors ({card['weight_bytes_on_disk'] / 2**20:.1f} MiB for both), tied embeddings.

## Training
Target: next-token cross-entropy, AdamW, cosine schedule, {t['tokens_seen_target']:,} tokens
({plan['joint_steps']} steps × {plan['batch']} × {plan['seq_len']}).{warm} Draft: distilled from the target
(cross-entropy against the target's full distribution), jointly during the target's training and then for
{plan['draft_steps']} steps against the final target; {t['tokens_seen_draft']:,} tokens. Wall time
{t['training_seconds'] / 60:.0f} min on {t.get('hardware', t['device'])} ({t['device']}, {t['threads']} threads).
{provenance(t)}
## Results
Held-out, teacher-forced, windows of {card.get('window', 512)} tokens (`python -m specrpc.training.evaluate`);
`third_party_*` rows are packages the pair never saw:

| set | tokens | target bits/byte | draft bits/byte | greedy agreement | acceptance at T=1 |
| --- | --- | --- | --- | --- | --- |
{rows}
{fim_table}
Greedy completion of `def fibonacci(n):` by the target, as the opening of `fibonacci.py` (Generate with
`path="fibonacci.py"`):
```python
def fibonacci(n):{card['sample']}
```
and with no path (the same text could be anywhere in a file; the standard library has it in doctests):
```python
def fibonacci(n):{card.get('sample_bare', '')}
```

## Reproduce
{reproduce_section(t)}"""


if __name__ == "__main__":
    sys.exit(main())
