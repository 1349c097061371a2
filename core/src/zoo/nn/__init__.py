"""Shared building blocks for model families: norms, rotary embeddings, attention, KV cache.

These are the primitives the parallel core knows how to shard and recompute, so a model built
from them gets tensor/sequence/context parallelism and selective recomputation without changing.
Numerics follow the Hugging Face implementations (norms and RoPE's cos/sin in float32, rotate-half
layout): what makes logit parity at 1e-5 possible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.kernels import broadcast_dims
from zoo.nn.attention_ops import attend, attend_at
from zoo.nn.cache import KVCache as KVCache  # (its own module; zoo.nn's API)
from zoo.nn.loss import linear_cross_entropy as linear_cross_entropy  # (its own module; zoo.nn's API)
from zoo.nn.loss import soft_cap as soft_cap
from zoo.nn.recompute import SelectiveCore, recomputable, recording
from zoo.parallel.context import ContextParallelSite, SequenceShard  # noqa: F401 (SequenceShard: for models)
from zoo.spec import NormSpec


class _RMSNormFn(torch.autograd.Function):
    """RMS norm keeping only its input and the per-row 1/rms for backward (autograd's own graph
    keeps the normalised copy as well: one activation-sized tensor per norm)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, k: kernels.Kernels) -> torch.Tensor:
        y, rstd = k.call("rms_norm", x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight, rstd = ctx.saved_tensors
        return (*ctx.k.call("rms_norm_backward", grad, x, weight, rstd), None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` in float32, HF's numerics, with a memory-lean backward; under
    `zoo.nn.recompute` a layer that saves the output gets it recomputed from what the norm keeps."""
    k = kernels.active()
    y = _RMSNormFn.apply(x, weight, eps, k)
    if y.grad_fn is not None and recording():  # (only then: see `recording`)
        x_saved, w_saved, rstd = y.grad_fn.saved_tensors
        recomputable(y, lambda: k.call("rms_norm_again", x_saved, w_saved, eps, rstd))
    return y


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32. ``zero_centered``: the
    weight holds scale - 1 and starts at zero (Gemma's)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight + 1 if self.zero_centered else self.weight, self.eps)


class _SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up`` from the fused ``[gate | up]`` projection, saving only that input."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, k: kernels.Kernels) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.k = k
        return k.call("swiglu", gate_up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (gate_up,) = ctx.saved_tensors
        return ctx.k.call("swiglu_backward", grad, gate_up), None


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for a fused ``[gate | up]`` tensor (SwiGLU when ``activation == "silu"``);
    under `zoo.nn.recompute` the output projection's saved input is recomputed from ``gate_up``."""
    if activation == "silu":
        k = kernels.active()
        h = _SwiGLUFn.apply(gate_up, k)
        if h.grad_fn is not None and recording():
            (saved,) = h.grad_fn.saved_tensors
            recomputable(h, lambda: k.call("swiglu", saved))
        return h
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class _ModulatedLayerNormFn(torch.autograd.Function):
    """``LN(x) * (1 + scale) + shift`` (LayerNorm without affine weights, DiT's adaLN) keeping only
    its inputs and the per-row statistics: autograd's graph would also keep the normalised copy.
    The output is rounded to ``dtype`` as it is written; the gradient arriving in that dtype is
    widened in the backward's own pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                dtype: torch.dtype, k: kernels.Kernels) -> torch.Tensor:
        y, mean, rstd = k.call("modulated_ln", x, shift, scale, eps, dtype)
        ctx.save_for_backward(x, shift, scale, mean, rstd)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, shift, scale, mean, rstd = ctx.saved_tensors
        return (*ctx.k.call("modulated_ln_backward", grad, x, shift, scale, mean, rstd), None, None, None)


def _autocast_output(x: torch.Tensor) -> torch.dtype:
    """x's dtype, or the lower precision autocast computes x's device's products in when it is on
    and narrower than x's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        low = torch.get_autocast_dtype(kind)
        if x.is_floating_point() and low.itemsize < x.dtype.itemsize:
            return low
    return x.dtype


def modulated_layer_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """DiT's adaLN: ``LayerNorm(x) * (1 + scale) + shift`` (no affine weights), computed in float32
    with a memory-lean backward; under `zoo.nn.recompute` a layer that saves the output gets it
    recomputed from what the norm keeps (one activation-sized tensor per norm fewer).

    Under autocast the output is in autocast's lower precision (what the linear layer that reads
    it would cast it to: the same values), written so by the norm's own pass, which saves a
    float32 output and a separate cast each way (forward, recomputation, the gradient's
    widening). A caller that wants float32 math on the output disables autocast around the call."""
    dtype = _autocast_output(x)
    k = kernels.active()
    y = _ModulatedLayerNormFn.apply(x, shift, scale, eps, dtype, k)
    if y.grad_fn is not None and recording():
        xs, sh, sc, mean, rstd = y.grad_fn.saved_tensors
        recomputable(y, lambda: k.call("modulated_ln_again", xs, sh, sc, mean, rstd, eps, dtype))
    return y


class _GatedResidualFn(torch.autograd.Function):
    """``x + gate * y`` computed in float32 and rounded once to the output's dtype, in one pass each
    way; keeps gate and y, as autograd's product would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, k: kernels.Kernels) -> torch.Tensor:
        ctx.save_for_backward(gate, y)
        ctx.x_dtype, ctx.k = x.dtype, k
        return k.call("gated_residual", x, gate, y)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        gate, y = ctx.saved_tensors
        dy, dgate = ctx.k.call("gated_residual_backward", grad, gate, y, broadcast_dims(y, gate))
        return grad.to(ctx.x_dtype), dgate, dy, None


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """adaLN-Zero's gated residual ``x + gate * y`` (gate broadcasting over y's tokens, or one per
    token), computed in float32 and rounded once to the output's dtype. Eager torch computes a bf16
    ``gate * y`` (rounded, written), widens it for the float32 residual in a second pass, and in
    backward narrows the gradient in a third before two products and a sum; here it is one pass
    each way (the run's kernels, `zoo.kernels`; torch's ``addcmul`` by default)."""
    if x.shape != y.shape or gate.dim() != y.dim() or not all(b in (1, a) for a, b in zip(y.shape, gate.shape)):
        return x + gate * y
    return _GatedResidualFn.apply(x, gate, y, kernels.active())


class _ActivationFn(torch.autograd.Function):
    """An elementwise activation that keeps only its input (its output is recomputable)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, k: kernels.Kernels) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.name, ctx.k = name, k
        return _activate(k, name, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (x,) = ctx.saved_tensors
        if ctx.name == "gelu_tanh":
            return ctx.k.call("gelu_tanh_backward", grad, x), None, None
        if ctx.name in _DERIVATIVES:  # autograd's own kernel, without recomputing the activation
            return _DERIVATIVES[ctx.name](grad, x), None, None
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            (gx,) = torch.autograd.grad(ACTIVATIONS[ctx.name](xd), xd, grad)
        return gx, None, None


def _activate(k: kernels.Kernels, name: str, x: torch.Tensor) -> torch.Tensor:
    return k.call("gelu_tanh", x) if name == "gelu_tanh" else ACTIVATIONS[name](x)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """``ACTIVATIONS[name](x)``; under `zoo.nn.recompute` the next layer's saved copy of the output
    is recomputed from the input (which the activation keeps for its own backward anyway)."""
    k = kernels.active()
    y = _ActivationFn.apply(x, name, k)
    if y.grad_fn is not None and recording():
        (saved,) = y.grad_fn.saved_tensors
        recomputable(y, lambda: _activate(k, name, saved))
    return y


_DERIVATIVES = {
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x),
    "silu": torch.ops.aten.silu_backward,
    "relu": lambda g, x: torch.ops.aten.threshold_backward(g, x, 0),
}


def make_norm(spec: NormSpec, dim: int, eps: float) -> nn.Module:
    if spec.kind == "rmsnorm":
        return RMSNorm(dim, eps, zero_centered=spec.zero_centered)
    if spec.zero_centered:
        raise ValueError("NormSpec: zero_centered is an RMSNorm option")
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=spec.affine, bias=spec.bias and spec.affine)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: kernels.active().call("gelu_tanh", x),  # (`activation` passes its own kernels)
    # x sigmoid(1.702 x) as silu(1.702 x) / 1.702: CLIP's MLP with one saved tensor, not two
    "quick_gelu": lambda x: F.silu(x * 1.702) * (1 / 1.702),
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


# ------------------------------------------------------------------------------------------ RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings, with ``linear`` and ``llama3`` scaling.

    ``llama3`` (Meta's Llama 3.1 recipe): wavelengths longer than the original context / low-freq
    factor are divided by ``factor``, shorter than context / high-freq factor are kept, and the band
    in between is interpolated smoothly.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    assert scaling is not None
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


class Float32Buffers(nn.Module):
    """A module whose buffers named in ``float32_buffers`` stay float32 when the module is cast to
    bf16 or fp16 (``model.to(torch.bfloat16)``, as ``train.param_dtype`` and ``zoo generate
    --dtype`` do); device moves and float64 apply as usual. A buffer is no parameter: no fp32
    master copy stands behind it, so a cast would be its only value. RoPE's inverse frequencies in
    bf16 (8 significant bits) put the angle at position 1,024 off by up to ~1 radian; a
    load-balancing bias moved by 1e-3 a step stops moving in bf16 once it passes 0.5."""

    float32_buffers: tuple[str, ...] = ()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        before = {n: self._buffers[n] for n in self.float32_buffers if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.is_floating_point() and new.element_size() < 4 <= old.element_size():
                self._buffers[name] = old.to(device=new.device)  # the values as they were, where the cast put them
        return self


class Rotary(Float32Buffers):
    """cos/sin tables for positions, rotate-half layout (as in HF), float32."""

    float32_buffers = ("inv_freq",)

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) or (T,)
        with torch.autocast(positions.device.type, enabled=False):
            freqs = positions.float()[..., None] * self.inv_freq.float()  # (..., T, hd/2)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """``x * cos + sign * rotate_half(x) * sin`` written half by half into one output: the same
    roundings as the textbook formula (a + (-b) is a - b), without its concatenation and negation
    temporaries. ``sign=-1`` is the transpose, which backward applies to the gradient."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(x1, cos[..., :h], out=o1)
    torch.mul(x2, cos[..., h:], out=o2)
    if sign > 0:
        o1.sub_(x2 * sin[..., :h])
        o2.add_(x1 * sin[..., h:])
    else:
        o1.add_(x2 * sin[..., h:])
        o2.sub_(x1 * sin[..., :h])
    return out


class _RotaryFn(torch.autograd.Function):
    """Rotary embedding keeping only the cos/sin tables for backward (autograd's own graph of the
    formula adds a concatenation and a negation per call in both directions)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, +1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, hd); cos/sin: (B, T, hd) or (T, hd)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.requires_grad or sin.requires_grad:  # (tables are buffers; a caller differentiating them gets autograd's path)
        return x * cos + _rotate_half(x) * sin
    return _RotaryFn.apply(x, cos, sin)


# ------------------------------------------------------------------------------------- attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, offset: int = 0,
              segment_ids: torch.Tensor | None = None, kv_segment_ids: torch.Tensor | None = None,
              q_positions: torch.Tensor | None = None, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads, on one process's whole sequence.

    q: (B, H, T, hd), k/v: (B, KV, S, hd) with H a multiple of KV. ``offset`` is the number of
    cached positions before q's first one (S = offset + T), so causal masking stays right when
    decoding with a KV cache. ``segment_ids`` (B, T) keeps attention inside documents packed into
    one sample (Megatron's reset_attention_mask, or samples packed for a DiT); ``kv_segment_ids``
    (B, S) are the keys' when they are not the queries' (cross-attention to packed text).
    ``q_positions`` (B, T): the queries are those of these positions only (a layer computing a few
    outputs, `zoo.nn.layers.run_layers`); masks follow their positions. ``window`` (causal only):
    sliding-window attention, a query sees itself and the ``window - 1`` keys before it (Mistral,
    Qwen2's ``sliding_window``; Megatron's ``--window-size window-1,0``). ``softcap``: the scaled
    scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2's attention logit
    soft-capping). Models call it through `AttentionCore`, which the core can switch to ring
    attention or recomputation.
    """
    if window is not None and (not causal or window < 1):
        raise ValueError(f"sliding-window attention is causal with a window of at least 1 (window={window}, "
                         f"causal={causal})")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention logit soft-capping needs a positive cap (softcap={softcap})")
    if torch.is_grad_enabled() and q._base is None:
        # K or V still a slice of the fused qkv projection (no rotary applied to it) would keep the
        # whole projection alive among the saved tensors once Q and K are rotated copies: its own
        # copy costs less than what that frees.
        k = k.contiguous() if k._base is not None else k
        v = v.clone(memory_format=torch.contiguous_format) if v._base is not None else v
    if q_positions is not None:
        return attend_at(q, k, v, causal, offset, segment_ids, kv_segment_ids, q_positions, window, softcap)
    return attend(q, k, v, causal, offset, segment_ids, kv_segment_ids, window, softcap)


class AttentionCore(SelectiveCore, ContextParallelSite):
    """``softmax(q k^T) v`` as a module (no parameters), so the core can change how it runs
    without the model changing: a model holds one per attention layer and calls it like
    `attention`. Two fields, set from outside and read only here:

    - ``cp_group``: a context-parallel group (set by `zoo.parallel.engine.Parallel` when cp > 1);
      the layer then holds 2 of the 2*cp sequence chunks and runs ring attention over the group.
    - ``recompute``: recompute the core in backward instead of keeping its activations (set by
      ``train.recompute=selective`` through `zoo.nn.recompute.apply`).
    """

    def __init__(self, *, cross: bool = False) -> None:
        super().__init__()
        self.keys_split = not cross  # cross-attention's keys (text) are whole on every CP rank

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, offset: int = 0,
                segment_ids: torch.Tensor | None = None, kv_segment_ids: torch.Tensor | None = None,
                q_positions: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if self.cp_group is not None:  # context parallel: this rank holds 2 of the 2*cp sequence chunks
            if offset or q_positions is not None or (kv_segment_ids is not None and kv_segment_ids is not segment_ids):
                raise ValueError("context-parallel attention is self-attention without a KV cache")
            from zoo.parallel.context import ring_attention

            if torch.is_grad_enabled() and q._base is None:  # as in `attention`: free the fused projection
                k = k.contiguous() if k._base is not None else k
                v = v.clone(memory_format=torch.contiguous_format) if v._base is not None else v
            # Keeps only q, k, v, out and the log-sum-exp; packed samples' ids travel with the keys.
            return ring_attention(q, k, v, self.cp_group, causal=causal, segment_ids=segment_ids, window=window,
                                  softcap=softcap)
        if self.recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(attention, q, k, v, use_reentrant=False, causal=causal, offset=offset,
                              segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                              window=window, softcap=softcap)
        return attention(q, k, v, causal=causal, offset=offset, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                         q_positions=q_positions, window=window, softcap=softcap)

