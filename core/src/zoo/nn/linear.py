"""The linear layer zoo's families build: an ``nn.Linear`` (same parameters, state dict and
initialisation) whose product is the run's ``linear`` operation (`zoo.kernels`)."""

from __future__ import annotations

import torch
from torch import nn

from zoo import kernels


class Linear(nn.Linear):
    """``nn.Linear`` computing through `zoo.kernels` (``F.linear`` unless a provider takes it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.active().call("linear", x, self.weight, self.bias)


__all__ = ["Linear"]
