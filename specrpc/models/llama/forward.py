"""The eager torch forward of a Llama-family model: grouped-query attention against a preallocated KV cache,
optional biases on every projection, tied or untied embeddings, per-layer sliding windows.

One decoder (`_decoder`) runs the layers; what differs between its callers is the attention path: one slot
(`llama_forward`), several slots at once (`llama_forward_batch`), or a fixed-shape twin over a slot's whole
capacity (`llama_forward_static`, which `backends.cuda_graphs` captures on CUDA, as it does the greedy draft loop
`greedy_draft_static`). Each path masks keys with `window_mask`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specrpc.models.batch import BatchRow
from specrpc.models.llama.weights import LlamaWeights, linear, linear_add


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees: q_pos [..., Q, 1] and k_pos [S] positions → bool [..., Q, S], true for the keys at
    or before the query and, with a `window`, fewer than `window` positions behind it."""
    mask = k_pos <= q_pos  # [..., Q, S]
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _attention_spans(
    w: LlamaWeights, start: int, end: int
) -> dict[int | None, tuple[int, torch.Tensor | None]]:
    """Per distinct window: first key position and bool mask [rep·T, end-lo] (None when every key is visible)."""
    a = w.args
    rep, count = a.heads // a.kv_heads, end - start
    spans: dict[int | None, tuple[int, torch.Tensor | None]] = {}
    for window in {layer.window for layer in w.layers}:
        if count == 1:
            spans[window] = (0 if window is None else max(0, end - window), None)
            continue
        lo = 0 if window is None else max(0, start - window + 1)
        q_pos = w.positions[start:end].repeat(rep)[:, None]  # [rep·T, 1], rows ordered (rep, t)
        k_pos = w.positions[lo:end]  # [S]
        spans[window] = (lo, window_mask(q_pos, k_pos, window))  # mask [rep·T, S]
    return spans


Attention = Callable[[int, int | None, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer index, window, q [T, hq, D], k_new [hkv, T, D], v_new [hkv, T, D]) → attention output [T, hq·D]: stores
the new K/V and attends to what each query may see."""


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [T, hq, D] against k, v [1, hkv, S, D] under mask [rep·T, S] (None: all visible) → [T, hq·D]. Query heads
    are grouped by their KV head ([1, hkv, rep·T, D]) so GQA needs no repeated K/V."""
    count, hq, dh = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    q = q.reshape(count, hkv, rep, dh).permute(1, 2, 0, 3).reshape(1, hkv, rep * count, dh)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [1, hkv, rep·T, D] (4-D: fused CPU kernel)
    return o.view(hkv, rep, count, dh).permute(2, 0, 1, 3).reshape(count, hq * dh)  # [T, hq·D]


def _decoder(
    w: LlamaWeights,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: Attention,
    logit_rows: slice | torch.Tensor,
) -> torch.Tensor:
    """The layers over ids [T] with RoPE rows cos, sin [T, D] → float32 logits [R, V] of the rows `logit_rows`
    selects (R of them). `attention` (see `Attention`) is all that differs between one slot, a fixed-shape graph
    and a batch of slots: the matrix products run once over all T tokens."""
    a = w.args
    count = ids.shape[0]
    hq, hkv, dh = a.heads, a.kv_heads, a.head_dim
    nqk = (hq + hkv) * dh
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    x = F.embedding(ids, w.embed)  # [T, d]
    for i, layer in enumerate(w.layers):
        h = layer.attn_norm(x)  # [T, d]
        qkv = linear(h, layer.qkv)  # [T, (hq + 2·hkv)·D]
        qk = qkv[:, :nqk].view(count, hq + hkv, dh)  # [T, hq + hkv, D]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (dh,), None, a.eps).mul_(layer.qk_norm)  # per head, [T, hq + hkv, D]
        qk = torch.addcmul(qk * cos, qk.roll(dh // 2, -1), sin)  # rotary, [T, hq + hkv, D]
        o = attention(i, layer.window, qk[:, :hq], qk[:, hq:].transpose(0, 1),  # [T, hq, D], [hkv, T, D]
                      qkv[:, nqk:].view(count, hkv, dh).transpose(0, 1))  # [hkv, T, D] → o [T, hq·D]
        x = linear_add(o, layer.o, x)  # [T, d]
        up = linear(layer.mlp_norm(x), layer.up)  # [T, 2·ffn] gated, [T, ffn] plain
        hidden = w.act(up[:, : a.ffn]).mul_(up[:, a.ffn :]) if a.gated else w.act(up)  # [T, ffn]
        x = linear_add(hidden, layer.down, x)  # [T, d]
    x = w.norm(x[logit_rows])  # [R, d]
    return linear(x, w.head).float()  # [R, V]


def _slot_attention(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, end: int
) -> Attention:
    """Attention of positions start..end-1 of one slot (k_cache, v_cache [L, H_kv, C, D]): writes their K/V, reads
    only the span a layer can see, so the cost grows with the context, not the capacity."""
    spans = _attention_spans(w, start, end)

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        k_cache[i, :, start:end] = k_new
        v_cache[i, :, start:end] = v_new
        lo, mask = spans[window]
        return _grouped_sdpa(q, k_cache[i, None, :, lo:end], v_cache[i, None, :, lo:end], mask)  # [T, hq·D]

    return attention


def llama_forward(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor, start: int, num_logits: int,
    valid: int | None = None,
) -> torch.Tensor:
    """ids [T] at positions start..start+T-1 → logits [num_logits, V] (float32) for the last positions (of the first
    `valid` ids, when the rest is padding: its K/V lie past the slot's length, where nothing reads them).

    k_cache, v_cache: one slot's [L, H_kv, C, D]; positions start..start+T-1 are written, [0, start) are read.
    """
    end = start + ids.shape[0]
    last = ids.shape[0] if valid is None else valid
    return _decoder(w, ids, w.cos[start:end], w.sin[start:end], _slot_attention(w, k_cache, v_cache, start, end),
                    slice(last - num_logits, last))


def _rows_attention(w: LlamaWeights, k_all: torch.Tensor, v_all: torch.Tensor, rows: list[BatchRow]) -> Attention:
    """Attention of several rows of T tokens each (decode steps, verify steps of one k) as one SDPA per layer, not
    one per row: the queries go in a [slots, hkv, rep·T, D] batch over the slots from the lowest to the highest of
    theirs, the keys are the cache itself ([L, S, H_kv, C, D], a strided view, no copy) up to the furthest row's
    last position, each row masked to its own positions (a slot in the range with no row attends to its key 0, and
    is dropped)."""
    a = w.args
    hkv, rep, dh = a.kv_heads, a.heads // a.kv_heads, a.head_dim
    count, tokens = len(rows), rows[0].ids.shape[0]
    slots = [r.slot for r in rows]
    low = min(slots)
    width = max(slots) + 1 - low
    device = k_all.device
    at = torch.tensor([s - low for s in slots], device=device)  # [n]: each row's place in the batch
    steps = w.positions[:tokens]  # [T]
    pos = torch.tensor([r.start for r in rows], device=device)[:, None] + steps  # [n, T]
    slot_ids = (at + low)[:, None].expand(count, tokens)  # [n, T]
    span = max(r.start for r in rows) + tokens
    q_pos = torch.zeros(width, tokens, dtype=torch.long, device=device).index_copy_(0, at, pos)  # [B, T]
    q_pos = q_pos.repeat(1, rep)[:, :, None]  # [B, rep·T, 1], rows ordered (rep, t)
    k_pos = w.positions[:span]  # [S]
    masks = {window: window_mask(q_pos, k_pos, window)[:, None]  # [B, 1, rep·T, S]
             for window in {layer.window for layer in w.layers}}

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        k_all[i, slot_ids, :, pos] = k_new.reshape(hkv, count, tokens, dh).permute(1, 2, 0, 3)  # [n, T, hkv, D]
        v_all[i, slot_ids, :, pos] = v_new.reshape(hkv, count, tokens, dh).permute(1, 2, 0, 3)
        q = q.reshape(count, tokens, hkv, rep, dh).permute(0, 2, 3, 1, 4).reshape(count, hkv, rep * tokens, dh)
        grouped = q.new_zeros(width, hkv, rep * tokens, dh).index_copy_(0, at, q)  # [B, hkv, rep·T, D]
        o = F.scaled_dot_product_attention(grouped, k_all[i, low : low + width, :, :span],
                                           v_all[i, low : low + width, :, :span], attn_mask=masks[window])
        o = o[at].view(count, hkv, rep, tokens, dh).permute(0, 3, 1, 2, 4)  # [n, T, hkv, rep, D]
        return o.reshape(count * tokens, a.heads * dh)  # [n·T, hq·D]

    return attention


def llama_forward_batch(
    w: LlamaWeights, k_all: torch.Tensor, v_all: torch.Tensor, rows: list[BatchRow]
) -> list[torch.Tensor]:
    """Several slots in one forward, each row with its own tokens at its own positions (ragged): the rows' tokens
    are concatenated [N] for every matrix product, and split for attention, where each row attends to its own
    slot's cache up to its position (rows of equal length together, `_rows_attention`; a row of a length no other
    row has, alone). k_all, v_all: the whole cache [L, S, H_kv, C, D]. → per row float32 logits [num_logits, V], as
    `llama_forward` of that row alone computes them (up to the rounding of a product over more rows)."""
    order = sorted(range(len(rows)), key=lambda j: rows[j].ids.shape[0])  # rows of one length side by side
    rows = [rows[j] for j in order]
    lengths = [r.ids.shape[0] for r in rows]
    groups: list[tuple[int, int, Attention]] = []  # token range in the concatenation, and its attention
    end = 0
    for length, members in itertools.groupby(rows, key=lambda r: r.ids.shape[0]):
        same = list(members)
        if len(same) > 1:
            groups.append((end, end + length * len(same), _rows_attention(w, k_all, v_all, same)))
        else:
            r = same[0]
            groups.append((end, end + length, _slot_attention(w, k_all[:, r.slot], v_all[:, r.slot], r.start,
                                                              r.start + length)))
        end += length * len(same)

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        parts = [part(i, window, q[lo:hi], k_new[:, lo:hi], v_new[:, lo:hi]) for lo, hi, part in groups]
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # [N, hq·D]

    ids = torch.cat([r.ids for r in rows])  # [N]
    positions = torch.cat([w.positions[r.start : r.start + r.ids.shape[0]] for r in rows])  # [N]
    ends = list(itertools.accumulate(lengths))
    # the rows' last tokens in the concatenation (which may be longer than the position table: not from it)
    picks = torch.tensor([i for r, e in zip(rows, ends, strict=True) for i in range(e - r.num_logits, e)],
                         device=ids.device)  # [R]
    logits = _decoder(w, ids, w.cos[positions], w.sin[positions], attention, picks)  # [R, V]
    sizes = [r.num_logits for r in rows]
    out = [logits[e - n : e] for n, e in zip(sizes, itertools.accumulate(sizes), strict=True)]
    result: list[torch.Tensor] = [out[0]] * len(out)
    for place, j in enumerate(order):
        result[j] = out[place]
    return result


def llama_forward_static(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
    num_logits: int
) -> torch.Tensor:
    """`llama_forward` with the positions as a tensor pos [T] (consecutive) and attention over the slot's whole
    capacity under a causal mask, so that every shape depends on T alone: a CUDA graph captured once per T replays
    at any position. Positions past pos[-1] hold stale or zero K/V and are masked out."""
    a = w.args
    q_pos = pos.repeat(a.heads // a.kv_heads)[:, None]  # [rep·T, 1], rows ordered (rep, t)
    k_pos = w.positions  # [C]
    masks = {window: window_mask(q_pos, k_pos, window)  # [rep·T, C]
             for window in {layer.window for layer in w.layers}}

    def attention(i: int, window: int | None, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                  ) -> torch.Tensor:
        k_cache[i].index_copy_(1, pos, k_new)  # [hkv, C, D]
        v_cache[i].index_copy_(1, pos, v_new)
        return _grouped_sdpa(q, k_cache[i, None], v_cache[i, None], masks[window])  # [T, hq·D]

    count = ids.shape[0]
    return _decoder(w, ids, w.cos[pos], w.sin[pos], attention, slice(count - num_logits, count))


def greedy_draft_static(
    w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, first: torch.Tensor, base: torch.Tensor, steps: int
) -> torch.Tensor:
    """A greedy draft's loop with no host sync: `first` [1] (the token drafted from the catch-up's logits) at
    position `base` [1], then `steps` forwards, each feeding the previous argmax → tokens [steps + 1]. Shapes depend
    on `steps` alone, so `cuda_graphs.GraphedDraftLoop` captures it once per (slot, steps)."""
    tokens = [first]
    for i in range(steps):
        logits = llama_forward_static(w, k_cache, v_cache, tokens[-1], base + i, 1)  # [1, V]
        tokens.append(logits[0].argmax().view(1))
    return torch.cat(tokens)  # [steps + 1]

