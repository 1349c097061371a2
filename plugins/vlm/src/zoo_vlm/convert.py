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
from zoo.checkpoint.fields import FieldTable
from zoo.checkpoint.hf import library_config, make_config
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
    return {"hidden_size": cfg.vision_hidden_size, "intermediate_size": cfg.vision_ffn_hidden_size,
            "num_hidden_layers": cfg.vision_num_layers, "num_attention_heads": cfg.vision_num_heads,
            "image_size": cfg.image_size, "patch_size": cfg.patch_size, "num_channels": cfg.num_channels,
            "layer_norm_eps": cfg.vision_norm_eps, "hidden_act": "quick_gelu", "attention_dropout": 0.0}


def _vision_from_hf(v: dict[str, Any]) -> dict[str, Any]:
    return dict(image_size=v["image_size"], patch_size=v["patch_size"], num_channels=v["num_channels"],
                vision_hidden_size=v["hidden_size"], vision_num_layers=v["num_hidden_layers"],
                vision_num_heads=v["num_attention_heads"], vision_ffn_hidden_size=v["intermediate_size"],
                vision_norm_eps=v["layer_norm_eps"])


def clip_to_hf(cfg: CLIPConfig) -> Any:
    """transformers' ``CLIPConfig`` for ``cfg``."""
    if cfg.eos_token_id == 2:
        raise UsageError("model.eos_token_id=2: transformers' CLIP reads that value as 'pool at the largest id'; "
                         "renumber the end token")
    text = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.text_hidden_size,
            "intermediate_size": cfg.text_ffn_hidden_size, "num_hidden_layers": cfg.text_num_layers,
            "num_attention_heads": cfg.text_num_heads, "max_position_embeddings": cfg.max_seq_length,
            "layer_norm_eps": cfg.text_norm_eps, "hidden_act": "quick_gelu", "projection_dim": cfg.projection_dim,
            "eos_token_id": 2 if cfg.eos_token_id is None else cfg.eos_token_id, "attention_dropout": 0.0}
    return make_config("clip", architectures=["CLIPModel"], projection_dim=cfg.projection_dim,
                       logit_scale_init_value=cfg.logit_scale_init, text_config=text,
                       vision_config={**_vision_to_hf(cfg), "projection_dim": cfg.projection_dim})


def clip_from_hf(config: Any) -> CLIPConfig:
    """zoo's config for transformers' ``CLIPConfig`` (or a document transformers turns into one)."""
    hf = library_config(config).to_dict()
    t, v = hf["text_config"], hf["vision_config"]
    eos = t["eos_token_id"]
    return CLIPConfig(**_vision_from_hf(v), vocab_size=t["vocab_size"], max_seq_length=t["max_position_embeddings"],
                      text_hidden_size=t["hidden_size"], text_num_layers=t["num_hidden_layers"],
                      text_num_heads=t["num_attention_heads"], text_ffn_hidden_size=t["intermediate_size"],
                      text_norm_eps=t["layer_norm_eps"], eos_token_id=None if eos == 2 else eos,
                      projection_dim=hf["projection_dim"], logit_scale_init=hf["logit_scale_init_value"])


def llava_to_hf(cfg: LlavaConfig) -> Any:
    """transformers' ``LlavaConfig`` for ``cfg`` (its language model LLaMA's, `zoo_gpt.convert`)."""
    text = gpt_convert.to_hf_config(dataclasses.replace(cfg, layer_spec="llama")).to_dict()  # (its language model's)
    text.pop("architectures", None)
    return make_config("llava", architectures=["LlavaForConditionalGeneration"], image_token_index=cfg.image_token_id,
                       projector_hidden_act="gelu", multimodal_projector_bias=cfg.projector_bias,
                       vision_feature_layer=cfg.vision_feature_layer,
                       vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                       image_seq_length=cfg.image_features, tie_word_embeddings=cfg.tie_embeddings,
                       text_config=text, vision_config={"model_type": "clip_vision_model", **_vision_to_hf(cfg)})


def llava_from_hf(config: Any) -> LlavaConfig:
    """zoo's config for transformers' ``LlavaConfig`` (or a document transformers turns into one)."""
    config = library_config(config)
    hf = config.to_dict()
    text = hf["text_config"]
    if text.get("model_type") != "llama":
        raise UsageError(f"LLaVA with a {text.get('model_type')!r} language model: zoo converts LLaMA ones")
    # (the image-text model's own flag ties its head, as transformers builds it)
    lm = gpt_convert.from_hf_config({**text, "tie_word_embeddings": hf["tie_word_embeddings"]})
    if lm.layer_spec != "llama":  # (llama_attn_bias: q/k/v/o biases)
        raise UsageError("LLaVA's text_config: LlamaConfig.attention_bias=True changes the computation and zoo's LLaVA "
                         "language model has no attention biases")
    fields = {k: v for k, v in vars(lm).items() if k != "layer_spec"}
    return LlavaConfig(**fields, **_vision_from_hf(hf["vision_config"]),
                       vision_feature_layer=hf["vision_feature_layer"],
                       vision_feature_select_strategy=hf["vision_feature_select_strategy"],
                       projector_bias=hf["multimodal_projector_bias"], image_token_id=hf["image_token_index"])


# Every field of each config class (see zoo.checkpoint.fields). CLIP's per-tower projection_dim is
# read by the single-tower "with projection" models only; CLIPModel projects by the top-level one.
_INIT = ("initializer_range", "initializer_factor", "attention_dropout")
_TOWER = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "layer_norm_eps")
FIELDS = {t.config_class: t for t in (
    FieldTable(config_class="CLIPConfig", mapped=("text_config", "vision_config", "projection_dim",
                                                  "logit_scale_init_value"), inert=("initializer_factor",)),
    FieldTable(config_class="CLIPTextConfig", mapped=(*_TOWER, "vocab_size", "max_position_embeddings", "eos_token_id"),
               inert=(*_INIT, "projection_dim", "pad_token_id", "bos_token_id"), fixed={"hidden_act": ("quick_gelu",)}),
    FieldTable(config_class="CLIPVisionConfig", mapped=(*_TOWER, "num_channels", "image_size", "patch_size"),
               inert=(*_INIT, "projection_dim"), fixed={"hidden_act": ("quick_gelu",)}),
    FieldTable(config_class="LlavaConfig",
               mapped=("vision_config", "text_config", "image_token_index", "vision_feature_select_strategy",
                       "vision_feature_layer", "multimodal_projector_bias", "tie_word_embeddings"),
               inert=("image_seq_length",),  # (the processor's count of image tokens; the model counts its own)
               fixed={"projector_hidden_act": ("gelu",)}),
    gpt_convert.FIELDS["LlamaConfig"],
)}


HF_CLIP = ExternalFormat(name="hf", architectures={"CLIPModel": "clip"}, table=clip_table, to_config=clip_to_hf,
                         from_config=clip_from_hf, fields=FIELDS)
HF_LLAVA = ExternalFormat(name="hf", architectures={"LlavaForConditionalGeneration": "llava"}, table=llava_table,
                          to_config=llava_to_hf, from_config=llava_from_hf, import_table=llava_import_table,
                          fields=FIELDS)
