"""Data parallelism with contiguous, bucketed gradient buffers and overlapped reduction.

Gradients live in flat buffers, one per bucket, filled in reverse parameter order (the order
backward produces them); each parameter's ``.grad`` is a view into its bucket. A post-accumulate
hook counts ready parameters, and as soon as a bucket is complete its all-reduce is launched
asynchronously while backward continues with earlier layers. Inside `no_sync()` (all but the last
micro-batch of an accumulation) nothing is launched and gradients simply accumulate in the
buffers. Buckets hold at least ``bucket_size`` elements (Megatron's default is 40M), so a step
issues ``ceil(parameters / bucket_size)`` all-reduces at most.

Parameters held in bf16/fp16 (``train.param_dtype``) get float32 buckets by default (``grad_dtype``,
``train.grad_dtype``), as Megatron keeps ``main_grad`` for bf16: gradients accumulate over
micro-batches and are reduced over ranks in float32. Autograd gives a parameter's gradient in the
parameter's own type, so there ``.grad`` is not a view: each parameter's ``main_grad`` is, and the
post-accumulate hook adds the new ``.grad`` into it and drops it (`grad_of` reads either).

Reductions average over the data-parallel group, so with gradient accumulation the result equals
one large batch when each micro-batch loss is a mean scaled by ``1 / accumulation``. A partition
of the parameters can be reduced over another group with another divisor: expert-parallel experts
are summed over their expert-data-parallel replicas and divided by the data x context size (the
all-to-all already summed what the data-parallel ranks' tokens contributed, as Megatron does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zoo.parallel import comm


class _Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device, group: Any,
                 divisor: int | None) -> None:
        self.params, self.group = params, group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.divisor = self.size if divisor is None else divisor
        self.numel = sum(p.numel() for p in params)
        # Padded so it cuts into equal data-parallel shards (the distributed optimizer's unit).
        pad_to = self.size
        padded = -(-self.numel // pad_to) * pad_to
        self.buffer = torch.zeros(padded, dtype=dtype, device=device)
        self.pending = len(params)
        self.handle: Any = None


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's accumulated gradient: its float32 ``main_grad`` where `GradBuckets` keeps one,
    else ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


class GradBuckets:
    def __init__(self, module: nn.Module, group: Any, *, bucket_size: int = 40_000_000, shard: bool = False,
                 partitions: Sequence[tuple[set[int], Any, int]] = (), grad_dtype: torch.dtype | None = None) -> None:
        """``shard``: reduce-scatter instead of all-reduce; each rank then owns 1/DP of every bucket
        (ZeRO-1, `zoo.parallel.zero`), and only that shard of the buffer holds reduced values.
        ``partitions``: ``(parameter ids, group, divisor)``: those parameters are bucketed apart and
        summed over their own group, then divided by ``divisor`` (expert parallelism).
        ``grad_dtype``: the buckets' type (None: each parameter's own); a wider one than the
        parameters' makes ``main_grad`` views (module docstring)."""
        self.module, self.group, self.shard, self.grad_dtype = module, group, shard, grad_dtype
        self.size = 1 if group is None else dist.get_world_size(group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[_Bucket] = []
        apart = set().union(*(ids for ids, _, _ in partitions)) if partitions else set()
        self._fill([p for p in params if id(p) not in apart], group, None, bucket_size)
        for ids, pgroup, divisor in partitions:
            self._fill([p for p in params if id(p) in ids], pgroup, divisor, bucket_size)
        self._bucket_of: dict[int, _Bucket] = {}
        for b in self.buckets:
            offset = 0
            for p in b.params:
                view = b.buffer[offset:offset + p.numel()].view_as(p)
                if view.dtype == p.dtype:
                    p.grad = view
                else:  # autograd's gradient comes in p's type; `_ready` adds it in
                    p.grad, p.main_grad = None, view  # type: ignore[attr-defined]
                offset += p.numel()
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._ready)
        self.sync = True
        self.launched = 0  # reductions issued (for tests and the benchmark)
        self.launched_bytes = 0  # bytes of the buffers they reduced

    def _fill(self, params: list[nn.Parameter], group: Any, divisor: int | None, bucket_size: int) -> None:
        seen: set[int] = set()
        ordered = []
        for p in reversed(params):  # backward produces the last layers' gradients first
            if id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
        current: list[nn.Parameter] = []
        count = 0
        for p in ordered:
            current.append(p)
            count += p.numel()
            if count >= bucket_size:
                self.buckets.append(_Bucket(current, self.grad_dtype or current[0].dtype, current[0].device, group,
                                            divisor))
                current, count = [], 0
        if current:
            self.buckets.append(_Bucket(current, self.grad_dtype or current[0].dtype, current[0].device, group, divisor))

    def _ready(self, p: torch.Tensor) -> None:
        main = getattr(p, "main_grad", None)
        if main is not None:  # (in float32, every micro-batch)
            main.add_(p.grad)
            p.grad = None
        if not self.sync:  # accumulating: nothing to launch (a pipeline sets `sync` per chunk)
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0 and self.sync and (b.size > 1 or b.divisor != 1):
            if b.divisor != 1:
                b.buffer.div_(b.divisor)
            if b.size == 1:
                return
            if self.shard:  # only this rank's shard is reduced; the rest of the buffer is stale
                out = b.buffer.chunk(b.size)[b.rank]
                b.handle = comm.reduce_scatter_into(out, b.buffer.clone(), b.group, async_op=True)
            else:
                b.handle = dist.all_reduce(b.buffer, group=b.group, async_op=True)
            self.launched += 1
            self.launched_bytes += b.buffer.numel() * b.buffer.element_size()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
            for b in self.buckets:
                b.pending = len(b.params)

    def finish(self) -> None:
        """Wait for every launched reduction (call after the last backward of a step)."""
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            elif b.size > 1 and b.pending != 0:
                raise RuntimeError("a gradient bucket never completed: some parameters received no gradient")
            b.pending = len(b.params)

    def unshard(self) -> None:
        """After a sharded (ZeRO) reduction: all-gather every bucket's reduced shards so each
        parameter's ``.grad`` is whole again (for inspection; training never needs it)."""
        if not self.shard:
            return
        for b in self.buckets:
            if b.size == 1:
                continue
            parts = list(b.buffer.chunk(b.size))
            gathered = [torch.empty_like(p) for p in parts]
            dist.all_gather(gathered, parts[b.rank].clone(), group=b.group)
            b.buffer.copy_(torch.cat(gathered))

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
