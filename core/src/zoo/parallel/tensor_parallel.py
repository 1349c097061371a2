"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019) and vocab-parallel cross entropy.

Each layer holds only its shard. `load_full` takes the full (unsharded) tensor and keeps this
rank's slice, so a model initialised from one seed is the same model for every TP size, which is
what lets every layout be compared with a single process. Activations are ``[..., hidden]``; with
sequence parallelism the inputs and outputs of a TP region are sharded along dim 0 (sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.parallel import comm
from zoo.parallel.data_parallel import grad_of
from zoo.parallel.sharding import TPShard, local


def _tp(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _shard(style: str, group: Any, segments: tuple[int, ...] = ()) -> TPShard:
    n, r = _tp(group)
    return TPShard(style, n, r, group, segments)  # type: ignore[arg-type]


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split along its output rows: each rank computes a slice of y.

    ``gated``: the weight is a fused ``[gate; up]`` whose halves are split per rank (each rank
    holds ``[gate_r; up_r]``, so a gated activation works on its slice); ``segments``: the output
    packs segments of these sizes, each split the same way (Mamba's in_proj). ``vocab``: the output is a
    vocabulary (an LM head): `zoo.nn.linear_cross_entropy` then computes the loss vocab-parallel
    instead of gathering the logits."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: Any, gated: bool = False,
                 vocab: bool = False, gather_output: bool = False, sequence_parallel: bool = False,
                 segments: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.vocab = vocab
        self.seq_dim = 0
        self.local = False  # input gradient summed elsewhere (`zoo.parallel.apply`'s column_local)
        self.shard = _shard("segments" if segments else "gated_rows" if gated else "rows", group, segments)
        local = self.shard.local_shape((out_features, in_features))
        self.weight = nn.Parameter(torch.empty(local))
        self.bias = nn.Parameter(torch.zeros(local[0])) if bias else None

    def tp_shards(self) -> dict[str, TPShard]:
        return {name: self.shard for name in ("weight", "bias") if getattr(self, name) is not None}

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(self.shard.cut(weight))
        if self.bias is not None and bias is not None:
            self.bias.copy_(self.shard.cut(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = comm.gather_seq(x, self.group, self.seq_dim)
        elif not self.local:
            x = comm.copy_to(x, self.group)
        y = kernels.active().call("linear", x, self.weight, self.bias)
        return comm.gather_from(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split along its input columns; partial results are summed."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: Any,
                 input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.seq_dim = 0
        self.feeds_split = False  # `zoo.parallel.apply`'s row_allreduce
        self.shard = _shard("cols", group)
        self.weight = nn.Parameter(torch.empty(self.shard.local_shape((out_features, in_features))))
        # Replicated and added once; under sequence parallelism it is added to this rank's sequence
        # shard only, so its gradient is summed over TP (`sequence_parallel_params`).
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def tp_shards(self) -> dict[str, TPShard]:
        return {"weight": self.shard}

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(self.shard.cut(weight))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to(x, self.group, -1)
        y = kernels.active().call("linear", x, self.weight)
        if self.feeds_split:  # consumers on every rank use the whole output: their gradients are partial
            y = comm.copy_to(comm.reduce_from(y, self.group), self.group)
        elif self.sequence_parallel:
            y = comm.reduce_scatter_seq(y, self.group, self.seq_dim)
        else:
            y = comm.reduce_from(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP ranks; ids outside this rank's range contribute zeros."""

    def __init__(self, num_embeddings: int, dim: int, *, group: Any, padding_idx: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.shard = _shard("rows", group)
        if num_embeddings % self.shard.size:
            raise ValueError(f"vocabulary of {num_embeddings} does not split over tp={self.shard.size} (pad it)")
        per = num_embeddings // self.shard.size
        self.start, self.end = self.shard.rank * per, (self.shard.rank + 1) * per
        # (the row without input gradient, as nn.Embedding's padding_idx, where this rank holds it)
        self.padding_idx = padding_idx - self.start if padding_idx is not None and self.start <= padding_idx < self.end \
            else None
        self.weight = nn.Parameter(torch.empty(per, dim))

    def tp_shards(self) -> dict[str, TPShard]:
        return {"weight": self.shard}

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.weight.copy_(self.shard.cut(weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self.padding_idx).masked_fill(outside[..., None], 0.0)
        return comm.reduce_from(out, self.group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
        n, r = _tp(group)
        per = logits.shape[-1]
        start = r * per
        logits = logits.float()
        # Three all-reduces: the max (stability), the target's logit, the sum of exponentials.
        m = comm.all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - m[..., None]
        outside = (target < start) | (target >= start + per)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local[..., None]).squeeze(-1).masked_fill(outside, 0.0)
        picked = comm.all_reduce(picked, group)
        exp = shifted.exp()
        total = comm.all_reduce(exp.sum(dim=-1), group)
        loss = total.log() - picked
        softmax = exp / total[..., None]
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local[..., None], -hit[..., None])
        return grad * g[..., None], None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
    """Per-token cross entropy of logits whose vocabulary is split over ``group`` (no gather)."""
    return _VocabParallelCE.apply(logits, target, group)


def reduce_sequence_parallel_grads(params: Iterable[nn.Parameter], group: Any) -> None:
    """Sum over TP the gradients of parameters applied to sequence shards (norm weights, row
    biases), all in one all-reduce of their concatenation."""
    grads = [local(g) for g in map(grad_of, params) if g is not None]  # (an FSDP gradient: this rank's shard)
    if not grads or comm._size(group) == 1:
        return
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
