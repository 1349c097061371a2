"""The linear layers zoo's families build: an ``nn.Linear`` (same parameters, state dict and
initialisation) whose product is the run's ``linear`` operation (`zoo.kernels`), and the two ends
of a language model, whose type tells the core how to split them under tensor parallelism
(`zoo.parallel.apply.tensor_parallel_plan`): the vocabulary's rows over the ranks."""

from __future__ import annotations

import torch
from torch import nn

from zoo import kernels


class Linear(nn.Linear):
    """``nn.Linear`` computing through `zoo.kernels` (``F.linear`` unless a provider takes it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.active().call("linear", x, self.weight, self.bias)


class TokenEmbedding(nn.Embedding):
    """A language model's token embedding (a `ModelSpec` with ``embedding="token"``): an
    ``nn.Embedding`` in every respect; under tensor parallelism the core splits its vocabulary."""

    tensor_parallel_sizes = ()

    def tensor_parallel(self) -> dict[str, str]:
        return {"": "vocab_embedding"}


class LMHead(Linear):
    """A language model's output projection to the vocabulary (``head="lm"``); under tensor
    parallelism the core splits its vocabulary (a tied head shares the embedding's shard)."""

    tensor_parallel_sizes = ()

    def tensor_parallel(self) -> dict[str, str]:
        return {"": "vocab_head"}


__all__ = ["LMHead", "Linear", "TokenEmbedding"]
