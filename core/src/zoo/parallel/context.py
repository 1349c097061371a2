"""Context parallelism: ring attention over a load-balanced split of the sequence.

The sequence is cut into ``2 cp`` chunks and CP rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``
(a causal mask then gives every rank the same work). Inside attention, each rank keeps its
queries while the key/value blocks travel around the ring (``cp - 1`` hops, each overlapped with
the block computed meanwhile); partial results are merged by their log-sum-exp, so the result is
exactly softmax attention over the whole sequence (Liu et al. 2023, "Ring Attention"). Backward
recomputes the block scores from the saved log-sum-exp (flash-attention style) and sends the
key/value gradients around the ring with the blocks, so they arrive at their owner after ``cp``
hops. Grouped-query heads are handled without repeating K/V. Non-causal attention (a DiT) computes
every block; packed samples travel with their segment ids, so a query only sees keys of its own
sample wherever they live. Pure PyTorch on any backend.

The core switches it on by setting ``cp_group`` on every `ContextParallelSite` of the model
(`zoo.nn.AttentionCore` is one, unless its keys are not the split sequence: cross-attention),
which then routes self-attention here. Batches are split with
`split_batch`.

A mixer that needs the whole sequence in order (Mamba-2's scan) instead trades sequence shards
for channel shards (`to_channel_shards`, `to_sequence_shards`: an all-to-all each way, as
Megatron's Mamba context parallelism): every rank then runs its share of the heads over the
whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zoo.parallel import comm

# Apart from pipeline tags (2 * stage + direction).
_TAG_KV, _TAG_DKV, _TAG_SEG = 1 << 20, (1 << 20) + 1, (1 << 20) + 2


class ContextParallelSite(torch.nn.Module):
    """A module whose attention runs as ring attention over ``cp_group`` once the core sets it
    (`zoo.parallel.engine.Parallel`, when cp > 1); None runs it on the whole sequence.
    ``keys_split``: False when its keys are not the split sequence (cross-attention to text that
    every context-parallel rank holds whole): the core leaves it alone."""

    def __init__(self, *, keys_split: bool = True) -> None:
        super().__init__()
        self.cp_group: Any = None
        self.keys_split = keys_split


class SequenceShard(torch.nn.Module):
    """This rank's part of a per-token tensor that travels beside the residual stream (a packed
    row's segment ids), to pair with the stream where sequence parallelism shards it. Identity
    until the core sets ``group`` (`zoo.parallel.apply.apply_sequence_parallel`, on the modules
    inside the blocks); the attention inside still takes the whole tensor, its column-parallel
    projections having gathered the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.group: Any = None
        self.dim = 1

    def forward(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.group is None:
            return t
        from zoo.parallel.comm import scatter_seq

        return scatter_seq(t, self.group, self.dim)


class BatchGather(torch.nn.Module):
    """Gathers a per-sample tensor (B, ...) from every data-parallel rank along dim 0, in rank
    order, once the core sets ``group`` (`zoo.parallel.engine.Parallel`, when dp > 1); identity
    with None. The backward sums each rank's gradient for this rank's rows (a reduce-scatter),
    so a loss over the gathered batch (CLIP's global negatives) trains as the one-process loss
    over the whole global batch. ``rank`` is this rank's index in the gathered rows."""

    def __init__(self) -> None:
        super().__init__()
        self.group: Any = None

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        from zoo.parallel.comm import gather_seq

        return gather_seq(x.contiguous(), self.group, 0)


def local_positions(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Global positions held by CP rank ``rank``: chunks ``rank`` and ``2 cp - 1 - rank``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2*cp = {2 * cp} chunks")
    c = seq_len // (2 * cp)
    a, b = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])


def _chunk_order(seq_len: int, cp: int, device: Any) -> torch.Tensor:
    """The global positions of the CP ranks' tokens, rank after rank."""
    return torch.cat([local_positions(seq_len, cp, r, device) for r in range(cp)])


def to_channel_shards(pieces: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence shards -> channel shards. ``pieces`` (cp, B, T/cp, C): piece ``j`` holds CP rank
    ``j``'s channels of this rank's tokens. Returns (B, T, C): this rank's channels over the whole
    sequence, in position order. Differentiable (an all-to-all each way)."""
    cp, b, tl, c = pieces.shape
    got = comm.exchange(pieces, group, 0, 0)  # got[i]: this rank's channels of rank i's tokens
    full = got.permute(1, 0, 2, 3).reshape(b, cp * tl, c)
    return full.index_select(1, torch.argsort(_chunk_order(cp * tl, cp, full.device)))


def to_sequence_shards(full: torch.Tensor, group: Any) -> torch.Tensor:
    """Channel shards -> sequence shards, `to_channel_shards`' inverse: ``full`` (B, T, C) this
    rank's channels over the whole sequence; returns (B, T/cp, cp * C), this rank's tokens with
    every rank's channels, rank after rank."""
    cp = dist.get_world_size(group)
    b, t, c = full.shape
    pieces = full.index_select(1, _chunk_order(t, cp, full.device)).view(b, cp, t // cp, c).transpose(0, 1)
    got = comm.exchange(pieces, group, 0, 0)  # got[i]: rank i's channels of this rank's tokens
    return got.permute(1, 2, 0, 3).reshape(b, t // cp, cp * c)


def split_batch(batch: Mapping[str, Any], keys: Sequence[str], *, cp: int, rank: int, seq_len: int,
                dim: int = 1, positions_key: str | None = None) -> dict[str, Any]:
    """This CP rank's part of a batch: every tensor under ``keys`` indexed along ``dim``. When
    ``positions_key`` is absent it is added first (0..T-1), so the model sees global positions."""
    out = dict(batch)
    ref = next((out[k] for k in keys if k in out and torch.is_tensor(out[k])), None)
    if positions_key and positions_key not in out and ref is not None:
        out[positions_key] = torch.arange(seq_len, device=ref.device).expand(ref.shape[0], seq_len)
    if cp == 1:
        return out
    for k in (*keys, *( [positions_key] if positions_key else [])):
        v = out.get(k)
        if torch.is_tensor(v) and v.dim() > dim and v.shape[dim] == seq_len:
            idx = local_positions(seq_len, cp, rank, device=v.device)
            out[k] = v.index_select(dim, idx)
    return out


# ----------------------------------------------------------------------------- ring attention


def _peers(group: Any) -> tuple[int, int, int, int]:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    return n, r, ranks[(r + 1) % n], ranks[(r - 1) % n]


def _exchange(t: torch.Tensor, nxt: int, prv: int, tag: int) -> tuple[Any, Any, torch.Tensor]:
    """Send ``t`` to the next rank and receive the previous rank's into a new tensor (async)."""
    incoming = torch.empty_like(t)
    send = dist.isend(t.contiguous(), nxt, tag=tag)
    recv = dist.irecv(incoming, prv, tag=tag)
    return send, recv, incoming


def _blocks(r: int, src: int, cp: int, causal: bool, c: int, window: int | None
            ) -> list[tuple[int, int, int | None]]:
    """(q chunk 0/1, kv chunk 0/1, distance) triples with any unmasked entry, for rank ``r``'s
    queries against rank ``src``'s keys: the distance from the key chunk's first position to the
    query chunk's (0 on the diagonal; None when attention is not causal: all four pairs). With a
    sliding ``window``, pairs whose nearest query and key are ``window`` or more apart are left out."""
    if not causal:
        return [(a, b, None) for a in (0, 1) for b in (0, 1)]
    q_idx, k_idx = (r, 2 * cp - 1 - r), (src, 2 * cp - 1 - src)
    out = []
    for a, qi in enumerate(q_idx):
        for b, kj in enumerate(k_idx):
            distance = (qi - kj) * c
            if kj <= qi and (window is None or distance - (c - 1) < window):
                out.append((a, b, distance))
    return out


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # softmax statistics never below float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, distance: int | None, window: int | None,
            q_seg: torch.Tensor | None, k_seg: torch.Tensor | None, softcap: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, KV, G, Tq, hd), k (B, KV, Tk, hd) -> masked scores (B, KV, G, Tq, Tk) in float32 (or
    wider); with a ``softcap`` they are capped first (``cap tanh(s / cap)``) and the cap's slope,
    d capped / d s, comes second (None without)."""
    acc = _acc(q)
    s = torch.matmul(q.to(acc), k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    slope = None
    if softcap is not None:
        s = torch.tanh(s / softcap)
        slope = 1 - s * s
        s = s * softcap
    tq, tk = s.shape[-2:]
    # Causal (and window) mask where the block needs one: query x is distance + x - y after key y.
    if distance is not None and (distance == 0 or (window is not None and distance + tq - 1 >= window)):
        apart = distance + torch.arange(tq, device=s.device)[:, None] - torch.arange(tk, device=s.device)[None, :]
        seen = apart >= 0 if window is None else (apart >= 0) & (apart < window)
        s = s.masked_fill(~seen, float("-inf"))
    if q_seg is not None and k_seg is not None:  # packed samples: attention stays inside each one
        s = s.masked_fill(q_seg[:, None, None, :, None] != k_seg[:, None, None, None, :], float("-inf"))
    return s, slope


def _finite(x: torch.Tensor) -> torch.Tensor:
    # A block where a query sees no key (another packed sample's) has log-sum-exp -inf; subtracting
    # it would give NaN (-inf - -inf), subtracting 0 gives the block's zero weight.
    return torch.where(torch.isinf(x), torch.zeros((), dtype=x.dtype, device=x.device), x)


def _travel(kv: torch.Tensor, seg: torch.Tensor | None, nxt: int, prv: int) -> tuple[list[Any], torch.Tensor,
                                                                                   torch.Tensor | None]:
    """Start sending the held key/value block (and its samples' ids) on; the previous rank's arrive."""
    send, recv, kv_in = _exchange(kv, nxt, prv, _TAG_KV)
    ops, seg_in = [send, recv], None
    if seg is not None:
        s2, r2, seg_in = _exchange(seg, nxt, prv, _TAG_SEG)
        ops += [s2, r2]
    return ops, kv_in, seg_in


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                seg: torch.Tensor | None, window: int | None, softcap: float | None) -> torch.Tensor:
        cp, r, nxt, prv = _peers(group)
        b, h, t, hd = q.shape
        kvh = k.shape[1]
        c = t // 2
        scale = 1.0 / math.sqrt(hd)
        qg = q.view(b, kvh, h // kvh, t, hd)
        acc = _acc(q)
        out = torch.zeros(b, kvh, h // kvh, t, hd, dtype=acc, device=q.device)
        lse = torch.full((b, kvh, h // kvh, t), float("-inf"), dtype=acc, device=q.device)
        kv, kv_seg = torch.stack([k, v]), seg
        for step in range(cp):
            src = (r - step) % cp
            pending = _travel(kv, kv_seg, nxt, prv) if step < cp - 1 else None
            for a, bb, distance in _blocks(r, src, cp, causal, c, window):
                qs, ks = slice(a * c, (a + 1) * c), slice(bb * c, (bb + 1) * c)
                s, _ = _scores(qg[..., qs, :], kv[0][..., ks, :], scale, distance, window,
                               None if seg is None else seg[:, qs], None if kv_seg is None else kv_seg[:, ks], softcap)
                blk_lse = torch.logsumexp(s, dim=-1)
                blk_out = torch.matmul(torch.exp(s - _finite(blk_lse)[..., None]),
                                       kv[1][..., ks, :].to(acc).unsqueeze(2))
                merged = torch.logaddexp(lse[..., qs], blk_lse)
                new = _finite(merged)
                out[..., qs, :] = (out[..., qs, :] * torch.exp(lse[..., qs] - new)[..., None]
                                   + blk_out * torch.exp(blk_lse - new)[..., None])
                lse[..., qs] = merged
            if pending is not None:
                for op in pending[0]:
                    op.wait()
                kv, kv_seg = pending[1], pending[2]
        ctx.group, ctx.scale, ctx.causal, ctx.window, ctx.softcap = group, scale, causal, window, softcap
        ctx.save_for_backward(q, k, v, out, lse, *([] if seg is None else [seg]))
        return out.to(q.dtype).view(b, h, t, hd)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, *rest = ctx.saved_tensors
        seg = rest[0] if rest else None
        cp, r, nxt, prv = _peers(ctx.group)
        b, h, t, hd = q.shape
        kvh = k.shape[1]
        c = t // 2
        acc = _acc(q)
        qg = q.view(b, kvh, h // kvh, t, hd).to(acc)
        do = dout.reshape(b, kvh, h // kvh, t, hd).to(acc)
        delta = (do * out).sum(-1)  # (B, KV, G, T): rowwise dot of dout and out
        dq = torch.zeros_like(qg)
        kv, kv_seg = torch.stack([k, v]), seg
        dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)
        for step in range(cp):
            src = (r - step) % cp
            pending = _travel(kv, kv_seg, nxt, prv) if step < cp - 1 else None
            for a, bb, distance in _blocks(r, src, cp, ctx.causal, c, ctx.window):
                qs, ks = slice(a * c, (a + 1) * c), slice(bb * c, (bb + 1) * c)
                kb, vb = kv[0][..., ks, :].to(acc), kv[1][..., ks, :].to(acc)
                s, slope = _scores(qg[..., qs, :], kb, ctx.scale, distance, ctx.window,
                                   None if seg is None else seg[:, qs], None if kv_seg is None else kv_seg[:, ks],
                                   ctx.softcap)
                p = torch.exp(s - lse[..., qs, None])
                dkv[1][..., ks, :] += torch.matmul(p.transpose(-1, -2), do[..., qs, :]).sum(2)
                dp = torch.matmul(do[..., qs, :], vb.unsqueeze(2).transpose(-1, -2))
                ds = p * (dp - delta[..., qs, None]) * ctx.scale
                if slope is not None:  # through the cap
                    ds = ds * slope
                dq[..., qs, :] += torch.matmul(ds, kb.unsqueeze(2))
                dkv[0][..., ks, :] += torch.matmul(ds.transpose(-1, -2), qg[..., qs, :]).sum(2)
            # The gradient of the block held now travels on with it; after cp hops it is home.
            send, recv, dkv = _exchange(dkv, nxt, prv, _TAG_DKV)
            send.wait()
            recv.wait()
            if pending is not None:
                for op in pending[0]:
                    op.wait()
                kv, kv_seg = pending[1], pending[2]
        return (dq.to(q.dtype).view(b, h, t, hd), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *, causal: bool = True,
                   segment_ids: torch.Tensor | None = None, window: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose other parts the ring brings.
    q: (B, H, T_local, hd), k/v: (B, KV, T_local, hd) with T_local = 2 chunks (causal: the
    load-balanced chunks of `local_positions`; otherwise any split). ``segment_ids`` (B, T_local):
    the packed sample of each local token; a query sees only keys of its own sample. ``window``
    (causal only): sliding-window attention; chunk pairs wholly outside the window are skipped.
    ``softcap``: scores soft-capped before the masks, as `zoo.nn.attention`'s."""
    if q.shape[2] % 2:
        raise ValueError(f"context-parallel attention needs an even local length, got {q.shape[2]}")
    if segment_ids is not None:
        segment_ids = segment_ids.contiguous()
    return _RingAttention.apply(q, k, v, group, causal, segment_ids, window, softcap)
