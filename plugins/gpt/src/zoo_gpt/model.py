"""One decoder for GPT-2 and LLaMA; the layer spec picks norm, positions, biases and MLP.

Shapes: B batch, T sequence, D hidden, H query heads, KV key/value heads, hd head dim, V vocab.
The fused q|k|v projection is laid out per KV group, ``[q heads of group g, k_g, v_g]`` for each g,
so a contiguous tensor-parallel split hands every rank whole groups. The fused gate|up projection
is ``[gate; up]``. Parallelism, recomputation and precision are applied from outside by the core.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zoo.nn import (
    ACTIVATIONS,
    AttentionCore,
    KVCache,
    Rotary,
    apply_rotary,
    gated_activation,
    linear_cross_entropy,
    make_norm,
)
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec
from zoo_gpt.plugin import GPTConfig


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, spec: AttentionSpec, layer: int) -> None:
        super().__init__()
        self.layer, self.spec = layer, spec
        self.h, self.kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=spec.bias)
        self.proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=spec.bias)
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
    def __init__(self, cfg: GPTConfig, spec: MLPSpec) -> None:
        super().__init__()
        self.gated, self.activation, self.act = spec.gated, spec.activation, ACTIVATIONS[spec.activation]
        width = cfg.ffn_hidden_size * (2 if spec.gated else 1)
        self.fc = nn.Linear(cfg.hidden_size, width, bias=spec.bias)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.proj(gated_activation(self.fc(x), self.activation))
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, spec: BlockSpec, layer: int) -> None:
        super().__init__()
        assert isinstance(spec.mixer, AttentionSpec) and isinstance(spec.ffn, MLPSpec)
        self.attn_norm = make_norm(spec.norm, cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, spec.mixer, layer)
        self.mlp_norm = make_norm(spec.norm, cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg, spec.ffn)

    def forward(self, x: torch.Tensor, rope: Any, cache: KVCache | None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, segment_ids)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.cfg = cfg
        block = spec.block_for("T")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_seq_length, cfg.hidden_size) if spec.positions == "learned" else None
        uses_rope = isinstance(block.mixer, AttentionSpec) and block.mixer.positions == "rope"
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) if uses_rope else None
        self.layers = nn.ModuleList(Block(cfg, block, i) for i in range(cfg.num_layers))
        assert spec.final_norm is not None
        self.norm = make_norm(spec.final_norm, cfg.hidden_size, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self._init(cfg)

    def _init(self, cfg: GPTConfig) -> None:
        # GPT-2 initialisation; residual output projections scaled by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.num_layers))
            else:
                nn.init.normal_(p, std=cfg.init_std)

    def forward(self, tokens: torch.Tensor, *, cache: KVCache | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V); with ``cache``, T new tokens after ``cache.pos`` old ones.

        With ``labels`` (B, T) it returns the mean next-token cross entropy instead, computed
        without materialising the logits (`zoo.nn.linear_cross_entropy`). ``position_ids`` (B, T)
        restart positions per packed document; ``segment_ids`` (B, T) keep attention inside them.
        """
        t = tokens.shape[1]
        start = cache.pos if cache is not None else 0
        if start + t > self.cfg.max_seq_length:
            raise ValueError(f"{start + t} positions exceed the model's context of {self.cfg.max_seq_length}")
        positions = position_ids if position_ids is not None else torch.arange(start, start + t, device=tokens.device)
        # A later pipeline stage has no embedding and receives the hidden state instead of tokens.
        x = self.embed(tokens) if self.embed is not None else tokens  # (B, T, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = self.rotary(positions) if self.rotary is not None else None
        for blk in self.layers:
            x = blk(x, rope, cache, segment_ids)
        if cache is not None:
            cache.pos += t
        if self.head is None:  # not the last pipeline stage: hand the hidden state on
            return x
        x = self.norm(x)
        if labels is not None:
            mask = loss_mask.flatten().bool() if loss_mask is not None else None
            return linear_cross_entropy(x.flatten(0, 1), self.head, labels.flatten(), mask)
        return self.head(x)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed.weight
        return KVCache(num_layers=self.cfg.num_layers, batch=batch, kv_heads=self.cfg.num_kv_heads,
                       head_dim=self.cfg.head_dim, max_len=max_len, dtype=p.dtype, device=p.device)


def build(cfg: GPTConfig, spec: ModelSpec) -> GPT:
    return GPT(cfg, spec)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross entropy, averaged over the tokens the loss mask keeps."""
    return model(batch["tokens"], labels=batch["labels"], loss_mask=batch.get("loss_mask"),
                 position_ids=batch.get("position_ids"), segment_ids=batch.get("segment_ids")), {}


def example_batch(cfg: GPTConfig, *, batch_size: int, seq_length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    data = torch.randint(0, cfg.vocab_size, (batch_size, seq_length + 1), generator=generator)
    return {"tokens": data[:, :-1], "labels": data[:, 1:]}


def generate(model: GPT, cfg: GPTConfig, **request: Any) -> torch.Tensor:
    from zoo.nn.sampling import generate_tokens

    return generate_tokens(model, context=cfg.max_seq_length, **request)
