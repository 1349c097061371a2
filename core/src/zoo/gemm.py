"""float32 matrix products on a CPU through oneDNN where it is faster than torch's BLAS.

torch computes float32 ``F.linear``/``mm`` on a CPU with MKL, which runs its generic (AVX2) kernels
on CPUs that are not Intel's: on a 2-core AMD EPYC (Zen 5) a 2048^3 float32 product reached 212
GFLOP/s through MKL and 477-503 through oneDNN (which torch ships for bf16 and uses there already).
`configure` decides once per process ("auto": oneDNN where MKL is on its generic path; "onednn";
"blas": torch's own), and `linear`/`mm` then route float32 CPU products through oneDNN's matmul
when it was chosen. Both are float32 products (IEEE float32 multiply-adds; only the summation order
differs, as between any two BLAS builds); autocast, other dtypes and accelerators are untouched.
`zoo train` applies it to every ``nn.Linear`` of the model (`adopt`), the tensor-parallel linears,
the experts' products and the LM loss: `train.cpu_gemm`; `zoo version` says what it chose.
"""

from __future__ import annotations

import platform
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

Mode = Literal["auto", "onednn", "blas"]
_ONEDNN = False  # whether float32 CPU products go through oneDNN in this process


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_works() -> bool:
    """Whether this torch build has oneDNN's matmul op and it computes a small product right."""
    try:
        g = torch.Generator().manual_seed(0)  # never the global stream: models are built from it next
        a, b = torch.randn(64, 48, generator=g), torch.randn(32, 48, generator=g)
        return torch.allclose(_onednn_linear(a, b), a @ b.t(), rtol=1e-4, atol=1e-4)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def blas_is_generic() -> bool:
    """Whether torch's float32 BLAS here is MKL on an x86 CPU that is not Intel's (where MKL takes
    its generic code path). Decided from the machine, not timed, so every process of a run (and a
    resumed run) computes with the same products."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkl.is_available()
            and _cpu_vendor() not in ("", "GenuineIntel"))


def configure(mode: Mode = "auto") -> str:
    """Choose the float32 CPU GEMM for this process ("auto": oneDNN where `blas_is_generic`); returns
    what was chosen and why (one line)."""
    global _ONEDNN
    _ONEDNN = False
    if mode == "blas":
        return "float32 CPU products: torch's BLAS (train.cpu_gemm=blas)"
    if mode == "auto" and not blas_is_generic():
        return "float32 CPU products: torch's BLAS"
    if not _onednn_works():
        if mode == "onednn":
            raise RuntimeError("train.cpu_gemm=onednn: this torch build has no working oneDNN matmul "
                               "(torch.ops.mkldnn._linear_pointwise); use auto or blas")
        return "float32 CPU products: torch's BLAS (no oneDNN matmul in this torch build)"
    _ONEDNN = True
    why = "train.cpu_gemm=onednn" if mode == "onednn" else f"MKL's generic path on this {_cpu_vendor()} CPU"
    return f"float32 CPU products: oneDNN ({why})"


def onednn_for(*tensors: torch.Tensor) -> bool:
    return (_ONEDNN and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not torch.is_autocast_enabled("cpu") and all(t.numel() for t in tensors))


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` and its gradients, each product through oneDNN (transposed operands
    are read in place, as strides). Saves what F.linear's graph saves: the input and the weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dx = _onednn_linear(g, weight.t()).reshape(x.shape) if ctx.needs_input_grad[0] else None
        dw = _onednn_linear(g.t(), x.reshape(-1, x.shape[-1]).t()) if ctx.needs_input_grad[1] else None
        db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through oneDNN for float32 on a CPU when `configure` chose it."""
    if onednn_for(x, weight) and (bias is None or onednn_for(bias)):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (2-D, no autograd: for hand-written backward passes), into ``out`` if given."""
    if not onednn_for(a, b):
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    y = _onednn_linear(a, b.t())
    return y if out is None else out.copy_(y)


class Linear(nn.Linear):
    """An ``nn.Linear`` whose product goes through `linear` (what `adopt` turns linears into)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def adopt(model: nn.Module) -> int:
    """Every plain ``nn.Linear`` of ``model`` computes through `linear` (same parameters, state dict
    and type checks: a subclass); returns how many. A no-op for the products unless `configure`
    chose oneDNN."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
            n += 1
    return n
