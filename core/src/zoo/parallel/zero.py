"""The distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020).

Every gradient bucket is cut into DP equal shards, ignoring parameter boundaries. Each rank keeps
float32 master weights and optimizer state only for its shard: per step the gradients are
reduce-scattered (`GradBuckets(shard=True)`), the rank updates its shard, writes it into the
model's parameters and the parameters are all-gathered. Optimizer state per rank is therefore
1/DP of the unsharded state (plus padding of each bucket to a multiple of DP).

Inside a shard, each parameter's piece becomes its own float32 master tensor, so per-parameter
rules (no weight decay on vectors, learning-rate multipliers) carry over unchanged: ``group_of``
gives each parameter its optimizer group's options, as it does for the plain optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zoo.parallel.data_parallel import GradBuckets
from zoo.parallel.sharding import groups_by_param, optimizer_state

if TYPE_CHECKING:
    from zoo.training.loss_scale import DynamicLossScale

# (gradient, parameter) pairs and the data-parallel group -> the model's squared gradient norm
NormSquared = Callable[[list[tuple[torch.Tensor, nn.Parameter]], Any], torch.Tensor]


class DistributedOptimizer:
    def __init__(self, buckets: GradBuckets, make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 *, group_of: Callable[[nn.Parameter], dict[str, Any]]) -> None:
        if not buckets.shard:
            raise ValueError("the distributed optimizer needs GradBuckets(shard=True)")
        self.buckets, self.group = buckets, buckets.group
        self.size = buckets.size  # (of the dense buckets; each bucket knows its own group, e.g. experts')
        # (bucket, offset of the piece in the bucket, length, float32 master, parameter, offset in it)
        self.pieces: list[tuple[Any, int, int, torch.Tensor, nn.Parameter, int]] = []
        groups: dict[tuple[Any, ...], dict[str, Any]] = {}
        for b in buckets.buckets:
            per = b.buffer.numel() // b.size
            lo, hi = b.rank * per, (b.rank + 1) * per
            offset = 0
            for p in b.params:
                a, z = max(lo, offset), min(hi, offset + p.numel())
                if a < z:
                    master = p.detach().reshape(-1)[a - offset:z - offset].float().clone().requires_grad_(True)
                    self.pieces.append((b, a, z - a, master, p, a - offset))
                    options = group_of(p)
                    key = tuple(sorted(options.items()))
                    groups.setdefault(key, {**options, "params": []})["params"].append(master)
                offset += p.numel()
        self.optimizer = make_optimizer(list(groups.values()))
        self._by_bucket: dict[int, list[int]] = {}  # id(bucket) -> indices of its pieces on this rank
        for i, piece in enumerate(self.pieces):
            self._by_bucket.setdefault(id(piece[0]), []).append(i)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_bytes(self) -> int:
        """Bytes of float32 master weights plus optimizer state held by this rank."""
        total = sum(piece[3].numel() * piece[3].element_size() for piece in self.pieces)
        for st in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())
        return total

    @torch.no_grad()
    def step(self, *, max_norm: float = 0.0, norm_squared: NormSquared | None = None,
             loss_scale: DynamicLossScale | None = None, skip: Callable[[torch.Tensor], bool] | None = None
             ) -> torch.Tensor:
        """Update this rank's shard and all-gather the parameters; returns the global gradient norm
        (clipping to ``max_norm`` when positive). ``norm_squared(pairs, dp_group)`` sums squared
        ``(gradient piece, its parameter)`` pairs over the whole model (the layout's rule:
        `zoo.parallel.engine.Parallel.grad_norm_squared`; default: one process, every parameter
        whole). With ``loss_scale`` (fp16) the gradients are unscaled first; an overflow anywhere
        makes the norm infinite on every rank, and every rank then skips the update and lowers the
        scale alike. ``skip(norm)`` True leaves the parameters as they are (a non-finite norm,
        `zoo.training.guard`)."""
        inv = 1.0 / loss_scale.factor if loss_scale is not None else 1.0
        for b, a, n, master, _, _ in self.pieces:
            # this rank's reduced gradient slice, unscaled: a float32 buffer's own memory (the step
            # reads it before the buffer may be reused for the parameters below), a bf16/fp16 one's copy
            grad = b.buffer[a:a + n].float()
            master.grad = grad.mul_(inv) if inv != 1.0 else grad
        pairs = [(piece[3].grad, piece[4]) for piece in self.pieces]
        if norm_squared is None:
            from zoo.parallel.apply import grad_norm_squared

            device = self.buckets.buckets[0].buffer.device if self.buckets.buckets else "cpu"
            total = grad_norm_squared(((g, None) for g, _ in pairs), dp_group=self.group, device=device)
        else:
            total = norm_squared(pairs, self.group)
        norm = total.sqrt()
        # fp16: whether to skip is a host decision (one read per step); an overflow skips the step
        # everywhere, the parameters stay as they are
        if loss_scale is not None and not loss_scale.settle(norm):
            self.buckets.zero_grad()
            return norm
        if skip is not None and skip(norm):
            self.buckets.zero_grad()
            return norm
        if max_norm > 0 and self.pieces:
            from zoo.parallel.apply import scale_grads

            scale_grads([piece[3].grad for piece in self.pieces], norm, max_norm)
        self.optimizer.step()
        self.publish([piece[3] for piece in self.pieces], through_grads=True)
        self.buckets.zero_grad()
        return norm

    @torch.no_grad()
    def publish(self, values: Sequence[torch.Tensor], *, through_grads: bool = False) -> None:
        """Every bucket's parameters set to per-piece values aligned with `pieces` (the masters
        after a step, the EMA for a preview), gathered in the parameters' type. Collective over
        each bucket's group. ``through_grads``: a gradient buffer of the parameters' type may
        carry them (the caller zeroes the buffers after)."""
        for b in self.buckets.buckets:
            mine = self._by_bucket.get(id(b), [])
            if b.size == 1:  # nothing to gather: straight into the parameters (one cast copy, not two)
                for i in mine:
                    _, _, n, _, p, at = self.pieces[i]
                    p.detach().view(-1)[at:at + n].copy_(values[i])
                continue
            # through the gradient buffer where allowed and of the parameters' type, else (float32
            # gradients of bf16 parameters) one bucket's buffer of it at a time
            reuse = through_grads and b.buffer.dtype == b.params[0].dtype
            flat = b.buffer if reuse else b.buffer.new_empty(b.buffer.numel(), dtype=b.params[0].dtype)
            for i in mine:
                _, a, n, _, _, _ = self.pieces[i]
                flat[a:a + n].copy_(values[i])  # (cast on the way)
            full = self._gather(flat, b)
            offset = 0
            for p in b.params:
                p.detach().copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def gathered(self, values: Sequence[torch.Tensor | None]) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each bucket's parameters whole (this rank's tensor-parallel piece of each) in float32,
        from per-piece values aligned with `pieces` (None: zeros): the masters, a field of the Adam
        state, the EMA. One all-gather per bucket over its group. Collective."""
        for b in self.buckets.buckets:
            flat = torch.zeros(b.buffer.numel(), dtype=torch.float32, device=b.buffer.device)
            for i in self._by_bucket.get(id(b), []):
                if values[i] is not None:
                    _, a, n, _, _, _ = self.pieces[i]
                    flat[a:a + n] = values[i]
            full = self._gather(flat, b)
            offset = 0
            for p in b.params:
                yield p, full[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()

    @staticmethod
    def _gather(flat: torch.Tensor, b: Any) -> torch.Tensor:
        """The whole of a bucket-shaped tensor of which this rank holds its shard (over the bucket's group)."""
        if b.size == 1:
            return flat
        per = flat.numel() // b.size
        mine = flat[b.rank * per:(b.rank + 1) * per].clone()
        parts = [torch.empty_like(mine) for _ in range(b.size)]
        dist.all_gather(parts, mine, group=b.group)
        return torch.cat(parts)

    def full_state(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """Adam state as full per-parameter tensors keyed ``name::field``, the same form a plain
        optimizer's checkpoint has (so checkpoints move between ZeRO-1 on and off); with
        low-precision parameters also their fp32 masters (``name::master``). Collective."""
        state = self.optimizer.state
        fields = sorted({k for st in state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim()})
        out: dict[str, torch.Tensor] = {}
        for f in fields:
            values = [state[piece[3]][f] if piece[3] in state else None for piece in self.pieces]
            out.update((f"{names[id(p)]}::{f}", t) for p, t in self.gathered(values))
        step = next((st["step"] for st in state.values() if "step" in st), None)
        params = [p for b in self.buckets.buckets for p in b.params]
        if step is not None:
            out.update((f"{names[id(p)]}::step", torch.as_tensor(step).clone()) for p in params)
        if any(p.dtype != torch.float32 for p in params):  # low-precision parameters: the fp32 masters are the truth
            out.update((f"{names[id(p)]}::master", t) for p, t in self.gathered([piece[3].detach() for piece in self.pieces])
                       if p.dtype != torch.float32)
        return out

    @torch.no_grad()
    def load_full_state(self, tensors: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        """Adam state from `full_state`'s form; the fp32 masters are re-read from the parameters
        (loaded just before), never left at the values they had when the optimizer was made."""
        for _, _, n, master, p, start in self.pieces:
            saved = tensors.get(f"{names[id(p)]}::master")
            source = saved if saved is not None else p.detach()
            master.copy_(source.reshape(-1)[start:start + n].float())
        fields: dict[str, list[tuple[str, torch.Tensor]]] = {}  # parameter name -> its state entries
        for key, value in tensors.items():
            pname, _, field = key.partition("::")
            if field != "master":
                fields.setdefault(pname, []).append((field, value))
        groups = groups_by_param(self.optimizer)
        for _, _, n, master, p, start in self.pieces:
            st: dict[str, Any] = {}
            for field, value in fields.get(names[id(p)], []):
                piece = value if value.dim() == 0 else value.reshape(-1)[start:start + n]
                st[field] = optimizer_state(groups[id(master)], master, field, piece.clone())
            if st:
                self.optimizer.state[master] = st
