"""Sparse MoE decoders (Mixtral, Qwen2-MoE): LLaMA's decoder (`zoo_gpt.model.GPT`) whose blocks
hold the core's `zoo.nn.moe.MoE` instead of an MLP (``E`` in the config's pattern), or a dense
SwiGLU MLP (``T``).

Each MoE layer leaves its routing statistics row in ``moe.stats``; the forward sums them into one
(MoE layers, `zoo.nn.moe.stats_width`) tensor, ``moe_stats``, that goes to the loss with the
hidden state, across pipeline stages as a carried tensor, so the balancing losses of every layer
are computed in one place, from global statistics, whatever the layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zoo.nn import KVCache, make_norm
from zoo.nn.layers import SelfAttention, TransformerLayer
from zoo.nn.moe import MoE, balance_metrics, stats_width
from zoo.spec import AttentionSpec, BlockSpec, ModelSpec, MoESpec
from zoo_gpt.model import GPT
from zoo_moe.plugin import MoEConfig


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, spec: BlockSpec, layer: int, index: int) -> None:
        super().__init__()
        assert isinstance(spec.mixer, AttentionSpec) and isinstance(spec.ffn, MoESpec)
        # Its row of the statistics: how many MoE layers come before it (the same under any pipeline cut).
        self.index = index
        self.attn_norm = make_norm(spec.norm, cfg.hidden_size, cfg.norm_eps)
        self.attn = SelfAttention(spec.mixer, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, layer=layer, eps=cfg.norm_eps, window=cfg.window(layer))
        self.mlp_norm = make_norm(spec.norm, cfg.hidden_size, cfg.norm_eps)
        self.moe = MoE(spec.ffn, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden_size, num_experts=cfg.num_experts,
                       top_k=cfg.top_k, shared_ffn_hidden=cfg.shared_ffn_hidden_size,
                       capacity_factor=cfg.capacity_factor, drop_policy=cfg.drop_policy, expert_bias=cfg.expert_bias,
                       bias_update_rate=cfg.bias_update_rate, router_groups=cfg.router_groups,
                       router_group_topk=cfg.router_group_topk, router_scaling=cfg.router_scaling,
                       sequence_stats=cfg.aux_loss_convention == "sequence")

    def forward(self, x: torch.Tensor, rope: Any, cache: KVCache | None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, segment_ids)
        return x + self.moe(self.mlp_norm(x))


class MoEDecoder(GPT):
    symbol = "E"

    def layer_symbols(self, cfg: Any) -> str:
        return cfg.symbols

    def make_block(self, cfg: Any, spec: BlockSpec, layer: int) -> nn.Module:
        if not isinstance(spec.ffn, MoESpec):
            return TransformerLayer(spec, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, ffn_hidden=cfg.dense_ffn_hidden_size, eps=cfg.norm_eps,
                                    layer=layer, window=cfg.window(layer))
        return MoEBlock(cfg, spec, layer, cfg.symbols[:layer].count("E"))

    def _init(self, cfg: Any) -> None:
        super()._init(cfg)
        for blk in self.layers:  # experts like the linear layers they stand for; `down` is a residual output
            if isinstance(blk, MoEBlock):
                nn.init.normal_(blk.moe.gate_up, std=cfg.init_std)
                nn.init.normal_(blk.moe.down, std=cfg.init_std / math.sqrt(2 * cfg.num_layers))

    def forward(self, tokens: torch.Tensor, *, cache: KVCache | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, moe_stats: torch.Tensor | None = None) -> Any:
        """tokens (B, T) -> logits (B, T, V); with ``labels``, ``(mean cross entropy, moe_stats)``.
        On a pipeline stage without the head: ``{"tokens": hidden, "moe_stats": stats so far}``."""
        x, rope = self.embed_input(tokens, cache, position_ids)
        stats = moe_stats
        if stats is None:
            stats = torch.zeros(self.cfg.moe_layers, stats_width(self.cfg.num_experts), device=x.device)
        for blk in self.layers:
            x = blk(x, rope, cache, segment_ids)
            if isinstance(blk, MoEBlock):
                row = torch.tensor([blk.index], device=x.device)
                stats = stats.index_add(0, row, blk.moe.stats[None])
        if cache is not None:
            cache.pos += tokens.shape[1]
        if self.head is None:
            return {"tokens": x, "moe_stats": stats}
        out = self.output(x, labels, loss_mask)
        return (out, stats) if labels is not None else out


def build(cfg: MoEConfig, spec: ModelSpec) -> MoEDecoder:
    return MoEDecoder(cfg, spec)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    """Next-token cross entropy; the balancing terms (coefficients applied) are the family's
    auxiliary metrics, which the core adds to what it backpropagates."""
    out = model(batch["tokens"], labels=batch["labels"], loss_mask=batch.get("loss_mask"),
                position_ids=batch.get("position_ids"), segment_ids=batch.get("segment_ids"),
                moe_stats=batch.get("moe_stats"))
    if isinstance(out, dict):  # not the last pipeline stage
        return out, {}
    ce, stats = out
    cfg = model.cfg
    return ce, balance_metrics(stats, num_experts=cfg.num_experts, top_k=cfg.top_k, convention=cfg.aux_loss_convention,
                               aux_coeff=cfg.aux_loss_coeff, z_coeff=cfg.z_loss_coeff)


def flops_per_token(model: nn.Module, run: Any) -> float:
    """6 x the weights a token passes through (attention, head, dense MLPs, router, top-k routed experts
    and the shared expert) + attention scores, per trained token."""
    from zoo.training.metrics import lm_flops_per_token

    cfg = run.model
    dense = lm_flops_per_token(model, run)  # nn.Linear weights (attention, dense MLPs, shared expert, head) + attention
    per_expert = 3 * cfg.hidden_size * cfg.ffn_hidden_size  # SwiGLU: gate, up, down
    routed = cfg.moe_layers * (cfg.top_k * per_expert + cfg.num_experts * cfg.hidden_size)
    return dense + 6.0 * routed


def generate(model: MoEDecoder, cfg: MoEConfig, **request: Any) -> torch.Tensor:
    from zoo.nn.sampling import generate_tokens

    return generate_tokens(model, context=cfg.max_seq_length, **request)
