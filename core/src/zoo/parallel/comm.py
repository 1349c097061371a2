"""Communication primitives as autograd functions with their conjugates, in one place.

Tensor parallel (Megatron's regions): ``copy_to`` (forward identity, backward all-reduce),
``reduce_from`` (all-reduce / identity), ``scatter_to`` (split the last dim / all-gather),
``gather_from`` (all-gather the last dim / split). Sequence parallel, along the sequence:
``scatter_seq`` (split / all-gather), ``gather_seq`` (all-gather / reduce-scatter),
``reduce_scatter_seq`` (reduce-scatter / all-gather); the sequence dimension is a parameter
(0 in Megatron's ``(T, B, D)`` layout, 1 for ``(B, T, D)``). Every function is the identity when the
group is None or has one rank. Where a backend lacks a collective (older gloo: reduce-scatter) it falls
back to an all-reduce followed by taking this rank's slice. ``exchange`` is the differentiable
all-to-all (expert parallelism), its own conjugate with the dimensions swapped.
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


_NATIVE: dict[str, bool] = {}  # backend -> has a working reduce-scatter (gloo gained one in torch 2.x)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """``out`` = this rank's 1/n slice of the sum of ``x`` (flat, contiguous, divisible by n).
    Native where the backend has it; otherwise an all-reduce and a copy of the slice (correct, but
    it moves twice the bytes of a reduce-scatter)."""
    backend = dist.get_backend(group)
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if _NATIVE.get(backend, True):
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the old name is deprecated in newer torch
                return op(out, x, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError, AttributeError):
            _NATIVE[backend] = False
    full = x.clone()
    dist.all_reduce(full, group=group)
    out.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return None


def reduce_scatter(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of {tuple(x.shape)} does not split over {n} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    reduce_scatter_into(out, moved, group)
    return out.movedim(0, dim)


def all_to_all(x: torch.Tensor, group: Any, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``x`` into n parts along ``split_dim``, send part i to rank i, and concatenate what
    arrives along ``concat_dim`` (the exchange of expert parallelism and of Ulysses-style
    sequence/head re-sharding)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[split_dim] % n:
        raise ValueError(f"dim {split_dim} of {tuple(x.shape)} does not split over {n} ranks")
    send = x.movedim(split_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    parts = recv.chunk(n, dim=0)  # part j came from rank j
    return torch.cat([p.movedim(0, split_dim) for p in parts], dim=concat_dim)


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


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, split_dim: int, concat_dim: int) -> torch.Tensor:
        ctx.group, ctx.split_dim, ctx.concat_dim = group, split_dim, concat_dim
        return all_to_all(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_to_all(g, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None


def exchange(x: torch.Tensor, group: Any, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Differentiable `all_to_all`; its backward is the reverse exchange."""
    return x if _size(group) == 1 else _AllToAll.apply(x, group, split_dim, concat_dim)


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
