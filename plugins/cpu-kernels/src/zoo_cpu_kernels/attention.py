"""How the attention core is computed: torch's `scaled_dot_product_attention` with zoo's masks,
or, on a CPU, blocks of batched GEMMs (`blocked_attention`) where those are faster: bf16/fp16 (over
fewer than 1,024 keys on a CPU with AMX, where torch's kernel uses it), and fp32 causal attention
with grouped KV heads.

torch's CPU flash-attention kernel (what `scaled_dot_product_attention` picks on a CPU) spends most
of its time outside matrix products in bf16, where a CPU with fast bf16 GEMMs makes attention a
large share of a training step. The blocked path does the same work as oneDNN's batched GEMMs and
torch's fused softmax kernels, a block of query rows at a time, in a fraction of the time
(`benchmarks/attention_cpu.py` measures both). In fp32 torch's kernel is near the GEMM speed and is
kept, except for causal attention with grouped KV heads (faster blocked: its GEMMs are G times
taller and half of them skipped; without both, not faster).

- grouped-query heads are stacked as rows: the G query heads of one KV head and a block of
  positions form one matrix against that KV head's keys, so K and V are never repeated and each
  product is one `bmm` over (batch x KV head) matrices;
- causal blocks stop at their last key (about half the products of the square) and only the
  diagonal strip of each block is masked; under a sliding window (Mistral's) a block's keys start
  at its first query's window, so the products are T x window, not T x T / 2;
- backward recomputes each block's probabilities (one GEMM and one softmax) instead of keeping
  the (T x S) matrix: forward keeps q (row-stacked), k and v, as flash attention does;
  dK and dV add up over the query blocks in float32.

Numerics: the GEMMs accumulate in float32 and round their outputs to bf16, so the scores are
rounded to bf16 before the float32 softmax (torch's kernel keeps them in float32). Against float64
(`tests/test_attention_ops.py`) the output's and gradients' errors are the size of torch's bf16
kernel's (4e-3 to 7e-3 relative); run in fp32 the blocked path is at 3e-7 as torch's is.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo_cpu_kernels import native
from zoo_cpu_kernels.gemm import has_amx

# A block is a chunk of (batch x KV head) matrices times a block of query rows: enough rows for
# the GEMMs to run near the peak, few enough elements that the block's scores stay in cache for the
# elementwise passes over them (masking, softmax, its backward). bf16/fp16 over long keys takes
# blocks of twice the rows and four times the elements: faster from ~2,048 positions, slower at a
# few hundred positions and for float32 causal attention.
_BLOCK_ROWS = 256
_BLOCK_ELEMENTS = 1 << 20
_LONG_KEYS = 2048
_LONG_BLOCK_ROWS = 512
_LONG_BLOCK_ELEMENTS = 1 << 22
# On a CPU with AMX, bf16/fp16 blocks of up to four times the elements whatever the length: the
# batched GEMMs over more matrices run nearer AMX's peak and the scores still stream well (faster
# for DiT's and ViT's shapes, level for causal LLaMA's).
_AMX_BLOCK_ELEMENTS = 1 << 22
# On a CPU with AMX, torch's kernel computes bf16/fp16 attention with AMX tiles and is the faster
# one from 1,024 keys on (causal, full, fp16 and packed alike); below 1,024 keys the blocked path
# still wins.
# Decided from the CPU's flags, not timed, so every process of a run computes the same way.
_AMX_TORCH_KEYS = 1024


def blocked_supported(q: torch.Tensor, k: torch.Tensor, *, causal: bool, segment_ids: torch.Tensor | None,
                      kv_segment_ids: torch.Tensor | None, window: int | None = None,
                      softcap: float | None = None) -> bool:
    """Whether `attend` takes the blocked path: on a CPU, bf16/fp16 (or autocast to them) except over
    1,024 keys or more on a CPU with AMX, or fp32 causal attention with grouped KV heads or a sliding
    window; more than one query (a decoding step is a matrix-vector product either way);
    self-attention or cross-attention without packed keys.

    A sliding window is a mask to torch's kernel, which then computes every query against every key;
    the blocked path computes T x window (`benchmarks/attention_cpu.py`: several times faster for a
    window much shorter than the sequence, level when they are close).

    Soft-capped scores (``softcap``, Gemma 2's) are beyond torch's kernel: on a CPU the blocked path
    takes them in every dtype, elsewhere `attend` writes the scores out (`_capped_attention`)."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    if q.device.type != "cpu" or q.shape[2] < 2:
        return False
    if softcap is not None:
        return _packing_supported(q, k, segment_ids, kv_segment_ids)
    fp32_blocked = causal and (q.shape[1] > k.shape[1] or window is not None)
    if dtype not in (torch.bfloat16, torch.float16) and not (dtype == torch.float32 and fp32_blocked):
        return False
    if dtype != torch.float32 and k.shape[2] >= _AMX_TORCH_KEYS and has_amx():
        return False
    return _packing_supported(q, k, segment_ids, kv_segment_ids)


def _packing_supported(q: torch.Tensor, k: torch.Tensor, segment_ids: torch.Tensor | None,
                       kv_segment_ids: torch.Tensor | None) -> bool:
    if kv_segment_ids is not None and kv_segment_ids is not segment_ids:
        return False  # packed cross-attention can leave a query no key: SDPA's path handles it
    return segment_ids is None or k.shape[2] == q.shape[2]


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, offset: int = 0,
                      segment_ids: torch.Tensor | None = None, window: int | None = None,
                      softcap: float | None = None, use_native: bool = False) -> torch.Tensor:
    """``softmax(q k^T / sqrt(hd)) v`` for q (B, H, T, hd), k/v (B, KV, S, hd), H a multiple of KV
    (query head i reads KV head i // (H // KV)). ``causal``: query i sees keys up to ``offset + i``
    (S = offset + T with a KV cache). ``segment_ids`` (B, T), self-attention only: attention stays
    inside each packed sample. ``window`` (causal): query i sees keys offset + i - window + 1 .. offset + i.
    ``softcap``: the scores are ``softcap * tanh(scores / softcap)`` before the masks (Gemma 2's).
    Returns (B, H, T, hd) laid out as (B, T, H, hd) in memory, so the
    usual ``transpose(1, 2).reshape(B, T, H * hd)`` before the output projection copies nothing.
    ``use_native``: bf16 softmax by `zoo_cpu_kernels.native` on a CPU with AMX, where it is built."""
    if torch.is_autocast_enabled("cpu"):  # what autocast does to scaled_dot_product_attention
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    with torch.autocast("cpu", enabled=False):
        return _BlockedAttention.apply(q, k, v, causal, offset, segment_ids, backward, window, softcap, use_native)


def _row_stacked(x: torch.Tensor, kv: int) -> torch.Tensor:
    """(B, H, T, hd) in any layout -> contiguous (B*KV, T, G, hd)."""
    b, h, t, hd = x.shape
    src = x.unflatten(1, (kv, h // kv)).permute(0, 1, 3, 2, 4)
    return torch.empty((b, kv, t, h // kv, hd), dtype=x.dtype, device=x.device).copy_(src).flatten(0, 1)


class _Plan:
    """The blocks of one call and their masks, shared by forward and backward. Matrices are the
    (batch, KV head) pairs; a matrix's rows are (position, query head of the group) pairs."""

    def __init__(self, b: int, h: int, kv: int, t: int, s: int, causal: bool, offset: int,
                 segment_ids: torch.Tensor | None, like: torch.Tensor, window: int | None = None,
                 softcap: float | None = None, use_native: bool = False) -> None:
        self.b, self.kv, self.g, self.t, self.s = b, kv, h // kv, t, s
        self.causal, self.offset, self.window, self.softcap = causal, offset, window, softcap
        # The softmax scale is the products' own alpha (``scaled``): a scaled copy of q costs several
        # times a plain one, and a rounded scaled q is no more
        # exact; with a power-of-two scale (64-wide heads) the bits are the same either way.
        self.scale = like.shape[-1] ** -0.5
        # bf16 on a CPU with zoo_cpu_kernels.native's softmax: the scale is applied inside the softmax and its
        # backward instead (`softmax`), every product plain: oneDNN's product with an alpha takes
        # longer than without on AMX. The -inf of the masks stay -inf.
        self.native = softcap is None and like.dtype == torch.bfloat16 and like.device.type == "cpu" \
            and use_native and has_amx() and native.softmax_ok(s)
        self.alpha = 1.0 if self.native else self.scale
        self.zero = like.new_zeros(1, 1, 1)  # (baddbmm's input, ignored at beta=0)
        # each matrix's batch row's sample ids
        self.segment_ids = None if segment_ids is None else segment_ids.repeat_interleave(kv, 0)
        rows, elements = _BLOCK_ROWS, _BLOCK_ELEMENTS
        if like.element_size() == 2 and s >= _LONG_KEYS:
            rows, elements = _LONG_BLOCK_ROWS, _LONG_BLOCK_ELEMENTS
        elif like.element_size() == 2 and like.device.type == "cpu" and has_amx():
            elements = _AMX_BLOCK_ELEMENTS
        self.tb = max(1, min(t, rows // self.g))
        mb = max(1, elements // (self.tb * self.g * s))
        # whole batch rows of KV heads, or KV heads of one batch row: a block of matrices is then a
        # rectangle of the (B, T, KV, G, hd) output as well as a range of the (B*KV) matrices
        self.bb, self.kb = (min(b, mb // kv), kv) if mb >= kv else (1, mb)
        # Causal mask of a block's diagonal strip relative to its first query: the same for every
        # block (keys from the block's first position on). As an additive bias whose last tb
        # columns are the strip, a whole block's keys are its last `end` columns, and the GEMM adds
        # the mask as it writes the scores (baddbmm: bitwise the masked product, no second pass).
        self.strip = torch.ones(self.tb, self.tb, dtype=torch.bool, device=like.device).triu(1)[:, None] if causal else None
        # A causal block reads its keys up to a multiple of key_step (at most 16 distinct lengths),
        # the ones past its last position masked: oneDNN builds and keeps a kernel for every matrix
        # shape it meets, and one length per block held ~400 MB at 8,192 positions.
        self.key_step = self.tb * -(-s // (16 * self.tb))
        self.bias = None
        if causal:  # [zeros | strip | -inf for the padding keys]
            self.bias = torch.zeros(self.tb, self.g, s + self.key_step, dtype=like.dtype, device=like.device)
            self.bias[..., s - self.tb:s].masked_fill_(self.strip, float("-inf"))
            self.bias[..., s:] = float("-inf")
            self.bias = self.bias.flatten(0, 1)

    def blocks(self) -> list[tuple[slice, slice, slice, int, int, int, int]]:
        """Per block: its batch rows, KV heads and queries (slices of the (B, T, KV, G, hd) output),
        its first and end matrix of the (B*KV) ones, its first query and the range of the keys it
        reads: up to a causal block's own end rounded up to a multiple of key_step, and under a
        sliding window from its first query's first key rounded down to one (the keys before are
        no product of the block's, which is what a window saves)."""
        out = []
        for b0 in range(0, self.b, self.bb):
            b1 = min(self.b, b0 + self.bb)
            for k0 in range(0, self.kv, self.kb):
                k1 = min(self.kv, k0 + self.kb)
                for i0 in range(0, self.t, self.tb):
                    i1 = min(self.t, i0 + self.tb)
                    end = min(self.s, -(-(self.offset + i1) // self.key_step) * self.key_step) if self.causal else self.s
                    start = 0
                    if self.window is not None:
                        start = max(0, self.offset + i0 - self.window + 1) // self.key_step * self.key_step
                    out.append((slice(b0, b1), slice(k0, k1), slice(i0, i1), b0 * self.kv + k0,
                                (b1 - 1) * self.kv + k1, i0, start, end))
        return out

    def scaled(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``scale * (a @ b)`` batched, the scale applied by the product to its float32 sums; with
        `native`, ``a @ b`` (the scale is the softmax's: `softmax`, `softmax_backward`)."""
        if self.native:
            return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
        if out is None:
            return torch.baddbmm(self.zero, a, b, beta=0, alpha=self.scale)
        return torch.baddbmm(self.zero, a, b, beta=0, alpha=self.scale, out=out)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """The probabilities of a block's scores (from `scores`: with `native`, not yet scaled)."""
        if self.native:
            probs = native.softmax(scores, self.scale)
            if probs is not None:
                return probs
            return torch.softmax(scores.float() * self.scale, -1).to(scores.dtype)
        return torch.softmax(scores, -1)

    def softmax_backward(self, dprobs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """d scores = P * (dP - rowsum(dP * P)) (torch's fused softmax backward); with `native` times
        the scale, which then is no product's."""
        if self.native:
            ds = native.softmax_backward(dprobs, probs, self.scale)
            if ds is not None:
                return ds
            return torch._softmax_backward_data(dprobs.float(), probs.float(), -1, torch.float32).mul_(
                self.scale).to(probs.dtype)
        return torch._softmax_backward_data(dprobs, probs, -1, probs.dtype)

    def put(self, out: torch.Tensor, block: tuple, value: torch.Tensor) -> None:
        """Writes a block's (matrices, rows, G, hd) result into the (B, T, KV, G, hd) ``out``."""
        bs, ks, ts = block[:3]
        nb, nk = bs.stop - bs.start, ks.stop - ks.start
        out[bs, ts, ks] = value.view(nb, nk, ts.stop - ts.start, self.g, value.shape[-1]).transpose(1, 2)

    def scores(self, qb: torch.Tensor, kb: torch.Tensor, m0: int, m1: int, i0: int, i1: int, start: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masked ``qb kb^T`` of one block, kb the keys from ``start`` on: (m1-m0, (i1-i0)*G, keys),
        and with a soft cap the derivative of the capped scores by the plain ones (None without)."""
        tb, n = i1 - i0, kb.shape[1]
        end = start + n
        slope = None
        if self.softcap is not None:  # cap tanh(s / cap), then the masks
            th = torch.baddbmm(self.zero, qb.flatten(1, 2), kb.transpose(1, 2), beta=0,
                               alpha=self.scale / self.softcap).tanh_()
            slope = 1 - th * th
            if self.bias is not None and tb == self.tb:  # the causal bias added as the cap scales
                first = self.s - (self.offset + i1)
                scores = torch.add(self.bias[:, first + start:first + end], th, alpha=self.softcap)
            else:
                scores = th.mul_(self.softcap)
        elif self.bias is not None and tb == self.tb:
            first = self.s - (self.offset + i1)  # the bias column of key 0: the strip ends at the block's end
            scores = torch.baddbmm(self.bias[:, first + start:first + end], qb.flatten(1, 2), kb.transpose(1, 2),
                                   alpha=self.alpha)
        else:  # the last block, fewer rows: its keys end at its own end (S)
            scores = self.scaled(qb.flatten(1, 2), kb.transpose(1, 2))
        view = scores.view(m1 - m0, tb, self.g, n)
        if self.causal and tb != self.tb:  # keys before the block's first position are visible to all its queries
            view[..., self.offset + i0 - start:].masked_fill_(self.strip[:tb, :, :tb], float("-inf"))
        if self.window is not None:  # keys a window or more before the query: a second pass, as packing's
            first = self.offset + i0 - self.window + 1  # the first key query i0 sees
            if first + tb - 1 > 0:  # (the block's last query sees from first + tb - 1 on)
                rows = torch.arange(tb, device=scores.device)[:, None]
                seen = torch.arange(start, end, device=scores.device)[None, :] >= first + rows
                view.masked_fill_(~seen[:, None, :], float("-inf"))
        if self.segment_ids is not None:
            ids = self.segment_ids[m0:m1]
            view.masked_fill_((ids[:, i0:i1, None] != ids[:, None, start:end])[:, :, None], float("-inf"))
        return scores, slope


def _keeps_probs(plan: _Plan, hd: int, dtype: torch.dtype, per_score: int = 1) -> bool:
    """Whether the forward keeps each block's probabilities for backward (which then recomputes no
    scores and softmax): when the blocks it computes (a causal call forms no block above the
    diagonal) hold at most as many elements as the q, k, v and output kept anyway, hd x (2T + 2S)
    per KV group, twice as many in bf16/fp16, where products are 2-4x float32's speed and the
    recomputation a larger share of the step. That keeps a DiT's 256 tokens (6 MiB a layer in bf16)
    and a bf16 causal LLaMA's 512 of 64-wide heads (9 MiB a layer for 4 x 512 tokens: a little
    more saved memory for a faster step), never a long sequence. ``per_score``: the
    tensors of a block's size kept (soft-capped scores keep the cap's slope as well: 2)."""
    kept = sum((m1 - m0) * (ts.stop - ts.start) * plan.g * (end - start)
               for _, _, ts, m0, m1, _, start, end in plan.blocks())
    budget = plan.b * plan.kv * hd * (2 * plan.g * plan.t + 2 * plan.s)
    return kept * per_score <= (2 if dtype.itemsize == 2 else 1) * budget


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, offset: int,
                segment_ids: torch.Tensor | None, keep_probs: bool, window: int | None,
                softcap: float | None, use_native: bool) -> torch.Tensor:
        b, h, t, hd = q.shape
        kv, s = k.shape[1], k.shape[2]
        plan = _Plan(b, h, kv, t, s, causal, offset, segment_ids, q, window, softcap, use_native)
        qs = _row_stacked(q, kv)  # (B*KV, T, G, hd)
        kf, vf = k.reshape(b * kv, s, hd), v.reshape(b * kv, s, hd)
        out = q.new_empty(b, t, kv, plan.g, hd)
        # (a capped block keeps its cap's slope beside its probabilities)
        keep = keep_probs and _keeps_probs(plan, hd, q.dtype, 1 if softcap is None else 2)
        kept = []
        for block in plan.blocks():
            m0, m1, i0, start, end = block[3:]
            i1 = block[2].stop
            scores, slope = plan.scores(qs[m0:m1, i0:i1], kf[m0:m1, start:end], m0, m1, i0, i1, start)
            probs = plan.softmax(scores)
            plan.put(out, block, torch.bmm(probs, vf[m0:m1, start:end]))
            if keep:
                kept += [probs] if slope is None else [probs, slope]
        ctx.save_for_backward(qs, kf, vf, *kept)
        ctx.plan, ctx.shape = plan, q.shape
        return out.view(b, t, h, hd).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        qs, kf, vf, *kept = ctx.saved_tensors
        plan: _Plan = ctx.plan
        b, h, t, hd = ctx.shape
        kv, s = plan.kv, plan.s
        gs = _row_stacked(grad.to(qs.dtype), kv)
        dq = qs.new_empty(b, t, kv, plan.g, hd)
        # One query block per matrix (every non-causal DiT/CLIP-length call): each block's dk/dv is
        # its matrices' whole gradient, written in place in the inputs' dtype (bitwise what summing
        # into float32 zeros and casting gives: the product is rounded once either way).
        direct = plan.tb >= t
        if direct:
            dk, dv = kf.new_empty(b * kv, s, hd), vf.new_empty(b * kv, s, hd)
        else:
            dk = torch.zeros(b * kv, s, hd, dtype=torch.promote_types(kf.dtype, torch.float32), device=qs.device)
            dv = torch.zeros_like(dk)
        for n, block in enumerate(plan.blocks()):
            m0, m1, i0, start, end = block[3:]
            i1 = block[2].stop
            qb, gb = qs[m0:m1, i0:i1].flatten(1, 2), gs[m0:m1, i0:i1].flatten(1, 2)
            kb, vb = kf[m0:m1, start:end], vf[m0:m1, start:end]
            if kept:  # (probs, and a capped block's slope)
                probs, slope = (kept[n], None) if plan.softcap is None else kept[2 * n:2 * n + 2]
            else:
                scores, slope = plan.scores(qs[m0:m1, i0:i1], kb, m0, m1, i0, i1, start)
                probs = plan.softmax(scores)
            dscores = plan.softmax_backward(torch.bmm(gb, vb.transpose(1, 2)), probs)
            if slope is not None:  # through the cap: d cap tanh(s / cap) / ds = 1 - tanh^2
                dscores.mul_(slope)
            plan.put(dq, block, plan.scaled(dscores, kb))
            if direct:
                torch.bmm(probs.transpose(1, 2), gb, out=dv[m0:m1, start:end])
                plan.scaled(dscores.transpose(1, 2), qb, out=dk[m0:m1, start:end])
                for outside in (slice(0, start), slice(end, s)):  # keys no query of the block sees
                    if outside.start < outside.stop:
                        dv[m0:m1, outside] = 0
                        dk[m0:m1, outside] = 0
            else:
                dv[m0:m1, start:end] += torch.bmm(probs.transpose(1, 2), gb)
                dk[m0:m1, start:end] += plan.scaled(dscores.transpose(1, 2), qb)
        return (dq.view(b, t, h, hd).transpose(1, 2), dk.view(b, kv, s, hd).to(kf.dtype),
                dv.view(b, kv, s, hd).to(vf.dtype), None, None, None, None, None, None, None)


__all__ = ["blocked_attention", "blocked_supported"]
