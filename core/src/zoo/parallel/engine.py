"""Every parallel layout behind one object: `Parallel` takes the plain model a family built (the
same full model on every rank, from one seed) and a validated `Layout`, and applies, in this
order, tensor parallelism (the family's ``tp_plan``), sequence parallelism (the family's
``sequence.dim``), pipeline stages (the family's `PipelineSpec`), context parallelism (ring
attention in every `zoo.nn.AttentionCore`, batches split by `prepare`) and the data-parallel
gradient buckets over the data x context group. What it did to each parameter is recorded once,
in ``placements`` (`zoo.parallel.sharding`).

One optimizer step is then ``forward_backward`` (all micro-batches, with or without a pipeline
schedule; the loss and the family's metrics reduced over micro-batches and ranks), ``finish_grads``
(DP reduction, sequence-parallel norm gradients, tied embeddings) and ``clip``. The trainer and
the tests use exactly this path.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zoo.errors import PluginError
from zoo.family import Family
from zoo.parallel import apply as tp_apply
from zoo.parallel import comm, context, fsdp
from zoo.parallel.data_parallel import grad_of
from zoo.parallel.grid import ProcessGrid
from zoo.parallel.layout import Layout
from zoo.parallel.materialize import InitRecord, allocate, replay, tensor_refs
from zoo.parallel.pipeline import Pipeline, Stages, _tied, build_stages, gather_objects, gather_state, sync_tied_grads
from zoo.parallel.sharding import EPShard, ExpertShard, FSDPChunk, Placement, Placements, local

StepFn = Callable[[nn.Module, dict[str, Any]], tuple[Any, Any]]


class StepOutput(NamedTuple):
    """A step's (or an evaluation's) results, the same on every rank: ``loss`` is what was
    backpropagated (auxiliary terms included), ``metrics`` holds ``"loss"`` (the main objective)
    and the family's declared metrics, each reduced as declared. All are 0-dim float32 tensors."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


class Parallel:
    """``model``: the plain model every rank built in full from one seed, or (``init`` given) the
    model built on the meta device by `zoo.parallel.materialize.record_build`, of which this rank
    then materialises only its own parameters on ``device``, bitwise those of the full build.
    ``model_config``: the model's config, which decides the family's metrics that have a ``when``
    (`Family.metrics_for`); None: every declared metric."""

    def __init__(self, model: nn.Module, family: Family, layout: Layout, *, rank: int = 0, seed: int = 1234,
                 init: InitRecord | None = None, device: Any = "cpu", model_config: Any = None) -> None:
        self.family, self.layout = family, layout
        self.graphs: Any = None  # a GraphedMicroBatches under train.cuda_graph (zoo.parallel.cuda_graphs)
        refs = tensor_refs(model) if init is not None else {}
        lay = layout
        self.tp, self.cp, self.pp, self.dp, self.vpp = lay.tp, lay.cp, lay.pp, lay.dp, lay.vpp
        self.grid = ProcessGrid({"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp},
                                [a for a in lay.order.split("-") if a != "ep"], rank=rank, world_size=lay.world_size)
        g = self.grid
        self.tp_group, self.cp_group, self.pp_group = g.group("tp"), g.group("cp"), g.group("pp")
        self.dp_cp_group = g.group("dp", "cp")  # gradients are averaged over data and context ranks
        self.dp_rank, self.cp_rank, self.pp_rank = g.index("dp"), g.index("cp"), g.index("pp")
        self.tp_rank = g.index("tp")
        from zoo.parallel.random import TensorParallelRNG

        # Dropout inside TP regions draws from this (`tp_rng.fork()`); saved with checkpoints.
        self.tp_rng = TensorParallelRNG(seed, self.tp_rank)
        seq, pipe = family.sequence, family.pipeline
        tp_plan, tp_local = tp_apply.tensor_parallel_plan(model, family.tp_plan, family.tp_local)
        if lay.tp > 1:
            with torch.device("meta") if init is not None else contextlib.nullcontext():
                tp_apply.apply_tensor_parallel(model, tp_plan, tp_local, self.tp_group)
        self.sequence_parallel = lay.sequence_parallel and lay.tp > 1
        experts = self._expert_parallel(model, init is not None)
        shards = {**tp_apply.tensor_parallel_shards(model), **experts}
        # Gradients summed over TP after backward: per-head norms (partial per rank's heads) and,
        # under sequence parallelism, whatever a block applies to its sequence shard.
        on_shards: set[str] = tp_apply.per_head_parameters(model, tp_plan) if lay.tp > 1 else set()
        if self.sequence_parallel:
            assert pipe is not None  # the layout checked it
            on_shards |= tp_apply.apply_sequence_parallel(model, pipe.layers, seq.dim if seq else 1, self.tp_group)
            on_shards -= set(experts)  # (reduced over their expert-data-parallel group instead)
        if lay.cp > 1:
            self._ring_attention(model)
        if self.dp > 1:
            for m in model.modules():
                if isinstance(m, context.BatchGather):
                    m.group = g.group("dp")
        self.stages: Stages | None = None
        self.embedding_group = None
        if lay.pp > 1:
            assert pipe is not None
            self.stages = build_stages(model, pipe, pp=lay.pp, vpp=lay.vpp, rank=self.pp_rank, sizes=lay.pp_layers)
            self.model = self.stages.local
            self.chunks = self.stages.chunks
            # Every rank joins the group's creation, so decide from the full model's structure.
            self.embedding_group = g.group_at("pp", (0, lay.pp - 1)) if _tied(model, pipe) else None
            self.pipeline = Pipeline(self.stages, pipe, pp_ranks=g.ranks_of(["pp"]), pp_rank=self.pp_rank,
                                     kind=lay.pp_schedule)
        else:
            self.model, self.chunks = model, [model]
        self.fsdp_roots: list[nn.Module] = []  # FSDP's (`zoo.parallel.fsdp`): its groups, this rank's replica
        self.fsdp_group, self.fsdp_replicas, self.fsdp_replica = self.dp_cp_group, None, 0
        if lay.fsdp > 1:
            fsdp.apply(self, device)
        self.placements = self._placements(shards, on_shards)
        if init is not None:
            self._materialize(init, refs, device)
            self.placements = self._placements(shards, on_shards)  # (by the new parameters' identity)
        # The chunk whose output is the loss (the family's metrics are only known there).
        self._last_chunk = self.chunks[-1] if self.pp_rank == lay.pp - 1 else None
        # Whether positions must be supplied: the model cannot count them from a sequence slice.
        self._needs_positions = (seq is not None and seq.positions is not None
                                 and (lay.cp > 1 or lay.pp > 1 or self.sequence_parallel))
        self.buckets: Any = None
        # Where this rank's bookkeeping tensors (losses, metrics, norms) live: its parameters' device.
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        # (every rank of a run has the same model config, so the same metrics)
        metrics = family.metrics if model_config is None else family.metrics_for(model_config)
        self._metric_specs = [("loss", "mean")] + [(m.name, m.reduce) for m in metrics]
        self._aux = [m.name for m in metrics if m.aux_loss]
        self._vectors = {m.name for m in metrics if m.vector}
        self._vector_sizes: dict[str, int] | None = None

    # ----------------------------------------------------------------------------- set-up

    def _ring_attention(self, model: nn.Module) -> None:
        cores = [m for m in model.modules() if isinstance(m, context.ContextParallelSite) and m.keys_split]
        if not cores:
            raise PluginError(f"parallel.cp={self.cp}: family {self.family.name!r} builds no zoo.nn.AttentionCore, "
                              "so its attention cannot run as ring attention")
        for core in cores:
            core.cp_group = self.cp_group

    def _gradient_sync(self, roots: Sequence[nn.Module], sync: bool) -> None:
        for root in roots:
            root.set_requires_gradient_sync(sync)  # type: ignore[operator]  (an FSDP module)

    def _materialize(self, init: InitRecord, refs: Mapping[str, Any], device: Any) -> None:
        """This rank's parameters and buffers on ``device``, each cut from the full tensor the
        replayed build makes (on the CPU, whose random stream the single-process build uses)."""
        if self.fsdp_roots:  # FSDP's own allocation of its shards, tied parameters kept (swapped, not replaced)
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                for root in [self.model, *self.chunks]:
                    root.to_empty(device=device)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
        else:
            allocate([self.model, *self.chunks], device)
        targets = []
        for name, p in self.model.named_parameters():
            placement = self.placements[name]
            targets.append((refs[placement.name], _keeper(local(p), placement.split)))
        for name, b in self.model.named_buffers():
            targets.append((refs[name], _keeper(b, None)))
        replay(init, targets, "cpu")

    def _placements(self, shards: Mapping[str, Any], on_shards: set[str]) -> Placements:
        st = self.stages
        fsdp_rank = dist.get_rank(self.fsdp_group) if self.fsdp_roots else 0
        edp = dist.get_world_size(self.edp_group) if self.edp_group is not None else 1
        out = {}
        for name, p in self.model.named_parameters():
            canon = st.canonical.get(name, name) if st is not None else name
            chunk = None  # (what FSDP leaves whole has none: `zoo.parallel.fsdp`)
            if self.fsdp_roots and fsdp.sharded(p):  # experts over the expert-data-parallel ranks, the rest over fsdp x cp
                chunk = FSDPChunk(edp, self.edp_rank, p.shape[0]) if isinstance(shards.get(canon), EPShard) \
                    else FSDPChunk(self.layout.fsdp * self.cp, fsdp_rank, p.shape[0])
            out[name] = Placement(canon, shard=shards.get(canon), sequence_parallel=canon in on_shards,
                                  tied=st is not None and name in st.tied,
                                  duplicate=st is not None and name in st.duplicates, fsdp=chunk)
        return Placements(self.model, out)

    def _expert_parallel(self, model: nn.Module, meta: bool) -> dict[str, EPShard]:
        """Every MoE layer (a module with ``shard_experts``, `zoo.nn.moe.MoE`): its routing
        statistics summed over the ranks holding other tokens of the same sequences (TP under
        sequence parallelism, CP; averaged over CP afterwards, hence the gradient scale), and with
        ep > 1 its experts cut to this rank's over the expert grid's EP group, with etp > 1 each
        expert's MLP split over its ETP group. Returns the experts' splits."""
        layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "shard_experts")]
        self.ep_group = self.edp_group = self.expert_mp_group = None  # (expert_mp: ep x etp, for norms)
        self.ep_rank = self.edp_rank = 0
        stats = self.grid.group("tp", "cp") if self.sequence_parallel else self.grid.group("cp")
        self._bias_group = self.grid.group("tp", "cp", "dp") if self.sequence_parallel else self.dp_cp_group
        for _, m in layers:
            m.stats_group, m.stats_scale = stats, float(self.cp)
        ep, etp = self.layout.ep, self.layout.etp
        if ep == etp == 1 or not layers:
            return {}
        from zoo.parallel.grid import expert_grid

        eg = expert_grid(self.grid, etp=etp, ep=ep, order=self.layout.order.split("-"))
        self.ep_group, self.edp_group = eg.group("ep"), eg.group("edp")
        self.ep_rank, self.edp_rank = eg.index("ep"), eg.index("edp")
        self.expert_mp_group = eg.group("etp", "ep")
        etp_group, etp_rank = eg.group("etp"), eg.index("etp")
        out: dict[str, EPShard] = {}
        for name, m in layers:
            with torch.device("meta") if meta else contextlib.nullcontext():
                m.shard_experts(self.ep_group, ep, self.ep_rank, etp_group=etp_group, etp=etp, etp_rank=etp_rank)
            m.dispatcher = self.layout.ep_dispatcher
            for pname, dim in (("gate_up", 1), ("down", 2)):
                out[f"{name}.{pname}"] = EPShard("rows", ep, self.ep_rank, group=self.ep_group) if etp == 1 else \
                    ExpertShard("rows", ep * etp, eg.index("etp", "ep"), group=self.expert_mp_group, etp=etp, dim=dim,
                                gated=dim == 1 and m.gated)
        return out

    def make_buckets(self, bucket_size: int, *, shard: bool, grad_dtype: Any = None) -> Any:
        """Gradient buckets over the data x context group; with ``shard`` (the distributed
        optimizer) also for a single data-parallel rank, where they hold the fp32-master
        optimizer's gradients without reducing anything. Expert-parallel experts are bucketed apart,
        summed over their expert-data-parallel replicas and divided by the data x context size."""
        experts = {id(p) for n, p in self.model.named_parameters() if isinstance(self.placements[n].shard, EPShard)}
        reduce_experts = bool(experts) and (self.edp_group is not None or self.dp * self.cp > 1)
        if (self.dp_cp_group is None and not shard and not reduce_experts) or self.fsdp_roots:  # (FSDP reduces its own)
            return None
        from zoo.parallel.data_parallel import GradBuckets

        partitions = [(experts, self.edp_group, self.dp * self.cp)] if experts else []
        self.buckets = GradBuckets(self.model, self.dp_cp_group, bucket_size=bucket_size, shard=shard,
                                   partitions=partitions, grad_dtype=grad_dtype)
        return self.buckets

    # -------------------------------------------------------------------------------- step

    def prepare(self, batch: Mapping[str, Any], seq_length: int) -> dict[str, Any]:
        """This rank's share of a micro-batch (context parallel split, positions filled in)."""
        seq = self.family.sequence
        if seq is None or not self._needs_positions and self.cp == 1:
            return dict(batch)
        # The batch's own length: a family whose rows are padded to their longest (a DiT's) may
        # run shorter than train.seq_length.
        ref = next((batch[k] for k in seq.keys if torch.is_tensor(batch.get(k)) and batch[k].dim() > 1), None)
        length = ref.shape[1] if ref is not None else seq_length
        return context.split_batch(batch, seq.keys, cp=self.cp, rank=self.cp_rank, seq_len=length, dim=1,
                                   positions_key=seq.positions if self._needs_positions else None)

    def _loss_weight(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Under CP each rank's loss is a mean over its own tokens; weight it so the average over
        CP ranks is the mean over all tokens (1 when every rank holds as many loss tokens). A
        float32 scalar on the batch's device: reading it on the host would synchronise per
        micro-batch."""
        seq = self.family.sequence
        if self.cp == 1 or seq is None or seq.loss_mask is None or seq.loss_mask not in batch:
            return torch.ones((), dtype=torch.float32, device=self.device)
        n = batch[seq.loss_mask].detach().float().sum().reshape(1)
        total = comm.all_reduce(n.clone(), self.cp_group)
        return (n * self.cp / total.clamp(min=1)).reshape(())

    def _objective(self, step_fn: StepFn) -> StepFn:
        """The family's loss with its auxiliary terms added (on the stage that computes the loss);
        returns ``(what to backpropagate, {"loss": main objective, **metrics})``. Metrics the family
        did not declare are averaged like the loss; a pipeline needs them declared (its other
        stages must know what to reduce)."""
        declared = {name for name, _ in self._metric_specs}

        def run(model: nn.Module, batch: dict[str, Any]) -> tuple[Any, Any]:
            out, metrics = step_fn(model, batch)
            if model is not self._last_chunk:
                return out, {}
            missing = sorted(declared - {"loss"} - set(metrics))
            undeclared = sorted(set(metrics) - declared)
            if missing or (undeclared and self.pp > 1) or "loss" in metrics:
                raise PluginError(f"family {self.family.name!r}: its loss returned metrics {sorted(metrics)}; declared in "
                                  f"Family.metrics: {sorted(declared - {'loss'})} (under pipeline parallelism every "
                                  "metric must be declared; 'loss' is the core's)")
            total = out
            for name in self._aux:
                total = total + metrics[name]
            return total, {"loss": out, **metrics}

        return run

    def _reduce(self, per_mb: Sequence[Mapping[str, Any]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
        """Micro-batch metrics -> step metrics on every rank: ``mean`` weighted like the loss,
        ``sum``, ``max``. Only the last pipeline stage has any (``per_mb`` is empty elsewhere);
        ``total`` (what was backpropagated, when auxiliary terms make it differ from the loss) is
        averaged like the loss, and so are metrics the family did not declare (pp = 1 only: every
        rank then knows their names)."""
        extra = sorted(set(per_mb[0]) - {"total"} - {n for n, _ in self._metric_specs}) if per_mb else []
        specs = [*([("total", "mean")] if self._aux else []), *self._metric_specs, *[(name, "mean") for name in extra]]
        sizes = self._metric_sizes(specs, per_mb)
        starts = [sum(sizes[:i]) for i in range(len(specs))]
        m = len(weights)
        # Everything stays on the device (a collective of the device's backend reduces it); the
        # trainer reads the results once per logging interval.
        sums = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
        maxes = torch.full((sum(sizes),), -math.inf, dtype=torch.float32, device=self.device)
        for (name, kind), a, z in zip(specs, starts, sizes):
            for metrics, w in zip(per_mb, weights):
                v = torch.as_tensor(metrics[name], device=self.device).detach().float().reshape(z)
                if kind == "mean":
                    sums[a:a + z] += v * w / m  # (w is 1 unless context parallelism weighs the ranks)
                elif kind == "sum":
                    sums[a:a + z] += v
                else:
                    maxes[a:a + z] = torch.maximum(maxes[a:a + z], v)
        if self.pp > 1:
            sums = comm.all_reduce(sums, self.pp_group)  # only the last stage had them
        if self.dp_cp_group is not None:
            sums = comm.all_reduce(sums, self.dp_cp_group)
            for (_, kind), a, z in zip(specs, starts, sizes):
                if kind == "mean":
                    sums[a:a + z] /= self.dp * self.cp
        if any(kind == "max" for _, kind in specs):
            for group in (self.pp_group if self.pp > 1 else None, self.dp_cp_group):
                maxes = comm.all_reduce(maxes, group, torch.distributed.ReduceOp.MAX)
        out = {}
        for (name, kind), a, z in zip(specs, starts, sizes):
            v = (maxes if kind == "max" else sums)[a:a + z]
            if name not in self._vectors:
                out[name] = v[0]
                continue
            # One value per element (an MoE layer's load, say) and the whole under the plain name.
            out.update({f"{name}/{j}": v[j] for j in range(z)})
            out[name] = (v.max() if kind == "max" else v.sum() if kind == "sum" else v.mean()) if z else sums.new_zeros(())
        return out

    def _metric_sizes(self, specs: Sequence[tuple[str, str]], per_mb: Sequence[Mapping[str, Any]]) -> list[int]:
        """Elements of each metric: 1, or a vector metric's length, which under pipeline
        parallelism only the last stage knows (told to the others once: it never changes)."""
        if not self._vectors:
            return [1] * len(specs)
        if self._vector_sizes is None:
            known = [(torch.as_tensor(per_mb[0][name]).numel() if per_mb else 0) if name in self._vectors else 1
                     for name, _ in specs]
            if self.pp > 1:
                known = comm.all_reduce(torch.tensor(known, device=self.device), self.pp_group,
                                        torch.distributed.ReduceOp.MAX).tolist()
            self._vector_sizes = {name: int(z) for (name, _), z in zip(specs, known)}
        return [self._vector_sizes.get(name, 1) for name, _ in specs]

    def forward_backward(self, batches: Sequence[Mapping[str, Any]], step_fn: StepFn, *, seq_length: int,
                         scale: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> StepOutput:
        """Forward and backward of one step's micro-batches (losses averaged over them, gradients
        accumulated). The loss is the global mean over micro-batches, data and context ranks.
        ``scale`` maps the loss to what is backpropagated (a loss scaler)."""
        m = len(batches)
        prepared = [self.prepare(b, seq_length) for b in batches]
        weights = [self._loss_weight(b) for b in prepared]
        objective = self._objective(step_fn)
        buckets = self.buckets
        results: list[tuple[torch.Tensor, Any]] = []
        if self.pp == 1:
            def micro_batch(batch: dict[str, Any], weight: torch.Tensor) -> tuple[torch.Tensor, Any]:
                loss, metrics = objective(self.model, batch)
                scale(loss * weight / m).backward()  # (m: fixed for a run, so a graph may keep it)
                return loss.detach(), metrics

            for i, batch in enumerate(prepared):
                sync = buckets.no_sync() if (buckets is not None and i < m - 1) else contextlib.nullcontext()
                if self.fsdp_roots:  # reduce-scatter on the last micro-batch only
                    self._gradient_sync(self.fsdp_roots, i == m - 1)
                with sync:  # (train.cuda_graph: replayed from a graph of this batch shape)
                    run = micro_batch if self.graphs is None else functools.partial(self.graphs, micro_batch)
                    results.append(run(batch, weights[i]))
        else:
            def scale_last(loss: torch.Tensor, mb: int) -> torch.Tensor:
                return scale(loss * weights[mb] / m)

            def before_backward(chunk: int, last: bool) -> None:
                if buckets is not None:  # reduce on each chunk's final backward only
                    buckets.sync = last
                if self.fsdp_roots:
                    self._gradient_sync([self.fsdp_roots[chunk]], last)

            results = self.pipeline.run(prepared, objective, scale_loss=scale_last, before_backward=before_backward)
            if buckets is not None:
                buckets.sync = True
        return self._step_output(results, weights)

    def _step_output(self, results: Sequence[tuple[torch.Tensor, Any]], weights: Sequence[float]) -> StepOutput:
        reduced = self._reduce([{**metrics, "total": loss} for loss, metrics in results], weights)
        total = reduced.pop("total") if self._aux else reduced["loss"]
        return StepOutput(total, reduced)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Mapping[str, Any]], step_fn: StepFn, *, seq_length: int) -> StepOutput:
        """Loss and metrics over ``batches`` without gradients (forward-only pipeline), averaged
        over data and context ranks like a training step's."""
        if not batches:
            nan = torch.tensor(float("nan"), device=self.device)
            return StepOutput(nan, {name: nan for name, _ in self._metric_specs})
        prepared = [self.prepare(b, seq_length) for b in batches]
        weights = [self._loss_weight(b) for b in prepared]
        objective = self._objective(step_fn)
        if self.pp == 1:
            results = [objective(self.model, b) for b in prepared]
            results = [(loss.detach(), metrics) for loss, metrics in results]
        else:
            results = self.pipeline.run(prepared, objective, scale_loss=lambda x, _: x, forward_only=True)
        self.reshard()
        return self._step_output(results, weights)

    def reshard(self) -> None:
        """After forwards without backward (evaluation, previews): an FSDP root keeps its gathered
        parameters registered until then; put its shards back (what the optimizer and checkpoints hold)."""
        for root in self.fsdp_roots:
            root.reshard()  # type: ignore[operator]

    def finish_grads(self) -> None:
        """After the last backward of a step: wait for the data-parallel reductions, sum over TP the
        gradients of what is applied to a part of the data there (norms on sequence shards, per-head
        norms on a rank's heads) and tied embeddings' over the first and last stage."""
        if self.buckets is not None:
            self.buckets.finish()
        if self.fsdp_roots:
            fsdp.finish_whole_grads(self)
        params = dict(self.model.named_parameters())
        if self.tp > 1:
            from zoo.parallel.tensor_parallel import reduce_sequence_parallel_grads

            reduce_sequence_parallel_grads([params[n] for n, pl in self.placements.items() if pl.sequence_parallel],
                                           self.tp_group)
        sync_tied_grads([params[n] for n, pl in self.placements.items() if pl.tied], self.embedding_group)
        for m in self.model.modules():  # aux-loss-free balancing: once per step, loads summed over the batch's ranks
            router = getattr(m, "router", None)
            if hasattr(m, "shard_experts") and getattr(router, "expert_bias", None) is not None:
                router.update_bias(m.bias_update_rate, self._bias_group)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` by the whole model's gradient norm, which is returned (on the device)."""
        return tp_apply.clip_grad_norm(self.model, self.placements, max_norm, self.tp_group, self.pp_group,
                                       device=self.device, dp_group=self.fsdp_group if self.fsdp_roots else None,
                                       ep_group=self.expert_mp_group, edp_group=self.edp_group if self.fsdp_roots else None,
                                       fsdp=bool(self.fsdp_roots))

    def grad_norm_squared(self, pairs: Any, dp_group: Any = None) -> torch.Tensor:
        """`zoo.parallel.apply.grad_norm_squared` over this layout's groups, for ``(gradient,
        parameter)`` pairs (the distributed optimizer's pieces)."""
        return tp_apply.grad_norm_squared(((g, self.placements.of(p)) for g, p in pairs), tp_group=self.tp_group,
                                          pp_group=self.pp_group, dp_group=dp_group, device=self.device,
                                          ep_group=self.expert_mp_group, edp_group=self.edp_group)

    # --------------------------------------------------------------- full-tensor state (tests, checkpoints)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient at its full shape under its single-process name (collective; for tests
        and debugging)."""
        if self.buckets is not None:
            self.buckets.unshard()
        out = {}
        for name, p in self.model.named_parameters():
            placement = self.placements[name]
            grad = grad_of(p)
            if grad is None or placement.duplicate:
                continue
            out[placement.name] = _full(grad, placement)
        return gather_state(out, self.pp_group) if self.stages is not None else out

    def full_state(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Local tensors shaped like this rank's parameters (by local name) at their full shape under
        single-process names, on every rank (collective)."""
        out = {}
        for name, t in tensors.items():
            placement = self.placements.get(name)
            if placement is None or placement.duplicate:
                continue
            out[placement.name] = _full(t, placement)
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


def _keeper(data: torch.Tensor, split: Any) -> Callable[[torch.Tensor], None]:
    def keep(full: torch.Tensor) -> None:
        data.copy_(split.cut(full) if split is not None else full)

    return keep


def _full(t: torch.Tensor, placement: Placement) -> torch.Tensor:
    """A tensor shaped like a parameter at its single-process shape (collective: FSDP's gather
    over data-parallel ranks, then tensor parallelism's)."""
    t = t.detach()
    full_tensor = getattr(t, "full_tensor", None)
    t = full_tensor() if callable(full_tensor) else t.clone()
    return placement.shard.gather(t) if placement.shard else t


__all__ = ["Parallel", "StepOutput"]
