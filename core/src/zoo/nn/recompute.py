"""Activation recomputation applied from outside the model.

``elementwise`` (the default): outputs of the norm and gated-activation primitives (`zoo.nn`)
are not kept when a later layer saves them for backward (a linear layer keeps its input): the
saved slot holds a recipe and backward recomputes the output from what the primitive's own
backward keeps anyway (the norm's input, the fused gate|up projection). Two elementwise passes per
block buy back one activation-sized tensor per norm and the MLP's widest saved activation but
one; the recomputed values are bitwise those of the forward. ``selective`` adds the attention
core; ``full`` recomputes whole blocks.

``full``: every residual block (the family's ``model.layers``, or ``model.blocks``) runs under
`torch.utils.checkpoint`, keeping only block inputs. ``selective`` (Korthikanti et al. 2022):
only the attention core (`zoo.nn.AttentionCore`: softmax(QK^T)V, whose activations grow with the
square of the sequence) is recomputed, which costs little compute and saves most of the memory.
Both are applied to the model once (`apply`); ``elementwise`` works through saved-tensor hooks
installed around each training forward (`scope`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zoo.errors import ConfigError

# grad_fn of a recomputable output -> (recipe, shape, dtype); set while a training forward runs.
_OUTPUTS: contextvars.ContextVar[dict[Any, tuple[Callable[[], torch.Tensor], torch.Size, torch.dtype]] | None] = \
    contextvars.ContextVar("zoo_recomputable_outputs", default=None)
MODES = ("none", "elementwise", "selective", "full")


def recomputable(output: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Marks ``output`` (just computed by a primitive) as rebuilt by ``recipe`` if saved later.

    ``recipe`` must compute exactly ``output`` from tensors its primitive saves for its own
    backward, so that dropping ``output`` frees memory and recomputing it is bitwise exact."""
    table = _OUTPUTS.get()
    if table is not None and output.grad_fn is not None:
        table[output.grad_fn] = (recipe, output.shape, output.dtype)
    return output


def recording() -> bool:
    """Whether primitives should register recipes now (an ``elementwise`` or ``selective`` training
    forward). Only then may they read their own saved tensors during the forward: under
    `torch.utils.checkpoint` (``full``) reading one recomputes the block up to that point."""
    return _OUTPUTS.get() is not None


class _Recipe:
    """A saved tensor stored as how to rebuild it: the output's recipe, then the saved view."""

    __slots__ = ("recipe", "dtype", "size", "stride", "offset")

    def __init__(self, recipe: Callable[[], torch.Tensor], t: torch.Tensor) -> None:
        self.recipe, self.dtype, self.size, self.stride, self.offset = recipe, t.dtype, t.shape, t.stride(), t.storage_offset()

    def rebuild(self) -> torch.Tensor:
        with torch.no_grad():
            base = self.recipe()
        if base.dtype != self.dtype:  # the layer saved autocast's low-precision copy of the output
            base = base.to(self.dtype)
        return base.as_strided(self.size, self.stride, self.offset)


def _pack(t: torch.Tensor) -> Any:
    table = _OUTPUTS.get()
    if not table:
        return t
    # What is saved is the output itself, a view of it (a linear layer flattens its input), or a
    # view of autocast's cast copy of it; anything else is kept as is.
    base = t if t._base is None else t._base
    node = base.grad_fn
    if node is None:
        return t
    entry, cast = table.get(node), False
    if entry is None and type(node).__name__ == "ToCopyBackward0" and node.next_functions:
        entry, cast = table.get(node.next_functions[0][0]), True
    if entry is None:
        return t
    recipe, shape, dtype = entry
    if base.shape != shape or not base.is_contiguous() or (not cast and base.dtype != dtype):
        return t
    return _Recipe(recipe, t)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.rebuild() if isinstance(packed, _Recipe) else packed


def _recomputed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """Every block of every stack: the modules of each `layers` or `blocks` ModuleList, wherever it
    sits (a VLM's vision tower and language model, CLIP's two towers), not those nested in a block."""
    stacks: list[str] = []
    out: list[nn.Module] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks") \
                and not any(name.startswith(s + ".") for s in stacks):
            stacks.append(name)
            out += list(mod)
    if not out:
        raise ConfigError(f"train.recompute=full: {type(model).__name__} has no `layers` or `blocks` ModuleList")
    return out


def apply(model: nn.Module, mode: str) -> None:
    """``full``: recompute every block; ``selective``: every attention core (`zoo.nn.AttentionCore`).

    The block's own forward is replaced (not wrapped in a new module) so parameter names and
    checkpoints are the same with and without recomputation.
    """
    if mode not in MODES:
        raise ConfigError(f"train.recompute={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "full":
        for block in blocks_of(model):
            block.forward = _recomputed(block.forward)  # type: ignore[method-assign]
    elif mode == "selective":
        cores = [m for m in model.modules() if isinstance(m, SelectiveCore)]
        if not cores:
            raise ConfigError(f"train.recompute=selective: {type(model).__name__} has no zoo.nn.AttentionCore to recompute")
        for core in cores:
            core.recompute = True


class SelectiveCore(nn.Module):
    """A parameter-free module that ``train.recompute=selective`` recomputes in backward (its
    ``forward`` reads ``recompute``): `zoo.nn.AttentionCore` is one."""

    def __init__(self) -> None:
        super().__init__()
        self.recompute = False


@contextlib.contextmanager
def scope(mode: str) -> Iterator[None]:
    """Around a training forward: norm and activation outputs are recomputed under ``elementwise``
    and ``selective`` (``full`` and ``selective`` are applied to the model by `apply`; a block that
    ``full`` recomputes saves nothing else, so recipes would buy nothing there, and reading saved
    tensors inside it, as recording them does, would make torch's checkpoint recompute the block
    during the forward itself)."""
    if mode not in MODES:
        raise ConfigError(f"train.recompute={mode!r}: expected one of {', '.join(MODES)}")
    off = mode in ("none", "full")
    outputs = _OUTPUTS.set(None if off else {})
    try:
        if off:
            yield
        else:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
    finally:
        _OUTPUTS.reset(outputs)
