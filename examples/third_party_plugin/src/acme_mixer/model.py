"""Causal MLP-Mixer (Tolstikhin et al. 2021) for language modelling.

Token mixing is a learned ``[L, L]`` matrix masked to be lower-triangular, so position t only sees
positions <= t; channel mixing is the usual MLP. Shapes: B batch, T sequence, D hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from acme_mixer.plugin import MixerConfig
from zoo.spec import ModelSpec


class CausalTokenMix(nn.Module):
    def __init__(self, max_len: int, bias: bool) -> None:
        super().__init__()
        # Start close to a running mean of the past so early training is stable.
        init = torch.tril(torch.ones(max_len, max_len))
        self.weight = nn.Parameter(init / init.sum(dim=1, keepdim=True))
        self.bias = nn.Parameter(torch.zeros(max_len)) if bias else None
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        t = x.shape[1]
        w = self.weight[:t, :t].masked_fill(~self.mask[:t, :t], 0.0)  # (T, T), causal
        y = torch.einsum("ts,bsd->btd", w, x)
        if self.bias is not None:
            y = y + self.bias[:t, None]
        return y


class MLP(nn.Module):
    def __init__(self, d: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d * ratio)
        self.proj = nn.Linear(d * ratio, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: MixerConfig, bias: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mix = CausalTokenMix(cfg.max_seq_length, bias)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CausalMixer(nn.Module):
    def __init__(self, cfg: MixerConfig, spec: ModelSpec) -> None:
        super().__init__()
        block = spec.block_for("X")
        self.max_seq_length = cfg.max_seq_length
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, block.mixer.bias) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        if tokens.shape[1] > self.max_seq_length:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_seq_length={self.max_seq_length}")
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(cfg: MixerConfig, spec: ModelSpec) -> CausalMixer:
    return CausalMixer(cfg, spec)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    logits = model(batch["tokens"])
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
    return ce, {"ppl": float(ce.detach().exp())}


def example_batch(cfg: MixerConfig, *, batch_size: int, seq_length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    seq = min(seq_length, cfg.max_seq_length)
    data = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=generator)
    return {"tokens": data[:, :-1], "labels": data[:, 1:]}
