"""Shared building blocks for model families: norms, rotary embeddings, attention, KV cache.

These are the primitives the parallel core knows how to shard and recompute, so a model built
from them gets tensor/sequence/context parallelism and selective recomputation without changing.
Numerics follow the Hugging Face reference implementations (norms computed in float32, RoPE
cos/sin computed in float32 in the rotate-half layout), which is what makes logit parity at 1e-5
possible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zoo.spec import NormSpec


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(spec: NormSpec, dim: int, eps: float) -> nn.Module:
    if spec.kind == "rmsnorm":
        return RMSNorm(dim, eps)
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=spec.affine, bias=spec.bias and spec.affine)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
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


class Rotary(nn.Module):
    """cos/sin tables for positions, rotate-half layout (as in HF), float32."""

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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, hd); cos/sin: (B, T, hd) or (T, hd)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


# ------------------------------------------------------------------------------------- attention


class KVCache:
    """Per-layer key/value buffers for incremental decoding: (B, kv_heads, max_len, hd) each."""

    def __init__(self, *, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.pos = 0  # tokens already in the cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        end = self.pos + t
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} requested")
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, offset: int = 0) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q: (B, H, T, hd), k/v: (B, KV, S, hd) with H a multiple of KV. ``offset`` is the number of
    cached positions before q's first one (S = offset + T), so causal masking stays right when
    decoding with a KV cache. Under selective recomputation (`zoo.recompute`) the core is
    recomputed in backward instead of keeping its activations.
    """
    from zoo.recompute import SELECTIVE

    if SELECTIVE.get() and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_attention, q, k, v, causal, offset, use_reentrant=False)
    return _attention(q, k, v, causal, offset)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, offset: int) -> torch.Tensor:
    # enable_gqa: query head i attends with KV head i // (H // KV) (HF's grouping) without copying K/V.
    gqa = q.shape[1] != k.shape[1]
    t, s = q.shape[2], k.shape[2]
    if not causal or t == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if offset == 0 and s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
