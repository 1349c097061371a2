"""Communication primitives as autograd functions with their conjugates, in one place.

Tensor parallel (Megatron's regions): ``copy_to`` (forward identity, backward all-reduce),
``reduce_from`` (all-reduce / identity), ``scatter_to`` (split the last dim / all-gather),
``gather_from`` (all-gather the last dim / split). Sequence parallel along dim 0:
``scatter_seq`` (split / all-gather), ``gather_seq`` (all-gather / reduce-scatter),
``reduce_scatter_seq`` (reduce-scatter / all-gather); the sequence dimension is a parameter
(0 in Megatron's ``(T, B, D)`` layout, 1 for ``(B, T, D)``). Every function is the identity when the
group is None or has one rank. gloo lacks some collectives (``reduce_scatter_tensor``): those fall
back to an all-reduce followed by taking this rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """In place (on a contiguous tensor) and returned; ``op`` defaults to a sum."""
    if _size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return x


def all_gather(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def split(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of {tuple(x.shape)} does not split over {n} ranks")
    return x.chunk(n, dim=dim)[_rank(group)].contiguous()


def reduce_scatter(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if dim == 0 and dist.get_backend(group) == "nccl":
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    return split(all_reduce(x.clone(), group), group, dim)  # gloo has no reduce_scatter_tensor


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(g.clone(), ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(g, ctx.group, ctx.dim), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return split(g, ctx.group, ctx.dim), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter(g, ctx.group, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(g, ctx.group, ctx.dim), None, None


def copy_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFrom.apply(x, group)


def scatter_to(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterTo.apply(x, group, dim)


def gather_from(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherFrom.apply(x, group, dim)


def scatter_seq(x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterTo.apply(x, group, dim)


def gather_seq(x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherSeq.apply(x, group, dim)


def reduce_scatter_seq(x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceScatterSeq.apply(x, group, dim)
