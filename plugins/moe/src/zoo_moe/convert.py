"""Hugging Face layouts of Mixtral (`MixtralForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`).

Attention, norms, embeddings, head and the dense layers' MLPs (Qwen2-MoE's ``mlp_only_layers``,
``decoder_sparse_step``: ``T`` in the pattern) are LLaMA's rules (`zoo_gpt.convert`). Experts come
in two layouts, detected from the keys and never mixed:

- per expert (released checkpoints; what ``save_pretrained`` writes): Mixtral
  ``block_sparse_moe.experts.{e}.w1|w3|w2.weight``, Qwen2-MoE ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``;
- fused (transformers 5 in memory): ``mlp.experts.gate_up_proj`` (E, 2F, D) and ``down_proj`` (E, D, F),
  which are exactly our ``moe.gate_up`` and ``moe.down``.

Export writes the per-expert layout, which every transformers version reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, Literal

from zoo.checkpoint import ExternalFormat
from zoo.checkpoint.fields import FieldTable
from zoo.checkpoint.hf import library_config, make_config, rope_fields, rope_of
from zoo.checkpoint.mapping import Fuse, MappingError, MappingTable, Rename, StackExperts
from zoo.errors import UsageError
from zoo_gpt.convert import table as llama_table
from zoo_gpt.convert import windows_from_hf, windows_to_hf
from zoo_moe.plugin import MoEConfig

Layout = Literal["per_expert", "fused"]
L = "model.layers.{i}."


def _llama(cfg: MoEConfig) -> list[Any]:
    """LLaMA's rules (Qwen2's o_proj has no bias, which LLaMA's attention_bias would add); its MLP
    rules are the dense layers'."""
    spec = cfg.layer_spec
    as_llama = dataclasses.replace(cfg, layer_spec="llama_attn_bias" if spec.startswith("qwen2_moe")
                                   else "qwen3" if spec.startswith("qwen3_moe") else "llama")
    return [r for r in llama_table(as_llama).rules if not getattr(r, "ours", "").endswith("attn.proj.bias")]


def _experts(cfg: MoEConfig, layout: Layout) -> list[Any]:
    qwen = cfg.layer_spec.startswith(("qwen2_moe", "qwen3_moe"))  # (Qwen's expert names; Qwen2's shared expert)
    moe = L + ("mlp." if qwen or layout == "fused" else "block_sparse_moe.")
    rules: list[Any] = [Rename("layers.{i}.moe.router.weight", moe + "gate.weight")]
    if layout == "fused":
        rules += [Rename("layers.{i}.moe.gate_up", moe + "experts.gate_up_proj"),
                  Rename("layers.{i}.moe.down", moe + "experts.down_proj")]
    elif qwen:
        rules += [StackExperts("layers.{i}.moe.gate_up", (moe + "experts.{e}.gate_proj.weight", moe + "experts.{e}.up_proj.weight")),
                  StackExperts("layers.{i}.moe.down", moe + "experts.{e}.down_proj.weight")]
    else:
        rules += [StackExperts("layers.{i}.moe.gate_up", (moe + "experts.{e}.w1.weight", moe + "experts.{e}.w3.weight")),
                  StackExperts("layers.{i}.moe.down", moe + "experts.{e}.w2.weight")]
    if cfg.layer_spec.startswith("qwen2_moe"):
        rules += [Fuse("layers.{i}.moe.shared.fc.weight", (moe + "shared_expert.gate_proj.weight", moe + "shared_expert.up_proj.weight")),
                  Rename("layers.{i}.moe.shared.proj.weight", moe + "shared_expert.down_proj.weight"),
                  Rename("layers.{i}.moe.shared_gate.weight", moe + "shared_expert_gate.weight")]
    return rules


def _at(rule: Any, i: int) -> Any:
    """``rule`` for layer ``i`` alone ({i} filled in; {e} is the expert rules' own)."""
    def fill(v: Any) -> Any:
        if isinstance(v, str):
            return v.replace("{i}", str(i))
        return tuple(fill(x) for x in v) if isinstance(v, tuple) else v
    return dataclasses.replace(rule, **{f: fill(getattr(rule, f)) for f in ("ours", "theirs") if hasattr(rule, f)})


def table(cfg: MoEConfig, layout: Layout = "per_expert") -> MappingTable:
    """Every layer's rules by its kind (strict coverage needs a dense layer's MLP mapped and a MoE
    layer's experts, never both): attention everywhere, experts on ``E`` layers, the MLP on ``T``."""
    llama = _llama(cfg)
    whole = [r for r in llama if "{i}" not in getattr(r, "ours", "")]  # embeddings, final norm, head, ignores
    attn = [r for r in llama if "{i}" in getattr(r, "ours", "") and ".mlp." not in r.ours]
    kinds = {"E": attn + _experts(cfg, layout), "T": [r for r in llama if ".mlp." in getattr(r, "ours", "")] + attn}
    return MappingTable(rules=(*whole, *(_at(r, i) for i, s in enumerate(cfg.symbols) for r in kinds[s])))


def import_table(cfg: MoEConfig, keys: Collection[str]) -> MappingTable:
    """The table for the expert layout these keys use; a file mixing both is refused."""
    fused = sorted(k for k in keys if ".experts.gate_up_proj" in k or ".experts.down_proj" in k)
    per = sorted(k for k in keys if ".experts.0." in k)
    if fused and per:
        raise MappingError(f"the checkpoint mixes expert layouts: per-expert keys ({per[0]!r}, ...) and fused keys "
                           f"({fused[0]!r}, ...); convert it to one layout")
    return table(cfg, "fused" if fused else "per_expert")


def to_hf_config(cfg: MoEConfig) -> Any:
    """transformers' config object for ``cfg`` (refused where the architecture has no place for it)."""
    if cfg.router_groups > 1 or cfg.router_scaling != 1.0:
        raise UsageError("group-limited routing and router_scaling have no place in Hugging Face's Mixtral or "
                         "Qwen2-MoE configs; zoo's own checkpoints hold them")
    base = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                hidden_act="silu", max_position_embeddings=cfg.max_seq_length, rms_norm_eps=cfg.norm_eps,
                initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0,
                num_experts_per_tok=cfg.top_k, pad_token_id=cfg.pad_token_id,
                router_aux_loss_coef=cfg.aux_loss_coeff if cfg.aux_loss_convention == "hf" else 0.001)
    dense = [i for i, s in enumerate(cfg.symbols) if s == "T"]
    if cfg.layer_spec.startswith("qwen2_moe"):
        return make_config(
            "qwen2_moe", architectures=["Qwen2MoeForCausalLM"], **base, **rope_fields("qwen2_moe", cfg.rope_theta, cfg.rope_scaling),
            moe_intermediate_size=cfg.ffn_hidden_size, shared_expert_intermediate_size=cfg.shared_ffn_hidden_size,
            intermediate_size=cfg.dense_ffn_hidden_size or cfg.shared_ffn_hidden_size, num_experts=cfg.num_experts,
            norm_topk_prob=cfg.layer_spec == "qwen2_moe_norm", decoder_sparse_step=1, mlp_only_layers=dense,
            qkv_bias=True, **windows_to_hf(cfg, "qwen2_moe", "Qwen2MoeForCausalLM", flag=True))
    if cfg.layer_spec.startswith("qwen3_moe"):
        return make_config(
            "qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **base, **rope_fields("qwen3_moe", cfg.rope_theta, cfg.rope_scaling),
            moe_intermediate_size=cfg.ffn_hidden_size, intermediate_size=cfg.dense_ffn_hidden_size or cfg.ffn_hidden_size,
            num_experts=cfg.num_experts, norm_topk_prob=cfg.layer_spec == "qwen3_moe_norm", decoder_sparse_step=1,
            mlp_only_layers=dense, attention_bias=False, **windows_to_hf(cfg, "all", "Qwen3MoeForCausalLM", flag=True))
    if dense:
        raise UsageError(f"model.pattern={cfg.pattern!r} has dense layers ('T'), which Hugging Face's Mixtral does not "
                         "have; only the Qwen specs export with dense layers")
    if cfg.layer_spec != "mixtral":
        raise UsageError(f"model.layer_spec={cfg.layer_spec!r} has no Hugging Face architecture (mixtral, qwen2_moe, "
                         "qwen3_moe only)")
    return make_config("mixtral", architectures=["MixtralForCausalLM"], **base,
                       **rope_fields("mixtral", cfg.rope_theta, cfg.rope_scaling), intermediate_size=cfg.ffn_hidden_size,
                       num_local_experts=cfg.num_experts, router_jitter_noise=0.0,
                       **windows_to_hf(cfg, "all", "MixtralForCausalLM", flag=False))


def from_hf_config(config: Any) -> MoEConfig:
    """zoo's config for transformers' Mixtral / Qwen2-MoE / Qwen3-MoE ``config`` (or a document
    transformers turns into one); the fixed fields were checked against `FIELDS` before."""
    config = library_config(config)
    hf = config.to_dict()
    kind = hf.get("model_type")
    if kind not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        raise UsageError(f"model_type {kind!r} is not Mixtral, Qwen2-MoE or Qwen3-MoE")
    qwen = kind in ("qwen2_moe", "qwen3_moe")
    experts = config.num_experts if qwen else config.num_local_experts  # (attribute maps: names differ by release)
    pattern = ""  # every layer MoE
    if qwen:  # transformers' Qwen2MoeDecoderLayer: sparse unless listed in mlp_only_layers or off the step
        step, dense = int(hf["decoder_sparse_step"]), set(hf.get("mlp_only_layers") or ())
        pattern = "".join("E" if i not in dense and experts > 0 and (i + 1) % step == 0 else "T"
                          for i in range(hf["num_hidden_layers"]))
        pattern = pattern if "T" in pattern else ""
    theta, scaling = rope_of(config, what=kind)
    heads = hf["num_attention_heads"]
    spec = (f"{kind}_norm" if hf.get("norm_topk_prob") else kind) if qwen else "mixtral"
    return MoEConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                     num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                     head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                     ffn_hidden_size=hf["moe_intermediate_size"] if qwen else hf["intermediate_size"],
                     max_seq_length=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
                     tie_embeddings=bool(hf["tie_word_embeddings"]), rope_theta=theta, rope_scaling=scaling,
                     init_std=hf["initializer_range"], pad_token_id=hf.get("pad_token_id"),
                     **windows_from_hf(hf, "qwen2_moe" if kind == "qwen2_moe" else "all", flag=qwen),
                     num_experts=experts, top_k=hf["num_experts_per_tok"],
                     shared_ffn_hidden_size=hf.get("shared_expert_intermediate_size") or 0,
                     aux_loss_coeff=float(hf["router_aux_loss_coef"]), aux_loss_convention="hf",
                     pattern=pattern, dense_ffn_hidden_size=hf["intermediate_size"] if pattern else 0,
                     layer_spec=spec)


# Every field of each config class (see zoo.checkpoint.fields and zoo_gpt.convert.FIELDS).
_IDS = ("use_cache", "bos_token_id", "eos_token_id", "output_router_logits", "attention_dropout")
_DECODER = ("pad_token_id", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "initializer_range", "rms_norm_eps", "tie_word_embeddings",
            "rope_parameters", "rope_theta", "rope_scaling", "head_dim", "num_experts_per_tok", "router_aux_loss_coef")
_QWEN = ("decoder_sparse_step", "moe_intermediate_size", "num_experts", "norm_topk_prob", "mlp_only_layers",
         "use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
FIELDS = {t.config_class: t for t in (
    FieldTable(config_class="MixtralConfig", mapped=(*_DECODER, "sliding_window", "num_local_experts"), inert=_IDS,
               # (jitter multiplies the experts' input by noise in training: zoo has no such noise)
               fixed={"hidden_act": ("silu",), "router_jitter_noise": (0.0, None)}),
    FieldTable(config_class="Qwen2MoeConfig", mapped=(*_DECODER, *_QWEN, "shared_expert_intermediate_size"), inert=_IDS,
               fixed={"hidden_act": ("silu",), "qkv_bias": (True,)}),  # (zoo's Qwen2-MoE spec has q/k/v biases)
    FieldTable(config_class="Qwen3MoeConfig", mapped=(*_DECODER, *_QWEN), inert=_IDS,
               fixed={"hidden_act": ("silu",), "attention_bias": (False,)}),
)}


HF = ExternalFormat(
    name="hf",
    architectures={"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2-moe", "Qwen3MoeForCausalLM": "qwen3-moe"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
    import_table=import_table,
    fields=FIELDS,
)
