"""One decoder for Mamba-1, Mamba-2 and hybrid stacks: a list of single-purpose residual layers
``x + f(norm(x))``, each built from the block its pattern symbol names in the layer spec.

The mixers are the core's (`zoo_mamba.ssm`, `zoo.nn.layers`, `zoo.nn.moe`); parallelism is applied by
the core from the family's plan. MoE layers leave routing statistics that the forward sums into one
``moe_stats`` tensor for the loss, as the MoE decoders do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zoo.nn import KVCache, Rotary, linear_cross_entropy, make_norm
from zoo.nn.layers import MLP, SelfAttention
from zoo.nn.linear import LMHead, TokenEmbedding
from zoo.nn.moe import MoE, balance_metrics, stats_width
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, MoESpec, SSMSpec
from zoo_mamba.plugin import MambaConfig
from zoo_mamba.ssm import Mamba1Mixer, Mamba2Mixer, SSMCache


class HybridCache(KVCache):
    """Decoding state: keys/values of the attention layers and the SSM layers' recurrent state."""

    def __init__(self, *, ssm_layers: int, **kv: Any) -> None:
        super().__init__(**kv)
        self.states = SSMCache(ssm_layers)


class Layer(nn.Module):
    """``x + f(norm(x))`` with f one of ssm, attn, mlp, moe; ``index`` numbers its kind (cache slots, MoE rows)."""

    def __init__(self, cfg: MambaConfig, spec: BlockSpec, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm = make_norm(spec.norm, cfg.hidden_size, cfg.norm_eps)
        mixer, ffn = spec.mixer, spec.ffn
        if isinstance(mixer, SSMSpec) and mixer.kind == "mamba1":
            self.ssm: nn.Module = Mamba1Mixer(mixer, hidden=cfg.hidden_size, inner=cfg.ssm_inner,
                                              state=cfg.ssm_state_size, conv=cfg.conv_kernel, dt_rank=cfg.dt_rank,
                                              chunk=cfg.chunk_size, layer=index)
        elif isinstance(mixer, SSMSpec):
            self.ssm = Mamba2Mixer(mixer, hidden=cfg.hidden_size, heads=cfg.ssm_heads, head_dim=cfg.ssm_head_dim,
                                   groups=cfg.ssm_groups, state=cfg.ssm_state_size, conv=cfg.conv_kernel,
                                   chunk=cfg.chunk_size, eps=cfg.norm_eps, dt_limit=(cfg.dt_min, cfg.dt_max), layer=index)
        elif isinstance(mixer, AttentionSpec):
            self.attn = SelfAttention(mixer, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, layer=index)
        elif isinstance(ffn, MLPSpec):
            self.mlp = MLP(ffn, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden_size)
        elif isinstance(ffn, MoESpec):
            self.moe = MoE(ffn, hidden=cfg.hidden_size, ffn_hidden=cfg.moe_ffn_hidden_size,
                           num_experts=cfg.num_experts or 0, top_k=cfg.top_k,
                           shared_ffn_hidden=cfg.shared_ffn_hidden_size, expert_bias=cfg.expert_bias,
                           bias_update_rate=cfg.bias_update_rate, router_groups=cfg.router_groups,
                           router_group_topk=cfg.router_group_topk, router_scaling=cfg.router_scaling)
        else:
            raise ValueError(f"block {spec} has no mixer or feed-forward this decoder knows")

    def forward(self, x: torch.Tensor, rope: Any, cache: HybridCache | None) -> torch.Tensor:
        h = self.norm(x)
        if hasattr(self, "ssm"):
            return x + self.ssm(h, cache.states if cache is not None else None)
        if hasattr(self, "attn"):
            return x + self.attn(h, rope, cache)
        return x + (self.mlp(h) if hasattr(self, "mlp") else self.moe(h))


class Hybrid(nn.Module):
    def __init__(self, cfg: MambaConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.hidden_size)
        seen: dict[str, int] = {}
        layers = []
        for sym in cfg.symbols:
            block = spec.block_for(sym)
            kind = "ssm" if isinstance(block.mixer, SSMSpec) else sym  # indexes cache slots / MoE rows per kind
            layers.append(Layer(cfg, block, seen.get(kind, 0)))
            seen[kind] = seen.get(kind, 0) + 1
        self.layers = nn.ModuleList(layers)
        # A spec with MoE blocks hands routing statistics on (its family carries them between
        # pipeline stages), zeros when this pattern has no "E".
        self.routes = any(isinstance(b.ffn, MoESpec) for b in spec.blocks.values())
        attn = next((b.mixer for b in spec.blocks.values() if isinstance(b.mixer, AttentionSpec)), None)
        uses_rope = "*" in cfg.symbols and attn is not None and attn.positions == "rope"
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, None) if uses_rope else None
        assert spec.final_norm is not None
        self.norm = make_norm(spec.final_norm, cfg.hidden_size, cfg.norm_eps)
        self.head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self._init(cfg)

    def _init(self, cfg: MambaConfig) -> None:
        # Linear and embedding weights N(0, init_std), residual outputs scaled by 1/sqrt(2 * layers)
        # (mamba-ssm's rescale_prenorm_residual); the SSM parameters keep the mixers' own init.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down")) and not name.endswith(("in_proj.weight", "x_proj.weight", "dt_proj.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.num_layers))
            elif name.endswith(("fc.weight", "qkv.weight", "in_proj.weight", "x_proj.weight", "embed.weight",
                                "head.weight", "gate_up", "router.weight")):
                nn.init.normal_(p, std=cfg.init_std)

    def forward(self, tokens: torch.Tensor, *, cache: HybridCache | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, moe_stats: torch.Tensor | None = None, **_: Any) -> Any:
        """tokens (B, T) -> logits (B, T, V); with ``cache``, T new tokens after ``cache.pos`` old ones.
        With ``labels``: the mean cross entropy, and with MoE layers ``(loss, moe_stats)``. On a
        pipeline stage without the head: the hidden state (with MoE layers ``{"tokens", "moe_stats"}``).
        Packed documents are not separated: SSM state flows across them (no ``segment_ids``)."""
        t = tokens.shape[1]
        start = cache.pos if cache is not None else 0
        x = self.embed(tokens) if self.embed is not None else tokens
        rope = self.rotary(torch.arange(start, start + t, device=x.device)) if self.rotary is not None else None
        moe = self.routes
        stats = moe_stats
        if moe and stats is None:
            stats = torch.zeros(max(self.cfg.moe_layers, 1), stats_width(self.cfg.num_experts or 0), device=x.device)
        for layer in self.layers:
            x = layer(x, rope, cache)
            if hasattr(layer, "moe"):
                stats = stats.index_add(0, torch.tensor([layer.index], device=x.device), layer.moe.stats[None])
        if cache is not None:
            cache.pos += t
        if self.head is None:
            return {"tokens": x, "moe_stats": stats} if moe else x
        x = self.norm(x)
        if labels is None:
            return self.head(x)
        mask = loss_mask.flatten().bool() if loss_mask is not None else None
        ce = linear_cross_entropy(x.flatten(0, 1), self.head, labels.flatten(), mask)
        return (ce, stats) if moe else ce

    def new_cache(self, batch: int, max_len: int) -> HybridCache:
        p = self.embed.weight
        cfg = self.cfg
        return HybridCache(ssm_layers=cfg.symbols.count("M"), num_layers=cfg.symbols.count("*"), batch=batch,
                           kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len, dtype=p.dtype,
                           device=p.device)


def build(cfg: MambaConfig, spec: ModelSpec) -> Hybrid:
    return Hybrid(cfg, spec)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    """Next-token cross entropy; with MoE layers, their balancing terms as auxiliary metrics."""
    out = model(batch["tokens"], labels=batch["labels"], loss_mask=batch.get("loss_mask"),
                moe_stats=batch.get("moe_stats"))
    cfg = model.cfg
    if isinstance(out, dict) or not isinstance(out, tuple):  # not the last pipeline stage, or no MoE blocks
        return out, {}
    ce, stats = out
    if cfg.moe_layers == 0:  # (a spec with "E" blocks carries zero statistics for a pattern without)
        return ce, {}  # the family's MoE metrics exist only where the pattern has "E" (MetricSpec.when)
    return ce, balance_metrics(stats, num_experts=cfg.num_experts, top_k=cfg.top_k, convention="megatron",
                               aux_coeff=cfg.aux_loss_coeff, z_coeff=cfg.z_loss_coeff)


def flops_per_token(model: nn.Module, run: Any) -> float:
    """6 x the matmul weights a token passes through (experts: top-k of them), + attention scores
    on the attention layers, + the scans (about 9 multiply-adds per inner channel and state, x 3)."""
    from zoo.training.metrics import linear_weights

    cfg = run.model
    n = linear_weights(model)
    if cfg.moe_layers:
        n += cfg.moe_layers * cfg.top_k * cfg.hidden_size * cfg.moe_ffn_hidden_size * 2
    attn = 12.0 * cfg.symbols.count("*") * cfg.num_heads * cfg.head_dim * run.train.seq_length
    scan = 3 * 2 * 9.0 * cfg.symbols.count("M") * cfg.ssm_inner * cfg.ssm_state_size
    return 6.0 * n + attn + scan


def generate(model: Hybrid, cfg: MambaConfig, **request: Any) -> torch.Tensor:
    from zoo.nn.sampling import generate_tokens

    return generate_tokens(model, context=cfg.max_seq_length, **request)
