"""Apply tensor parallelism to a plain model from the family's static plan (torchtitan's way:
the model file stays architecture only; a table names which modules split how).

Every rank builds the full model from the same seed, then each planned `nn.Linear`/`nn.Embedding`
is replaced by its tensor-parallel counterpart holding this rank's slice, so the sharded model is
the same model for any TP size. How each parameter is split is the layer's `TPShard`
(`zoo.parallel.sharding`), collected by `tensor_parallel_shards`. Styles:

- ``column``: output rows split contiguously (a fused q|k|v laid out per KV group hands every
  rank whole groups); ``column_gated``: a fused ``[gate; up]`` whose halves are split per rank and
  re-joined as ``[gate_r; up_r]``; ``column_context``: a column split whose input is a replicated
  side input (cross-attention keys/values from text), never the sequence-sharded residual stream;
  ``column_segments``: the output packs segments (sizes in the module's ``tp_segments``), each split
  contiguously, so a rank holds whole heads and groups of every segment (Mamba-2's [z, x, B, C, dt]);
  ``row``: input columns split, partial sums all-reduced; ``row_allreduce``: the same, whose whole
  output feeds every rank's channels (Mamba-1's x_proj: dt, B, C), so its gradient, partial per
  rank, is all-reduced on the way back too (and sequence parallelism leaves it alone);
  ``column_local``: a column split of such a replicated input, with no communication of its own
  (the preceding ``row_allreduce`` sums its input gradient; Mamba-1's dt_proj);
- ``channels``: the module's own parameters (not its children's) split along dim 0, by
  ``tp_segments`` when it has them; a depthwise ``nn.Conv1d`` keeps its channel count consistent.
  For per-channel state (Mamba's conv, A_log, D, dt_bias, gated norm): no communication;
- ``vocab_embedding`` / ``vocab_head``: vocabulary rows split; a tied head shares the embedding's
  shard, and the loss is computed vocab-parallel (`zoo.nn.linear_cross_entropy`);
- ``per_head``: the module stays whole on every rank but is applied to this rank's heads only (a
  per-head RMSNorm of q and k), so its gradient, partial per rank, is summed over TP after backward
  (`per_head_parameters`), with or without sequence parallelism.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from zoo.parallel import comm
from zoo.parallel.sharding import Placement, Placements, TPShard, local
from zoo.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def _matches(name: str, pattern: str) -> bool:
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, plan: Mapping[str, str], local: Mapping[str, tuple[str, ...]],
                          group: Any) -> nn.Module:
    """Replace every planned module by its tensor-parallel counterpart holding this rank's piece
    (cut from the full module's tensors, so every TP size trains the same model)."""
    n = comm._size(group)
    if n == 1:
        return model
    embeddings: dict[int, VocabParallelEmbedding] = {}
    for name, mod in list(model.named_modules()):
        style = next((s for p, s in plan.items() if _matches(name, p)), None)
        if style is None:
            continue
        if style == "channels":
            _split_channels(name, mod, group)
            continue
        if style == "per_head":  # whole here; its gradient is summed (`per_head_parameters`)
            continue
        if style in ("column", "column_gated", "vocab_head", "column_context", "column_segments", "column_local"):
            assert isinstance(mod, nn.Linear), f"{name}: {style} needs nn.Linear, found {type(mod).__name__}"
            segments = tuple(getattr(mod, "tp_segments", ())) if style == "column_segments" else ()
            if style == "column_segments" and not segments:
                raise ValueError(f"tp_plan: {name} is column_segments but declares no tp_segments")
            new: nn.Module = ColumnParallelLinear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                                  group=group, gated=style == "column_gated", vocab=style == "vocab_head",
                                                  segments=segments)
            if style == "vocab_head" and id(mod.weight) in embeddings:  # tied: share the embedding's shard
                new.weight = embeddings[id(mod.weight)].weight
            else:
                new.load_full(mod.weight, mod.bias)
            new.takes_context = style in ("column_context", "column_local")  # type: ignore[assignment]
            new.local = style == "column_local"  # type: ignore[assignment]
        elif style in ("row", "row_allreduce"):
            assert isinstance(mod, nn.Linear), f"{name}: {style} needs nn.Linear"
            new = RowParallelLinear(mod.in_features, mod.out_features, bias=mod.bias is not None, group=group)
            new.load_full(mod.weight, mod.bias)
            new.takes_context = new.feeds_split = style == "row_allreduce"  # type: ignore[assignment]
        elif style == "vocab_embedding":
            assert isinstance(mod, nn.Embedding), f"{name}: vocab_embedding needs nn.Embedding"
            new = VocabParallelEmbedding(mod.num_embeddings, mod.embedding_dim, group=group, padding_idx=mod.padding_idx)
            new.load_full(mod.weight)
            embeddings[id(mod.weight)] = new
        else:
            raise ValueError(f"tp_plan: unknown style {style!r} for {name}")
        _set(model, name, new)
    for name, mod in model.named_modules():
        for pattern, attrs in local.items():
            if _matches(name, pattern):
                for a in attrs:
                    value = getattr(mod, a)
                    if value % n:
                        raise ValueError(f"{name}.{a}={value} does not split over tp={n}")
                    setattr(mod, a, value // n)
    return model


def derived_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The tensor-parallel plan the layers of ``model`` declare themselves: module name -> style,
    and module name -> the attributes counting heads that TP divides. A layer the core builds from
    a layer spec says how it splits through two members (`SplitsUnderTP`): ``tensor_parallel()``,
    names relative to it (``""``: itself) -> style, and ``tensor_parallel_sizes``. Megatron's split:

    - `zoo.nn.layers.SelfAttention` (an `AttentionSpec`): the fused q|k|v ``column`` (laid out per
      KV group, so a rank holds whole groups), the output ``row``, per-head q/k norms ``per_head``;
    - `zoo.nn.layers.MLP` (an `MLPSpec`, also a MoE's shared expert): ``fc`` ``column_gated`` when
      the spec is gated (the fused [gate; up] split per half), else ``column``; ``proj`` ``row``;
    - `zoo.nn.linear.TokenEmbedding` / `zoo.nn.linear.LMHead` (``embedding="token"``, ``head="lm"``): the
      vocabulary split (``vocab_embedding`` / ``vocab_head``).

    Norms and everything else stay replicated; routed experts are sharded by expert parallelism.
    A plugin's own module may declare the same two members instead of ``tp_plan`` patterns."""
    plan: dict[str, str] = {}
    sizes: dict[str, tuple[str, ...]] = {}
    for name, mod in model.named_modules():
        declare = getattr(mod, "tensor_parallel", None)
        if not callable(declare):
            continue
        for leaf, style in declare().items():
            plan[".".join(p for p in (name, leaf) if p)] = style
        if getattr(mod, "tensor_parallel_sizes", ()):
            sizes[name] = tuple(mod.tensor_parallel_sizes)
    return plan, sizes


class SplitsUnderTP(Protocol):
    """What a module declares to be split by the core under tensor parallelism (`derived_plan`)."""

    tensor_parallel_sizes: tuple[str, ...]  # attributes counting heads, divided by the TP size

    def tensor_parallel(self) -> Mapping[str, str]: ...


def tensor_parallel_plan(model: nn.Module, declared: Mapping[str, str] | None = None,
                         declared_local: Mapping[str, tuple[str, ...]] | None = None
                         ) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The plan `apply_tensor_parallel` takes for ``model``: a family's own entries (``tp_plan``,
    ``tp_local``: patterns for the modules the spec vocabulary does not describe) first, then what
    the core derives (`derived_plan`) for every module those entries do not name."""
    declared, declared_local = dict(declared or {}), dict(declared_local or {})
    derived, sizes = derived_plan(model)
    plan = {**declared, **{n: s for n, s in derived.items() if not any(_matches(n, p) for p in declared)}}
    local = {**declared_local,
             **{n: a for n, a in sizes.items() if not any(_matches(n, p) for p in declared_local)}}
    return plan, local


def per_head_parameters(model: nn.Module, plan: Mapping[str, str]) -> set[str]:
    """The parameters of the modules the plan marks ``per_head``: whole on every TP rank, their
    gradients partial (each rank's heads), so summed over TP after backward."""
    heads = [p for p, s in plan.items() if s == "per_head"]
    return {f"{name}.{pname}" if name else pname for name, mod in model.named_modules()
            if any(_matches(name, p) for p in heads) for pname, _ in mod.named_parameters()}


class _Channels:
    """The `tp_shards` of a module whose own parameters `_split_channels` cut."""

    def __init__(self, shards: dict[str, TPShard]) -> None:
        self.shards = shards

    def __call__(self) -> dict[str, TPShard]:
        return self.shards


@torch.no_grad()
def _split_channels(name: str, mod: nn.Module, group: Any) -> None:
    n, r = comm._size(group), comm._rank(group)
    segments = tuple(getattr(mod, "tp_segments", ()))
    shards = {}
    for pname, p in list(mod.named_parameters(recurse=False)):
        shard = TPShard("segments" if segments else "rows", n, r, group, segments)
        try:
            piece = shard.cut(p.data)
        except ValueError as e:
            raise ValueError(f"{name}.{pname}: {e}") from None
        setattr(mod, pname, nn.Parameter(piece, requires_grad=p.requires_grad))
        shards[pname] = shard
    if isinstance(mod, nn.Conv1d) and mod.groups == mod.in_channels == mod.out_channels:  # depthwise
        mod.in_channels = mod.out_channels = mod.groups = mod.weight.shape[0]
    mod.tp_shards = _Channels(shards)  # type: ignore[assignment]


def tensor_parallel_shards(model: nn.Module) -> dict[str, TPShard]:
    """Parameter name -> its split, read off the tensor-parallel layers (a parameter shared by two
    of them, a tied head, appears under both names)."""
    out = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        shards = getattr(mod, "tp_shards", None)
        if callable(shards):
            for pname, shard in shards().items():
                out[f"{prefix}.{pname}" if prefix else pname] = shard
    return out


@torch.no_grad()
def apply_sequence_parallel(model: nn.Module, layers: str, dim: int, group: Any) -> set[str]:
    """Shard the residual stream between tensor-parallel regions along the sequence (Korthikanti et
    al. 2022): the input of the first block is split over TP, the output of the last one gathered;
    column-parallel layers all-gather their input and row-parallel ones reduce-scatter their
    output along ``dim``. Norms (and other replicated parameters) inside the blocks then see only
    their sequence shard, so their gradients are summed over TP after backward
    (`reduce_sequence_parallel_grads`): their names are returned. A whole tensor a block takes
    beside the residual stream (DiT's conditioning vector) is likewise used against a shard, so
    its gradient is summed over TP on the way back (`comm.copy_to`); a per-token one (packed
    samples' segment ids) is cut to the stream's shard by the block's `zoo.nn.SequenceShard`
    modules. Call after `apply_tensor_parallel`, before cutting stages."""
    if comm._size(group) == 1:
        return set()
    from zoo.parallel.context import SequenceShard

    blocks = getattr(model, layers)
    split = tensor_parallel_shards(model)
    on_shards = set()
    for i, block in enumerate(blocks):
        for mod in block.modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and not getattr(mod, "takes_context", False):
                mod.sequence_parallel, mod.seq_dim = True, dim
            elif isinstance(mod, SequenceShard):
                mod.group, mod.dim = group, dim
        for pname, _ in block.named_parameters():
            name = f"{layers}.{i}.{pname}"
            if name not in split:  # norm weights, row-parallel biases: whole, applied to a shard
                on_shards.add(name)

    def scatter(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (comm.scatter_seq(args[0], group, dim), *args[1:])

    def gather(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        # What follows runs replicated on every TP rank (final norm, then the head, whose input
        # gradient is already all-reduced), so the backward takes this rank's slice: a
        # reduce-scatter would count the full gradient TP times.
        return comm.gather_from(out, group, dim)

    def side_inputs(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0], *(comm.copy_to(a, group) if isinstance(a, torch.Tensor) and a.requires_grad else a
                           for a in args[1:]))

    blocks[0].register_forward_pre_hook(scatter)
    for block in blocks:
        block.register_forward_pre_hook(side_inputs)
    blocks[len(blocks) - 1].register_forward_hook(gather)
    return on_shards


# Elements per row of `sum_of_squares`: few enough that a row's float32 norm is exact to ~1e-7.
_NORM_ROW = 2048


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """``(g ** 2).sum()`` as a float64 scalar, to ~2e-7 relative, in one read of ``g``: float32 norms
    of 2048-element rows, squared and summed in float64. (A float64 copy, its square and a sum cost
    a copy of every gradient at twice its width; a float32 norm of a whole tensor is off by 1e-3
    over 16M elements, accumulating sequentially.)"""
    f = g.detach().reshape(-1)
    n = f.numel() // _NORM_ROW * _NORM_ROW
    rows = torch.linalg.vector_norm(f[:n].view(-1, _NORM_ROW), dim=1, dtype=torch.promote_types(f.dtype, torch.float32))
    sq = rows.double().square().sum()
    return sq + f[n:].double().square().sum() if n < f.numel() else sq


def grad_norm_squared(grads: Iterable[tuple[torch.Tensor, Placement | None]], *, tp_group: Any = None,
                      pp_group: Any = None, dp_group: Any = None, device: Any = "cpu", ep_group: Any = None,
                      edp_group: Any = None, fsdp: bool = False) -> torch.Tensor:
    """Sum of squared gradients of the whole (unsharded) model from this rank's ``(gradient, its
    parameter's placement)`` pairs: TP shards summed over TP, replicated ones counted once, the last
    stage's copy of a tied embedding skipped, stages summed over PP, and (for the distributed
    optimizer, whose ranks hold disjoint pieces) pieces summed over ``dp_group``. Expert-parallel
    experts are summed over ``ep_group`` (and, as distributed-optimizer pieces, over ``edp_group``).
    ``fsdp``: the pieces are FSDP's, and a parameter it leaves whole (no ``placement.fsdp``) is the
    same on every rank of ``dp_group``, counted once.
    A float64 scalar on ``device`` (the gradients'), never read on the host here."""
    from zoo.parallel.sharding import EPShard

    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)  # under FSDP, a parameter it left whole
    for g, placement in grads:
        if placement is not None and placement.duplicate:
            continue
        sq = sum_of_squares(g)
        if placement is not None and isinstance(placement.shard, EPShard):
            experts += sq
        elif fsdp and placement is not None and placement.fsdp is None and placement.shard is None:
            whole += sq  # (every rank of dp_group holds the same: counted once, not summed over it)
        elif placement is not None and placement.shard is not None:
            sharded += sq
        else:
            replicated += sq
    total = comm.all_reduce(comm.all_reduce(sharded, tp_group) + replicated, dp_group) + whole
    total = total + comm.all_reduce(comm.all_reduce(experts, edp_group), ep_group)
    return comm.all_reduce(total, pp_group)


def clip_grad_norm(model: nn.Module, placements: Placements, max_norm: float, tp_group: Any, pp_group: Any = None,
                   *, device: Any = "cpu", dp_group: Any = None, ep_group: Any = None, edp_group: Any = None,
                   fsdp: bool = False) -> torch.Tensor:
    """Clip by the global gradient norm of the unsharded model (see `grad_norm_squared`); returns
    the norm before clipping. No host synchronisation: the factor ``min(1, max / (norm + 1e-6))``
    is applied on the device (multiplying by exactly 1 when the norm is below the maximum).
    ``dp_group``, ``edp_group``: FSDP's, whose ranks hold disjoint pieces of every gradient (of the
    experts' over the expert-data-parallel ranks)."""
    pairs = [(local(p.grad), placements.of(p)) for p in model.parameters() if p.grad is not None]
    total = grad_norm_squared(pairs, tp_group=tp_group, pp_group=pp_group, dp_group=dp_group, device=device,
                              ep_group=ep_group, edp_group=edp_group, fsdp=fsdp)
    norm = total.sqrt()
    if max_norm > 0 and pairs:
        scale_grads([g for g, _ in pairs], norm, max_norm)
    return norm


def scale_grads(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """``grads *= min(1, max_norm / (norm + 1e-6))`` computed in float64 on the device."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].device))


def parameters_per_rank(model: nn.Module, plan: Mapping[str, str], tp: int, *, ep: int = 1, etp: int = 1) -> int:
    """Parameters one rank holds: planned modules split over ``tp``, routed experts (``gate_up`` and
    ``down`` of a module with ``shard_experts``) over ``ep`` x ``etp``, the rest replicated."""
    experts = {f"{n}.{k}" if n else k for n, m in model.named_modules() if hasattr(m, "shard_experts")
               for k in ("gate_up", "down")}
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name in experts:
            total += p.numel() // (ep * etp)
            continue
        module = name.rpartition(".")[0]
        split = tp > 1 and any(_matches(module, pat) and plan[pat] != "per_head" for pat in plan)
        total += p.numel() // tp if split else p.numel()
    return total
