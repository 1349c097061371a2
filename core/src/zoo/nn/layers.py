"""Transformer layers shared by families: self-attention with a fused, per-KV-group q|k|v projection
(GPT-2, LLaMA, the MoE decoders, a hybrid stack's ``*`` layers, CLIP's towers), the position-wise
MLP (a model's feed-forward, an MoE's shared expert) and the pre-norm layer made of the two.

The fused q|k|v projection is laid out per KV group, ``[q heads of group g, k_g, v_g]`` for each g,
so a contiguous tensor-parallel split hands every rank whole groups; the fused gate|up projection is
``[gate; up]``. Tensor parallelism replaces ``qkv``/``fc`` (column) and ``proj`` (row) from outside
and divides the head counts ``h``/``kv`` (a family's ``tp_local``).
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.nn import ACTIVATIONS, AttentionCore, KVCache, apply_rotary, gated_activation, make_norm
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec


class SelfAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, *, hidden: int, heads: int, kv_heads: int, head_dim: int, layer: int) -> None:
        super().__init__()
        self.layer, self.spec = layer, spec
        self.h, self.kv, self.hd = heads, kv_heads, head_dim
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=spec.bias)
        self.proj = nn.Linear(heads * head_dim, hidden, bias=spec.bias if spec.out_bias is None else spec.out_bias)
        self.core = AttentionCore()  # softmax(q k^T) v; the core may make it ring attention or recompute it

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: KVCache | None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]  # (not x's: under sequence parallelism x holds a slice of the sequence)
        qkv = qkv.view(b, t, self.kv, self.h // self.kv + 2, self.hd)  # per KV group: q..., k, v
        # split (not indexing): its backward is one concatenation instead of three zero-filled buffers
        q, k, v = qkv.split([self.h // self.kv, 1, 1], dim=3)
        q = q.reshape(b, t, self.h, self.hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.squeeze(3).transpose(1, 2)  # (B, KV, T, hd)
        v = v.squeeze(3).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        offset = 0
        if cache is not None:
            offset = cache.pos
            k, v = cache.update(self.layer, k, v)
        y = self.core(q, k, v, causal=self.spec.causal, offset=offset, segment_ids=segment_ids)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, spec: MLPSpec, *, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gated, self.activation, self.act = spec.gated, spec.activation, ACTIVATIONS[spec.activation]
        self.fc = nn.Linear(hidden, ffn_hidden * (2 if spec.gated else 1), bias=spec.bias)
        self.proj = nn.Linear(ffn_hidden, hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.proj(gated_activation(self.fc(x), self.activation))
        return self.proj(self.act(self.fc(x)))


class TransformerLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``: a GPT-2/LLaMA decoder layer, a CLIP encoder
    layer (its spec non-causal for images). ``layer`` indexes the KV cache."""

    def __init__(self, spec: BlockSpec, *, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn_hidden: int,
                 eps: float, layer: int) -> None:
        super().__init__()
        assert isinstance(spec.mixer, AttentionSpec) and isinstance(spec.ffn, MLPSpec)
        self.attn_norm = make_norm(spec.norm, hidden, eps)
        self.attn = SelfAttention(spec.mixer, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                  layer=layer)
        self.mlp_norm = make_norm(spec.norm, hidden, eps)
        self.mlp = MLP(spec.ffn, hidden=hidden, ffn_hidden=ffn_hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, segment_ids)
        return x + self.mlp(self.mlp_norm(x))


__all__ = ["MLP", "SelfAttention", "TransformerLayer"]
