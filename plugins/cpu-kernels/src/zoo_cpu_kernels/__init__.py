"""zoo's CPU kernels: a provider of `zoo.kernels` operations for CPU runs.

- compiled elementwise passes (`fused`: torch inductor's C++ for the norms, gated residuals,
  SwiGLU, tanh-GELU, the LM loss's softmax gradient, transpositions; the Mamba mixers' scans and
  convolutions through `Kernels.fuse`),
- float32 products through oneDNN where torch's BLAS is on its generic path, and bf16-autocast
  linears as one oneDNN call (`gemm`),
- C kernels built with the system's compiler at first use (`native`: transposition, tanh-GELU and
  a bf16 softmax, on CPUs with AMX only),
- the blocked attention core for bf16/fp16 and grouped causal fp32 (`attention`),
- freed memory kept for reuse by glibc's malloc during a run (`malloc`).

Each is chosen per run from ``train.cpu_malloc``, ``train.cpu_gemm`` and ``train.cpu_fused`` and
``ZOO_BACKENDS`` (``-inductor``, ``-native``), into the `CpuKernels` selection the run holds.
Uninstalled, zoo computes every operation by its PyTorch reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zoo import backends
from zoo.kernels import Selection, broadcast_dims

__version__ = "0.1.0"


class CpuKernels:
    """The implementations one run chose (`Provider.select`): each returns NotImplemented for inputs
    it does not take, and the reference computes them."""

    def __init__(self, fused_on: bool, native_on: bool, gemm: Any) -> None:
        self.fused_on, self.native_on, self.gemm = fused_on, native_on, gemm

    def wants(self, x: torch.Tensor) -> bool:
        from zoo_cpu_kernels import fused

        return self.fused_on and fused.takes(x)

    def fuse(self, name: str, fn: Any, eager: Any, *args: Any) -> Any:
        from zoo_cpu_kernels import fused

        return fused.run(name, fn, eager, *args)

    def impls(self) -> dict[str, Any]:
        from zoo_cpu_kernels import attention, fused

        w = self.wants
        nat = self.native_on

        def modulated_ln_backward(g: Any, x: Any, shift: Any, scale: Any, mean: Any, rstd: Any) -> Any:
            if not (w(x) and shift.shape == scale.shape and shift.dim() == x.dim()):
                return NotImplemented
            gx, gshift, gscale = fused.modulated_ln_backward(g, x, scale, mean, rstd, broadcast_dims(x, shift))
            return gx, gshift.to(shift.dtype), gscale.to(scale.dtype)

        def attend(q: Any, k: Any, v: Any, causal: bool, offset: int, segment_ids: Any, kv_segment_ids: Any,
                   window: Any, softcap: Any) -> Any:
            if not attention.blocked_supported(q, k, causal=causal, segment_ids=segment_ids,
                                               kv_segment_ids=kv_segment_ids, window=window, softcap=softcap):
                return NotImplemented
            return attention.blocked_attention(q, k, v, causal=causal, offset=offset, segment_ids=segment_ids,
                                               window=window, softcap=softcap, use_native=nat)

        def mm_keeps_shapes(t: Any) -> Any:
            return True if self.gemm.onednn_for(t) else NotImplemented

        no = NotImplemented
        return {
            "rms_norm": lambda x, wt, eps: fused.rms_norm(x, wt, eps) if w(x) else no,
            "rms_norm_again": lambda x, wt, eps, rstd: fused.rms_norm(x, wt, eps)[0] if w(x) else no,
            "rms_norm_backward": lambda g, x, wt, rstd: fused.rms_norm_backward(g, x, wt, rstd) if w(x) else no,
            "swiglu": lambda gu: fused.swiglu(gu) if w(gu) else no,
            "swiglu_backward": lambda g, gu: fused.swiglu_backward(g, gu) if w(gu) else no,
            "modulated_ln": lambda x, sh, sc, eps, dt: fused.modulated_ln(x, sh, sc, eps, dt) if w(x) else no,
            "modulated_ln_again": lambda x, sh, sc, mean, rstd, eps, dt: (
                fused.modulate(x, sh, sc, mean, rstd, dt) if w(x) else no),
            "modulated_ln_backward": modulated_ln_backward,
            "gated_residual": lambda x, gate, y: fused.gated_residual(x, gate, y) if w(y) else no,
            "gated_residual_backward": lambda g, gate, y, dims: (
                fused.gated_residual_backward(g, gate, y, dims) if w(y) else no),
            "gelu_tanh": self.gemm.gelu_tanh,
            "gelu_tanh_backward": self.gemm.gelu_tanh_backward,
            "cross_entropy_grad": lambda logits, labels, scale, cap=None: (
                fused.cross_entropy_grad(logits, labels, scale, cap) if w(logits) else no),
            "linear": self.gemm.linear,
            "mm": self.gemm.mm,
            "mm_keeps_shapes": mm_keeps_shapes,
            "attention": attend,
        }


class Provider:
    """The ``zoo.kernels`` entry point ``cpu``."""

    name = "zoo-cpu-kernels"
    device = "cpu"

    def select(self, options: Mapping[str, Any]) -> Selection:
        from zoo_cpu_kernels import fused, gemm, malloc, native

        mode = options.get("cpu_fused", "auto")
        fused_on = mode == "auto" and not backends.switched_off("inductor")
        # zoo's C kernels serve CPUs with AMX only (where they were measured faster): built only there
        native_on = mode == "auto" and not backends.switched_off("native") and gemm.has_amx()
        choice, gemm_line = gemm.configure(options.get("cpu_gemm", "auto"), fused_on=fused_on, native_on=native_on)
        why = "train.cpu_fused=eager" if mode != "auto" else "ZOO_BACKENDS switches inductor off"
        if native_on:
            native_line = native.describe()
            native_on = native.available()
            choice = gemm.Gemm(choice.onednn, choice.eltwise, choice.autocast, fused_on, native_on)
        elif mode != "auto" or backends.switched_off("native"):
            native_line = "zoo's C kernels: off (" + ("train.cpu_fused=eager" if mode != "auto"
                                                     else "ZOO_BACKENDS switches native off") + ")"
        else:
            native_line = "zoo's C kernels: not built (no AMX on this CPU: measured there only)"
        chosen = CpuKernels(fused_on, native_on, choice)
        lines = ("cpu allocator: " + malloc.configure(options.get("cpu_malloc", "retain")), gemm_line,
                 fused.describe(fused_on, why), native_line)
        notes = ()
        if options.get("precision") == "bf16" and not gemm.bf16_is_native():
            notes = ("note: bf16 on a CPU without bf16 products (no AVX-512 BF16, AMX or AVX-512): they run 10-400x "
                     "slower than float32 here; fp32 is the fast choice",)
        return Selection(impls=chosen.impls(), fuse=chosen.fuse if fused_on else None,
                         fuses=chosen.wants if fused_on else None, lines=lines, notes=notes)


PROVIDER = Provider()
