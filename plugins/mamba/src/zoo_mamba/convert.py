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
from zoo.checkpoint.fields import FieldTable
from zoo.checkpoint.hf import library_config, make_config
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


def to_hf_config(cfg: MambaConfig) -> Any:
    """transformers' config object for ``cfg``."""
    base = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, layer_norm_epsilon=cfg.norm_eps,
                initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings, conv_kernel=cfg.conv_kernel,
                expand=cfg.expand, use_conv_bias=True, use_bias=False)
    if cfg.layer_spec == "mamba1":
        return make_config("mamba", architectures=["MambaForCausalLM"], **base, num_hidden_layers=cfg.num_layers,
                           state_size=cfg.ssm_state_size, time_step_rank=cfg.dt_rank,
                           hidden_act="silu", residual_in_fp32=True)
    if cfg.layer_spec == "mamba2":
        return make_config("mamba2", architectures=["Mamba2ForCausalLM"], **base, num_hidden_layers=cfg.num_layers,
                           state_size=cfg.ssm_state_size, num_heads=cfg.ssm_heads, head_dim=cfg.ssm_head_dim,
                           n_groups=cfg.ssm_groups, chunk_size=cfg.chunk_size, time_step_limit=(cfg.dt_min, cfg.dt_max),
                           hidden_act="silu", residual_in_fp32=True)
    if cfg.layer_spec != "nemotron_h":
        raise UsageError(f"model.layer_spec={cfg.layer_spec!r} has no Hugging Face architecture")
    if cfg.dt_max != math.inf:
        raise UsageError("NemotronH clamps dt to [time_step_min, inf): model.dt_max must stay inf to export it")
    if cfg.tie_embeddings:
        raise UsageError("transformers' NemotronHForCausalLM never ties its head to the embedding, whatever "
                         "tie_word_embeddings says: model.tie_embeddings must be false to export it")
    out = dict(layers_block_type=[_KIND[s] for s in cfg.symbols], ssm_state_size=cfg.ssm_state_size,
               mamba_num_heads=cfg.ssm_heads, mamba_head_dim=cfg.ssm_head_dim, n_groups=cfg.ssm_groups,
               chunk_size=cfg.chunk_size, time_step_min=cfg.dt_min, mamba_hidden_act="silu",
               mamba_proj_bias=False, num_attention_heads=max(cfg.num_heads, 1),
               num_key_value_heads=max(cfg.num_kv_heads, 1), head_dim=cfg.head_dim or None,
               max_position_embeddings=cfg.max_seq_length, attention_bias=False,
               intermediate_size=cfg.ffn_hidden_size, mlp_hidden_act="relu2", mlp_bias=False)
    if cfg.moe_layers:
        out |= dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                    moe_intermediate_size=cfg.moe_ffn_hidden_size,
                    moe_shared_expert_intermediate_size=cfg.shared_ffn_hidden_size, n_shared_experts=1,
                    n_group=cfg.router_groups, topk_group=cfg.router_group_topk, norm_topk_prob=True,
                    routed_scaling_factor=cfg.router_scaling)
        if cfg.router_groups > 1 and cfg.top_k != 2 * cfg.router_group_topk:
            raise UsageError(_GROUP_RULE.format(k=cfg.top_k, g=cfg.router_group_topk))
    return make_config("nemotron_h", architectures=["NemotronHForCausalLM"], **base, **out)


# Hugging Face scores a group of experts by its top 2, Megatron (and zoo) by its top k / topk_group.
_GROUP_RULE = ("group-limited routing with num_experts_per_tok={k}, topk_group={g}: Hugging Face scores a group by "
               "its top 2 experts, zoo by its top k/topk_group as Megatron; they agree only where k = 2 x topk_group")


def from_hf_config(config: Any) -> MambaConfig:
    """zoo's config for transformers' Mamba / Mamba-2 / NemotronH ``config`` (or a document
    transformers turns into one); the fixed fields were checked against `FIELDS` before."""
    config = library_config(config)
    hf = config.to_dict()
    kind = hf.get("model_type")
    common = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], norm_eps=hf["layer_norm_epsilon"],
                  init_std=hf["initializer_range"], conv_kernel=hf["conv_kernel"], expand=hf["expand"],
                  tie_embeddings=bool(hf["tie_word_embeddings"]))
    if kind == "mamba":
        rank = hf["time_step_rank"]
        return MambaConfig(**common, num_layers=hf["num_hidden_layers"], ssm_state_size=hf["state_size"],
                           dt_rank=math.ceil(hf["hidden_size"] / 16) if rank == "auto" else int(rank), layer_spec="mamba1")
    if kind == "mamba2":
        low, high = config.time_step_limit or (0.0, math.inf)
        cfg = MambaConfig(**common, num_layers=hf["num_hidden_layers"], ssm_state_size=hf["state_size"],
                          ssm_head_dim=hf["head_dim"], ssm_groups=hf["n_groups"], chunk_size=hf["chunk_size"],
                          dt_min=float(low), dt_max=float(high), layer_spec="mamba2")
        _same_heads(cfg, hf.get("num_heads"), "num_heads")
        return cfg
    if kind == "nemotron_h":
        groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        if groups > 1 and hf["num_experts_per_tok"] != 2 * group_topk:
            raise UsageError(_GROUP_RULE.format(k=hf["num_experts_per_tok"], g=group_topk))
        types = hf.get("layers_block_type") or hf.get("layer_types")
        unknown = sorted({t for t in types if t not in _SYMBOL})
        if unknown:
            raise UsageError(f"NemotronH layer types {unknown} are not supported (mamba, attention, mlp, moe)")
        pattern = "".join(_SYMBOL[t] for t in types)
        moe = "E" in pattern
        heads = hf["num_attention_heads"]
        # (transformers' NemotronH keeps lm_head its own tensor whatever tie_word_embeddings says)
        cfg = MambaConfig(**{**common, "tie_embeddings": False}, num_layers=len(pattern), pattern=pattern,
                          ssm_state_size=hf["ssm_state_size"],
                          ssm_head_dim=hf["mamba_head_dim"], ssm_groups=hf["n_groups"], chunk_size=hf["chunk_size"],
                          dt_min=float(hf["time_step_min"]),
                          num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                          head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                          ffn_hidden_size=hf.get("intermediate_size") or 0, max_seq_length=hf["max_position_embeddings"],
                          num_experts=hf.get("n_routed_experts") if moe else None, top_k=hf["num_experts_per_tok"],
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


# Every field of each config class (see zoo.checkpoint.fields). The time-step bounds other than
# the clamp (time_step_min/max/floor/scale/init_scheme) and the residual rescaling only initialise
# weights; residual_in_fp32 keeps a reduced-precision residual in float32 (zoo's precision policy
# decides that); the kernel switches pick an implementation of the same scan.
_IDS = ("use_cache", "pad_token_id", "bos_token_id", "eos_token_id")
_INIT = ("time_step_min", "time_step_max", "time_step_floor", "rescale_prenorm_residual", "residual_in_fp32")
_SSM_FIXED = {"use_bias": (False,), "use_conv_bias": (True,), "hidden_act": ("silu",)}
_COMMON = ("vocab_size", "hidden_size", "layer_norm_epsilon", "initializer_range", "conv_kernel", "expand",
           "tie_word_embeddings")
FIELDS = {t.config_class: t for t in (
    FieldTable(config_class="MambaConfig", mapped=(*_COMMON, "state_size", "num_hidden_layers", "time_step_rank"),
               inert=(*_IDS, *_INIT, "time_step_scale", "time_step_init_scheme", "use_mambapy", "use_associative_scan"),
               fixed=_SSM_FIXED),
    FieldTable(config_class="Mamba2Config", mapped=(*_COMMON, "num_heads", "head_dim", "state_size", "num_hidden_layers",
                                                    "n_groups", "chunk_size", "time_step_limit"),
               inert=(*_IDS, *_INIT, "time_step_rank"),  # (Mamba-2's dt comes from in_proj: no rank)
               fixed=_SSM_FIXED),
    FieldTable(config_class="NemotronHConfig",
               mapped=(*(f for f in _COMMON if f != "tie_word_embeddings"), "layers_block_type", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "max_position_embeddings", "intermediate_size", "ssm_state_size", "mamba_num_heads",
                       "mamba_head_dim", "n_groups", "chunk_size", "time_step_min", "n_routed_experts",
                       "moe_intermediate_size", "moe_shared_expert_intermediate_size", "num_experts_per_tok",
                       "routed_scaling_factor", "n_group", "topk_group"),
               inert=(*_IDS, "tie_word_embeddings",  # (its model never ties: see from_hf_config)
                      "time_step_max", "time_step_floor", "rescale_prenorm_residual", "residual_in_fp32",
                      "num_logits_to_keep", "attention_dropout", "hidden_dropout", "use_mamba_kernels",
                      "mamba_ssm_cache_dtype", "output_router_logits", "moe_shared_expert_overlap",
                      "mtp_layers_block_type",  # (the multi-token-prediction layers: none while num_nextn_predict_layers=0)
                      "time_step_limit"),  # (NemotronH clamps to [time_step_min, inf) whatever this says)
               fixed={"use_bias": (False,), "use_conv_bias": (True,), "mamba_hidden_act": ("silu",),
                      "mamba_proj_bias": (False,), "attention_bias": (False,), "mlp_bias": (False,),
                      "mlp_hidden_act": ("relu2",), "n_shared_experts": (1, None), "norm_topk_prob": (True,),
                      "moe_latent_size": (None,), "num_nextn_predict_layers": (0, None), "sliding_window": (None,)}),
)}


HF = ExternalFormat(
    name="hf",
    architectures={"MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "hybrid"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
    import_table=import_table,
    fields=FIELDS,
)
