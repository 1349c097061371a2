"""Hugging Face layouts of `CLIPModel` and `LlavaForConditionalGeneration`: key tables and config
translation. The tables are data; `zoo.checkpoint.mapping` applies them strictly both ways.

LLaVA's keys moved between transformers releases (PR #37033 in 4.52 nested the parts under
``model.``; 5.x dropped ``.vision_model.`` from the tower and saves yet another mix). `LLAVA_LAYOUTS`
is that history as a table: a state dict is imported from whichever layout its keys follow (a mix
of two is refused by the strict coverage check, naming the keys), and export writes the Hub layout
every release reads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection
from typing import Any

from zoo.checkpoint import ExternalFormat
from zoo.checkpoint.mapping import Fuse, Ignore, MappingTable, Rename, Rule
from zoo.errors import UsageError
from zoo_gpt import convert as gpt_convert
from zoo_vlm.plugin import CLIPConfig, LlavaConfig, VisionFields


def _tower(ours: str, theirs: str, ph: str, heads: str) -> list[Rule]:
    """One CLIP encoder's layers ``{ph}``: HF's separate q/k/v become our per-head fused q|k|v."""
    L, E = f"{ours}layers.{{{ph}}}.", f"{theirs}encoder.layers.{{{ph}}}."
    rules: list[Rule] = []
    for kind in ("weight", "bias"):
        rules += [
            Fuse(L + f"attn.qkv.{kind}", tuple(E + f"self_attn.{n}_proj.{kind}" for n in "qkv"), groups=heads),
            Rename(L + f"attn.proj.{kind}", E + f"self_attn.out_proj.{kind}"),
            Rename(L + f"attn_norm.{kind}", E + f"layer_norm1.{kind}"),
            Rename(L + f"mlp_norm.{kind}", E + f"layer_norm2.{kind}"),
            Rename(L + f"mlp.fc.{kind}", E + f"mlp.fc1.{kind}"),
            Rename(L + f"mlp.proj.{kind}", E + f"mlp.fc2.{kind}"),
        ]
    return rules


def _vision(ours: str, theirs: str) -> list[Rule]:
    return [
        Rename(ours + "patch.weight", theirs + "embeddings.patch_embedding.weight"),
        Rename(ours + "class_token", theirs + "embeddings.class_embedding"),
        Rename(ours + "positions.weight", theirs + "embeddings.position_embedding.weight"),
        Rename(ours + "pre_norm.weight", theirs + "pre_layrnorm.weight"),  # (HF's spelling)
        Rename(ours + "pre_norm.bias", theirs + "pre_layrnorm.bias"),
        *_tower(ours, theirs, "j", "vision_num_heads"),
        Rename(ours + "post_norm.weight", theirs + "post_layernorm.weight"),
        Rename(ours + "post_norm.bias", theirs + "post_layernorm.bias"),
        Ignore(re.escape(theirs) + r"embeddings\.position_ids"),  # a buffer older files carry
    ]


def clip_table(cfg: CLIPConfig) -> MappingTable:
    rules = [
        *_vision("vision.", "vision_model."),
        Rename("text.embed.weight", "text_model.embeddings.token_embedding.weight"),
        Rename("text.positions.weight", "text_model.embeddings.position_embedding.weight"),
        *_tower("text.", "text_model.", "i", "text_num_heads"),
        Rename("text.norm.weight", "text_model.final_layer_norm.weight"),
        Rename("text.norm.bias", "text_model.final_layer_norm.bias"),
        Rename("vision_proj.weight", "visual_projection.weight"),
        Rename("text_proj.weight", "text_projection.weight"),
        Rename("logit_scale", "logit_scale"),
        Ignore(r"text_model\.embeddings\.position_ids"),
    ]
    return MappingTable(rules=tuple(rules), counts={"i": "text_num_layers", "j": "vision_num_layers"})


# Where each part of a LlavaForConditionalGeneration lives, by transformers release. The first
# is written on export: the Hub's files (llava-hf/*) use it and every release reads it.
LLAVA_LAYOUTS: dict[str, dict[str, str]] = {
    "hub (transformers <= 4.51, and what 4.52+ save_pretrained writes)": {
        "lm": "language_model.model.", "head": "language_model.lm_head.", "vision": "vision_tower.vision_model.",
        "projector": "multi_modal_projector."},
    "transformers 4.52-4.57 in memory": {
        "lm": "model.language_model.", "head": "lm_head.", "vision": "model.vision_tower.vision_model.",
        "projector": "model.multi_modal_projector."},
    "transformers 5.x in memory": {
        "lm": "model.language_model.", "head": "lm_head.", "vision": "model.vision_tower.",
        "projector": "model.multi_modal_projector."},
    "transformers 5.x save_pretrained": {
        "lm": "language_model.model.", "head": "language_model.lm_head.", "vision": "vision_tower.",
        "projector": "multi_modal_projector."},
}


def _relocated(rule: Rule, move: Callable[[str], str], move_regex: Callable[[str], str]) -> Rule:
    """A zoo-gpt rule with its HF keys moved under the LLaVA prefixes."""
    if isinstance(rule, Ignore):
        return Ignore(move_regex(rule.theirs))
    theirs = getattr(rule, "theirs", None)
    if isinstance(theirs, str):
        return dataclasses.replace(rule, theirs=move(theirs))
    if isinstance(theirs, tuple):
        return dataclasses.replace(rule, theirs=tuple(move(t) for t in theirs))
    return rule


def llava_table(cfg: LlavaConfig, layout: str | None = None) -> MappingTable:
    if cfg.layer_spec != "llava":
        raise UsageError(f"Hugging Face LLaVA conversion covers LLaMA language models (model.layer_spec=llava), "
                         f"not {cfg.layer_spec!r}")
    where = LLAVA_LAYOUTS[layout or next(iter(LLAVA_LAYOUTS))]

    def move(key: str) -> str:
        for old, new in (("model.", where["lm"]), ("lm_head.", where["head"])):
            if key.startswith(old):
                return new + key[len(old):]
        raise AssertionError(key)

    def move_regex(pattern: str) -> str:
        for old, new in ((r"model\.", where["lm"]), (r"lm_head\.", where["head"])):
            if pattern.startswith(old):
                return re.escape(new) + pattern[len(old):]
        raise AssertionError(pattern)

    rules: list[Rule] = [_relocated(r, move, move_regex) for r in gpt_convert.table(cfg).rules]
    rules += _vision("vision.", where["vision"])
    proj = where["projector"]
    for kind in ("weight", "bias") if cfg.projector_bias else ("weight",):
        rules += [Rename(f"projector.fc.{kind}", f"{proj}linear_1.{kind}"),
                  Rename(f"projector.proj.{kind}", f"{proj}linear_2.{kind}")]
    return MappingTable(rules=tuple(rules), counts={"i": "num_layers", "j": "vision_num_layers"})


def llava_import_table(cfg: LlavaConfig, keys: Collection[str]) -> MappingTable:
    """The table of the layout these keys follow (the one most of them start like)."""
    def score(parts: dict[str, str]) -> int:
        return sum(any(k.startswith(p + ("embeddings." if n == "vision" else "")) for k in keys) for n, p in parts.items())

    best = max(LLAVA_LAYOUTS, key=lambda name: score(LLAVA_LAYOUTS[name]))
    return llava_table(cfg, best)


# ------------------------------------------------------------------------------------- configs


def _vision_to_hf(cfg: VisionFields) -> dict[str, Any]:
    return {"model_type": "clip_vision_model", "hidden_size": cfg.vision_hidden_size,
            "intermediate_size": cfg.vision_ffn_hidden_size, "num_hidden_layers": cfg.vision_num_layers,
            "num_attention_heads": cfg.vision_num_heads, "image_size": cfg.image_size, "patch_size": cfg.patch_size,
            "num_channels": cfg.num_channels, "layer_norm_eps": cfg.vision_norm_eps, "hidden_act": "quick_gelu"}


def _vision_from_hf(v: dict[str, Any]) -> dict[str, Any]:
    if v.get("hidden_act", "quick_gelu") != "quick_gelu":
        raise UsageError(f"a CLIP vision tower with hidden_act={v['hidden_act']!r} (quick_gelu only)")
    return dict(image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 32),
                num_channels=v.get("num_channels", 3), vision_hidden_size=v.get("hidden_size", 768),
                vision_num_layers=v.get("num_hidden_layers", 12), vision_num_heads=v.get("num_attention_heads", 12),
                vision_ffn_hidden_size=v.get("intermediate_size", 3072), vision_norm_eps=v.get("layer_norm_eps", 1e-5))


def clip_to_hf(cfg: CLIPConfig) -> dict[str, Any]:
    if cfg.eos_token_id == 2:
        raise UsageError("model.eos_token_id=2: transformers' CLIP reads that value as 'pool at the largest id'; "
                         "renumber the end token")
    text = {"model_type": "clip_text_model", "vocab_size": cfg.vocab_size, "hidden_size": cfg.text_hidden_size,
            "intermediate_size": cfg.text_ffn_hidden_size, "num_hidden_layers": cfg.text_num_layers,
            "num_attention_heads": cfg.text_num_heads, "max_position_embeddings": cfg.max_seq_length,
            "layer_norm_eps": cfg.text_norm_eps, "hidden_act": "quick_gelu", "projection_dim": cfg.projection_dim,
            "eos_token_id": 2 if cfg.eos_token_id is None else cfg.eos_token_id}
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": cfg.projection_dim,
            "logit_scale_init_value": cfg.logit_scale_init, "text_config": text,
            "vision_config": {**_vision_to_hf(cfg), "projection_dim": cfg.projection_dim}}


def clip_from_hf(hf: dict[str, Any]) -> CLIPConfig:
    t, v = hf.get("text_config") or {}, hf.get("vision_config") or {}
    if t.get("hidden_act", "quick_gelu") != "quick_gelu":
        raise UsageError(f"a CLIP text tower with hidden_act={t['hidden_act']!r} (quick_gelu only)")
    eos = t.get("eos_token_id", 2)
    return CLIPConfig(**_vision_from_hf(v), vocab_size=t.get("vocab_size", 49408),
                      max_seq_length=t.get("max_position_embeddings", 77), text_hidden_size=t.get("hidden_size", 512),
                      text_num_layers=t.get("num_hidden_layers", 12), text_num_heads=t.get("num_attention_heads", 8),
                      text_ffn_hidden_size=t.get("intermediate_size", 2048), text_norm_eps=t.get("layer_norm_eps", 1e-5),
                      eos_token_id=None if eos == 2 else eos, projection_dim=hf.get("projection_dim", 512),
                      logit_scale_init=hf.get("logit_scale_init_value", 2.6592))


def llava_to_hf(cfg: LlavaConfig) -> dict[str, Any]:
    text = gpt_convert.to_hf_config(dataclasses.replace(cfg, layer_spec="llama"))  # (its language model's)
    text.pop("architectures")
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "image_token_index": cfg.image_token_id, "projector_hidden_act": "gelu",
            "multimodal_projector_bias": cfg.projector_bias, "vision_feature_layer": cfg.vision_feature_layer,
            "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
            "image_seq_length": cfg.image_features, "tie_word_embeddings": cfg.tie_embeddings,
            "text_config": text, "vision_config": _vision_to_hf(cfg)}


def llava_from_hf(hf: dict[str, Any]) -> LlavaConfig:
    text = dict(hf.get("text_config") or {})
    if text.get("model_type", "llama") != "llama":
        raise UsageError(f"LLaVA with a {text.get('model_type')!r} language model: zoo converts LLaMA ones")
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise UsageError(f"projector_hidden_act={hf['projector_hidden_act']!r}: zoo's projector is GELU")
    text.setdefault("model_type", "llama")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    lm = gpt_convert.from_hf_config(text)
    fields = {k: v for k, v in vars(lm).items() if k != "layer_spec"}
    return LlavaConfig(**fields, **_vision_from_hf(hf.get("vision_config") or {}),
                       vision_feature_layer=hf.get("vision_feature_layer", -2),
                       vision_feature_select_strategy=hf.get("vision_feature_select_strategy", "default"),
                       projector_bias=hf.get("multimodal_projector_bias", True),
                       image_token_id=hf.get("image_token_index", hf.get("image_token_id", 32000)))


HF_CLIP = ExternalFormat(name="hf", architectures={"CLIPModel": "clip"}, table=clip_table, to_config=clip_to_hf,
                         from_config=clip_from_hf)
HF_LLAVA = ExternalFormat(name="hf", architectures={"LlavaForConditionalGeneration": "llava"}, table=llava_table,
                          to_config=llava_to_hf, from_config=llava_from_hf, import_table=llava_import_table)
