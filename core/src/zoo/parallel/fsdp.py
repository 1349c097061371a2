"""FSDP as zoo applies it (torch's ``fully_shard``, FSDP2) to the chunks of a `Parallel` layout.

Every block of every chunk is its own unit (gathered just before it runs, freed after), then each
chunk's remaining parameters (embeddings, final norm, head); bf16 compute with fp32 gradient
reduction under ``train.precision=bf16``. The units shard over the data x context group
(context-parallel ranks hold the same parameters and average their gradients, so they share the
sharding, as torchtitan's dp_shard x cp mesh). With ``parallel.fsdp`` below the data-parallel size
(HSDP) each group of that many neighbouring data-parallel ranks (x cp) shards and the groups
replicate: a 2-D (replicate, shard) mesh on which FSDP reduce-scatters inside a group and
all-reduces across the replicas, so parameters are gathered over the nearer ranks only.

Under expert parallelism each MoE layer's experts are a unit of their own on the
expert-data-parallel mesh (`_shard_experts`). What FSDP leaves whole (0-d parameters, experts no
other rank replicates) gets its gradient reduction in `finish_whole_grads`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zoo.parallel import comm
from zoo.parallel.grid import ProcessGrid
from zoo.parallel.sharding import EPShard

if TYPE_CHECKING:
    from zoo.parallel.engine import Parallel


def apply(par: Parallel, device: Any) -> None:
    """Shard ``par``'s chunks; sets its ``fsdp_roots`` (each chunk, an FSDP module), ``fsdp_group``
    (the ranks one parameter is sharded over), ``fsdp_replicas`` and ``fsdp_replica`` (HSDP's
    replicate group and this rank's index in it; None and 0 without HSDP)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lay, kind = par.layout, torch.device(device).type
    if lay.fsdp < par.dp:
        # dp split into shard (fsdp neighbouring DP ranks, varying faster) x replicate
        order = [b for a in lay.order.split("-") if a != "ep" for b in (("shard", "rep") if a == "dp" else (a,))]
        sizes = {"tp": par.tp, "cp": par.cp, "shard": lay.fsdp, "rep": par.dp // lay.fsdp, "pp": par.pp}
        fg = ProcessGrid(sizes, order, rank=par.grid.rank, world_size=par.grid.world_size, share=par.grid)
        par.fsdp_group, par.fsdp_replicas, par.fsdp_replica = fg.group("cp", "shard"), fg.group("rep"), fg.index("rep")
        ranks = [fg.ranks_of(["cp", "shard"], r) for r in fg.ranks_of(["rep"])]
        mesh = DeviceMesh.from_group([par.fsdp_replicas, par.fsdp_group], kind, mesh=ranks,
                                     mesh_dim_names=("replicate", "shard"))
    else:
        mesh = DeviceMesh.from_group(par.dp_cp_group, kind)
    # bf16: parameters gathered and computed in bf16, gradients reduced in fp32. fp16 gathers fp32 and
    # leaves the casts to autocast, as one process does: FSDP accumulates a step's micro-batches in
    # the gathered dtype, and fp16 gradients would overflow at a lower loss scale than the same run
    # without FSDP (the layout would change which steps are skipped)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if lay.fsdp_dtype == "bf16" else MixedPrecisionPolicy()
    pipe = par.family.pipeline
    expert_mesh = DeviceMesh.from_group(par.edp_group, kind) if par.edp_group is not None else None
    for chunk in par.chunks:
        ignored = _shard_experts(par, chunk, mesh, expert_mesh, mp) if par.expert_mp_group is not None else set()
        # FSDP cannot shard a 0-d parameter (CLIP's logit scale): it stays whole on every rank
        ignored = ignored | {p for p in chunk.parameters() if p.dim() == 0} or None
        for block in getattr(chunk, pipe.layers) if pipe is not None else ():
            fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored)
        fully_shard(chunk, mesh=mesh, mp_policy=mp, ignored_params=ignored)
        # FSDP hooks backward onto a unit's output; a view there (a DiT's last linear over (B, N, D)
        # is one) would lose that hook to any in-place op on it, and torch warns on every rank:
        # the output becomes a tensor of its own before FSDP sees it
        chunk.register_forward_hook(_not_a_view, prepend=True)
        par.fsdp_roots.append(chunk)


def _shard_experts(par: Parallel, chunk: nn.Module, mesh: Any, expert_mesh: Any, mp: Any) -> set[nn.Parameter]:
    """FSDP for the MoE layers of ``chunk`` under expert parallelism, as torchtitan's: each rank's
    experts are replicated over their expert-data-parallel ranks, not over the data x context
    ones, so each MoE layer's experts are a unit of their own on the expert-data-parallel mesh,
    gradients summed there and divided by the data x context size (as the gradient buckets do
    without FSDP); its router and shared expert are units on the dense mesh. Where no other rank
    replicates a rank's experts (edp = 1) they stay whole, outside FSDP: returns them, for the
    enclosing units to ignore."""
    from torch.distributed.fsdp import fully_shard

    ignored: set[nn.Parameter] = set()
    for moe in [m for m in chunk.modules() if hasattr(m, "shard_experts")]:
        for child in moe.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, mp_policy=mp)
        if expert_mesh is None:
            ignored.update(moe.parameters(recurse=False))
            continue
        fully_shard(moe, mesh=expert_mesh, mp_policy=mp)
        # (summed, then divided after the reduction: no PREMUL_SUM, which gloo lacks)
        moe.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        moe.set_gradient_divide_factor(float(par.dp * par.cp))  # type: ignore[operator]
    return ignored


def finish_whole_grads(par: Parallel) -> None:
    """After the last backward: the gradients of what FSDP left whole, reduced as FSDP reduces its
    own: experts no other rank holds divided by the data x context size, 0-d parameters averaged
    over the data x context ranks."""
    if par.dp * par.cp == 1:
        return
    for name, p in par.model.named_parameters():
        if p.grad is None or sharded(p):
            continue
        expert = isinstance(par.placements[name].shard, EPShard)
        (p.grad if expert else comm.all_reduce(p.grad, par.dp_cp_group)).div_(par.dp * par.cp)


def sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is an FSDP (DTensor) parameter or gradient."""
    return getattr(t, "device_mesh", None) is not None


def _not_a_view(module: nn.Module, args: Any, output: Any) -> Any:
    return output.clone() if isinstance(output, torch.Tensor) and output._base is not None else None


__all__ = ["apply", "finish_whole_grads", "sharded"]
