"""Activation recomputation applied from outside the model.

``full``: every residual block (the family's ``model.layers``, or ``model.blocks``) runs under
`torch.utils.checkpoint`, keeping only block inputs. ``selective`` (Korthikanti et al. 2022):
only the attention core (`zoo.nn.attention`: softmax(QK^T)V, whose activations grow with the
square of the sequence) is recomputed, which costs little compute and saves most of the memory.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zoo.errors import ConfigError

SELECTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("zoo_selective_recompute", default=False)


def _recomputed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def blocks_of(model: nn.Module) -> nn.ModuleList:
    for name in ("layers", "blocks"):
        mods = getattr(model, name, None)
        if isinstance(mods, nn.ModuleList):
            return mods
    raise ConfigError(f"train.recompute=full: {type(model).__name__} exposes no `layers` or `blocks` ModuleList")


def apply(model: nn.Module, mode: str) -> None:
    """``full``: recompute every block (``selective`` is switched on around forwards by `scope`).

    The block's own forward is replaced (not wrapped in a new module) so parameter names and
    checkpoints are the same with and without recomputation.
    """
    if mode == "full":
        for block in blocks_of(model):
            block.forward = _recomputed(block.forward)  # type: ignore[method-assign]


@contextlib.contextmanager
def scope(mode: str) -> Iterator[None]:
    """Within this block, attention cores are recomputed when ``mode`` is ``selective``."""
    token = SELECTIVE.set(mode == "selective")
    try:
        yield
    finally:
        SELECTIVE.reset(token)
