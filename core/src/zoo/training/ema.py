"""An exponential moving average of the parameters (``train.ema``: the decay per step), the
weights diffusion models are sampled with (Karras et al. 2022 and DiT evaluate EMA weights).

Kept in fp32 for this rank's trainable parameters only, so it is split exactly like them under
every layout (TP pieces, pipeline stages; replicated over data parallelism like the parameters).
It is a checkpoint `Stateful`: saved as ``ema/<single-process name>`` in the parameter's global
shape, so it reshards with the checkpoint; `zoo generate`, HF export and `zoo.load_model` use it
when present (``--weights ema|raw``). Frozen parameters never change, so they need no average.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zoo.checkpoint.reader import EMA as PREFIX
from zoo.checkpoint.state import Checkpoint
from zoo.parallel.sharding import Placements, Split, TPShard, local


class EMA:
    key = "ema"

    def __init__(self, model: nn.Module, placements: Placements, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} must lie in (0, 1)")
        self.decay, self.placements = decay, placements
        # This rank's local data of each trainable parameter (an FSDP parameter's shard).
        self.params = [(n, local(p)) for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for _, p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """``ema <- decay * ema + (1 - decay) * parameter``, after each optimizer step."""
        torch._foreach_lerp_(self.shadow, [p.detach().float() for _, p in self.params], 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averaged weights in the model for the duration (previews); the raw ones back after."""
        raw = [p.detach().clone() for _, p in self.params]
        with torch.no_grad():
            for (_, p), s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), r in zip(self.params, raw):
                    p.copy_(r)

    def state_tensors(self) -> list[tuple[str, torch.Tensor, TPShard | Split | None]]:
        out = []
        for (name, _), s in zip(self.params, self.shadow):
            placement = self.placements[name]
            if not placement.duplicate:
                out.append((PREFIX + placement.name, s, placement.split))
        return out

    def state_json(self) -> dict[str, Any]:
        return {"decay": self.decay}

    def load_state(self, ckpt: Checkpoint, saved: Any) -> None:
        """The saved average where the checkpoint has one; a checkpoint written without EMA starts
        the average from the restored weights (as a fresh run starts it from the initial ones)."""
        for (name, p), s in zip(self.params, self.shadow):
            placement = self.placements[name]
            key = PREFIX + placement.name
            s.copy_(ckpt.read(key, p.shape, placement.split) if ckpt.has(key) else p.detach())


__all__ = ["EMA"]
