"""fp16's dynamic loss scale, one for every layout.

The loss is multiplied by the scale before backward so that small fp16 gradients do not flush to
zero; a step whose gradients overflow is skipped and halves the scale, ``window`` clean steps in a
row double it (torch's GradScaler policy; Megatron's ``--initial-loss-scale`` and
``--loss-scale-window``: ``train.initial_loss_scale``, ``train.loss_scale_window``).

Overflow is decided on the global gradient norm, which every rank computes alike (summed over
TP, PP, EP, FSDP and ZeRO pieces): one gradient that overflows on one rank makes it infinite
everywhere, so every rank skips the same steps. torch's GradScaler checks the gradients a rank
holds, which under tensor, pipeline, expert or fully sharded parallelism are not the same on every
rank: ranks would disagree on which steps to skip and drift apart. The decision costs nothing
extra: the trainer reads the norm once a step anyway.

The scale is also the same number in every layout. Each data-parallel (and context-parallel) rank
backpropagates its share of the step's micro-batches with a loss weighted to average correctly over
``ranks`` = dp x cp ranks, so its per-token gradients are ``ranks`` times one process's; it
multiplies by ``scale / ranks``, and the values its fp16 backward carries are one process's: data
and context parallelism do not change which steps overflow (tensor parallelism's split sums round
differently, so near fp16's largest number it may overflow a step earlier or later).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from zoo.parallel.sharding import local


class DynamicLossScale:
    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, *, enabled: bool = True,
                 ranks: int = 1) -> None:
        # (train.initial_loss_scale and train.loss_scale_window are checked with the configuration)
        self.scale_value, self.growth_interval, self.clean_steps = float(init_scale), growth_interval, 0
        self.enabled, self.ranks = enabled, ranks

    @property
    def factor(self) -> float:
        """What a rank's loss is multiplied by before its backward."""
        return self.scale_value / self.ranks

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.factor if self.enabled else loss

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> None:
        """Divide gradients (averaged over the ranks) by the factor in place (a DTensor's local
        piece: FSDP's shards)."""
        pieces = [local(g) for g in grads if g is not None]
        if pieces:
            torch._foreach_mul_(pieces, 1.0 / self.factor)

    def settle(self, grad_norm: torch.Tensor) -> bool:
        """Whether the step may update, from the global norm of its unscaled gradients; lowers
        or raises the scale accordingly."""
        finite = math.isfinite(float(grad_norm))
        self.update(found_inf=not finite)
        return finite

    def update(self, *, found_inf: bool) -> None:
        if found_inf:
            self.scale_value, self.clean_steps = self.scale_value / 2, 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:  # (>=: a resumed run may lower the window)
                self.scale_value, self.clean_steps = self.scale_value * 2, 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This class's state, or torch GradScaler's (``_growth_tracker``: the runs before every
        layout shared one scale saved that where they had no distributed optimizer). The window
        stays the configured one: it is a setting, not state."""
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"] if "clean_steps" in state else state["_growth_tracker"])


__all__ = ["DynamicLossScale"]
