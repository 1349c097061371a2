"""float32 matrix products on a CPU through oneDNN where it is faster than torch's BLAS.

torch computes float32 ``F.linear``/``mm`` on a CPU with MKL, which runs its generic (AVX2) kernels
on CPUs that are not Intel's, where oneDNN (which torch ships for bf16 and uses there already)
runs the CPU's AVX-512 and reaches about twice MKL's rate (docs/benchmarks.md).
`configure` decides once per process ("auto": oneDNN where MKL is on its generic path and the CPU
has AVX-512, which MKL's generic kernels leave unused; "onednn"; "blas": torch's own), and
`linear`/`mm` then route float32 CPU products through oneDNN's matmul when it was chosen. On an
AVX2-only AMD CPU MKL's AVX2 kernels are as fast for a square product and faster for a
training step's transposed ones. Both are float32 products (IEEE float32 multiply-adds; only the summation order differs, as
between any two BLAS builds); autocast, other dtypes and accelerators are untouched.
A run selects it once (`train.cpu_gemm`, through `zoo.kernels`): zoo's linear layers, the
tensor-parallel linears, the experts' products and the LM loss then call it; `zoo version` and the
run's config.yaml say what was chosen. oneDNN
takes a product's input dense and reads its weight through its strides, so a product with
transposed operands (a weight gradient ``g.T @ x``) copies at most one of them (`_product`).

The same oneDNN call also gives zoo its tanh-GELU (`gelu_tanh`) on a CPU: torch's kernel evaluates
tanh with SLEEF, far slower than an elementwise pass, and a DiT or GPT-2 MLP runs it twice a step
(forward and the recomputed copy). oneDNN's JIT eltwise, applied as the post-op of a product with
the identity, is several times faster. And
under bf16 autocast on a CPU, `linear` is one oneDNN call with the bias fused that keeps the
float32 weight for backward instead of autocast's bf16 copy (`_AutocastLinear`). The GELU is
oneDNN's where its AVX-512 kernel runs ("auto"; on an AVX2-only CPU torch's is faster) or "onednn"
asks for it, in bf16 only where oneDNN computes bf16 at all; the
autocast linear wherever oneDNN has bf16 products. "blas" turns both off. On a CPU with AMX, and
where oneDNN's GELU is not chosen, `zoo_cpu_kernels.fused`'s compiled kernel (one exponential) computes it
instead, where the compiled kernels are on.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from zoo import kernels as reference
from zoo_cpu_kernels import fused, native

Mode = Literal["auto", "onednn", "blas"]
_FEW_ROWS = 32  # autocast linears over at most this many rows compute in float32 (`linear`)
_EYE = 16  # width of the identity `gelu_tanh` multiplies by (the fastest of 8-128 measured)
# `mm` makes an operand of a bf16 product read along its columns dense first from this many
# elements of the reduction and this many multiply-adds (`_dense_first`): below, the copy's cost
# is not won back (measured on experts' and attention's products of a few hundred rows).
_DENSE_REDUCTION = 256
_DENSE_WORK = 1 << 27


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


def _eltwise_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's tanh-GELU post-op exists here in ``dtype`` and agrees with torch's formula
    (without bf16 instructions, oneDNN has no bf16 inner product to attach it to)."""
    try:
        x = torch.linspace(-6, 6, 64 * _EYE)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        return torch.allclose(_gelu_tanh(x.to(dtype)).float(), F.gelu(x, approximate="tanh"), rtol=tol, atol=tol)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # Rows of _EYE elements times the identity: every output is its input times 1 plus exact zeros,
    # so the product is the input itself and the post-op sees exactly x. (An inf or NaN turns its
    # whole row of _EYE outputs NaN, inf * 0: a step with one is not finite either way.)
    eye = torch.eye(_EYE, dtype=x.dtype)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, _EYE), eye, None, "gelu", [], "tanh")
    # A tensor of its own, not a view: `zoo.nn.recompute` recognises an activation's output by it
    return torch.ops.aten._unsafe_view(y, x.shape)


def bf16_is_native() -> bool:
    """Whether oneDNN computes bf16 products on this CPU (and a small one right): with AVX-512 BF16 or
    AMX, or emulated on AVX-512. Without (an AVX2-only CPU), torch's bf16 products are fallbacks
    10-400x slower than float32."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        g = torch.Generator().manual_seed(0)
        a, b, c = (torch.randn(*s, generator=g).bfloat16() for s in ((64, 48), (32, 48), (32,)))
        want = a.float() @ b.float().t() + c.float()
        return torch.allclose(_onednn_linear(a, b, c).float(), want, rtol=2e-2, atol=2e-2)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo ("" where there is none, as off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_vendor() -> str:
    return _cpuinfo("vendor_id")


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (the foundation instructions), from /proc/cpuinfo."""
    return "avx512f" in _cpuinfo("flags").split()


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), from /proc/cpuinfo: torch's
    CPU flash-attention kernel then computes its bf16/fp16 blocks with oneDNN's AMX brgemm, and
    oneDNN's tanh-GELU is slower than `zoo_cpu_kernels.fused`'s (`gelu_tanh`)."""
    return "amx_tile" in _cpuinfo("flags").split()


def blas_is_generic() -> bool:
    """Whether torch's float32 BLAS here is MKL on an x86 CPU that is not Intel's (where MKL takes
    its generic code path). Decided from the machine, not timed, so every process of a run (and a
    resumed run) computes with the same products."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkl.is_available()
            and _cpu_vendor() not in ("", "GenuineIntel"))


def onednn_is_faster() -> bool:
    """What "auto" decides from the machine: MKL on its generic path (`blas_is_generic`) on a CPU
    with AVX-512, whose vector width oneDNN uses and MKL's generic kernels do not."""
    return blas_is_generic() and has_avx512()


@dataclass(frozen=True)
class Gemm:
    """What one run chose (`configure`): float32 CPU products through oneDNN (``onednn``), the dtypes
    whose tanh-GELU is oneDNN's eltwise kernel (``eltwise``), bf16-autocast linears through
    `_AutocastLinear` (``autocast``), and whether the compiled elementwise kernels (``fused``) and
    zoo's C kernels (``native``) are on beside them."""

    onednn: bool = False
    eltwise: tuple[torch.dtype, ...] = ()
    autocast: bool = False
    fused: bool = False
    native: bool = False

    def onednn_for(self, *tensors: torch.Tensor) -> bool:
        return (self.onednn and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
                and not torch.is_autocast_enabled("cpu") and all(t.numel() for t in tensors))

    def gelu_tanh(self, x: torch.Tensor) -> Any:
        """``F.gelu(x, approximate="tanh")`` for a CPU tensor outside autograd (the activations' own
        backward takes the derivative), through the fastest kernel measured for the CPU: on a CPU
        with AMX zoo's C kernel, else the compiled one where oneDNN's eltwise kernel is not chosen;
        oneDNN's where `configure` chose it (AVX-512 AMD CPUs), for contiguous float32/bf16; else
        NotImplemented (torch's). Each is within float32 rounding of torch's and gives the same bits
        for the same input whatever the tensor's size or thread count, so a recomputed copy is exact."""
        if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            return NotImplemented
        if self.native_gelu(x):
            return native.gelu_tanh(x)
        if self.fused and fused.takes(x) and (not self._onednn_gelu(x) or has_amx()):
            return fused.gelu_tanh(x, self.gelu_tanh_unfused)
        return self._gelu_tanh(x) if self._onednn_gelu(x) else NotImplemented

    def gelu_tanh_backward(self, g: torch.Tensor, x: torch.Tensor) -> Any:
        if self.native_gelu(g, x):
            return native.gelu_tanh_backward(g, x)
        if self.fused and fused.takes(x):
            return fused.gelu_tanh_backward(g, x)
        return NotImplemented

    def native_gelu(self, *tensors: torch.Tensor) -> bool:
        """Whether tanh-GELU (or its derivative, given ``g, x``) of these tensors is zoo's C kernel's:
        on a CPU with AMX (where it was measured the faster), tensors of at least the compiled
        kernels' minimum size."""
        return (self.native and tensors[0].numel() >= fused.MIN_ELEMENTS and has_amx()
                and native.gelu_ok(*tensors))

    def _onednn_gelu(self, x: torch.Tensor) -> bool:
        return x.dtype in self.eltwise and x.is_contiguous() and x.numel() % _EYE == 0 and x.numel() > 0

    def _gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        return _gelu_tanh(x)

    def gelu_tanh_unfused(self, x: torch.Tensor) -> torch.Tensor:
        """`gelu_tanh` without the compiled kernel: oneDNN's where chosen, else torch's (no autograd)."""
        return _gelu_tanh(x) if self._onednn_gelu(x) else F.gelu(x, approximate="tanh")

    def _dense(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` contiguous, as oneDNN's inner product takes its input: a transposed view of a large
        matrix through `zoo_cpu_kernels.fused.transpose` (torch's strided copy cost a quarter of each
        float32 weight gradient's time), anything else as torch copies it."""
        if t.is_contiguous():
            return t
        if t.dim() == 2 and t.t().is_contiguous() and self.fused and fused.takes(t):
            return fused.transpose(t.t())
        return t.contiguous()

    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` (2-D, float32, CPU) through oneDNN, whose inner product computes ``A @ W.T`` from
        a dense input A and a weight W it reads through its strides: as ``a @ b`` (A = a, W = b.T) or
        as ``(b.T @ a.T).T`` (A = b.T, W = a), whichever copies fewer elements into dense operands
        (the second counts transposing its result). A weight gradient ``g.T @ x`` so copies only the
        smaller of g and x, not both. May return a transposed view."""
        def copied(inp: torch.Tensor, w: torch.Tensor) -> int:
            return (0 if inp.is_contiguous() else inp.numel()) + (0 if _readable(w) else w.numel())

        flip = copied(b.t(), a) + a.shape[0] * b.shape[1] < copied(a, b.t())
        if flip:  # (b.T @ a.T).T: the same product of the transposed operands, swapped
            a, b = b.t(), a.t()
        w = b.t()
        y = _onednn_linear(self._dense(a), w if _readable(w) else w.contiguous())
        return y.t() if flip else y

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        """``F.linear`` through oneDNN for float32 on a CPU where chosen, and under bf16 CPU autocast
        (`_AutocastLinear`) unless torch's own kernels were ("blas"); else NotImplemented."""
        if self.onednn_for(x, weight) and (bias is None or self.onednn_for(bias)):
            return _Linear.apply(x, weight, bias, self)
        if (self.autocast and x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16 and x.dtype in (torch.float32, torch.bfloat16)
                and weight.dtype in (torch.float32, torch.bfloat16) and x.numel()):
            if weight.dtype == torch.float32 and x.numel() <= _FEW_ROWS * x.shape[-1]:
                # A few rows (a DiT's per-image adaLN and embedders, a decoding step): the float32
                # product reads the weight once, where its bf16 copy (three casts a step) costs more
                # than the bf16 product saves. The output is rounded to bf16, as autocast's would be.
                with torch.autocast("cpu", enabled=False):
                    b = None if bias is None else bias.float()
                    y = self.linear(x.float(), weight, b)
                    return (F.linear(x.float(), weight, b) if y is NotImplemented else y).to(torch.bfloat16)
            # the input's cast stays in autograd's graph (a ToCopy node, as autocast's own), so
            # `zoo.nn.recompute` still recognises a recomputable norm or activation output behind it
            return _AutocastLinear.apply(x.to(torch.bfloat16), weight, bias, torch.bfloat16, self)
        return NotImplemented

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        """``a @ b`` (2-D, no autograd) through oneDNN where chosen, or from a dense copy of a bf16
        operand read by columns (`_dense_first`); else NotImplemented (torch's ``mm``)."""
        if self.onednn_for(a, b):
            y = self._product(a, b)
            return self._dense(y) if out is None else out.copy_(y)
        if self._dense_first(a, b):
            return _transposed_product(a, b, out)
        return NotImplemented

    def mm_or_torch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = self.mm(a, b, out)
        return reference.mm(a, b, out) if y is NotImplemented else y

    def _dense_first(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether ``a @ b`` computes from a dense copy of one operand (`_transposed_product`): bf16 on a
        CPU with AMX (the kind measured), ``a`` laid out by columns (``g.T``, g's rows the reduction:
        every linear layer's weight gradient) and ``b`` by rows, large enough, with zoo's C
        transposition available. oneDNN's AMX products read their left operand along the
        reduction; given ``g.T``, read the other way, they transpose it themselves and take 1.6-2x
        the time of the product of a dense operand, which the C kernel makes for a fraction of it."""
        return (a.dtype == torch.bfloat16 and b.dtype == a.dtype and a.device.type == "cpu"
                and b.device.type == "cpu" and a.dim() == 2 and b.dim() == 2 and a.stride(0) == 1
                and a.shape[0] > 1 and b.stride(1) == 1 and a.shape[1] >= _DENSE_REDUCTION
                and a.shape[0] * a.shape[1] * b.shape[1] >= _DENSE_WORK and has_amx() and self.native
                and native.available())


def configure(mode: Mode = "auto", *, fused_on: bool = False, native_on: bool = False) -> tuple[Gemm, str]:
    """Choose the float32 CPU GEMM ("auto": oneDNN where `onednn_is_faster`), the tanh-GELU kernel
    and the bf16-autocast linear (see the module's docstring); returns the choice and what was
    chosen and why (one line)."""
    autocast = mode != "blas" and bf16_is_native()
    eltwise_on = mode == "onednn" or (mode == "auto" and has_avx512())
    eltwise = tuple(d for d in (torch.float32, torch.bfloat16) if eltwise_on and _eltwise_works(d))
    also = f"; tanh-GELU: oneDNN's kernel ({', '.join(str(d)[6:] for d in eltwise)})" if eltwise else ""
    also += "; bf16-autocast linears: oneDNN's" if autocast else ""
    plain = Gemm(False, eltwise, autocast, fused_on, native_on)
    if mode == "blas":
        return Gemm(fused=fused_on, native=native_on), "float32 CPU products: torch's BLAS (train.cpu_gemm=blas)"
    if mode == "auto" and not onednn_is_faster():
        why = " (MKL's generic path, but no AVX-512 on this CPU for oneDNN to gain by)" if blas_is_generic() else ""
        return plain, "float32 CPU products: torch's BLAS" + why + also
    if not _onednn_works():
        if mode == "onednn":
            raise RuntimeError("train.cpu_gemm=onednn: this torch build has no working oneDNN matmul "
                               "(torch.ops.mkldnn._linear_pointwise); use auto or blas")
        return plain, "float32 CPU products: torch's BLAS (no oneDNN matmul in this torch build)" + also
    why = "train.cpu_gemm=onednn" if mode == "onednn" else f"MKL's generic path on this {_cpu_vendor()} AVX-512 CPU"
    return Gemm(True, eltwise, autocast, fused_on, native_on), f"float32 CPU products: oneDNN ({why})" + also


def _readable(w: torch.Tensor) -> bool:
    """Whether oneDNN's inner product reads ``w`` as its weight in place: a dense matrix or the
    transpose of one (it reorders its weight into its own layout either way)."""
    return w.is_contiguous() or w.t().is_contiguous()


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` and its gradients, each product through oneDNN (the input gradient
    reads the transposed weight in place; the weight gradient copies one of its operands, see
    `_product`). Saves what F.linear's graph saves: the input and the weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: Gemm
                ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.gemm = bias is not None, gemm
        return _onednn_linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dx = _onednn_linear(g, weight.t()).reshape(x.shape) if ctx.needs_input_grad[0] else None
        dw = ctx.gemm._dense(ctx.gemm._product(g.t(), x.reshape(-1, x.shape[-1]))) if ctx.needs_input_grad[1] else None
        db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class _AutocastLinear(torch.autograd.Function):
    """A linear layer under CPU autocast: ``x @ W.T + b`` in ``dtype`` (x already cast), one oneDNN
    call with the bias fused (torch's addmm first copies the bias into every output row). It keeps
    the float32 weight itself for backward, where autocast's graph keeps its low-precision copy (a
    sixth of what a bf16 DiT step saves) and casts it again in backward instead. Values as autocast's (the same products and sums)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype, gemm: Gemm) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.has_bias, ctx.gemm = dtype, bias is not None, gemm
        return _onednn_linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        g = grad.to(ctx.dtype).reshape(-1, grad.shape[-1])
        # torch's bf16 mm is oneDNN's too, and reads the transposed operands in place
        dx = torch.mm(g, weight.to(ctx.dtype)).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = (ctx.gemm.mm_or_torch(g.t(), x.reshape(-1, x.shape[-1]), torch.empty_like(weight))
              if ctx.needs_input_grad[1] else None)
        # (torch's bf16 sum accumulates in float32; sum(dtype=float32) would first copy g to float32)
        db = g.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def _transposed_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` for ``a`` read by columns (`_dense_first`), the smaller operand made dense first:
    ``a`` itself (dense ``a`` times ``b``), or ``b`` as ``(b.T @ a.T).T`` (``b.T`` dense, ``a.T`` read
    by rows), whose transposition back is the copy into ``out`` (widening it where ``out`` is
    float32). The same products, rounded once to the operands' dtype."""
    if a.shape[0] <= b.shape[1]:
        dense = native.transposed(a.t())
        if out is None or out.dtype != a.dtype:
            y = torch.mm(dense, b)
            return y if out is None else out.copy_(y)
        return torch.mm(dense, b, out=out)
    yt = torch.mm(native.transposed(b), a.t())
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return native.transpose_into(yt, out)
