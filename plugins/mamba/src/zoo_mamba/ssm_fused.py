"""The Mamba mixers' elementwise work around the scan, as compiled CPU kernels (`zoo.kernels.Kernels.fuse`): the
depthwise causal convolution with its SiLU, and Mamba-2's output gate ``RMSNorm((y + D x) *
silu(z))`` over groups.

In eager PyTorch the convolution is K shifted multiply-adds and the SiLU another pass, each way;
the gate is ~8 passes forward and ~15 backward, with autograd's buffers. Every pass over a
(T, inner) float32 tensor reads it from memory inside a training step. Here the convolution and
SiLU are one pass forward and two backward (the SiLU's gradient, from the sigmoid the forward kept
for float32, then the input's and the weight's), the gate one forward and one backward, keeping
its inputs and the rows' 1/rms. The SSD's own elementwise passes are compiled
in `zoo_mamba.ssd`. Used where the run's kernels fuse (`Kernels.fuses`) (CPU, large tensors, inductor on); the mixers'
eager code runs otherwise.

Inputs are passed to the compiled functions in the layouts they compute in (the gate's (rows,
groups, group size) views, the convolution's (K, channels) weight): a reshape inside a graph
compiled for dynamic sizes turns its loads into gathers (divisions and remainders of symbolic
sizes), which made the first version of the gate's backward slower than eager.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zoo import kernels

# Rows a partial column sum covers (`row_block_sums`).
_SUM_ROWS = 16


def row_block_sums(v: torch.Tensor) -> torch.Tensor:
    """Inside a compiled kernel: sums of ``v`` (rows, ...) over blocks of `_SUM_ROWS` rows, for the
    caller to add up outside it (``.sum(0)``: a few rows). Inductor computes a column sum as a loop
    down all the rows of each 16-column strip, and a block of rows at a time reads memory in order
    (faster from 384 columns up, level at 256). A sum of the partial sums inside the same kernel
    is merged back into the one loop. Rows not a multiple of the block: one plain sum."""
    r = v.shape[0]
    if r % _SUM_ROWS:
        return v.sum(0, keepdim=True)
    return v.reshape(r // _SUM_ROWS, _SUM_ROWS, *v.shape[1:]).sum(1)

# ------------------------------------------------------------------- causal convolution + SiLU


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The convolution in float32: x (B, T, C) from a zero history, w (K, C), b (C,) or None."""
    k, t = w.shape[0], x.shape[1]
    xp = F.pad(x.float(), (0, 0, k - 1, 0))  # (in a compiled kernel: masked loads, no copy)
    y = xp[:, :t] * w[0].float()
    for s in range(1, k):
        y = y + xp[:, s:s + t] * w[s].float()
    return y if b is None else y + b.float()


def _conv_silu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.silu(_conv(x, w, b)).to(x.dtype)


def _conv_silu_keep(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x: the output and the sigmoid backward takes SiLU's derivative from."""
    pre = _conv(x, w, b)
    sig = torch.sigmoid(pre)
    return pre * sig, sig


def _conv_silu_grad(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The gradient at the convolution's output (float32), the convolution recomputed."""
    pre = _conv(x, w, b)
    sig = torch.sigmoid(pre)
    return g.float() * sig * (1 + pre * (1 - sig))


def _conv_silu_grad_kept(g: torch.Tensor, y: torch.Tensor, sig: torch.Tensor) -> torch.Tensor:
    """The same from the kept output and sigmoid: silu'(u) = sig + y (1 - sig), no exponential."""
    return g.float() * (sig + y * (1 - sig))


def _conv_backward(gp: torch.Tensor, x: torch.Tensor, w: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the output's gradient gp (float32): the input's (x's dtype), and the weight's (K, C) and
    the bias's as float32 partial sums over blocks of rows (`row_block_sums`; the caller
    adds them up)."""
    k, t = w.shape[0], x.shape[1]
    ahead = F.pad(gp, (0, 0, 0, k - 1))  # y_t reads x_{t-K+1+s} with w_s: dx_t = sum_s w_s gp_{t+K-1-s}
    dx = ahead[:, k - 1:k - 1 + t] * w[0].float()
    for s in range(1, k):
        dx = dx + ahead[:, k - 1 - s:k - 1 - s + t] * w[s].float()
    xp = F.pad(x.float(), (0, 0, k - 1, 0))
    dw = torch.stack([row_block_sums((gp * xp[:, s:s + t]).flatten(0, 1)) for s in range(k)], 1)
    return dx.to(x.dtype), dw, row_block_sums(gp.flatten(0, 1))


class ConvSiLU(torch.autograd.Function):
    """``silu(causal_conv1d(x))`` from a zero history, x (B, T, C), weight (C, K); the output in
    x's dtype, computed in float32. Keeps x and the weight, and for a float32 x also the output
    and the sigmoid (the output is kept alive by the scan and the gate anyway; the sigmoid is
    T x C floats): backward then takes SiLU's derivative from them, no convolution recomputed and
    no exponential; for bf16 or
    fp16 it recomputes the convolution in float32 rather than use the rounded output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = weight.t().contiguous()  # (K, C): a vector load per shift
        if x.dtype != torch.float32:
            ctx.save_for_backward(x, w, bias)
            return kernels.active().fuse("conv_silu", _conv_silu, _conv_silu, x, w, bias)
        y, sig = kernels.active().fuse("conv_silu_keep", _conv_silu_keep, _conv_silu_keep, x, w, bias)
        ctx.save_for_backward(x, w, bias, y, sig)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w, bias, *kept = ctx.saved_tensors
        if kept:
            gp = kernels.active().fuse("conv_silu_grad_kept", _conv_silu_grad_kept, _conv_silu_grad_kept, grad.contiguous(), *kept)
        else:
            gp = kernels.active().fuse("conv_silu_grad", _conv_silu_grad, _conv_silu_grad, grad.contiguous(), x, w, bias)
        dx, dw, db = kernels.active().fuse("conv_backward", _conv_backward, _conv_backward, gp, x, w)
        return dx, dw.sum(0).t().to(w.dtype), None if bias is None else db.sum(0).to(bias.dtype)


# ------------------------------------------------------------------------ Mamba-2's output gate


def _gate(y: torch.Tensor, x: torch.Tensor, d: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    zf = z.float()
    v = (y + x.float() * d) * (zf * torch.sigmoid(zf))
    rstd = torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    return w.float() * (v * rstd), rstd


def _gate_backward(g: torch.Tensor, y: torch.Tensor, x: torch.Tensor, d: torch.Tensor, z: torch.Tensor,
                   w: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xf, zf = x.float(), z.float()
    u = y + xf * d
    sig = torch.sigmoid(zf)
    gate = zf * sig
    vhat = u * gate * rstd
    gf = g.float()
    gv = gf * w.float()
    dv = rstd * (gv - vhat * (gv * vhat).mean(-1, keepdim=True))
    du = dv * gate  # y's gradient; x's is du d
    dz = dv * u * sig * (1 + zf * (1 - sig))
    # D's and the weight's gradients as partial sums over blocks of rows, added up by the caller
    return (du, (du * d).to(x.dtype), row_block_sums(du * xf), dz.to(z.dtype),
            row_block_sums(gf * vhat))


class SkipGatedRMSNorm(torch.autograd.Function):
    """``weight * RMSNorm((y + d x) * silu(z))`` in float32, the norm over each of ``groups``
    groups of channels (mamba-ssm's RMSNormGated, norm_before_gate=False, after Mamba-2's skip).
    y, x (B, T, H, P) (y the scan's float32 output, x its input); d (H,); z (B, T, H*P);
    weight (H*P,). Returns (B, T, H*P) float32. Keeps its inputs and the rows' 1/rms."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, x: torch.Tensor, d: torch.Tensor, z: torch.Tensor,
                weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
        *lead, h, p = y.shape
        rows, size = y.numel() // (h * p), h * p // groups
        grouped = [v.reshape(rows, groups, size) for v in (y, x, z)]  # views of in_proj's output
        dfull = d.float()[:, None].expand(h, p).reshape(groups, size)  # D per channel
        out, rstd = kernels.active().fuse("gated_rms_norm", _gate, _gate, *grouped[:2], dfull, grouped[2],
                              weight.view(groups, size), eps)
        ctx.save_for_backward(*grouped, dfull, weight, rstd)
        ctx.shapes = y.shape, z.shape, d.dtype
        return out.view(*lead, h * p)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        y, x, z, dfull, weight, rstd = ctx.saved_tensors
        yshape, zshape, ddtype = ctx.shapes
        du, dx, dd, dz, dw = kernels.active().fuse("gated_rms_norm_backward", _gate_backward, _gate_backward,
                                       grad.reshape(y.shape), y, x, dfull, z, weight.view(dfull.shape), rstd)
        dd = dd.sum(0).view(yshape[-2], yshape[-1]).sum(-1).to(ddtype)  # per channel -> per head
        return (du.view(yshape), dx.view(yshape), dd, dz.view(zshape), dw.sum(0).view(-1).to(weight.dtype), None,
                None)
