"""DiT (Peebles & Xie 2023) for images and, with the video spec, NeMo DFM's text-to-video variant.

The network works on token sequences, so one forward serves a batch of equal-size images and a
pack of variable-size images or videos alike. Shapes: B rows, S tokens per row, N samples per row
(1 without packing), F features per token (``pt * ph * pw * C``, in that order of the token's
``(T, H, W)`` cell), D hidden, L text tokens, Dt text width.

- Tokens carry their ``(t, h, w)`` grid position; the fixed sin-cos embedding is computed for those
  positions (no table that can alias or overflow).
- ``segment_ids`` (B, S) says which sample of the row a token belongs to (-1: padding); attention
  stays inside a sample, and each sample is conditioned on its own noise level, class or text.
- Conditioning is one vector per sample, ``c = t_embed(noise_level) + y_embed(label)``; every block
  regresses its shift/scale/gate chunks from it (adaLN-Zero: the chunk layers start at zero).

The q|k|v projection is laid out per head (``[q_h; k_h; v_h]`` for each head h) so a contiguous
tensor-parallel split hands every rank whole heads. Parallelism, recomputation and precision are
applied from outside by the core; the EDM objective lives in `zoo_dit.diffusion`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zoo.nn import AttentionCore, RMSNorm, SequenceShard, gated_residual, modulated_layer_norm
from zoo.nn.layers import MLP
from zoo.nn.linear import Linear
from zoo.spec import AdaLNSpec, AttentionSpec, BlockSpec, MLPSpec, ModelSpec
from zoo_dit.plugin import DiTConfig


def sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """1-D sin-cos embedding ``[sin(p w_i), cos(p w_i)]``, ``w_i = 10000^(-i / (dim/2))`` (MAE/DiT)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim / 2))
    out = pos.to(torch.float64)[..., None] * omega
    return torch.cat([out.sin(), out.cos()], dim=-1).float()


def position_embedding(positions: torch.Tensor, dim: int, kind: str) -> torch.Tensor:
    """Fixed embedding of ``(t, h, w)`` positions (..., 3) -> (..., dim).

    ``sincos_2d``: ``[sincos(w), sincos(h)]``, half the width each (DiT, diffusers). ``sincos_3d``:
    ``[sincos(t) (dim/4), sincos(w), sincos(h) (3 dim/8 each)]`` (diffusers' 3-D layout, as DFM).
    """
    t, h, w = positions.unbind(-1)
    if kind == "sincos_2d":
        return torch.cat([sincos(w, dim // 2), sincos(h, dim // 2)], dim=-1)
    if kind == "sincos_3d":
        spatial = 3 * dim // 4
        return torch.cat([sincos(t, dim // 4), sincos(w, spatial // 2), sincos(h, spatial // 2)], dim=-1)
    raise ValueError(f"positions={kind!r}: DiT embeds 'sincos_2d' or 'sincos_3d' positions")


def timestep_embedding(t: torch.Tensor, dim: int = 256, freq_shift: float = 0.0) -> torch.Tensor:
    """``[cos(t f_i), sin(t f_i)]``, ``f_i = 10000^(-i / (dim/2 - freq_shift))``: shift 0 is Peebles &
    Xie's, 1 is diffusers' ``Timesteps(downscale_freq_shift=1)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - freq_shift))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def per_token(v: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """Per-sample vectors (B, N, C) -> per-token (B, S, C) (a broadcastable (B, 1, C) when N = 1)."""
    if v.shape[1] == 1 or segment_ids is None:
        return v[:, :1]
    idx = segment_ids.clamp(min=0)[..., None].expand(-1, -1, v.shape[-1])
    return v.gather(1, idx)


class Attention(nn.Module):
    """Bidirectional self-attention, or cross-attention to a context (``spec.cross``)."""

    def __init__(self, cfg: DiTConfig, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec, self.hd = spec, cfg.head_dim
        d = cfg.hidden_size
        if spec.cross:
            self.q = Linear(d, d, bias=spec.bias)
            self.kv = Linear(cfg.text_dim, 2 * d, bias=spec.bias)  # per head: [k_h; v_h]
        else:
            self.qkv = Linear(d, 3 * d, bias=spec.bias)  # per head: [q_h; k_h; v_h]
        self.q_norm = RMSNorm(self.hd, cfg.norm_eps) if spec.qk_norm is not None else None
        self.k_norm = RMSNorm(self.hd, cfg.norm_eps) if spec.qk_norm is not None else None
        self.proj = Linear(d, d, bias=spec.bias)
        self.core = AttentionCore(cross=spec.cross)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None, context: torch.Tensor | None = None,
                context_segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.spec.cross:
            assert context is not None
            q = self.q(x)
            b, s = q.shape[:2]  # (not x's: under sequence parallelism x holds a slice of the sequence)
            q = q.view(b, s, -1, self.hd)
            kv = self.kv(context).view(b, context.shape[1], -1, 2, self.hd)
            k, v = kv.unbind(3)
            kv_ids = context_segment_ids
            if segment_ids is not None and kv_ids is not None:
                # A padding token (-1) has no text of its own; let it read the first sample's rather
                # than attend to nothing (a softmax over no keys is NaN, and NaN * 0 poisons the loss).
                segment_ids = torch.where(segment_ids < 0, kv_ids[:, :1], segment_ids)
        else:
            qkv = self.qkv(x)
            b, s = qkv.shape[:2]
            q, k, v = qkv.view(b, s, -1, 3, self.hd).unbind(3)
            kv_ids = segment_ids
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before the heads move (Q/K RMSNorm, DFM)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        y = self.core(q, k, v, causal=False, segment_ids=segment_ids, kv_segment_ids=kv_ids)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """adaLN-Zero block: self-attention, [cross-attention,] MLP, each a gated, modulated residual."""

    def __init__(self, cfg: DiTConfig, spec: BlockSpec) -> None:
        super().__init__()
        assert isinstance(spec.mixer, AttentionSpec) and isinstance(spec.ffn, MLPSpec)
        assert isinstance(spec.conditioning, AdaLNSpec)
        if spec.norm.kind != "layernorm" or spec.norm.affine:
            raise ValueError("a DiT block's adaLN normalises with LayerNorm without affine weights "
                             f"(NormSpec(kind='layernorm', affine=False)), not {spec.norm}")
        d = cfg.hidden_size
        self.chunks = spec.conditioning.chunks
        # Every norm is modulated by the block's chunks: LN(x) * (1 + scale) + shift, no weights.
        self.eps, self.mlp_eps = cfg.norm_eps, cfg.mlp_norm_eps or cfg.norm_eps
        self.attn = Attention(cfg, spec.mixer)
        self.cross = Attention(cfg, spec.cross_attention) if spec.cross_attention is not None else None
        self.mlp = MLP(spec.ffn, hidden=d, ffn_hidden=cfg.ffn_hidden_size)
        if cfg.adaln_lora_rank:  # DFM's low-rank adaLN: D -> r -> chunks * D, no biases
            self.ada = nn.Sequential(nn.SiLU(), Linear(d, cfg.adaln_lora_rank, bias=False),
                                     Linear(cfg.adaln_lora_rank, self.chunks * d, bias=False))
        else:
            self.ada = nn.Sequential(nn.SiLU(), Linear(d, self.chunks * d))
        # The stream's tokens' segment ids (the core cuts them where it shards the sequence).
        self.tokens = SequenceShard()

    def forward(self, x: torch.Tensor, c: torch.Tensor, segment_ids: torch.Tensor | None,
                context: torch.Tensor | None, context_segment_ids: torch.Tensor | None) -> torch.Tensor:
        mod = per_token(self.ada(c), self.tokens(segment_ids)).chunk(self.chunks, dim=-1)
        x = gated_residual(x, mod[2], self.attn(modulated_layer_norm(x, mod[0], mod[1], self.eps), segment_ids))
        if self.cross is not None:
            x = gated_residual(x, mod[5], self.cross(modulated_layer_norm(x, mod[3], mod[4], self.eps), segment_ids,
                                                     context, context_segment_ids))
        shift, scale, gate = mod[-3:]
        return gated_residual(x, gate, self.mlp(modulated_layer_norm(x, shift, scale, self.mlp_eps)))


class FinalLayer(nn.Module):
    """adaLN (shift, scale) + linear to the token's features (DFM drops this adaLN; DiT has it)."""

    def __init__(self, cfg: DiTConfig, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.final_norm is not None and spec.final_norm.kind == "layernorm" and not spec.final_norm.affine
        d = cfg.hidden_size
        self.ada = nn.Sequential(nn.SiLU(), Linear(d, 2 * d))
        self.proj = Linear(d, cfg.out_features, bias=True)

    def forward(self, x: torch.Tensor, c: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
        shift, scale = per_token(self.ada(c), segment_ids).chunk(2, dim=-1)
        return self.proj(modulated_layer_norm(x, shift, scale, 1e-6))


class TimestepEmbedder(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.freq_shift = cfg.time_freq_shift
        self.fc1 = Linear(256, cfg.hidden_size)
        self.fc2 = Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(timestep_embedding(t, 256, self.freq_shift))))


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.cfg, self.positions = cfg, spec.positions
        block = spec.block_for(cfg.block)
        self.x_embed = Linear(cfg.token_features, cfg.hidden_size)
        self.t_embed = TimestepEmbedder(cfg)
        # One extra row: the null class that classifier-free guidance conditions on.
        self.y_embed = nn.Embedding(cfg.num_classes + 1, cfg.hidden_size) if cfg.num_classes else None
        self.layers = nn.ModuleList(Block(cfg, block) for _ in range(cfg.num_layers))
        self.final = FinalLayer(cfg, spec)
        self._init()

    def _init(self) -> None:
        # Peebles & Xie: xavier-uniform linears, N(0, 0.02) embedders, adaLN and the output zeroed
        # (so every block starts as the identity and the network predicts 0).
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.t_embed.fc1.weight, std=0.02)
        nn.init.normal_(self.t_embed.fc2.weight, std=0.02)
        if self.y_embed is not None:
            nn.init.normal_(self.y_embed.weight, std=0.02)
        for blk in self.layers:
            nn.init.zeros_(blk.ada[-1].weight)
            if blk.ada[-1].bias is not None:
                nn.init.zeros_(blk.ada[-1].bias)
        for lin in (self.final.ada[-1], self.final.proj):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None,
                noise_level: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, context: torch.Tensor | None = None,
                context_segment_ids: torch.Tensor | None = None, cond: torch.Tensor | None = None) -> Any:
        """x (B, S, F) input tokens -> the network's output (B, S, out_features): EDM's ``F``, or
        the VP diffusion's epsilon (with learn_sigma, each cell's variance channels after it).

        ``positions`` (B, S, 3) grid positions; ``noise_level`` (B, N) EDM's ``c_noise`` or the VP
        timestep; ``labels``
        (B, N) classes (``num_classes`` = the null class); ``context`` (B, L, Dt) text embeddings
        with ``context_segment_ids`` (B, L). A pipeline stage after the first receives the hidden
        state as ``x`` and the conditioning ``cond`` (B, N, D); one before the last returns both.
        """
        if self.x_embed is not None:
            assert positions is not None and noise_level is not None
            b, n = noise_level.shape
            cond = self.t_embed(noise_level.flatten()).view(b, n, -1)
            if self.y_embed is not None:
                if labels is None:
                    raise ValueError("this DiT is class-conditional: pass labels (the null class for none)")
                cond = cond + self.y_embed(labels)
            x = self.x_embed(x) + position_embedding(positions, self.cfg.hidden_size, self.positions).to(x.dtype)
        assert cond is not None
        for blk in self.layers:
            x = blk(x, cond, segment_ids, context, context_segment_ids)
        if self.final is None:  # not the last pipeline stage
            return {"hidden": x, "cond": cond}
        return self.final(x, cond, segment_ids)


def build(cfg: DiTConfig, spec: ModelSpec) -> DiT:
    return DiT(cfg, spec)


# ------------------------------------------------------------------------- patches <-> tokens


def patchify(latent: torch.Tensor, pt: int, ph: int, pw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., C, T, H, W) -> tokens (..., T/pt * H/ph * W/pw, pt*ph*pw*C) in (T, H, W) raster order,
    features ``(pt, ph, pw, C)``; and their ``(t, h, w)`` grid positions. Leading dims (a batch of
    equal-sized latents) take one copy, not one per sample."""
    *lead, c, t, h, w = latent.shape
    n = len(lead)
    x = latent.reshape(*lead, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(*range(n), n + 1, n + 3, n + 5, n + 2, n + 4, n + 6, n)
    x = x.reshape(*lead, (t // pt) * (h // ph) * (w // pw), pt * ph * pw * c)
    return x, _grid_positions(t // pt, h // ph, w // pw).clone()


@functools.lru_cache(maxsize=64)
def _grid_positions(gt: int, gh: int, gw: int) -> torch.Tensor:
    # the same few grids for every sample of a dataset: built once
    return torch.stack(torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij"),
                       dim=-1).reshape(-1, 3)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], pt: int, ph: int, pw: int) -> torch.Tensor:
    """Inverse of `patchify`: (..., gt*gh*gw, pt*ph*pw*C) -> (..., C, gt*pt, gh*ph, gw*pw)."""
    gt, gh, gw = grid
    *lead, _, f = tokens.shape
    n, c = len(lead), f // (pt * ph * pw)
    x = tokens.reshape(*lead, gt, gh, gw, pt, ph, pw, c)
    x = x.permute(*range(n), n + 6, n, n + 3, n + 1, n + 4, n + 2, n + 5)
    return x.reshape(*lead, c, gt * pt, gh * ph, gw * pw)


__all__ = ["DiT", "build", "patchify", "position_embedding", "sincos", "timestep_embedding", "unpatchify"]
