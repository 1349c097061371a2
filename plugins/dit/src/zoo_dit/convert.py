"""The image DiT's weights in two other layouts, converted both ways with strict coverage:

- ``reference``: facebookresearch/DiT's ``models.py`` state dict (``x_embedder.proj`` a conv,
  ``t_embedder.mlp``, ``y_embedder.embedding_table``, ``blocks.N.attn.qkv`` as ``[q; k; v]``,
  ``blocks.N.adaLN_modulation.1``, ``final_layer``, the fixed ``pos_embed`` buffer);
- ``diffusers``: ``DiTTransformer2DModel`` (``pos_embed.proj``, per block a *copy* of the shared
  timestep/class embedder under ``norm1.emb``, ``attn1.to_q/k/v/out.0``, ``ff.net.0.proj/2``,
  ``proj_out_1/2``). Importing refuses copies that differ (they would be a different model).

Every key of the source must be consumed and every key of the target written, or the
conversion fails naming the keys. Only the layout changes: values are copied exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from zoo.checkpoint.mapping import MappingError
from zoo_dit.model import position_embedding
from zoo_dit.plugin import DiTConfig

State = dict[str, torch.Tensor]


def _check(cfg: DiTConfig, fmt: str) -> None:
    if cfg.layer_spec != "dit" or cfg.adaln_lora_rank or cfg.patch_t != 1:
        raise MappingError(f"the {fmt} layout holds the image DiT (layer_spec 'dit', full-rank adaLN), not "
                           f"{cfg.layer_spec!r}")
    if not cfg.num_classes:
        raise MappingError(f"the {fmt} layout is class-conditional: model.num_classes must be > 0")


class _Taken(dict):
    """A source dict that records what was read, so leftovers can be reported."""

    def __init__(self, src: Mapping[str, torch.Tensor], what: str) -> None:
        super().__init__(src)
        self.what, self.used = what, set()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self:
            raise MappingError(f"{self.what}: missing {key}")
        self.used.add(key)
        return super().__getitem__(key)

    def finish(self, ignore: Callable[[str], bool] = lambda k: False) -> None:
        extra = sorted(k for k in self if k not in self.used and not ignore(k))
        if extra:
            raise MappingError(f"{self.what}: unexpected keys {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))


def _qkv_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Separate q, k, v (rows) -> ours, per head ``[q_h; k_h; v_h]``."""
    parts = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return parts.reshape(-1, *q.shape[1:])


def _qkv_out(fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = fused.reshape(heads, 3, -1, *fused.shape[1:])
    return tuple(parts[:, j].reshape(-1, *fused.shape[1:]).contiguous() for j in range(3))  # type: ignore[return-value]


def _patch_in(conv: torch.Tensor) -> torch.Tensor:
    """Conv weight (D, C, ph, pw) -> our linear (D, ph*pw*C)."""
    return conv.permute(0, 2, 3, 1).reshape(conv.shape[0], -1)


def _patch_out(lin: torch.Tensor, cfg: DiTConfig) -> torch.Tensor:
    p = cfg.patch_size
    return lin.reshape(lin.shape[0], p, p, cfg.in_channels).permute(0, 3, 1, 2).contiguous()


# Per block: (ours, reference, diffusers) names of the tensors that only move.
_BLOCK = (
    ("attn.proj", "attn.proj", "attn1.to_out.0"),
    ("mlp.fc", "mlp.fc1", "ff.net.0.proj"),
    ("mlp.proj", "mlp.fc2", "ff.net.2"),
    ("ada.1", "adaLN_modulation.1", "norm1.linear"),
)


def from_reference(theirs: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    _check(cfg, "reference DiT")
    src = _Taken(theirs, "reference DiT state dict")
    h = cfg.num_heads
    out: State = {"x_embed.weight": _patch_in(src["x_embedder.proj.weight"]), "x_embed.bias": src["x_embedder.proj.bias"],
                  "t_embed.fc1.weight": src["t_embedder.mlp.0.weight"], "t_embed.fc1.bias": src["t_embedder.mlp.0.bias"],
                  "t_embed.fc2.weight": src["t_embedder.mlp.2.weight"], "t_embed.fc2.bias": src["t_embedder.mlp.2.bias"],
                  "y_embed.weight": src["y_embedder.embedding_table.weight"],
                  "final.ada.1.weight": src["final_layer.adaLN_modulation.1.weight"],
                  "final.ada.1.bias": src["final_layer.adaLN_modulation.1.bias"],
                  "final.proj.weight": src["final_layer.linear.weight"], "final.proj.bias": src["final_layer.linear.bias"]}
    if out["final.proj.weight"].shape[0] != cfg.token_features:
        raise MappingError(f"reference DiT: final_layer.linear has {out['final.proj.weight'].shape[0]} outputs, the "
                           f"model {cfg.token_features} (a learn_sigma checkpoint predicts a variance too; EDM does not)")
    for i in range(cfg.num_layers):
        b = f"blocks.{i}."
        w, bias = src[b + "attn.qkv.weight"], src[b + "attn.qkv.bias"]
        out[f"layers.{i}.attn.qkv.weight"] = _qkv_in(*w.chunk(3), h)
        out[f"layers.{i}.attn.qkv.bias"] = _qkv_in(*bias.chunk(3), h)
        for ours, ref, _ in _BLOCK:
            for s in ("weight", "bias"):
                out[f"layers.{i}.{ours}.{s}"] = src[f"{b}{ref}.{s}"]
    if "pos_embed" in src:  # a fixed buffer: it must be the sin-cos table the model computes
        pe = src["pos_embed"]
        want = _pos_table(cfg).to(pe.dtype)
        if pe.reshape(want.shape).sub(want).abs().max() > 1e-4:
            raise MappingError("reference DiT: pos_embed is not the 2-D sin-cos table for the config's sample_size")
    src.finish()
    return out


def to_reference(ours: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    _check(cfg, "reference DiT")
    src = _Taken(ours, "zoo DiT state dict")
    h = cfg.num_heads
    out: State = {"x_embedder.proj.weight": _patch_out(src["x_embed.weight"], cfg), "x_embedder.proj.bias": src["x_embed.bias"],
                  "pos_embed": _pos_table(cfg)[None],
                  "t_embedder.mlp.0.weight": src["t_embed.fc1.weight"], "t_embedder.mlp.0.bias": src["t_embed.fc1.bias"],
                  "t_embedder.mlp.2.weight": src["t_embed.fc2.weight"], "t_embedder.mlp.2.bias": src["t_embed.fc2.bias"],
                  "y_embedder.embedding_table.weight": src["y_embed.weight"],
                  "final_layer.adaLN_modulation.1.weight": src["final.ada.1.weight"],
                  "final_layer.adaLN_modulation.1.bias": src["final.ada.1.bias"],
                  "final_layer.linear.weight": src["final.proj.weight"], "final_layer.linear.bias": src["final.proj.bias"]}
    for i in range(cfg.num_layers):
        b = f"blocks.{i}."
        out[b + "attn.qkv.weight"] = torch.cat(_qkv_out(src[f"layers.{i}.attn.qkv.weight"], h))
        out[b + "attn.qkv.bias"] = torch.cat(_qkv_out(src[f"layers.{i}.attn.qkv.bias"], h))
        for ours_name, ref, _ in _BLOCK:
            for s in ("weight", "bias"):
                out[f"{b}{ref}.{s}"] = src[f"layers.{i}.{ours_name}.{s}"]
    src.finish()
    return out


def _pos_table(cfg: DiTConfig) -> torch.Tensor:
    g = cfg.sample_size // cfg.patch_size
    hh, ww = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    pos = torch.stack([torch.zeros_like(hh), hh, ww], -1).reshape(-1, 3)
    return position_embedding(pos, cfg.hidden_size, "sincos_2d")


_EMB = (("t_embed.fc1", "timestep_embedder.linear_1"), ("t_embed.fc2", "timestep_embedder.linear_2"))


def from_diffusers(theirs: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    _check(cfg, "diffusers DiTTransformer2DModel")
    src = _Taken(theirs, "diffusers DiTTransformer2DModel state dict")
    h = cfg.num_heads
    out: State = {"x_embed.weight": _patch_in(src["pos_embed.proj.weight"]), "x_embed.bias": src["pos_embed.proj.bias"],
                  "final.ada.1.weight": src["proj_out_1.weight"], "final.ada.1.bias": src["proj_out_1.bias"],
                  "final.proj.weight": src["proj_out_2.weight"], "final.proj.bias": src["proj_out_2.bias"]}
    # The shared embedders are stored once per block: block 0's is ours, the others must equal it.
    shared = [(f"{o}.{s}", f"norm1.emb.{t}.{s}") for o, t in _EMB for s in ("weight", "bias")]
    shared.append(("y_embed.weight", "norm1.emb.class_embedder.embedding_table.weight"))
    for ours, theirs_name in shared:
        first = src[f"transformer_blocks.0.{theirs_name}"]
        for i in range(1, cfg.num_layers):
            if not torch.equal(src[f"transformer_blocks.{i}.{theirs_name}"], first):
                raise MappingError(f"diffusers DiT: transformer_blocks.{i}.{theirs_name} differs from block 0's copy; "
                                   "zoo's DiT has one shared embedder (this checkpoint is a different model)")
        out[ours] = first
    for i in range(cfg.num_layers):
        b = f"transformer_blocks.{i}."
        for s in ("weight", "bias"):
            out[f"layers.{i}.attn.qkv.{s}"] = _qkv_in(*(src[f"{b}attn1.to_{n}.{s}"] for n in "qkv"), h)
            for ours_name, _, diff in _BLOCK:
                out[f"layers.{i}.{ours_name}.{s}"] = src[f"{b}{diff}.{s}"]
    src.finish(ignore=lambda k: k.startswith("pos_embed.pos_embed"))  # diffusers' fixed table (a buffer)
    return out


def to_diffusers(ours: Mapping[str, torch.Tensor], cfg: DiTConfig) -> State:
    _check(cfg, "diffusers DiTTransformer2DModel")
    src = _Taken(ours, "zoo DiT state dict")
    h = cfg.num_heads
    out: State = {"pos_embed.proj.weight": _patch_out(src["x_embed.weight"], cfg), "pos_embed.proj.bias": src["x_embed.bias"],
                  "proj_out_1.weight": src["final.ada.1.weight"], "proj_out_1.bias": src["final.ada.1.bias"],
                  "proj_out_2.weight": src["final.proj.weight"], "proj_out_2.bias": src["final.proj.bias"]}
    for i in range(cfg.num_layers):
        b = f"transformer_blocks.{i}."
        for o, t in _EMB:
            for s in ("weight", "bias"):
                out[f"{b}norm1.emb.{t}.{s}"] = src[f"{o}.{s}"]
        out[f"{b}norm1.emb.class_embedder.embedding_table.weight"] = src["y_embed.weight"]
        for s in ("weight", "bias"):
            q, k, v = _qkv_out(src[f"layers.{i}.attn.qkv.{s}"], h)
            out[f"{b}attn1.to_q.{s}"], out[f"{b}attn1.to_k.{s}"], out[f"{b}attn1.to_v.{s}"] = q, k, v
            for ours_name, _, diff in _BLOCK:
                out[f"{b}{diff}.{s}"] = src[f"layers.{i}.{ours_name}.{s}"]
    src.finish()
    return out


def diffusers_config(cfg: DiTConfig) -> dict[str, Any]:
    """``DiTTransformer2DModel`` keyword arguments for ``cfg``; refuses a model it would compute differently."""
    _check(cfg, "diffusers DiTTransformer2DModel")
    if cfg.time_freq_shift != 1 or cfg.norm_eps != 1e-6 or cfg.mlp_ratio != 4:
        raise MappingError("diffusers' DiT embeds timesteps with downscale_freq_shift=1, uses eps 1e-6 before "
                           "attention and an MLP ratio of 4: this model has time_freq_shift="
                           f"{cfg.time_freq_shift}, norm_eps={cfg.norm_eps}, mlp_ratio={cfg.mlp_ratio} and would "
                           "compute something else there (train with model.time_freq_shift=1 to export)")
    return {"num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim, "in_channels": cfg.in_channels,
            "out_channels": cfg.in_channels, "num_layers": cfg.num_layers, "sample_size": cfg.sample_size,
            "patch_size": cfg.patch_size, "num_embeds_ada_norm": cfg.num_classes,
            "norm_eps": cfg.mlp_norm_eps or cfg.norm_eps, "activation_fn": "gelu-approximate", "attention_bias": True}


def config_from_diffusers(d: Mapping[str, Any]) -> DiTConfig:
    out_ch = d.get("out_channels") or d.get("in_channels", 4)
    if out_ch != d.get("in_channels", 4):
        raise MappingError(f"diffusers DiT with out_channels={out_ch} != in_channels={d.get('in_channels', 4)} "
                           "(a learn_sigma model): EDM predicts the sample only")
    if d.get("activation_fn", "gelu-approximate") != "gelu-approximate" or not d.get("attention_bias", True):
        raise MappingError("diffusers DiT: only activation_fn='gelu-approximate' with attention biases is DiT")
    heads, hd = d.get("num_attention_heads", 16), d.get("attention_head_dim", 72)
    return DiTConfig(in_channels=d.get("in_channels", 4), patch_size=d.get("patch_size", 2), hidden_size=heads * hd,
                     num_layers=d.get("num_layers", 28), num_heads=heads, sample_size=d.get("sample_size", 32),
                     num_classes=d.get("num_embeds_ada_norm", 1000), time_freq_shift=1.0,
                     mlp_norm_eps=d.get("norm_eps", 1e-5))


__all__ = ["config_from_diffusers", "diffusers_config", "from_diffusers", "from_reference", "to_diffusers",
           "to_reference"]
