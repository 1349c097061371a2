"""The routed experts' MLPs on a CPU or GPU: each expert's contiguous slice of rows (sorted by
expert) through its gate/up and down products with a hand-written backward (`ExpertMLPs`), or
torch's grouped GEMM where it works on the device (`grouped_mm_works`). `zoo.nn.moe` dispatches
the rows; this is the compute.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo import kernels


class ExpertMLPs(torch.autograd.Function):
    """Each expert's MLP on its contiguous slice of rows (sorted by expert), one GEMM per slice each
    way (`_mm`, `_mm_t`), outputs and gradients written in place into whole tensors: autograd's
    graph of the same loop would concatenate the outputs, split the rows' gradient and stack the
    experts' weight gradients, a copy of each. Keeps the rows and the first GEMM's output; the
    activation is recomputed in backward (elementwise). Weights are used in the rows' dtype
    (autocast's cast), cast one expert at a time in each pass: under bf16 autocast a saved cast copy
    of every layer's experts would outweigh the layer's activations, and the weight gradients go
    straight into tensors of the weights' dtype instead of through a whole low-precision copy."""

    @staticmethod
    def forward(ctx: Any, xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, sizes: list[int],
                act: Any, gated: bool) -> torch.Tensor:
        h = xs.new_empty(xs.shape[0], gate_up.shape[1])
        out = xs.new_empty(xs.shape[0], down.shape[1])
        with torch.autocast(xs.device.type, enabled=False):
            start = 0
            for e, n in enumerate(sizes):
                if n:  # an idle expert costs nothing
                    rows = slice(start, start + n)
                    _mm(xs[rows], gate_up[e].to(xs.dtype).t(), h[rows])
                    _mm(_activation(h[rows], act, gated), down[e].to(xs.dtype).t(), out[rows])
                    start += n
        ctx.save_for_backward(xs, gate_up, down, h)
        ctx.sizes, ctx.act, ctx.gated = sizes, act, gated
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xs, gate_up, down, h = ctx.saved_tensors
        grad = grad.to(xs.dtype)
        gx, g1, g2 = torch.empty_like(xs), torch.empty_like(gate_up), torch.empty_like(down)
        start = 0
        for e, n in enumerate(ctx.sizes):
            if not n:  # an idle expert's gradient is zero, not missing (DP/EP reductions expect it)
                g1[e].zero_()
                g2[e].zero_()
                continue
            rows = slice(start, start + n)
            start += n
            w1, w2 = gate_up[e].to(xs.dtype), down[e].to(xs.dtype)
            with torch.enable_grad():
                he = h[rows].detach().requires_grad_(True)
                a = _activation(he, ctx.act, ctx.gated)
            _mm_t(grad[rows], a.detach(), g2[e])
            (gh,) = torch.autograd.grad(a, he, _mm(grad[rows], w2, xs.new_empty(n, w2.shape[1])))
            _mm_t(gh, xs[rows], g1[e])
            _mm(gh, w1, gx[rows])
        return gx, g1, g2, None, None, None


# oneDNN, which runs bf16/fp16 products on a CPU (and float32 ones where the run's kernels chose it),
# builds and keeps kernels for every new shape, and the experts' row counts change every step: a
# bf16 Mixtral step grew the process by 20-45 MB a step (2,000 row counts of one product held ~800
# MB; a float32 one through oneDNN ended 500 MB above HF's). There the rows are cut into
# power-of-two tiles, the last (< _TILE) zero-padded: a fixed set of shapes, whatever the routing.
_TILE = 16


def _tiles(n: int) -> list[tuple[int, int]]:
    """``(start, rows)`` pieces of ``n`` rows: powers of two >= `_TILE`, largest first, then the
    remainder below `_TILE`."""
    pieces, start = [], 0
    while n - start >= _TILE:
        size = 1 << ((n - start).bit_length() - 1)
        pieces.append((start, size))
        start += size
    return pieces + ([(start, n - start)] if start < n else [])


def _tiled(t: torch.Tensor) -> bool:
    """The product keeps a kernel per shape (`zoo.kernels.mm_keeps_shapes`: oneDNN's)."""
    return bool(kernels.active().call("mm_keeps_shapes", t))


def _padded(t: torch.Tensor) -> torch.Tensor:
    pad = t.new_zeros(_TILE, t.shape[1])
    pad[: t.shape[0]] = t
    return pad


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b``, ``a``'s rows tiled where `_tiled`."""
    if not _tiled(a):
        return kernels.active().call("mm", a, b, out)
    for s, m in _tiles(a.shape[0]):
        if m >= _TILE:
            kernels.active().call("mm", a[s:s + m], b, out[s:s + m])
        else:
            out[s:s + m] = kernels.active().call("mm", _padded(a[s:s + m]), b)[:m]
    return out


def _mm_t(a: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a^T c`` summed over the rows (a weight's gradient), kept in ``out``'s dtype: where
    `_tiled`, the tiles' products are summed in fp32 (the weights' own under autocast) and rounded
    once, as one product's accumulator would be."""
    if not _tiled(a):
        if out.dtype == a.dtype:
            kernels.active().call("mm", a.t(), c, out)
        else:
            out.copy_(a.t() @ c)
        return
    acc = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    acc.zero_()
    for s, m in _tiles(a.shape[0]):
        x, y = (a[s:s + m], c[s:s + m]) if m >= _TILE else (_padded(a[s:s + m]), _padded(c[s:s + m]))
        acc.add_(kernels.active().call("mm", x.t(), y))
    if acc is not out:
        out.copy_(acc)


def _activation(h: torch.Tensor, act: Any, gated: bool) -> torch.Tensor:
    if not gated:
        return act(h)
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward correctly here (CUDA with recent
    torch; the CPU build's has no backward): probed once per device type and dtype on a tiny case."""
    key = (device.type, dtype)
    if key not in _GROUPED:
        ok = False
        if hasattr(torch, "_grouped_mm") and device.type == "cuda":
            try:
                x = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=True)
                w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                offs = torch.tensor([8, 24], device=device, dtype=torch.int32)
                y = torch._grouped_mm(x, w, offs=offs)
                y.sum().backward()
                ref = torch.cat([x[:8] @ w[0], x[8:] @ w[1]])
                ok = bool(torch.allclose(y.float(), ref.float(), atol=1e-2, rtol=1e-2))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _GROUPED[key] = ok
    return _GROUPED[key]


__all__ = ["ExpertMLPs", "grouped_mm_works"]
