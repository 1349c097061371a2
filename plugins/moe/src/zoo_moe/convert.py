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
from zoo.checkpoint.mapping import Fuse, MappingError, MappingTable, Rename, StackExperts
from zoo.errors import UsageError
from zoo_gpt.convert import from_hf_config as llama_from_hf
from zoo_gpt.convert import table as llama_table
from zoo_gpt.convert import windows_from_hf
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


def to_hf_config(cfg: MoEConfig) -> dict[str, Any]:
    if cfg.router_groups > 1 or cfg.router_scaling != 1.0:
        raise UsageError("group-limited routing and router_scaling have no place in Hugging Face's Mixtral or "
                         "Qwen2-MoE configs; zoo's own checkpoints hold them")
    from zoo_gpt.convert import to_hf_config as llama_to_hf
    from zoo_gpt.convert import windows_to_hf

    # (as LLaMA's: the windows are written below)
    window_free = dataclasses.replace(cfg, sliding_window=None, window_layers=None, layer_spec="llama")
    base = {k: v for k, v in llama_to_hf(window_free).items() if k not in ("attention_bias", "mlp_bias")}
    hf_coef = cfg.aux_loss_coeff if cfg.aux_loss_convention == "hf" else 0.001
    if cfg.layer_spec.startswith("qwen2_moe"):
        return {**base, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                "moe_intermediate_size": cfg.ffn_hidden_size, "shared_expert_intermediate_size": cfg.shared_ffn_hidden_size,
                "intermediate_size": cfg.dense_ffn_hidden_size or cfg.shared_ffn_hidden_size,
                "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
                "norm_topk_prob": cfg.layer_spec == "qwen2_moe_norm", "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, s in enumerate(cfg.symbols) if s == "T"], "qkv_bias": True,
                "router_aux_loss_coef": hf_coef, **windows_to_hf(cfg, "qwen2_moe", "Qwen2MoeForCausalLM", flag=True)}
    if cfg.layer_spec.startswith("qwen3_moe"):
        return {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "moe_intermediate_size": cfg.ffn_hidden_size, "intermediate_size": cfg.dense_ffn_hidden_size or cfg.ffn_hidden_size,
                "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
                "norm_topk_prob": cfg.layer_spec == "qwen3_moe_norm", "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, s in enumerate(cfg.symbols) if s == "T"], "attention_bias": False,
                "router_aux_loss_coef": hf_coef, **windows_to_hf(cfg, "all", "Qwen3MoeForCausalLM", flag=True)}
    if "T" in cfg.symbols:
        raise UsageError(f"model.pattern={cfg.pattern!r} has dense layers ('T'), which Hugging Face's Mixtral does not "
                         "have; only the Qwen specs export with dense layers")
    if cfg.layer_spec != "mixtral":
        raise UsageError(f"model.layer_spec={cfg.layer_spec!r} has no Hugging Face architecture (mixtral, qwen2_moe, "
                         "qwen3_moe only)")
    return {**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": hf_coef, "router_jitter_noise": 0.0,
            **windows_to_hf(cfg, "all", "MixtralForCausalLM", flag=False)}


def from_hf_config(hf: dict[str, Any]) -> MoEConfig:
    kind = hf.get("model_type")
    if kind not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        raise UsageError(f"model_type {kind!r} is not Mixtral, Qwen2-MoE or Qwen3-MoE")
    if kind == "qwen3_moe" and hf.get("attention_bias"):
        raise UsageError("Qwen3-MoE with attention biases is not supported")
    if hf.get("router_jitter_noise"):
        raise UsageError("router_jitter_noise > 0 is not supported (it scales the experts' input too, as in HF)")
    qwen = kind in ("qwen2_moe", "qwen3_moe")
    # (transformers 5 writes Qwen3-MoE's count as num_local_experts; the released configs num_experts)
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    pattern = ""  # every layer MoE
    if qwen:  # transformers' Qwen2MoeDecoderLayer: sparse unless listed in mlp_only_layers or off the step
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
        pattern = "".join("E" if i not in dense and experts > 0 and (i + 1) % step == 0 else "T"
                          for i in range(hf["num_hidden_layers"]))
        pattern = pattern if "T" in pattern else ""
    base = llama_from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False, "sliding_window": None,
                          "intermediate_size": hf["moe_intermediate_size"] if qwen else hf["intermediate_size"]})
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__ if f != "layer_spec"}
    fields.update(windows_from_hf(hf, "qwen2_moe" if kind == "qwen2_moe" else "all", flag=qwen))
    spec = (f"{kind}_norm" if hf.get("norm_topk_prob") else kind) if qwen else "mixtral"
    return MoEConfig(**fields, num_experts=experts,
                     top_k=hf["num_experts_per_tok"], shared_ffn_hidden_size=hf.get("shared_expert_intermediate_size", 0),
                     aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), aux_loss_convention="hf",
                     pattern=pattern, dense_ffn_hidden_size=hf["intermediate_size"] if pattern else 0,
                     layer_spec=spec)


HF = ExternalFormat(
    name="hf",
    architectures={"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2-moe", "Qwen3MoeForCausalLM": "qwen3-moe"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
    import_table=import_table,
)
