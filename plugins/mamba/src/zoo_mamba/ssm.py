"""Selective state-space mixers in pure PyTorch: Mamba-1 (Gu & Dao 2023) and Mamba-2's SSD (Dao &
Gu 2024), with chunked scans whose memory is bounded by the chunk, and a recurrent state for decoding.

Shapes: B batch, T sequence, D model width, I inner width (expand x D), N state size; Mamba-2 splits
I into H heads of P channels and shares B/C over G groups of H/G heads.

Mamba-1's decay ``exp(dt A)`` is a (I, N) matrix per step, so no (T x T) matrix form is cheap: the
scan runs chunk by chunk, the recurrence step by step inside a chunk (one multiply-add a step) and
whole-chunk passes for the rest, with a hand-written backward that recomputes a chunk's states
(`_SelectiveScan`): a layer keeps its inputs and one state per chunk, and its (B, chunk, I, N)
tensors (HF's are (B, I, T, N)) exist for one chunk at a time. Mamba-2's decay is a
scalar per head, so each chunk is a masked "attention" with decays (``ssd_minimal``), the chunks
pass their states on one multiply-add per chunk, linear in T (the minimal code's dense chunk x
chunk einsum is quadratic), and its backward is written out (`zoo_mamba.ssd`). A one-token
step (decoding) runs either recurrence itself. Both compute in float32, under autocast too.
`mamba_ssm`/`causal_conv1d` kernels are used on CUDA when they import (`_kernel`), never required;
on a CPU the convolution with its SiLU and Mamba-2's gated norm run compiled (`zoo_mamba.ssm_fused`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.nn.linear import Linear
from zoo.parallel.context import ContextParallelSite, to_channel_shards, to_sequence_shards
from zoo.spec import SSMSpec
from zoo_mamba import ssd, ssm_fused

# The optional CUDA kernels (`zoo.backends`), each for one function here, used on CUDA tensors when
# their package imports: mamba_ssm's scans (Mamba-1's selective scan, Mamba-2's fused chunk scan,
# both with their own backward) and causal_conv1d's depthwise convolution.
_KERNELS = {"selective_scan": ("mamba-ssm", "mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
            "ssd": ("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
            "conv": ("causal-conv1d", "causal_conv1d", "causal_conv1d_fn")}


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def _kernel(which: str, x: torch.Tensor) -> Any:
    """The CUDA kernel ``which`` of `_KERNELS` for tensors like ``x``, or None (not on CUDA, or the
    package does not import: the PyTorch path then runs)."""
    from zoo.backends import kernel

    return kernel(*_KERNELS[which]) if _on_cuda(x) else None


class _CausalConv1d(torch.autograd.Function):
    """Depthwise causal convolution from a zero history as K shifted multiply-adds in the (B, T, C)
    layout, with its own backward (K passes for the input, K products summed for the weight):
    torch's grouped conv1d wants (B, C, T), and the layout copies around it cost more than the
    convolution. x is neither padded nor copied; backward keeps it (a view of in_proj's output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x (B, T, C); weight (C, K): y_t = b + sum_s w_{K-1-s} x_{t-s}, zero before x
        k, t = weight.shape[1], x.shape[1]
        y = x * weight[:, k - 1] if bias is None else torch.addcmul(bias, x, weight[:, k - 1])
        for s in range(1, min(k, t)):
            y[:, s:].addcmul_(x[:, :t - s], weight[:, k - 1 - s])
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        k, t = weight.shape[1], grad.shape[1]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grad * weight[:, k - 1]
            for s in range(1, min(k, t)):
                dx[:, :t - s].addcmul_(grad[:, s:], weight[:, k - 1 - s])
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(grad[:, s:] * x[:, :t - s]).sum((0, 1)) if s < t else weight.new_zeros(weight.shape[0])
                              for s in range(k - 1, -1, -1)], dim=1)
        db = grad.sum((0, 1)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None = None, *, silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution: x (B, T, C), weight (C, 1, K), ``state`` the K-1 inputs before
    x (B, C, K-1; zeros when None), then SiLU if ``silu`` (both mixers'). Returns y (B, T, C) and
    the K-1 last inputs (the next state)."""
    k = weight.shape[-1]
    dtype = torch.promote_types(x.dtype, weight.dtype) if not torch.is_autocast_enabled(x.device.type) else x.dtype
    before = x.new_zeros(x.shape[0], k - 1, x.shape[2]) if state is None else state.transpose(1, 2).to(x.dtype)
    w, b = weight.view(weight.shape[0], k).to(dtype), None if bias is None else bias.to(dtype)
    # the next state: the K-1 last inputs (a copy, not a view that keeps the whole input alive)
    recent = torch.cat([before, x[:, max(0, x.shape[1] - (k - 1)):]], dim=1)  # (for one token: the K inputs)
    nxt = recent[:, -(k - 1):].transpose(1, 2).contiguous()
    kernel = _kernel("conv", x) if state is None else None
    if silu and kernel is None and state is None and kernels.active().fuses(x):  # one compiled pass each way
        return ssm_fused.ConvSiLU.apply(x.to(dtype), w, b), nxt
    if kernel is not None:  # (B, C, T) in and out, as every causal_conv1d release takes it
        y = kernel(x.to(dtype).transpose(1, 2).contiguous(), w, b).transpose(1, 2)
    elif x.device.type == "cpu" and state is None:  # training, a prompt's first pass: no padded copy
        y = _CausalConv1d.apply(x.to(dtype), w, b)
    elif x.device.type == "cpu" and x.shape[1] == 1 and k > 1:  # a decoding step: K taps per channel
        # over the cached inputs and x (the multi-token path pads and copies for one token)
        y = torch.einsum("bkc,ck->bc", recent.to(dtype), w)[:, None]
        y = y if b is None else y + b
    elif x.device.type == "cpu":  # a continued sequence: over the cached inputs and x, the cached
        # ones' outputs dropped (for one token torch's grouped conv1d took 2x this path's time)
        y = _CausalConv1d.apply(torch.cat([before, x], dim=1).to(dtype), w, b)[:, k - 1:]
    else:  # accelerators: torch's grouped convolution kernel over the padded input
        xp = torch.cat([before, x], dim=1).to(dtype).transpose(1, 2)
        y = F.conv1d(xp, weight.to(dtype), b, groups=x.shape[2]).transpose(1, 2).contiguous()
    return F.silu(y) if silu else y, nxt


class _SelectiveScan(torch.autograd.Function):
    """Mamba-1's scan, chunk by chunk, with a hand-written backward. Within a chunk the state runs
    step by step (one multiply-add on a (B, I, N) slice a step, in place in the chunk's (B, Q, I, N)
    buffer); everything else is whole-chunk passes: the decays ``exp(dt a)``, the inputs
    ``dt x b``, the outputs ``<h_t, c_t>``. Kept for backward: the inputs and the state entering
    each chunk (B, K, I, N), linear in T; backward recomputes a chunk's states, runs the gradient's
    recurrence in reverse (``g_t = c_t dy_t + exp(dt_{t+1} a) g_{t+1}``) and forms every input's
    gradient from the two (3-4.5x faster than a log-depth scan recomputed under autograd).

    x, dt (B, T, I) float32, dt after softplus; a (I, N); b, c (B, T, N); h0 (B, I, N).
    Returns y (B, T, I) and the last state (B, I, N)."""

    @staticmethod
    def _states(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's decays and states (B, Q, I, N), from the state h before it."""
        decay = torch.exp(dt[..., None] * a)  # in (0, 1]: products underflow, never overflow
        hs = (dt * x)[..., None] * b[:, :, None, :]  # each step's input, turned into the states in place
        hs[:, 0].addcmul_(decay[:, 0], h)
        for t in range(1, hs.shape[1]):
            hs[:, t].addcmul_(decay[:, t], hs[:, t - 1])
        return decay, hs

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                h0: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.new_empty(x.shape)
        starts, h = [], h0
        for s in range(0, x.shape[1], chunk):
            q = slice(s, s + chunk)
            starts.append(h)
            _, hs = _SelectiveScan._states(x[:, q], dt[:, q], a, b[:, q], h)
            y[:, q] = (hs @ c[:, q, :, None]).squeeze(-1)
            h = hs[:, -1].clone()
        ctx.save_for_backward(x, dt, a, b, c, *starts)
        ctx.chunk = chunk
        return y, h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor, dlast: torch.Tensor | None) -> tuple[Any, ...]:
        with torch.autocast(dy.device.type, enabled=False):  # (when backward runs inside an autocast region)
            x, dt, a, b, c, *starts = ctx.saved_tensors
            chunk = ctx.chunk
            dx, ddt, db, dc = torch.empty_like(x), torch.empty_like(dt), torch.empty_like(b), torch.empty_like(c)
            da = torch.zeros_like(a)
            dh = dlast if dlast is not None else torch.zeros_like(starts[0])
            for k in range(len(starts) - 1, -1, -1):
                q = slice(k * chunk, (k + 1) * chunk)
                xq, dtq, bq, cq, dyq, h = x[:, q], dt[:, q], b[:, q], c[:, q], dy[:, q], starts[k]
                decay, hs = _SelectiveScan._states(xq, dtq, a, bq, h)
                dc[:, q] = (dyq[:, :, None, :] @ hs).squeeze(-2)  # y_t = <h_t, c_t>
                g = dyq[..., None] * cq[:, :, None, :]  # the gradient of each state, in place:
                g[:, -1].add_(dh)
                for t in range(g.shape[1] - 2, -1, -1):
                    g[:, t].addcmul_(decay[:, t + 1], g[:, t + 1])
                dh = decay[:, 0] * g[:, 0]  # the state entering the chunk
                # h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t
                dxdt = torch.matmul(g, bq[..., None]).squeeze(-1)  # (B, Q, I)
                dx[:, q] = dxdt * dtq
                db[:, q] = ((dtq * xq)[:, :, None, :] @ g).squeeze(-2)
                g.mul_(decay)  # d(dt a) = g_t h_{t-1} exp(dt_t a)
                g[:, 1:].mul_(hs[:, :-1])
                g[:, 0].mul_(h)
                ddt[:, q] = (g * a).sum(-1).addcmul_(dxdt, xq)
                da.add_((g * dtq[..., None]).sum((0, 1)))  # (an einsum made it a permuted copy and I products)
            return dx, ddt, da, db, dc, dh, None


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *,
                   state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1: ``h_t = exp(dt_t a) h_{t-1} + dt_t b_t x_t``, ``y_t = <h_t, c_t>`` per channel.

    x, dt (B, T, I) (dt after softplus); a (I, N) negative; b, c (B, T, N). Computed in fp32,
    ``chunk`` steps at a time (what the scan holds at once, and backward recomputes, is one chunk's
    (B, chunk, I, N) states). Returns y (B, T, I) fp32 and the last state (B, I, N)."""
    kernel = _kernel("selective_scan", x) if state is None and x.shape[1] > 1 else None
    if kernel is not None:  # mamba_ssm's kernel (its own backward) takes (B, I, T) and (B, N, T)
        y, last = kernel(x.transpose(1, 2), dt.transpose(1, 2), a, b.transpose(1, 2), c.transpose(1, 2),
                         return_last_state=True)
        return y.transpose(1, 2).float(), last.float()
    x, dt, b, c, a = x.float(), dt.float(), b.float(), c.float(), a.float()
    h = state.float() if state is not None else x.new_zeros(x.shape[0], x.shape[2], a.shape[1])
    with torch.autocast(x.device.type, enabled=False):  # float32 products too (autocast would make them bf16)
        if x.shape[1] == 1:  # a decoding step: the recurrence itself
            h = torch.exp(dt[:, 0, :, None] * a) * h + (dt[:, 0] * x[:, 0])[..., None] * b[:, 0, None, :]
            return (h @ c[:, 0, :, None]).transpose(1, 2), h
        return _SelectiveScan.apply(x.contiguous(), dt.contiguous(), a, b.contiguous(), c.contiguous(), h, chunk)


# The chunk is an algorithmic choice, not part of the model: any chunk computes the same function
# (to rounding). A chunk's quadratic part (the Q x Q decay matrices and products of every head)
# grows with Q and the state passing between chunks shrinks with it; on a CPU 64 is the best
# trade (measured against 32, 128 and 256 at several sequence lengths). Mamba-2 configs carry
# mamba-ssm's 256, the Triton kernel's choice on a GPU.
CPU_CHUNK = 64


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *,
             state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2: ``S_t = exp(dt_t a_h) S_{t-1} + dt_t x_t (x) b_t``, ``y_t = S_t c_t`` per head.

    x (B, T, H, P); dt (B, T, H) after softplus and clamping; a (H,) negative; b, c (B, T, G, N).
    Computed in fp32, chunk by chunk (T padded to a multiple of the chunk with steps that change
    nothing); on a CPU in chunks of at most `CPU_CHUNK`. Returns y (B, T, H, P) fp32 and the last
    state (B, H, P, N)."""
    bsz, t, h, p = x.shape
    n = b.shape[-1]
    q = min(chunk, t, CPU_CHUNK if x.device.type == "cpu" else chunk)
    pad = (-t) % q
    k = (t + pad) // q

    def chunked(v: torch.Tensor) -> torch.Tensor:  # (B, T, ...) -> (B, K, Q, ...)
        v = F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) if pad else v
        return v.reshape(bsz, k, q, *v.shape[2:])

    kernel = _kernel("ssd", x) if state is None else None
    if kernel is not None:  # mamba_ssm's Triton kernels (its own backward), same inputs and outputs
        y, last = kernel(x, dt, a, b, c, chunk_size=chunk, return_final_states=True)
        return y.float(), last.float()
    dt = dt.float()
    h0 = state.float() if state is not None else x.new_zeros(bsz, h, p, n, dtype=torch.float32)
    with torch.autocast(x.device.type, enabled=False):  # float32 products too (autocast would make them bf16)
        if t == 1:  # a decoding step: the recurrence itself (the chunked form is ~60 small ops)
            g = b.shape[2]
            bh = b.float().reshape(bsz, g, 1, 1, n)  # a group's heads share B and C
            x1 = (x.float()[:, 0] * dt[:, 0, :, None]).reshape(bsz, g, h // g, p, 1)
            last = (torch.exp(dt[:, 0] * a.float())[..., None, None] * h0).view(bsz, g, h // g, p, n).addcmul_(x1, bh)
            # y = S c: one matrix-vector product per group (its heads share C; a batched product per
            # head reads C once a head)
            y = last.view(bsz, g, (h // g) * p, n) @ c.float().reshape(bsz, g, n, 1)
            return y.view(bsz, 1, h, p), last.view(bsz, h, p, n)
        y, last = ssd.SSD.apply(chunked(x.float()).flatten(0, 1), chunked(dt).flatten(0, 1),
                                chunked(dt * a.float()).flatten(0, 1), chunked(b.float()).flatten(0, 1),
                                chunked(c.float()).flatten(0, 1), h0)
    return y.reshape(bsz, k * q, h, p)[:, :t], last


class GatedRMSNorm(nn.Module):
    """``RMSNorm(y * silu(z))`` over groups of ``group_size`` channels (mamba-ssm's RMSNormGated with
    norm_before_gate=False). Per group, the norm does not depend on how TP splits the groups."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight``: this module's, or the slice of it for the channels y holds (context parallelism)."""
        dtype = y.dtype
        v = y.float() * F.silu(z.float())
        v = v.unflatten(-1, (-1, self.group_size))
        v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight if weight is None else weight) * v.flatten(-2).to(dtype)


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
        self.in_proj = Linear(hidden, 2 * inner, bias=spec.proj_bias)
        self.in_proj.tp_segments = (inner, inner)  # type: ignore[assignment]  # x | z, each split over TP
        self.conv1d = nn.Conv1d(inner, inner, conv, groups=inner, padding=conv - 1, bias=spec.conv_bias)
        self.x_proj = Linear(inner, dt_rank + 2 * state, bias=False)
        self.dt_proj = Linear(dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = Linear(inner, hidden, bias=spec.proj_bias)
        with torch.no_grad():
            self.dt_proj.bias.copy_(_dt_bias(inner))

    def forward(self, u: torch.Tensor, cache: SSMCache | None = None) -> torch.Tensor:
        inner = self.in_proj.weight.shape[0] // 2  # this rank's channels under TP
        xs, z = self.in_proj(u).split([inner, inner], dim=-1)
        conv_state = cache.conv[self.layer] if cache is not None else None
        xs, conv_state = causal_conv1d(xs, self.conv1d.weight, self.conv1d.bias, conv_state, silu=True)
        dt, b, c = self.x_proj(xs).split([self.dt_rank, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt).float())
        a = -torch.exp(self.A_log.float())
        h0 = cache.ssm[self.layer] if cache is not None else None
        y, h = selective_scan(xs, dt, a, b, c, state=h0, chunk=self.chunk)
        if cache is not None:
            cache.conv[self.layer], cache.ssm[self.layer] = conv_state, h
        y = (y + xs.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(u.dtype))


class Mamba2Mixer(ContextParallelSite):
    """Mamba-2: in_proj -> [z, x, B, C, dt]; [x, B, C] -> causal conv -> SiLU; SSD chunk scan with a
    scalar decay per head; ``y + D x``; gated RMSNorm with z (per group, or over the whole inner
    width when ``spec.norm_per_group`` is false, as transformers < 5 did); out_proj.

    Under context parallelism (``cp_group`` set by the core) the scan needs the whole sequence:
    in_proj's output goes from sequence shards to head shards (an all-to-all; every rank then holds
    cp-th of the heads and groups with their z, x, B, C and dt over all positions, and uses the
    matching slices of the convolution and the per-head parameters), and the gated norm's output
    back before out_proj, as Megatron's Mamba context parallelism does."""

    def __init__(self, spec: SSMSpec, *, hidden: int, heads: int, head_dim: int, groups: int, state: int, conv: int,
                 chunk: int, eps: float, dt_limit: tuple[float, float], layer: int) -> None:
        super().__init__()
        if heads % groups:
            raise ValueError(f"Mamba-2: {heads} heads do not split into {groups} groups")
        inner = heads * head_dim
        self.heads, self.head_dim, self.groups, self.state = heads, head_dim, groups, state
        self.chunk, self.dt_limit, self.layer = chunk, dt_limit, layer
        self.in_proj = Linear(hidden, 2 * inner + 2 * groups * state + heads, bias=spec.proj_bias)
        # z | x | B | C | dt: each segment split over TP, so every rank holds whole heads and groups
        self.in_proj.tp_segments = (inner, inner, groups * state, groups * state, heads)  # type: ignore[assignment]
        channels = inner + 2 * groups * state
        self.conv1d = nn.Conv1d(channels, channels, conv, groups=channels, padding=conv - 1, bias=spec.conv_bias)
        self.conv1d.tp_segments = (inner, groups * state, groups * state)  # type: ignore[assignment]
        self.dt_bias = nn.Parameter(_dt_bias(heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GatedRMSNorm(inner, inner // groups if spec.norm_per_group else inner, eps)
        self.out_proj = Linear(inner, hidden, bias=spec.proj_bias)

    def forward(self, u: torch.Tensor, cache: SSMCache | None = None) -> torch.Tensor:
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state  # this rank's, under TP
        zxbcdt = self.in_proj(u)
        params = (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight)
        cp = self.cp_group is not None and cache is None
        if cp:  # this rank's heads over the whole sequence
            zxbcdt, params = self._head_shards(zxbcdt)
            h, g = h // dist.get_world_size(self.cp_group), g // dist.get_world_size(self.cp_group)
        conv_w, conv_b, dt_bias, a_log, skip, norm_w = params
        z, xbc, dt = zxbcdt.split([h * p, h * p + 2 * g * n, h], dim=-1)
        bsz, t, _ = z.shape  # (under sequence parallelism in_proj gathers the whole sequence)
        conv_state = cache.conv[self.layer] if cache is not None else None
        xbc, conv_state = causal_conv1d(xbc, conv_w, conv_b, conv_state, silu=True)
        xs, b, c = xbc.split([h * p, g * n, g * n], dim=-1)
        dt = F.softplus(dt.float() + dt_bias.float()).clamp(*self.dt_limit)
        a = -torch.exp(a_log.float())
        xs = xs.reshape(bsz, t, h, p)
        h0 = cache.ssm[self.layer] if cache is not None else None
        y, last = ssd_scan(xs, dt, a, b.reshape(bsz, t, g, n), c.reshape(bsz, t, g, n), state=h0, chunk=self.chunk)
        if cache is not None:
            cache.conv[self.layer], cache.ssm[self.layer] = conv_state, last
        if kernels.active().fuses(z):  # the skip, gate and norm in one compiled pass each way
            y = ssm_fused.SkipGatedRMSNorm.apply(y, xs, skip, z, norm_w, h * p // self.norm.group_size, self.norm.eps)
        else:
            y = self.norm((y + xs.float() * skip.float()[:, None]).reshape(bsz, t, h * p), z, norm_w)
        if cp:  # back to this rank's positions, every head
            y = to_sequence_shards(y, self.cp_group)
        return self.out_proj(y.to(u.dtype))

    def _head_shards(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """in_proj's output (B, T/cp, ...) for this CP rank's positions -> (B, T, ...) for its
        cp-th of the heads and groups (each of z, x, B, C, dt cut into cp contiguous parts, part j
        to rank j), and the slices of the convolution and per-head parameters those channels use."""
        group = self.cp_group
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state
        bsz, tl, _ = zxbcdt.shape
        parts = [s.view(bsz, tl, cp, s.shape[-1] // cp) for s in zxbcdt.split([h * p, h * p, g * n, g * n, h], dim=-1)]
        full = to_channel_shards(torch.cat(parts, dim=-1).permute(2, 0, 1, 3), group)
        hl, gl = h // cp, g // cp
        heads = slice(r * hl, (r + 1) * hl)
        dev = zxbcdt.device
        channels = torch.cat([torch.arange(r * hl * p, (r + 1) * hl * p, device=dev),  # x | B | C of the convolution
                              h * p + torch.arange(r * gl * n, (r + 1) * gl * n, device=dev),
                              h * p + g * n + torch.arange(r * gl * n, (r + 1) * gl * n, device=dev)])
        bias = self.conv1d.bias
        return full, (self.conv1d.weight.index_select(0, channels), None if bias is None else bias.index_select(0, channels),
                      self.dt_bias[heads], self.A_log[heads], self.D[heads], self.norm.weight[r * hl * p:(r + 1) * hl * p])
