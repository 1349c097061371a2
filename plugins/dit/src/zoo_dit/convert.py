"""The image DiT's weights in two other layouts, as key mapping tables (`zoo.checkpoint.mapping`),
converted both ways with strict coverage:

- ``reference``: facebookresearch/DiT's ``models.py`` state dict (``x_embedder.proj`` a conv,
  ``t_embedder.mlp``, ``y_embedder.embedding_table``, ``blocks.N.attn.qkv`` as ``[q; k; v]``,
  ``blocks.N.adaLN_modulation.1``, ``final_layer``, the fixed ``pos_embed`` buffer);
- ``diffusers``: ``DiTTransformer2DModel`` (``pos_embed.proj``, per block a *copy* of the shared
  timestep/class embedder under ``norm1.emb``, ``attn1.to_q/k/v/out.0``, ``ff.net.0.proj/2``,
  ``proj_out_1/2``), also a `zoo convert --from/--to diffusers` format. Importing refuses copies
  that differ (they would be a different model).

Every key of the source must be consumed and every key of the target written, or the
conversion fails naming the keys. Only the layout changes: values are copied exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.external import ExternalFormat
from zoo.checkpoint.fields import FieldTable
from zoo.checkpoint.files import FileFormat
from zoo.checkpoint.mapping import (
    Fuse,
    Ignore,
    MappingError,
    MappingTable,
    Patch,
    Rename,
    Replicate,
    from_external,
    to_external,
)
from zoo_dit.model import position_embedding
from zoo_dit.plugin import DiTConfig

State = dict[str, torch.Tensor]


def _check(cfg: DiTConfig, fmt: str) -> None:
    if cfg.layer_spec != "dit" or cfg.adaln_lora_rank or cfg.patch_t != 1:
        raise MappingError(f"the {fmt} layout holds the image DiT (layer_spec 'dit', full-rank adaLN), not "
                           f"{cfg.layer_spec!r}")
    if not cfg.num_classes:
        raise MappingError(f"the {fmt} layout is class-conditional: model.num_classes must be > 0")


def _wb(ours: str, theirs: str) -> list[Rename]:
    return [Rename(f"{ours}.{s}", f"{theirs}.{s}") for s in ("weight", "bias")]


# Per block: (ours, reference, diffusers) names of the tensors that only move.
_BLOCK = (
    ("attn.proj", "attn.proj", "attn1.to_out.0"),
    ("mlp.fc", "mlp.fc1", "ff.net.0.proj"),
    ("mlp.proj", "mlp.fc2", "ff.net.2"),
    ("ada.1", "adaLN_modulation.1", "norm1.linear"),
)


def reference_table(cfg: DiTConfig) -> MappingTable:
    _check(cfg, "reference DiT")
    rules: list[Any] = [Patch("x_embed.weight", "x_embedder.proj.weight"), Rename("x_embed.bias", "x_embedder.proj.bias"),
                        *_wb("t_embed.fc1", "t_embedder.mlp.0"), *_wb("t_embed.fc2", "t_embedder.mlp.2"),
                        Rename("y_embed.weight", "y_embedder.embedding_table.weight"),
                        *_wb("final.ada.1", "final_layer.adaLN_modulation.1"), *_wb("final.proj", "final_layer.linear"),
                        Ignore("pos_embed")]  # a fixed buffer, checked by `from_reference`
    for s in ("weight", "bias"):  # [q; k; v] there, per head [q_h; k_h; v_h] here
        rules.append(Fuse(f"layers.{{i}}.attn.qkv.{s}", (f"blocks.{{i}}.attn.qkv.{s}",), split=3, groups="num_heads"))
    for ours, ref, _ in _BLOCK:
        rules += _wb(f"layers.{{i}}.{ours}", f"blocks.{{i}}.{ref}")
    return MappingTable(rules=tuple(rules))


def diffusers_table(cfg: DiTConfig) -> MappingTable:
    _check(cfg, "diffusers DiTTransformer2DModel")
    emb = "transformer_blocks.{i}.norm1.emb"
    rules: list[Any] = [Patch("x_embed.weight", "pos_embed.proj.weight"), Rename("x_embed.bias", "pos_embed.proj.bias"),
                        *_wb("final.ada.1", "proj_out_1"), *_wb("final.proj", "proj_out_2"),
                        Replicate("y_embed.weight", f"{emb}.class_embedder.embedding_table.weight"),
                        Ignore(r"pos_embed\.pos_embed")]  # diffusers' fixed sin-cos table (a buffer)
    for ours, theirs in (("t_embed.fc1", "linear_1"), ("t_embed.fc2", "linear_2")):
        rules += [Replicate(f"{ours}.{s}", f"{emb}.timestep_embedder.{theirs}.{s}") for s in ("weight", "bias")]
    for s in ("weight", "bias"):
        rules.append(Fuse(f"layers.{{i}}.attn.qkv.{s}",
                          tuple(f"transformer_blocks.{{i}}.attn1.to_{n}.{s}" for n in "qkv"), groups="num_heads"))
    for ours, _, diff in _BLOCK:
        rules += _wb(f"layers.{{i}}.{ours}", f"transformer_blocks.{{i}}.{diff}")
    return MappingTable(rules=tuple(rules))


def from_reference(theirs: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    out = theirs.get("final_layer.linear.weight")
    if out is not None and out.shape[0] != cfg.out_features:
        hint = ("a learn_sigma checkpoint predicts a variance too: model.objective=vp model.learn_sigma=true"
                if out.shape[0] == 2 * cfg.token_features else "the config's in_channels and patch_size decide it")
        raise MappingError(f"reference DiT: final_layer.linear has {out.shape[0]} outputs, the model "
                           f"{cfg.out_features} ({hint})")
    if "pos_embed" in theirs:  # a fixed buffer: it must be the sin-cos table the model computes
        pe = theirs["pos_embed"]
        want = _pos_table(cfg).to(pe.dtype)
        if pe.numel() != want.numel() or pe.reshape(want.shape).sub(want).abs().max() > 1e-4:
            raise MappingError("reference DiT: pos_embed is not the 2-D sin-cos table for the config's sample_size")
    return from_external(reference_table(cfg), theirs, cfg)


def to_reference(ours: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    return {**to_external(reference_table(cfg), ours, cfg), "pos_embed": _pos_table(cfg)[None]}


def _pos_table(cfg: DiTConfig) -> torch.Tensor:
    g = cfg.sample_size // cfg.patch_size
    hh, ww = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    pos = torch.stack([torch.zeros_like(hh), hh, ww], -1).reshape(-1, 3)
    return position_embedding(pos, cfg.hidden_size, "sincos_2d")


def from_diffusers(theirs: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    return from_external(diffusers_table(cfg), theirs, cfg)


def to_diffusers(ours: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    return to_external(diffusers_table(cfg), ours, cfg)


def diffusers_config(cfg: DiTConfig) -> dict[str, Any]:
    """``DiTTransformer2DModel`` keyword arguments for ``cfg``; refuses a model it would compute differently."""
    _check(cfg, "diffusers DiTTransformer2DModel")
    if cfg.time_freq_shift != 1 or cfg.norm_eps != 1e-6 or cfg.mlp_ratio != 4:
        raise MappingError("diffusers' DiT embeds timesteps with downscale_freq_shift=1, uses eps 1e-6 before "
                           "attention and an MLP ratio of 4: this model has time_freq_shift="
                           f"{cfg.time_freq_shift}, norm_eps={cfg.norm_eps}, mlp_ratio={cfg.mlp_ratio} and would "
                           "compute something else there (train with model.time_freq_shift=1 to export)")
    return {"num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim, "in_channels": cfg.in_channels,
            "out_channels": cfg.in_channels * (2 if cfg.learn_sigma else 1), "num_layers": cfg.num_layers, "sample_size": cfg.sample_size,
            "patch_size": cfg.patch_size, "num_embeds_ada_norm": cfg.num_classes,
            "norm_eps": cfg.mlp_norm_eps or cfg.norm_eps, "activation_fn": "gelu-approximate", "attention_bias": True}


def config_from_diffusers(d: Mapping[str, Any]) -> DiTConfig:
    """zoo's config for diffusers' ``DiTTransformer2DModel`` config (its ``config``, every default
    filled in, or a document diffusers fills in); the fixed fields were checked against `FIELDS`."""
    from diffusers.configuration_utils import FrozenDict

    from zoo.checkpoint.external import diffusers_config_of

    if not isinstance(d, FrozenDict):  # (a document: diffusers fills in its defaults)
        d = diffusers_config_of("DiTTransformer2DModel", {"_class_name": "DiTTransformer2DModel", **d})
    out_ch = d["out_channels"] or d["in_channels"]
    if out_ch not in (d["in_channels"], 2 * d["in_channels"]):
        raise MappingError(f"diffusers DiT with out_channels={out_ch}: the DiT predicts epsilon "
                           f"(in_channels={d['in_channels']}) and with learn_sigma its variance too "
                           f"({2 * d['in_channels']})")
    heads, hd = d["num_attention_heads"], d["attention_head_dim"]
    # diffusers' DiT is the original's, sampled by DiTPipeline with its discrete VP schedulers:
    # imported with that objective (and the variance channels, where it has them).
    return DiTConfig(in_channels=d["in_channels"], patch_size=d["patch_size"], hidden_size=heads * hd,
                     num_layers=d["num_layers"], num_heads=heads, sample_size=d["sample_size"],
                     num_classes=d["num_embeds_ada_norm"], time_freq_shift=1.0, mlp_norm_eps=d["norm_eps"],
                     objective="vp", learn_sigma=out_ch == 2 * d["in_channels"])


# The scheduler fields zoo's VP diffusion reads, and the values it computes with for the rest (a
# scheduler that trained or samples otherwise is refused, naming the field).
_SCHEDULER_FIXED = {"beta_schedule": ("linear",), "prediction_type": ("epsilon",), "trained_betas": (None,),
                    "rescale_betas_zero_snr": (False,), "thresholding": (False,)}


def config_from_pipeline(cfg: DiTConfig, root: Path) -> DiTConfig:
    """A diffusers DiT pipeline's model, completed from its other components: the scheduler's
    training noise schedule (``scheduler/scheduler_config.json``, read by its own class) and the
    VAE its latents decode through (``vae/``, kept where it is: ``model.vae``)."""
    import dataclasses

    from zoo.checkpoint.external import diffusers_config_of
    from zoo.checkpoint.tensorio import read_json

    changes: dict[str, Any] = {}
    sched_file = root / "scheduler" / "scheduler_config.json"
    if sched_file.is_file():
        name = read_json(sched_file).get("_class_name")
        import diffusers

        if not isinstance(name, str) or not hasattr(diffusers, name):
            raise MappingError(f"{sched_file}: _class_name={name!r} is not a diffusers scheduler")
        sched = diffusers_config_of(name, read_json(sched_file), what=str(sched_file))
        for key, allowed in _SCHEDULER_FIXED.items():
            if key in sched and sched[key] not in allowed:
                raise MappingError(f"{sched_file}: {key}={sched[key]!r}: zoo's VP diffusion computes with "
                                   f"{' or '.join(map(repr, allowed))}")
        changes.update(num_timesteps=int(sched["num_train_timesteps"]), beta_start=float(sched["beta_start"]),
                       beta_end=float(sched["beta_end"]))
    if (root / "vae" / "config.json").is_file():
        changes["vae"] = str((root / "vae").resolve())
    return dataclasses.replace(cfg, **changes)


def reference_config(theirs: Mapping[str, torch.Tensor]) -> DiTConfig:
    """The config a facebookresearch DiT state dict describes: its sizes from the tensors' shapes
    (the heads from the paper's S/B/L/XL sizes: a file does not hold them), learn_sigma when the
    final layer predicts twice the channels, and the original's diffusion (VP, 1000 linear steps,
    Peebles & Xie's timestep frequencies)."""
    from zoo_dit.plugin import SIZES

    def shape(key: str) -> tuple[int, ...]:
        if key not in theirs:
            raise MappingError(f"no {key}: not a facebookresearch DiT state dict")
        return tuple(theirs[key].shape)

    hidden, channels, patch, _ = shape("x_embedder.proj.weight")
    layers = sum(1 for k in theirs if k.startswith("blocks.") and k.endswith(".attn.qkv.weight"))
    heads = {(n, d): h for n, d, h in SIZES.values()}.get((layers, hidden))
    if heads is None:
        known = ", ".join(f"{k} ({n} layers of {d})" for k, (n, d, _) in SIZES.items())
        raise MappingError(f"{layers} layers of width {hidden}: the file does not hold the number of heads, and this "
                           f"is none of DiT's sizes ({known})")
    tokens = shape("pos_embed")[-2]
    grid = round(tokens**0.5)
    if grid * grid != tokens:
        raise MappingError(f"pos_embed has {tokens} positions: not a square grid")
    out = shape("final_layer.linear.weight")[0]
    cell = patch * patch * channels
    if out not in (cell, 2 * cell):
        raise MappingError(f"final_layer.linear has {out} outputs: {cell} (epsilon) or {2 * cell} (with learn_sigma)")
    rows = shape("y_embedder.embedding_table.weight")[0]  # (the classes and the null class of guidance)
    return DiTConfig(in_channels=channels, patch_size=patch, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     sample_size=grid * patch, num_classes=rows - 1,
                     mlp_ratio=shape("blocks.0.mlp.fc1.weight")[0] / hidden, objective="vp",
                     learn_sigma=out == 2 * cell)


def _reference_read(theirs: Mapping[str, torch.Tensor]) -> tuple[DiTConfig, State]:
    cfg = reference_config(theirs)
    return cfg, from_reference(theirs, cfg)


def _config_object(cfg: DiTConfig) -> Any:
    """diffusers' own ``DiTTransformer2DModel`` for ``cfg``, built on the meta device (no memory),
    whose ``save_config`` writes the file diffusers writes."""
    import diffusers

    with torch.device("meta"):
        return diffusers.DiTTransformer2DModel(**diffusers_config(cfg))


# Every field of DiTTransformer2DModel's config (see zoo.checkpoint.fields).
FIELDS = {"DiTTransformer2DModel": FieldTable(
    config_class="DiTTransformer2DModel",
    mapped=("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers", "sample_size",
            "patch_size", "num_embeds_ada_norm", "norm_eps"),
    # (dropout: none at sampling, and zoo trains DiT without it; upcast_attention: the same product in
    # float32; norm_num_groups: read by no layer of the ada_norm_zero DiT)
    inert=("dropout", "upcast_attention", "norm_num_groups"),
    fixed={"attention_bias": (True,), "activation_fn": ("gelu-approximate",), "norm_type": ("ada_norm_zero",),
           "norm_elementwise_affine": (False,)})}


# `zoo convert --to diffusers RUN DIR` / `--from diffusers DIR OUT`: a directory diffusers'
# `DiTTransformer2DModel.from_pretrained` reads (config.json + diffusion_pytorch_model.safetensors).
DIFFUSERS = ExternalFormat(name="diffusers", architectures={"DiTTransformer2DModel": "dit"}, table=diffusers_table,
                           to_config=_config_object, from_config=config_from_diffusers,
                           stem="diffusion_pytorch_model", fields=FIELDS, from_pipeline=config_from_pipeline)

# `zoo convert --from facebook-dit DiT-XL-2-256x256.pt DIR` / `--to facebook-dit RUN FILE.pt`: the state
# dict facebookresearch/DiT's `models.py` holds (its released checkpoints are such files).
REFERENCE = FileFormat(read=_reference_read, write=lambda cfg, state: to_reference(state, cfg))

__all__ = ["DIFFUSERS", "REFERENCE", "reference_config", "FIELDS", "config_from_diffusers", "diffusers_config", "diffusers_table", "from_diffusers",
           "from_reference", "reference_table", "to_diffusers", "to_reference"]
