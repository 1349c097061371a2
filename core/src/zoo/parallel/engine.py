"""Every parallel layout behind one object: `Parallel` takes the plain model a family built (the
same full model on every rank, from one seed) and the run's layout, and applies, in this order,
tensor parallelism (the family's ``tp_plan``), sequence parallelism (the family's
``sequence.dim``), pipeline stages (the family's `PipelineSpec`), and the data-parallel gradient
buckets over the data x context group. Context parallelism needs no change to the model: batches
are split by `prepare` and attention becomes ring attention inside `scope`.

One optimizer step is then ``forward_backward`` (all micro-batches, with or without a pipeline
schedule), ``finish_grads`` (DP reduction, sequence-parallel norm gradients, tied embeddings)
and ``clip``. The training loop and the tests use exactly this path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zoo.parallel import apply as tp_apply
from zoo.parallel import comm, context
from zoo.parallel.grid import ProcessGrid
from zoo.parallel.pipeline import (
    Pipeline,
    Stages,
    _tied,
    build_stages,
    gather_objects,
    gather_state,
    sync_tied_grads,
)

StepFn = Callable[[nn.Module, dict[str, Any]], tuple[torch.Tensor, Any]]


class Parallel:
    def __init__(self, model: nn.Module, family: Any, *, tp: int = 1, cp: int = 1, pp: int = 1, vpp: int = 1,
                 sequence_parallel: bool = False, order: str = "tp-cp-ep-dp-pp", pp_layers: Sequence[int] | None = None,
                 pp_schedule: str = "1f1b", rank: int = 0, world_size: int = 1, seed: int = 1234) -> None:
        self.family = family
        if world_size % (tp * cp * pp):
            raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp = {tp * cp * pp}")
        dp = world_size // (tp * cp * pp)
        self.tp, self.cp, self.pp, self.dp, self.vpp = tp, cp, pp, dp, vpp
        self.grid = ProcessGrid({"tp": tp, "cp": cp, "dp": dp, "pp": pp}, [a for a in order.split("-") if a != "ep"],
                                rank=rank, world_size=world_size)
        g = self.grid
        self.tp_group, self.cp_group, self.pp_group = g.group("tp"), g.group("cp"), g.group("pp")
        self.dp_cp_group = g.group("dp", "cp")  # gradients are averaged over data and context ranks
        self.dp_rank, self.cp_rank, self.pp_rank = g.index("dp"), g.index("cp"), g.index("pp")
        self.tp_rank = g.index("tp")
        from zoo.parallel.random import TensorParallelRNG

        # Dropout inside TP regions draws from this (`tp_rng.fork()`); saved with checkpoints.
        self.tp_rng = TensorParallelRNG(seed, self.tp_rank)
        seq = family.sequence
        if cp > 1 and seq is None:
            raise ValueError(f"parallel.cp={cp}: family {family.name!r} declares no sequence spec (SequenceSpec)")
        if (pp > 1 or sequence_parallel) and family.pipeline is None:
            raise ValueError(f"family {family.name!r} declares no pipeline spec (PipelineSpec): "
                             "pipeline and sequence parallelism need its layer list")
        if tp > 1:
            if not family.tp_plan:
                raise ValueError(f"parallel.tp={tp}: family {family.name!r} declares no tp_plan")
            tp_apply.apply_tensor_parallel(model, family.tp_plan, family.tp_local, self.tp_group)
        self.sequence_parallel = sequence_parallel and tp > 1
        if self.sequence_parallel:
            tp_apply.apply_sequence_parallel(model, family.pipeline.layers, seq.dim if seq else 1, self.tp_group)
        self.stages: Stages | None = None
        self.embedding_group = None
        if pp > 1:
            self.stages = build_stages(model, family.pipeline, pp=pp, vpp=vpp, rank=self.pp_rank, sizes=pp_layers)
            self.model = self.stages.local
            self.chunks = self.stages.chunks
            # Every rank joins the group's creation, so decide from the full model's structure.
            self.embedding_group = g.group_at("pp", (0, pp - 1)) if _tied(model, family.pipeline) else None
            self.pipeline = Pipeline(self.stages, family.pipeline, pp_ranks=g.ranks_of(["pp"]), pp_rank=self.pp_rank,
                                     kind=pp_schedule)
        else:
            self.model, self.chunks = model, [model]
        # Whether positions must be supplied: the model cannot count them from a sequence slice.
        self._needs_positions = seq is not None and seq.positions is not None and (cp > 1 or pp > 1 or self.sequence_parallel)
        self.buckets = None

    # ----------------------------------------------------------------------------- set-up

    def make_buckets(self, bucket_size: int, *, shard: bool) -> Any:
        """Gradient buckets over the data x context group; with ``shard`` (the distributed
        optimizer) also for a single data-parallel rank, where they hold the fp32-master
        optimizer's gradients without reducing anything."""
        if self.dp_cp_group is None and not shard:
            return None
        from zoo.parallel.data_parallel import GradBuckets

        self.buckets = GradBuckets(self.model, self.dp_cp_group, bucket_size=bucket_size, shard=shard)
        return self.buckets

    # -------------------------------------------------------------------------------- step

    def prepare(self, batch: Mapping[str, Any], seq_length: int) -> dict[str, Any]:
        """This rank's share of a micro-batch (context parallel split, positions filled in)."""
        seq = self.family.sequence
        if seq is None or not self._needs_positions and self.cp == 1:
            return dict(batch)
        return context.split_batch(batch, seq.keys, cp=self.cp, rank=self.cp_rank, seq_len=seq_length, dim=1,
                                   positions_key=seq.positions if self._needs_positions else None)

    def _loss_weight(self, batch: Mapping[str, Any]) -> float:
        """Under CP each rank's loss is a mean over its own tokens; weight it so the average over
        CP ranks is the mean over all tokens (1.0 when every rank holds as many loss tokens)."""
        seq = self.family.sequence
        if self.cp == 1 or seq is None or seq.loss_mask is None or seq.loss_mask not in batch:
            return 1.0
        n = batch[seq.loss_mask].detach().float().sum().reshape(1)
        total = comm.all_reduce(n.clone(), self.cp_group)
        return float(n * self.cp / total.clamp(min=1))

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with context.scope(self.cp_group):
            yield

    def forward_backward(self, batches: Sequence[Mapping[str, Any]], step_fn: StepFn, *, seq_length: int,
                         scale: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> torch.Tensor:
        """Forward and backward of one step's micro-batches (losses averaged over them, gradients
        accumulated). Returns the step's loss: the global mean over micro-batches, data and context
        ranks, known on every rank. ``scale`` maps the loss to what is backpropagated (a loss scaler)."""
        m = len(batches)
        prepared = [self.prepare(b, seq_length) for b in batches]
        weights = [self._loss_weight(b) for b in prepared]
        total = torch.zeros((), dtype=torch.float32)
        buckets = self.buckets
        with self.scope():
            if self.pp == 1:
                for i, batch in enumerate(prepared):
                    sync = buckets.no_sync() if (buckets is not None and i < m - 1) else contextlib.nullcontext()
                    with sync:
                        loss, _ = step_fn(self.model, batch)
                        loss = loss * weights[i] if weights[i] != 1.0 else loss
                        scale(loss / m).backward()
                    total += loss.detach().float().cpu() / m
            else:
                def scale_last(loss: torch.Tensor, mb: int) -> torch.Tensor:
                    return scale(loss * weights[mb] / m)

                def before_backward(chunk: int, last: bool) -> None:
                    if buckets is not None:  # reduce on each chunk's final backward only
                        buckets.sync = last

                losses = self.pipeline.run(prepared, step_fn, scale_loss=scale_last, before_backward=before_backward)
                if buckets is not None:
                    buckets.sync = True
                for i, loss in enumerate(losses):
                    total += loss.float().cpu() * weights[i] / m
                total = comm.all_reduce(total, self.pp_group)  # only the last stage had it
        if self.dp_cp_group is not None:
            total = comm.all_reduce(total, self.dp_cp_group) / (self.dp * self.cp)
        return total

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Mapping[str, Any]], step_fn: StepFn, *, seq_length: int) -> float:
        """Mean loss over ``batches`` without gradients (forward-only pipeline), averaged over
        data and context ranks like a training step's loss."""
        if not batches:
            return float("nan")
        prepared = [self.prepare(b, seq_length) for b in batches]
        weights = [self._loss_weight(b) for b in prepared]
        total = torch.zeros((), dtype=torch.float32)
        with self.scope():
            if self.pp == 1:
                losses = [step_fn(self.model, b)[0] for b in prepared]
            else:
                losses = self.pipeline.run(prepared, step_fn, scale_loss=lambda x, _: x, forward_only=True)
            for i, loss in enumerate(losses):
                total += loss.float().cpu() * weights[i] / len(prepared)
            if self.pp > 1:
                total = comm.all_reduce(total, self.pp_group)
        if self.dp_cp_group is not None:
            total = comm.all_reduce(total, self.dp_cp_group) / (self.dp * self.cp)
        return float(total)

    def finish_grads(self) -> None:
        """After the last backward of a step: wait for the data-parallel reductions, sum the
        sequence-parallel norm gradients over TP and tied embeddings over the first and last stage."""
        if self.buckets is not None:
            self.buckets.finish()
        if self.sequence_parallel:
            from zoo.parallel.tensor_parallel import reduce_sequence_parallel_grads

            reduce_sequence_parallel_grads(self.model, self.tp_group)
        sync_tied_grads(self.model, self.embedding_group)

    def clip(self, max_norm: float) -> float:
        return tp_apply.clip_grad_norm(self.model, max_norm, self.tp_group, self.pp_group)

    # --------------------------------------------------------------- full-tensor state (checkpoints)

    def canonical(self, name: str) -> str:
        return self.stages.canonical.get(name, name) if self.stages is not None else name

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient at its full shape under its single-process name (collective; for tests
        and debugging)."""
        if self.buckets is not None:
            self.buckets.unshard()
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is None or self.canonical(name) != name:
                continue
            st = tp_apply.tp_style(self.model, name)
            out[name] = tp_apply.gather_full(p.grad, *st) if st else p.grad.detach().clone()
        return gather_state(out, self.pp_group) if self.stages is not None else out

    def global_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Optimizer param groups with every stage's parameter names, in single-process order."""
        if self.stages is None:
            return groups
        order = {n: i for i, n in enumerate(self.stages.global_order)}
        merged = []
        for per_stage in zip(*gather_objects(groups, self.pp_group)):
            names = {n for g in per_stage for n in g["params"] if n in order}
            merged.append({**per_stage[0], "params": sorted(names, key=order.__getitem__)})
        return merged

    def local_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a single-process state dict (TP shards of its stage's tensors)."""
        keys = self.model.state_dict().keys()
        missing = [k for k in keys if k not in full]
        if missing:
            from zoo.tensorio import CheckpointError

            raise CheckpointError(f"the checkpoint lacks {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        state = {k: full[k] for k in keys}
        return tp_apply.load_full_state_dict(self.model, state) if self.tp_group is not None else state

    def local_optimizer(self, tensors: Mapping[str, torch.Tensor], groups: list[dict[str, Any]], opt_order: list[list[str]]
                        ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """Saved optimizer tensors and groups (single-process names) for this rank's parameters,
        keyed by its own names; ``opt_order`` lists this rank's names per param group."""
        if self.stages is None:
            return dict(tensors), groups
        by_param: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for key, value in tensors.items():
            name, _, fieldname = key.partition("::")
            by_param.setdefault(name, []).append((fieldname, value))
        out = {}
        for names in opt_order:
            for n in names:
                for fieldname, value in by_param.get(self.canonical(n), []):
                    out[f"{n}::{fieldname}"] = value
        local_groups = [{**g, "params": list(names)} for g, names in zip(groups, opt_order)]
        for g, names in zip(groups, opt_order):
            saved = set(g["params"])
            absent = [n for n in names if self.canonical(n) not in saved]
            if absent:
                from zoo.tensorio import CheckpointError

                raise CheckpointError(f"optimizer state has no entry for parameter {self.canonical(absent[0])!r}")
        return out, local_groups


__all__ = ["Parallel"]
