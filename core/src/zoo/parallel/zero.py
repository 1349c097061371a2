"""The distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020).

Every gradient bucket is cut into DP equal shards, ignoring parameter boundaries. Each rank keeps
float32 master weights and optimizer state only for its shard: per step the gradients are
reduce-scattered (`GradBuckets(shard=True)`), the rank updates its shard, writes it into the
model's parameters and the parameters are all-gathered. Optimizer state per rank is therefore
1/DP of the unsharded state (plus padding of each bucket to a multiple of DP).

Inside a shard, each parameter's piece becomes its own float32 master tensor, so per-parameter
rules (no weight decay on vectors) carry over unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zoo.parallel.data_parallel import GradBuckets


class DistributedOptimizer:
    def __init__(self, buckets: GradBuckets, make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 *, weight_decay: float) -> None:
        if not buckets.shard:
            raise ValueError("the distributed optimizer needs GradBuckets(shard=True)")
        self.buckets, self.group = buckets, buckets.group
        self.size = buckets.size
        self.rank = 0 if self.group is None else dist.get_rank(self.group)
        # (bucket, offset of the piece in the bucket, length, float32 master of the piece)
        self.pieces: list[tuple[Any, int, int, torch.Tensor]] = []
        decay, no_decay = [], []
        for b in buckets.buckets:
            per = b.buffer.numel() // self.size
            lo, hi = self.rank * per, (self.rank + 1) * per
            offset = 0
            for p in b.params:
                a, z = max(lo, offset), min(hi, offset + p.numel())
                if a < z:
                    master = p.detach().reshape(-1)[a - offset:z - offset].float().clone().requires_grad_(True)
                    self.pieces.append((b, a, z - a, master))
                    (decay if p.dim() >= 2 else no_decay).append(master)
                offset += p.numel()
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = make_optimizer([g for g in groups if g["params"]])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_bytes(self) -> int:
        """Bytes of float32 master weights plus optimizer state held by this rank."""
        total = sum(m.numel() * m.element_size() for *_, m in self.pieces)
        for st in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())
        return total

    @torch.no_grad()
    def step(self) -> None:
        for b, a, n, master in self.pieces:
            master.grad = b.buffer[a:a + n].float()  # this rank's reduced gradient slice
        self.optimizer.step()
        for b, a, n, master in self.pieces:
            b.buffer[a:a + n].copy_(master.to(b.buffer.dtype))  # reuse the grad buffer to gather params
        for b in self.buckets.buckets:
            if self.size > 1:
                per = b.buffer.numel() // self.size
                mine = b.buffer[self.rank * per:(self.rank + 1) * per].clone()
                parts = [torch.empty_like(mine) for _ in range(self.size)]
                dist.all_gather(parts, mine, group=self.group)
                full = torch.cat(parts)
            else:
                full = b.buffer
            offset = 0
            for p in b.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.buckets.zero_grad()
