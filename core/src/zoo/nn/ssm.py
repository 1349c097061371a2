"""Selective state-space mixers in pure PyTorch: Mamba-1 (Gu & Dao 2023) and Mamba-2's SSD (Dao &
Gu 2024), with chunked scans whose memory is bounded by the chunk, and a recurrent state for decoding.

Shapes: B batch, T sequence, D model width, I inner width (expand x D), N state size; Mamba-2 splits
I into H heads of P channels and shares B/C over G groups of H/G heads.

Mamba-1's decay ``exp(dt A)`` is a (I, N) matrix per step, so no (T x T) matrix form is cheap: the
scan runs chunk by chunk, a log-depth (Hillis-Steele) scan of the pairs ``(exp(dt A), dt B x)``
inside each chunk, carrying the state between chunks. Mamba-2's decay is a scalar per head, so each
chunk is a masked "attention" with decays (``ssd_minimal``), and the chunks pass their states on
block by block (`_pass_states`: one product per block of 16 chunks), linear in T (the minimal
code's dense chunk x chunk einsum is quadratic).

Under autograd each chunk is recomputed in backward (`_Recomputed`), so what a layer keeps
for backward is its inputs and one state per chunk: Mamba-1's (B, chunk, I, N) scan tensors, and HF's
(B, I, T, N) ones, exist for one chunk at a time. `mamba_ssm`/`causal_conv1d` kernels are used on
CUDA when they import (`_kernels`), never required.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zoo.spec import SSMSpec


def _kernels() -> Any:
    """mamba_ssm's fused chunk scan for Mamba-2 on CUDA, or None (it is optional: `zoo.backends`)."""
    from zoo.backends import kernel

    return kernel("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")


class _CausalConv1d(torch.autograd.Function):
    """Depthwise causal convolution as K shifted multiply-adds in the (B, T, C) layout, with its own
    backward (the same K passes for the input, K products summed over B and T for the weight).
    torch's grouped conv1d wants (B, C, T), and for a Mamba-2 layer's 2,048 x 640 convolution (K 4)
    it took 10.9 ms forward and backward with the layout copies, this 4.9 ms."""

    @staticmethod
    def forward(ctx: Any, xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # xp (B, K-1+T, C): the K-1 inputs before x, then x; weight (C, K)
        k, t = weight.shape[1], xp.shape[1] - weight.shape[1] + 1
        y = xp[:, k - 1:] * weight[:, k - 1]
        for i in range(k - 1):
            y.addcmul_(xp[:, i:i + t], weight[:, i])
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(xp, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xp, weight = ctx.saved_tensors
        k, t = weight.shape[1], grad.shape[1]
        dxp = dw = None
        if ctx.needs_input_grad[0]:
            dxp = torch.zeros_like(xp)
            for i in range(k):
                dxp[:, i:i + t].addcmul_(grad, weight[:, i])
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(grad * xp[:, i:i + t]).sum((0, 1)) for i in range(k)], dim=1)
        db = grad.sum((0, 1)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dxp, dw, db


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution: x (B, T, C), weight (C, 1, K), ``state`` the K-1 inputs before
    x (B, C, K-1; zeros when None). Returns y (B, T, C) and the K-1 last inputs (the next state)."""
    k = weight.shape[-1]
    dtype = torch.promote_types(x.dtype, weight.dtype) if not torch.is_autocast_enabled(x.device.type) else x.dtype
    before = x.new_zeros(x.shape[0], k - 1, x.shape[2]) if state is None else state.transpose(1, 2).to(x.dtype)
    xp = torch.cat([before, x], dim=1)  # (B, K-1+T, C)
    w = weight.view(weight.shape[0], k)
    if x.device.type == "cpu":
        y = _CausalConv1d.apply(xp.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype))
    else:  # accelerators: torch's grouped convolution kernel
        y = F.conv1d(xp.transpose(1, 2), weight.to(dtype), None if bias is None else bias.to(dtype),
                     groups=x.shape[2]).transpose(1, 2).contiguous()
    return y, xp[:, xp.shape[1] - (k - 1):].transpose(1, 2).contiguous()  # (not a view that keeps xp alive)


class _Recomputed(torch.autograd.Function):
    """``fn(*args)`` keeping only ``args`` for backward, which reruns ``fn`` with autograd on. (What
    `torch.utils.checkpoint` promises; its non-reentrant form kept each chunk's intermediates here,
    measured at ~16 full (B, T, I, N)-sized tensors, and its reentrant one refuses `autograd.grad`.)"""

    @staticmethod
    def forward(ctx: Any, fn: Any, *args: torch.Tensor) -> Any:
        ctx.fn = fn
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        wants = ctx.needs_input_grad[1:]
        args = [a.detach().requires_grad_(w) for a, w in zip(ctx.saved_tensors, wants)]
        with torch.enable_grad():
            outs = ctx.fn(*args)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        inputs = [a for a in args if a.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
                   if pairs and inputs else [None] * len(inputs))
        return (None, *(next(got) if w else None for w in wants))


def _run(fn: Any, *args: torch.Tensor) -> Any:
    """``fn(*args)``, recomputed in backward when autograd records it."""
    if torch.is_grad_enabled() and any(a.requires_grad for a in args):
        return _Recomputed.apply(fn, *args)
    return fn(*args)


def _scan_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of Mamba-1: x, dt (B, Q, I); a (I, N); b, c (B, Q, N); h0 (B, I, N) fp32."""
    decay = torch.exp(dt[..., None] * a)  # (B, Q, I, N), in (0, 1]: products underflow, never overflow
    inp = (dt * x)[..., None] * b[:, :, None, :]
    inp = torch.cat([inp[:, :1] + decay[:, :1] * h0[:, None], inp[:, 1:]], dim=1)  # the carried state
    step, q = 1, x.shape[1]
    while step < q:  # inclusive scan of (decay, inp) under (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2)
        inp = torch.cat([inp[:, :step], decay[:, step:] * inp[:, :-step] + inp[:, step:]], dim=1)
        if step * 2 < q:
            decay = torch.cat([decay[:, :step], decay[:, step:] * decay[:, :-step]], dim=1)
        step *= 2
    y = (inp @ c[..., None]).squeeze(-1)  # (B, Q, I)
    return y, inp[:, -1]


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *,
                   state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1: ``h_t = exp(dt_t a) h_{t-1} + dt_t b_t x_t``, ``y_t = <h_t, c_t>`` per channel.

    x, dt (B, T, I) (dt after softplus); a (I, N) negative; b, c (B, T, N). Computed in fp32.
    Returns y (B, T, I) fp32 and the last state (B, I, N)."""
    x, dt, b, c, a = x.float(), dt.float(), b.float(), c.float(), a.float()
    h = state.float() if state is not None else x.new_zeros(x.shape[0], x.shape[2], a.shape[1])
    ys = []
    for s in range(0, x.shape[1], chunk):
        y, h = _run(_scan_chunk, x[:, s:s + chunk], dt[:, s:s + chunk], a, b[:, s:s + chunk], c[:, s:s + chunk], h)
        ys.append(y)
    return torch.cat(ys, dim=1), h


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a (..., Q) -> (..., Q, Q) with [l, s] = a[s+1] + ... + a[l] for s <= l, -inf above: each
    entry a sum of its own terms (a difference of cumulative sums would lose digits)."""
    q = a.shape[-1]
    rep = a[..., None, :].expand(*a.shape[:-1], q, q)  # [l, s] = a[s]... transposed below
    strict = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = rep.transpose(-1, -2).masked_fill(~strict, 0).cumsum(dim=-2)  # [l, s] = sum_{s<k<=l} a[k]
    return sums.masked_fill(~torch.ones_like(strict).tril(), float("-inf"))


_STATE_BLOCK = 16  # chunks whose states pass on in one product (`_pass_states`)


def _pass_states(states: torch.Tensor, log_decay: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering each chunk and the last one: ``h_k = exp(log_decay_k) h_{k-1} + states_k``.

    states (B, H, K, N, P) each chunk's own contribution; log_decay (B, H, K) its whole-chunk
    decay; h0 (B, H, N, P). Within a block of `_STATE_BLOCK` chunks the recurrence is one product
    per head, the block's (S+1) x (S+1) lower-triangular decay matrix (segment sums, no
    differences of cumulative sums) times [h_entering, states...]; blocks follow one another, so
    the work stays linear in K. (One chunk at a time took ~400 small ops per step at T=2048.)
    Returns the entering states (B, H, K, N, P) and the last one (B, H, N, P)."""
    bsz, h, k, n, p = states.shape
    starts = []
    for s0 in range(0, k, _STATE_BLOCK):
        blk = states[:, :, s0:s0 + _STATE_BLOCK]
        src = torch.cat([h0[:, :, None], blk], dim=2).flatten(3)  # (B, H, S+1, N*P)
        # row i: the state after i sources; entry [i, j] decays source j over chunks j .. i-1
        mat = torch.exp(_segsum(F.pad(log_decay[:, :, s0:s0 + blk.shape[2]], (1, 0))))
        out = (mat @ src).view(bsz, h, -1, n, p)
        starts.append(out[:, :, :-1])
        h0 = out[:, :, -1]
    return torch.cat(starts, dim=2), h0


def _ssd_chunks(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over whole chunks, in the sequence's own layout. x (B, K, Q, H, P) already times dt;
    a (B, K, Q, H) = dt A; b, c (B, K, Q, G, N); h0 (B, H, P, N). Returns y like x and the last
    state. A group's heads are one matrix wherever they share an operand (B or C): the states and
    the states' contribution are one product per chunk and group, (N x Q)(Q x R*P) and
    (Q x N)(N x R*P), instead of R products of 64 x 64 with a broadcast (copied) B or C."""
    bsz, k, q, h, p = x.shape
    g, n = b.shape[-2:]
    r = h // g
    ah = a.permute(0, 1, 3, 2)  # (B, K, H, Q)
    acum = ah.cumsum(dim=-1)
    decay = torch.exp(_segsum(ah))  # (B, K, H, Q, Q), zero above the diagonal
    bg, cg = b.transpose(2, 3), c.transpose(2, 3)  # (B, K, G, Q, N)
    scores = cg @ bg.transpose(-1, -2)  # (B, K, G, Q, Q): shared by a group's heads
    xh = x.view(bsz, k, q, g, r, p).permute(0, 1, 3, 4, 2, 5)  # (B, K, G, R, Q, P)
    y_in = (scores[:, :, :, None] * decay.view(bsz, k, g, r, q, q)) @ xh  # within each chunk
    to_end = torch.exp(acum[..., -1:] - acum)  # decay from each position to its chunk's end
    xw = (x * to_end.transpose(2, 3)[..., None]).view(bsz, k, q, g, r * p).transpose(2, 3)  # (B, K, G, Q, R*P)
    states = bg.transpose(-1, -2) @ xw  # (B, K, G, N, R*P)
    start, last = _pass_states(states.view(bsz, k, g, n, r, p).permute(0, 2, 4, 1, 3, 5).reshape(bsz, h, k, n, p),
                               acum[..., -1].transpose(1, 2), h0.transpose(-1, -2))
    start = start.view(bsz, g, r, k, n, p).permute(0, 3, 1, 4, 2, 5).reshape(bsz, k, g, n, r * p)
    y = (cg @ start).view(bsz, k, g, q, r, p) * torch.exp(acum).view(bsz, k, g, r, q).transpose(3, 4)[..., None]
    y = y.add_(y_in.transpose(3, 4))  # (B, K, G, Q, R, P)
    return y.transpose(2, 3).reshape(bsz, k, q, h, p), last.transpose(-1, -2).contiguous()


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *,
             state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2: ``S_t = exp(dt_t a_h) S_{t-1} + dt_t x_t (x) b_t``, ``y_t = S_t c_t`` per head.

    x (B, T, H, P); dt (B, T, H) after softplus and clamping; a (H,) negative; b, c (B, T, G, N).
    Computed in fp32, chunk by chunk (T padded to a multiple of ``chunk`` with steps that change
    nothing). Returns y (B, T, H, P) fp32 and the last state (B, H, P, N)."""
    bsz, t, h, p = x.shape
    n = b.shape[-1]
    q = min(chunk, t)
    pad = (-t) % q
    k = (t + pad) // q

    def chunked(v: torch.Tensor) -> torch.Tensor:  # (B, T, ...) -> (B, K, Q, ...)
        v = F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) if pad else v
        return v.reshape(bsz, k, q, *v.shape[2:])

    fused = _kernels() if x.is_cuda and state is None else None
    if fused is not None:  # mamba_ssm's Triton kernels (its own backward), same inputs and outputs
        y, last = fused(x, dt, a, b, c, chunk_size=chunk, return_final_states=True)
        return y.float(), last.float()
    dt = dt.float()
    h0 = state.float() if state is not None else x.new_zeros(bsz, h, p, n, dtype=torch.float32)
    y, last = _run(_ssd_chunks, chunked(x.float() * dt[..., None]), chunked(dt * a.float()), chunked(b.float()),
                   chunked(c.float()), h0)
    return y.reshape(bsz, k * q, h, p)[:, :t], last


class GatedRMSNorm(nn.Module):
    """``RMSNorm(y * silu(z))`` over groups of ``group_size`` channels (mamba-ssm's RMSNormGated with
    norm_before_gate=False). Per group, the norm does not depend on how TP splits the groups."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        v = y.float() * F.silu(z.float())
        v = v.unflatten(-1, (-1, self.group_size))
        v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * v.flatten(-2).to(dtype)


class SSMCache:
    """Recurrent decoding state of the SSM layers: per layer the conv inputs (B, C, K-1) and the
    SSM state, both None until a first forward fills them."""

    def __init__(self, num_layers: int) -> None:
        self.conv: list[torch.Tensor | None] = [None] * num_layers
        self.ssm: list[torch.Tensor | None] = [None] * num_layers


def _dt_bias(size: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    """Inverse softplus of dt ~ log-uniform [dt_min, dt_max] (clamped at ``floor``), as mamba-ssm."""
    dt = torch.exp(torch.rand(size) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class Mamba1Mixer(nn.Module):
    """Mamba-1: in_proj -> [x, z]; x -> causal conv -> SiLU -> x_proj -> (dt, B, C); selective scan;
    ``(y + D x) * silu(z)`` -> out_proj. ``layer`` indexes the decoding cache."""

    def __init__(self, spec: SSMSpec, *, hidden: int, inner: int, state: int, conv: int, dt_rank: int,
                 chunk: int, layer: int) -> None:
        super().__init__()
        self.state, self.dt_rank, self.chunk, self.layer = state, dt_rank, chunk, layer
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=spec.proj_bias)
        self.in_proj.tp_segments = (inner, inner)  # type: ignore[assignment]  # x | z, each split over TP
        self.conv1d = nn.Conv1d(inner, inner, conv, groups=inner, padding=conv - 1, bias=spec.conv_bias)
        self.x_proj = nn.Linear(inner, dt_rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=spec.proj_bias)
        with torch.no_grad():
            self.dt_proj.bias.copy_(_dt_bias(inner))

    def forward(self, u: torch.Tensor, cache: SSMCache | None = None) -> torch.Tensor:
        inner = self.in_proj.weight.shape[0] // 2  # this rank's channels under TP
        xs, z = self.in_proj(u).split([inner, inner], dim=-1)
        conv_state = cache.conv[self.layer] if cache is not None else None
        xs, conv_state = causal_conv1d(xs, self.conv1d.weight, self.conv1d.bias, conv_state)
        xs = F.silu(xs)
        dt, b, c = self.x_proj(xs).split([self.dt_rank, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt).float())
        a = -torch.exp(self.A_log.float())
        h0 = cache.ssm[self.layer] if cache is not None else None
        y, h = selective_scan(xs, dt, a, b, c, state=h0, chunk=self.chunk)
        if cache is not None:
            cache.conv[self.layer], cache.ssm[self.layer] = conv_state, h
        y = (y + xs.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(u.dtype))


class Mamba2Mixer(nn.Module):
    """Mamba-2: in_proj -> [z, x, B, C, dt]; [x, B, C] -> causal conv -> SiLU; SSD chunk scan with a
    scalar decay per head; ``y + D x``; gated RMSNorm with z (per group, or over the whole inner
    width when ``spec.norm_per_group`` is false, as transformers < 5 did); out_proj."""

    def __init__(self, spec: SSMSpec, *, hidden: int, heads: int, head_dim: int, groups: int, state: int, conv: int,
                 chunk: int, eps: float, dt_limit: tuple[float, float], layer: int) -> None:
        super().__init__()
        if heads % groups:
            raise ValueError(f"Mamba-2: {heads} heads do not split into {groups} groups")
        inner = heads * head_dim
        self.heads, self.head_dim, self.groups, self.state = heads, head_dim, groups, state
        self.chunk, self.dt_limit, self.layer = chunk, dt_limit, layer
        self.in_proj = nn.Linear(hidden, 2 * inner + 2 * groups * state + heads, bias=spec.proj_bias)
        # z | x | B | C | dt: each segment split over TP, so every rank holds whole heads and groups
        self.in_proj.tp_segments = (inner, inner, groups * state, groups * state, heads)  # type: ignore[assignment]
        channels = inner + 2 * groups * state
        self.conv1d = nn.Conv1d(channels, channels, conv, groups=channels, padding=conv - 1, bias=spec.conv_bias)
        self.conv1d.tp_segments = (inner, groups * state, groups * state)  # type: ignore[assignment]
        self.dt_bias = nn.Parameter(_dt_bias(heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GatedRMSNorm(inner, inner // groups if spec.norm_per_group else inner, eps)
        self.out_proj = nn.Linear(inner, hidden, bias=spec.proj_bias)

    def forward(self, u: torch.Tensor, cache: SSMCache | None = None) -> torch.Tensor:
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state  # this rank's, under TP
        z, xbc, dt = self.in_proj(u).split([h * p, h * p + 2 * g * n, h], dim=-1)
        bsz, t, _ = z.shape  # (under sequence parallelism in_proj gathers the whole sequence)
        conv_state = cache.conv[self.layer] if cache is not None else None
        xbc, conv_state = causal_conv1d(xbc, self.conv1d.weight, self.conv1d.bias, conv_state)
        xs, b, c = F.silu(xbc).split([h * p, g * n, g * n], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        a = -torch.exp(self.A_log.float())
        xs = xs.reshape(bsz, t, h, p)
        h0 = cache.ssm[self.layer] if cache is not None else None
        y, last = ssd_scan(xs, dt, a, b.reshape(bsz, t, g, n), c.reshape(bsz, t, g, n), state=h0, chunk=self.chunk)
        if cache is not None:
            cache.conv[self.layer], cache.ssm[self.layer] = conv_state, last
        y = y + xs.float() * self.D.float()[:, None]
        y = self.norm(y.reshape(bsz, t, h * p), z)
        return self.out_proj(y.to(u.dtype))
