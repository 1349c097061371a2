"""Transformer layers shared by families: self-attention with a fused, per-KV-group q|k|v projection
(GPT-2, LLaMA, the MoE decoders, a hybrid stack's ``*`` layers, CLIP's towers), the position-wise
MLP (a model's feed-forward, an MoE's shared expert) and the pre-norm layer made of the two.

The fused q|k|v projection is laid out per KV group, ``[q heads of group g, k_g, v_g]`` for each g,
so a contiguous tensor-parallel split hands every rank whole groups; the fused gate|up projection is
``[gate; up]``. Tensor parallelism replaces ``qkv``/``fc`` (column) and ``proj`` (row) from outside
and divides the head counts ``h``/``kv`` (a family's ``tp_local``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zoo.nn import AttentionCore, KVCache, activation, apply_rotary, gated_activation, make_norm
from zoo.nn.linear import Linear
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec


class SelfAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, *, hidden: int, heads: int, kv_heads: int, head_dim: int, layer: int,
                 eps: float = 1e-6, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.layer, self.spec = layer, spec
        self.window = window  # sliding-window attention: a query sees itself and window - 1 keys before it
        self.softcap = softcap  # scores soft-capped to (-softcap, softcap) by tanh (Gemma 2)
        # The softmax scale when it is not 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar): q is
        # multiplied by the ratio, so every attention path keeps its own 1/sqrt(head_dim).
        self.q_factor = None if scale is None or scale == head_dim ** -0.5 else scale * head_dim ** 0.5
        self.h, self.kv, self.hd = heads, kv_heads, head_dim
        self.qkv = Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=spec.bias)
        # Per-head norms of q and k before the rotation (Qwen3, OLMo 2); under tensor parallelism
        # whole on every rank, applied to its heads.
        self.q_norm = make_norm(spec.qk_norm, head_dim, eps) if spec.qk_norm is not None else None
        self.k_norm = make_norm(spec.qk_norm, head_dim, eps) if spec.qk_norm is not None else None
        self.proj = Linear(heads * head_dim, hidden, bias=spec.bias if spec.out_bias is None else spec.out_bias)
        self.core = AttentionCore()  # softmax(q k^T) v; the core may make it ring attention or recompute it

    # Under tensor parallelism (`zoo.parallel.apply.derived_plan`): each rank keeps whole KV groups
    # of the fused q|k|v (its columns, laid out per group) and the matching input columns of the
    # output; per-head norms stay whole and apply to the rank's heads; the head counts divide.
    tensor_parallel_sizes = ("h", "kv")

    def tensor_parallel(self) -> dict[str, str]:
        norms = {"q_norm": "per_head", "k_norm": "per_head"} if self.q_norm is not None else {}
        return {"qkv": "column", "proj": "row", **norms}

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: KVCache | None,
                segment_ids: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D), or with ``keep`` (B, K) positions only theirs (B, K, D): keys and
        values from every position, queries from those."""
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]  # (not x's: under sequence parallelism x holds a slice of the sequence)
        qkv = qkv.view(b, t, self.kv, self.h // self.kv + 2, self.hd)  # per KV group: q..., k, v
        # split (not indexing): its backward is one concatenation instead of three zero-filled buffers
        q, k, v = qkv.split([self.h // self.kv, 1, 1], dim=3)
        q = q.reshape(b, t, self.h, self.hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.squeeze(3).transpose(1, 2)  # (B, KV, T, hd)
        v = v.squeeze(3).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        offset = 0
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
            offset = k.shape[2] - t  # the cached keys before the new ones (all of them, or a window's)
        if keep is not None:
            q = q.gather(2, keep[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        if self.q_factor is not None:
            q = q * self.q_factor
        y = self.core(q, k, v, causal=self.spec.causal, offset=offset, segment_ids=segment_ids,
                      q_positions=keep, window=self.window, softcap=self.softcap)  # (B, H, T or K, hd)
        return self.proj(y.transpose(1, 2).reshape(b, y.shape[2], self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, spec: MLPSpec, *, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gated, self.activation = spec.gated, spec.activation
        self.fc = Linear(hidden, ffn_hidden * (2 if spec.gated else 1), bias=spec.bias)
        self.proj = Linear(ffn_hidden, hidden, bias=spec.bias)

    # Under tensor parallelism: the hidden units split, a gated [gate; up] per half so each rank
    # holds matching gate and up rows; the output projection by its input columns.
    tensor_parallel_sizes = ()

    def tensor_parallel(self) -> dict[str, str]:
        return {"fc": "column_gated" if self.gated else "column", "proj": "row"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.proj(gated_activation(self.fc(x), self.activation))
        return self.proj(activation(self.fc(x), self.activation))


class TransformerLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``: a GPT-2/LLaMA decoder layer, a CLIP encoder
    layer (its spec non-causal for images). ``layer`` indexes the KV cache."""

    def __init__(self, spec: BlockSpec, *, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn_hidden: int,
                 eps: float, layer: int, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        assert isinstance(spec.mixer, AttentionSpec) and isinstance(spec.ffn, MLPSpec)
        if spec.residual == "post_norm":
            raise ValueError("TransformerLayer: residual='post_norm' is not a decoder layer zoo builds "
                             "(pre_norm or sandwich)")
        self.attn_norm = make_norm(spec.norm, hidden, eps)
        self.attn = SelfAttention(spec.mixer, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                  layer=layer, eps=eps, window=window, scale=scale, softcap=softcap)
        sandwich = spec.residual == "sandwich"  # each sublayer's output normed before the residual add
        self.post_attn_norm = make_norm(spec.norm, hidden, eps) if sandwich else None
        self.mlp_norm = make_norm(spec.norm, hidden, eps)
        self.mlp = MLP(spec.ffn, hidden=hidden, ffn_hidden=ffn_hidden)
        self.post_mlp_norm = make_norm(spec.norm, hidden, eps) if sandwich else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, segment_ids: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); with ``keep`` (B, K) the outputs at those positions only, (B, K, D),
        computed for them alone (see `run_layers`)."""
        y = self.attn(self.attn_norm(x), rope, cache, segment_ids, keep)
        x = (x if keep is None else take_positions(x, keep)) + (y if self.post_attn_norm is None else self.post_attn_norm(y))
        y = self.mlp(self.mlp_norm(x))
        return x + (y if self.post_mlp_norm is None else self.post_mlp_norm(y))

    def selects_positions(self) -> bool:
        """Whether ``keep`` can be computed here: not when this rank holds a slice of the sequence
        (sequence parallelism gathers after the layer; context parallelism runs ring attention)."""
        return not getattr(self.attn.qkv, "sequence_parallel", False) and self.attn.core.cp_group is None


def take_positions(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) at positions keep (B, K) -> (B, K, ...)."""
    return x.gather(1, keep.view(*keep.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))


def run_layers(layers: Iterable[nn.Module], x: torch.Tensor, *args: Any, keep: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``x = layer(x, *args)`` through ``layers``. With ``keep`` (B, K) positions the result is the
    last layer's output there only, (B, K, D), and a last `TransformerLayer` computes just those
    (queries, output projection, MLP: K of T positions) -- when nothing reads the other outputs: a
    pooled token (CLIP), the positions a loss reads (an answer after an image and a prompt)."""
    layers = list(layers)
    for layer in layers[:-1]:
        x = layer(x, *args)
    if layers:
        last = layers[-1]
        if keep is not None and isinstance(last, TransformerLayer) and last.selects_positions():
            return last(x, *args, keep=keep)
        x = last(x, *args)
    return x if keep is None else take_positions(x, keep)


def kept_positions(loss_mask: torch.Tensor | None, *, at_most: float = 0.75) -> torch.Tensor | None:
    """The positions (B, K) a loss reads -- every column some row of ``loss_mask`` (B, T) keeps --
    or None when that is more than ``at_most`` of them (selecting would not pay)."""
    from zoo.parallel.cuda_graphs import capturing

    if loss_mask is None or capturing(loss_mask):  # (a CUDA graph cannot count them: all positions)
        return None
    cols = loss_mask.bool().any(0).nonzero().flatten()
    if cols.numel() > at_most * loss_mask.shape[1]:
        return None
    return cols.expand(loss_mask.shape[0], -1)


__all__ = ["MLP", "SelfAttention", "TransformerLayer", "kept_positions", "run_layers", "take_positions"]
