"""Hugging Face layouts of `MambaForCausalLM`, `Mamba2ForCausalLM` and `NemotronHForCausalLM`.

The mixers keep HF's tensors as they are (in_proj packed [x, z] or [z, x, B, C, dt], conv1d
(C, 1, K), A_log, D, dt_bias), so SSM layers map by name; NemotronH's attention fuses q/k/v per KV
group as LLaMA's does. Layers differ in kind, so the tables list each layer's keys (a rule per
layer, not a ``{i}`` template).

Accepted on import: the original mamba_ssm name ``backbone.embedding.weight`` (singular);
NemotronH as released and as ``save_pretrained`` writes it (``backbone.``, one tensor per expert)
and as transformers 5 holds it in memory (``model.``, experts fused ``(E, F, D)``), never mixed.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Literal

from zoo.checkpoint import ExternalFormat
from zoo.checkpoint.mapping import Fuse, Ignore, MappingError, MappingTable, Rename, StackExperts, Tie
from zoo.errors import UsageError
from zoo_mamba.plugin import MambaConfig

_SSM1 = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log",
         "D", "out_proj.weight")
_SSM2 = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
_KIND = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def table(cfg: MambaConfig, experts: Literal["per_expert", "fused"] = "per_expert") -> MappingTable:
    rules: list[Any] = [Rename("embed.weight", "backbone.embeddings.weight"), Rename("norm.weight", "backbone.norm_f.weight")]
    for i, sym in enumerate(cfg.symbols):
        ours, theirs = f"layers.{i}.", f"backbone.layers.{i}."
        rules.append(Rename(ours + "norm.weight", theirs + "norm.weight"))
        if sym == "M":
            names = _SSM1 if cfg.layer_spec == "mamba1" else _SSM2
            rules += [Rename(ours + "ssm." + n, theirs + "mixer." + n) for n in names]
        elif sym == "*":
            qkv = tuple(theirs + f"mixer.{n}_proj.weight" for n in "qkv")
            rules += [Fuse(ours + "attn.qkv.weight", qkv, groups="num_kv_heads", sizes=("q_size", "kv_size", "kv_size")),
                      Rename(ours + "attn.proj.weight", theirs + "mixer.o_proj.weight")]
        elif sym == "-":
            rules += [Rename(ours + "mlp.fc.weight", theirs + "mixer.up_proj.weight"),
                      Rename(ours + "mlp.proj.weight", theirs + "mixer.down_proj.weight")]
        else:
            m = theirs + "mixer."
            rules += [Rename(ours + "moe.router.weight", m + "gate.weight"),
                      Rename(ours + "moe.router.expert_bias", m + "gate.e_score_correction_bias"),
                      Rename(ours + "moe.shared.fc.weight", m + "shared_experts.up_proj.weight"),
                      Rename(ours + "moe.shared.proj.weight", m + "shared_experts.down_proj.weight")]
            if experts == "fused":
                rules += [Rename(ours + "moe.gate_up", m + "experts.up_proj"),
                          Rename(ours + "moe.down", m + "experts.down_proj")]
            else:
                rules += [StackExperts(ours + "moe.gate_up", m + "experts.{e}.up_proj.weight"),
                          StackExperts(ours + "moe.down", m + "experts.{e}.down_proj.weight")]
    if cfg.tie_embeddings:
        rules += [Tie("head.weight", to="embed.weight"), Ignore(r"lm_head\.weight")]
    else:
        rules.append(Rename("head.weight", "lm_head.weight"))
    # mamba_ssm's own checkpoints say backbone.embedding (singular); transformers 5 holds NemotronH as model.*
    prefixes = (("backbone.embeddings.", "backbone.embedding."), ("backbone.", "model."))
    return MappingTable(rules=tuple(rules), import_prefixes=prefixes)


def import_table(cfg: MambaConfig, keys: Collection[str]) -> MappingTable:
    """The table for the expert layout these keys use; a file mixing both is refused."""
    fused = sorted(k for k in keys if k.endswith((".experts.up_proj", ".experts.down_proj")))
    per = sorted(k for k in keys if ".experts.0." in k)
    if fused and per:
        raise MappingError(f"the checkpoint mixes expert layouts: per-expert keys ({per[0]!r}, ...) and fused keys "
                           f"({fused[0]!r}, ...); convert it to one layout")
    return table(cfg, "fused" if fused else "per_expert")


def to_hf_config(cfg: MambaConfig) -> dict[str, Any]:
    base = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings, "conv_kernel": cfg.conv_kernel,
            "expand": cfg.expand, "use_conv_bias": True}
    if cfg.layer_spec == "mamba1":
        return {**base, "architectures": ["MambaForCausalLM"], "model_type": "mamba", "num_hidden_layers": cfg.num_layers,
                "state_size": cfg.ssm_state_size, "intermediate_size": cfg.ssm_inner, "time_step_rank": cfg.dt_rank,
                "use_bias": False, "hidden_act": "silu", "residual_in_fp32": True}
    if cfg.layer_spec == "mamba2":
        return {**base, "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "num_hidden_layers": cfg.num_layers,
                "state_size": cfg.ssm_state_size, "num_heads": cfg.ssm_heads, "head_dim": cfg.ssm_head_dim,
                "n_groups": cfg.ssm_groups, "chunk_size": cfg.chunk_size, "time_step_limit": [cfg.dt_min, cfg.dt_max],
                "use_bias": False, "hidden_act": "silu", "residual_in_fp32": True}
    if cfg.layer_spec != "nemotron_h":
        raise UsageError(f"model.layer_spec={cfg.layer_spec!r} has no Hugging Face architecture")
    if cfg.dt_max != math.inf:
        raise UsageError("NemotronH clamps dt to [time_step_min, inf): model.dt_max must stay inf to export it")
    out = {**base, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
           "layers_block_type": [_KIND[s] for s in cfg.symbols], "ssm_state_size": cfg.ssm_state_size,
           "mamba_num_heads": cfg.ssm_heads, "mamba_head_dim": cfg.ssm_head_dim, "n_groups": cfg.ssm_groups,
           "chunk_size": cfg.chunk_size, "time_step_min": cfg.dt_min, "mamba_hidden_act": "silu",
           "mamba_proj_bias": False, "num_attention_heads": max(cfg.num_heads, 1),
           "num_key_value_heads": max(cfg.num_kv_heads, 1), "head_dim": cfg.head_dim or None,
           "max_position_embeddings": cfg.max_seq_length, "attention_bias": False,
           "intermediate_size": cfg.ffn_hidden_size, "mlp_hidden_act": "relu2", "mlp_bias": False}
    if cfg.moe_layers:
        out |= {"n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
                "moe_intermediate_size": cfg.moe_ffn_hidden_size,
                "moe_shared_expert_intermediate_size": cfg.shared_ffn_hidden_size, "n_shared_experts": 1,
                "n_group": cfg.router_groups, "topk_group": cfg.router_group_topk, "norm_topk_prob": True,
                "routed_scaling_factor": cfg.router_scaling}
        if cfg.router_groups > 1 and cfg.top_k != 2 * cfg.router_group_topk:
            raise UsageError(_GROUP_RULE.format(k=cfg.top_k, g=cfg.router_group_topk))
    return out


# Hugging Face scores a group of experts by its top 2, Megatron (and zoo) by its top k / topk_group.
_GROUP_RULE = ("group-limited routing with num_experts_per_tok={k}, topk_group={g}: Hugging Face scores a group by "
               "its top 2 experts, zoo by its top k/topk_group as Megatron; they agree only where k = 2 x topk_group")


def _require(hf: dict[str, Any], what: str, **expected: Any) -> None:
    for key, want in expected.items():
        if key in hf and hf[key] is not None and hf[key] != want:
            raise UsageError(f"{what} with {key}={hf[key]!r} is not supported ({want!r} only)")


def from_hf_config(hf: dict[str, Any]) -> MambaConfig:
    kind = hf.get("model_type")
    common = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                  init_std=hf.get("initializer_range", 0.1), conv_kernel=hf.get("conv_kernel", 4),
                  expand=hf.get("expand", 2))
    if kind == "mamba":
        _require(hf, "Mamba", use_bias=False, use_conv_bias=True, hidden_act="silu")
        rank = hf.get("time_step_rank", "auto")
        return MambaConfig(**common, num_layers=hf["num_hidden_layers"], ssm_state_size=hf.get("state_size", 16),
                           dt_rank=math.ceil(hf["hidden_size"] / 16) if rank == "auto" else int(rank),
                           tie_embeddings=bool(hf.get("tie_word_embeddings", True)), layer_spec="mamba1")
    if kind == "mamba2":
        _require(hf, "Mamba-2", use_bias=False, use_conv_bias=True, hidden_act="silu")
        low, high = hf.get("time_step_limit") or (0.0, math.inf)
        cfg = MambaConfig(**common, num_layers=hf["num_hidden_layers"], ssm_state_size=hf.get("state_size", 128),
                          ssm_head_dim=hf.get("head_dim", 64), ssm_groups=hf.get("n_groups", 1),
                          chunk_size=hf.get("chunk_size", 256), dt_min=float(low), dt_max=float(high),
                          tie_embeddings=bool(hf.get("tie_word_embeddings", True)), layer_spec="mamba2")
        _same_heads(cfg, hf.get("num_heads"), "num_heads")
        return cfg
    if kind == "nemotron_h":
        _require(hf, "NemotronH", mamba_proj_bias=False, use_conv_bias=True, mamba_hidden_act="silu", attention_bias=False,
                 mlp_bias=False, mlp_hidden_act="relu2", n_shared_experts=1, norm_topk_prob=True, moe_latent_size=None,
                 num_nextn_predict_layers=0)
        groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        if groups > 1 and hf.get("num_experts_per_tok", 2) != 2 * group_topk:
            raise UsageError(_GROUP_RULE.format(k=hf.get("num_experts_per_tok", 2), g=group_topk))
        types = hf.get("layers_block_type") or hf.get("layer_types")
        unknown = sorted({t for t in types if t not in _SYMBOL})
        if unknown:
            raise UsageError(f"NemotronH layer types {unknown} are not supported (mamba, attention, mlp, moe)")
        pattern = "".join(_SYMBOL[t] for t in types)
        moe = "E" in pattern
        heads = hf.get("num_attention_heads", 1)
        cfg = MambaConfig(**common, num_layers=len(pattern), pattern=pattern, ssm_state_size=hf.get("ssm_state_size", 128),
                          ssm_head_dim=hf.get("mamba_head_dim", 64), ssm_groups=hf.get("n_groups", 1),
                          chunk_size=hf.get("chunk_size", 128), dt_min=float(hf.get("time_step_min", 1e-3)),
                          num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                          head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                          ffn_hidden_size=hf.get("intermediate_size", 0), max_seq_length=hf.get("max_position_embeddings", 4096),
                          tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                          num_experts=hf.get("n_routed_experts") if moe else None, top_k=hf.get("num_experts_per_tok", 2),
                          moe_ffn_hidden_size=hf.get("moe_intermediate_size", 0) if moe else 0,
                          shared_ffn_hidden_size=hf.get("moe_shared_expert_intermediate_size", 0) if moe else 0,
                          aux_loss_coeff=0.0, expert_bias=moe, router_groups=groups, router_group_topk=group_topk,
                          router_scaling=float(hf.get("routed_scaling_factor") or 1.0), layer_spec="nemotron_h")
        _same_heads(cfg, hf.get("mamba_num_heads"), "mamba_num_heads")
        return cfg
    raise UsageError(f"model_type {kind!r} is not Mamba, Mamba-2 or NemotronH")


def _same_heads(cfg: MambaConfig, heads: int | None, key: str) -> None:
    if heads is not None and heads != cfg.ssm_heads:
        raise UsageError(f"{key}={heads} x head_dim={cfg.ssm_head_dim} must equal expand x hidden_size = {cfg.ssm_inner}")


HF = ExternalFormat(
    name="hf",
    architectures={"MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "hybrid"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
    import_table=import_table,
)
