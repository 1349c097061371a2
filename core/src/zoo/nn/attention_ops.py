"""How the attention core is computed: torch's `scaled_dot_product_attention` with zoo's masks
(causal, sliding window, packed documents), or soft-capped scores written out (Gemma 2's), unless
the run's kernels (`zoo.kernels`, operation ``attention``) compute it another way on its device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zoo import kernels


def causal_mask(t: int, s: int, offset: int, window: int | None, device: Any) -> torch.Tensor:
    """(T, S) booleans: query i (position ``offset + i``) sees key j when j <= offset + i and, with
    a sliding ``window``, offset + i - j < window (itself and the window - 1 keys before it)."""
    mask = torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=offset)
    return mask if window is None else mask.triu(diagonal=offset - window + 1)


def attention_mask(t: int, s: int, *, causal: bool, offset: int, window: int | None,
                   segment_ids: torch.Tensor | None, kv_segment_ids: torch.Tensor | None, device: Any
                   ) -> torch.Tensor | None:
    """The boolean mask (B or 1, 1, T, S) of `attend`'s causal, window and document masks, None for none."""
    mask = causal_mask(t, s, offset, window, device)[None, None] if causal else None
    if segment_ids is not None:  # block-diagonal (causal) mask: (B, 1, T, S)
        keys = segment_ids if kv_segment_ids is None else kv_segment_ids
        same = segment_ids[:, None, :, None] == keys[:, None, None, :]
        mask = same if mask is None else mask & same
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, offset: int,
           segment_ids: torch.Tensor | None = None, kv_segment_ids: torch.Tensor | None = None,
           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v with the masks `zoo.nn.attention` describes: the run's kernel
    for it where one takes these inputs, torch's scaled_dot_product_attention otherwise
    (soft-capped scores: `_capped_attention`)."""
    t, s = q.shape[2], k.shape[2]
    if window is not None and offset + t <= window:
        window = None  # no query reaches past the window: plain causal attention
    out = kernels.active().call("attention", q, k, v, causal, offset, segment_ids, kv_segment_ids, window, softcap)
    if out is not NotImplemented:
        return out
    if softcap is not None:
        mask = attention_mask(t, s, causal=causal, offset=offset, window=window, segment_ids=segment_ids,
                              kv_segment_ids=kv_segment_ids, device=q.device)
        return _capped_attention(q, k, v, mask, softcap, may_be_empty=kv_segment_ids is not None)
    # enable_gqa: query head i attends with KV head i // (H // KV) (HF's grouping) without copying K/V.
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is not None:
        mask = attention_mask(t, s, causal=causal, offset=offset, window=window, segment_ids=segment_ids,
                              kv_segment_ids=kv_segment_ids, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if not causal or (t == 1 and window is None):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if offset == 0 and s == t and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(t, s, offset, window, q.device),
                                          enable_gqa=gqa)


def attend_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, offset: int,
              segment_ids: torch.Tensor | None, kv_segment_ids: torch.Tensor | None, at: torch.Tensor,
              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """`attend` for q holding the queries of positions ``at`` (B, T') only: the causal, window and
    document masks are those rows of the full masks."""
    s = k.shape[2]
    mask = None
    if causal:
        keys, last = torch.arange(s, device=q.device)[None, None, None, :], (at + offset)[:, None, :, None]
        mask = keys <= last
        if window is not None:
            mask = mask & (keys > last - window)
    if segment_ids is not None:
        keys = segment_ids if kv_segment_ids is None else kv_segment_ids
        same = segment_ids.gather(1, at)[:, None, :, None] == keys[:, None, None, :]
        mask = same if mask is None else mask & same
    if softcap is not None:
        return _capped_attention(q, k, v, mask, softcap, may_be_empty=kv_segment_ids is not None)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      softcap: float, *, may_be_empty: bool = False) -> torch.Tensor:
    """Attention with soft-capped scores, ``softmax(cap * tanh(q k^T / (sqrt(hd) cap))) v``, as
    written: the (T x S) scores are formed (torch's fused kernels have no cap), in the inputs' dtype
    with a float32 softmax, as transformers' eager Gemma 2 computes them (float32 scores took 1.4-2.2x
    its time in bf16 on a CPU for 1.7x less error, the error of the GEMM's rounded output remaining).
    ``mask``: booleans broadcastable to (B, 1, T, S); ``may_be_empty``: a query may see no key (packed
    cross-attention), which then gets zeros."""
    if torch.is_autocast_enabled(q.device.type):  # as autocast treats scaled_dot_product_attention
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, h, t, hd = q.shape
    kv = k.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        qg = q.unflatten(1, (kv, h // kv))  # (B, KV, G, T, hd): a group's heads share their K and V
        scores = torch.tanh(torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * (hd ** -0.5 / softcap)) * softcap
        if mask is not None:  # (the smallest number, not -inf: a row with no visible key stays finite)
            scores = scores.masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype)
        if mask is not None and may_be_empty:
            probs = probs.masked_fill(~mask[:, :, None].any(-1, keepdim=True), 0)
        out = torch.matmul(probs, v.unsqueeze(2))  # (B, KV, G, T, hd)
    return out.flatten(1, 2)


__all__ = ["attend", "attend_at", "attention_mask", "causal_mask"]
