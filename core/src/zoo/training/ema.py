"""An exponential moving average of the parameters (``train.ema``: the decay per step), the
weights diffusion models are sampled with (Karras et al. 2022 and DiT evaluate EMA weights).

Kept in fp32 for this rank's trainable parameters only, so it is split exactly like them under
every layout (TP pieces, pipeline stages, FSDP shards). Under the distributed optimizer (ZeRO-1,
and always with ``train.param_dtype=bf16``) it is kept like the fp32 master weights instead: each
data-parallel rank averages its shard of the masters, so bf16 parameters' rounding never enters
the average and the average costs 1/DP of its memory; a preview gathers it into the parameters.
It is a checkpoint `Stateful`: saved as ``ema/<single-process name>`` in the parameter's global
shape whatever the layout, so it reshards with the checkpoint; `zoo generate`, HF export and
`zoo.load_model` use it when present (``--weights ema|raw``). Frozen parameters never change, so
they need no average.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zoo.checkpoint.reader import EMA as PREFIX
from zoo.checkpoint.state import Checkpoint
from zoo.parallel.sharding import Placements, Split, TPShard, local

if TYPE_CHECKING:
    from zoo.parallel.zero import DistributedOptimizer


class EMA:
    key = "ema"

    def __init__(self, model: nn.Module, placements: Placements, decay: float, *,
                 zero: DistributedOptimizer | None = None, ramp: bool = False, power: float = 0.0) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} must lie in (0, 1)")
        self.decay, self.placements, self.zero, self.ramp, self.power = decay, placements, zero, ramp, power
        self.updates = 0  # (saved: a resumed ramp continues where it was)
        # This rank's local data of each trainable parameter (an FSDP parameter's shard).
        self.params = [(n, local(p)) for n, p in model.named_parameters() if p.requires_grad]
        # What each average follows: (parameter name, its local data, offset in it) and the tensor
        # averaged: the whole parameter, or under ZeRO this rank's piece of its master
        if zero is None:
            self.pieces = [(n, p, 0) for n, p in self.params]
            self.sources = [p.detach() for _, p in self.params]
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            self.pieces = [(names[id(piece[4])], piece[4], piece[5]) for piece in zero.pieces]
            self.sources = [piece[3].detach() for piece in zero.pieces]
        self.shadow = [t.float().clone() for t in self.sources]

    def current_decay(self) -> float:
        """The decay of the coming update: ``train.ema``, or with the ramp ``min(ema, n / (n + 9))``
        at the n-th update and 0 at the first (diffusers' ``EMAModel.get_decay`` by default), or
        with ``power`` its warmup ``min(ema, 1 - n^-power)`` (``use_ema_warmup``, inv_gamma 1)."""
        if not self.ramp:
            return self.decay
        n = self.updates + 1
        if n == 1:
            return 0.0
        return min(self.decay, 1.0 - n ** -self.power if self.power > 0 else n / (n + 9))

    @torch.no_grad()
    def update(self) -> None:
        """``ema <- decay * ema + (1 - decay) * parameter``, after each optimizer step."""
        torch._foreach_lerp_(self.shadow, [t.float() for t in self.sources], 1.0 - self.current_decay())
        self.updates += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averaged weights in the model for the duration (previews); the raw ones back after.
        Under the distributed optimizer every data-parallel rank enters it (the average is gathered)."""
        raw = [p.detach().clone() for _, p in self.params]
        with torch.no_grad():
            if self.zero is not None:
                self.zero.publish(self.shadow)
            else:
                for (_, p), s in zip(self.params, self.shadow):
                    p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), r in zip(self.params, raw):
                    p.copy_(r)

    def state_tensors(self) -> list[tuple[str, torch.Tensor, TPShard | Split | None]]:
        """Collective under the distributed optimizer (its shards gathered over data parallelism)."""
        if self.zero is None:
            pairs = [(name, s) for (name, _), s in zip(self.params, self.shadow)]
        else:
            names = {id(p): n for n, p in self.params}
            pairs = [(names[id(p)], whole) for p, whole in self.zero.gathered(self.shadow)]
        out = []
        for name, s in pairs:
            placement = self.placements[name]
            if not placement.duplicate:
                out.append((PREFIX + placement.name, s, placement.split))
        return out

    def state_json(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates}

    def load_state(self, ckpt: Checkpoint, saved: Any) -> None:
        """The saved average where the checkpoint has one; a checkpoint written without EMA starts
        the average from the restored weights (as a fresh run starts it from the initial ones):
        under the distributed optimizer from the restored masters."""
        present = ckpt.has(PREFIX + self.placements[self.params[0][0]].name) if self.params else False
        # (a checkpoint from before the count was saved: one update per step it had trained)
        self.updates = int((saved or {}).get("updates", ckpt.train_state().step)) if present else 0
        for (name, p, start), s, source in zip(self.pieces, self.shadow, self.sources):
            placement = self.placements[name]
            key = PREFIX + placement.name
            if ckpt.has(key):
                s.copy_(ckpt.read(key, p.shape, placement.split).reshape(-1)[start:start + s.numel()].view_as(s))
            else:
                s.copy_(source)


__all__ = ["EMA"]
