"""Apply tensor parallelism to a plain model from the family's static plan (torchtitan's way:
the model file stays architecture only; a table names which modules split how).

Every rank builds the full model from the same seed, then each planned `nn.Linear`/`nn.Embedding`
is replaced by its tensor-parallel counterpart holding this rank's slice, so the sharded model is
the same model for any TP size. Styles:

- ``column``: output rows split contiguously (a fused q|k|v laid out per KV group hands every
  rank whole groups); ``column_gated``: a fused ``[gate; up]`` whose halves are split per rank and
  re-joined as ``[gate_r; up_r]``; ``row``: input columns split, partial sums all-reduced;
- ``vocab_embedding`` / ``vocab_head``: vocabulary rows split; a tied head shares the embedding's
  shard, and the loss is computed vocab-parallel (`zoo.nn.linear_cross_entropy`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zoo.parallel import comm
from zoo.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def _matches(name: str, pattern: str) -> bool:
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _mark(module: nn.Module, group: Any, names: tuple[str, ...], style: str) -> None:
    """Record how a parameter is sharded (``rows``, ``gated_rows``, ``cols``) for gathering it back."""
    for n in names:
        p = getattr(module, n, None)
        if isinstance(p, nn.Parameter) and not hasattr(p, "tp_style"):
            p.tensor_parallel = True  # type: ignore[attr-defined]
            p.tp_shard_group = group  # type: ignore[attr-defined]
            p.tp_style = style if p.dim() > 1 or style != "cols" else "rows"  # type: ignore[attr-defined]


def gather_full(t: torch.Tensor, style: str, group: Any) -> torch.Tensor:
    """The full tensor from this rank's shard (all ranks of ``group`` must call it)."""
    if style == "cols":
        return comm.all_gather(t, group, 1)
    full = comm.all_gather(t, group, 0)
    if style == "gated_rows":  # [g0; u0; g1; u1] -> [g0; g1; u0; u1]
        parts = full.chunk(2 * comm._size(group))
        full = torch.cat(parts[0::2] + parts[1::2])
    return full


def shard_full(t: torch.Tensor, style: str, group: Any) -> torch.Tensor:
    """This rank's shard of a full tensor (the inverse of `gather_full`)."""
    if style == "cols":
        return comm.split(t, group, 1)
    if style == "gated_rows":
        g, u = t.chunk(2)
        return torch.cat([comm.split(g, group, 0), comm.split(u, group, 0)])
    return comm.split(t, group, 0)


def tp_style(model: nn.Module, name: str) -> tuple[str, Any] | None:
    try:
        p = model.get_parameter(name)
    except AttributeError:
        return None
    style = getattr(p, "tp_style", None)
    return (style, p.tp_shard_group) if style else None  # type: ignore[attr-defined]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, with the same keys as the plain model (collective on TP ranks)."""
    out = {}
    for name, t in model.state_dict().items():
        st = tp_style(model, name)
        out[name] = gather_full(t, *st) if st else t
    # Tied tensors stay tied, so the checkpoint stores them once.
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            out[name] = out[by_id[id(p)]]
        else:
            by_id[id(p)] = name
    return out


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Slice a full state dict to this rank's shards (keys as in the plain model)."""
    out = {}
    for name, t in state.items():
        st = tp_style(model, name)
        out[name] = shard_full(t, *st) if st else t
    return out


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, plan: Mapping[str, str], local: Mapping[str, tuple[str, ...]],
                          group: Any) -> nn.Module:
    n = comm._size(group)
    if n == 1:
        return model
    embeddings: dict[int, VocabParallelEmbedding] = {}
    for name, mod in list(model.named_modules()):
        style = next((s for p, s in plan.items() if _matches(name, p)), None)
        if style is None:
            continue
        if style in ("column", "column_gated", "vocab_head"):
            assert isinstance(mod, nn.Linear), f"{name}: {style} needs nn.Linear, found {type(mod).__name__}"
            if style == "vocab_head" and id(mod.weight) in embeddings:  # tied: share the embedding's shard
                new = ColumnParallelLinear(mod.in_features, mod.out_features, bias=False, group=group)
                new.weight = embeddings[id(mod.weight)].weight
            else:
                new = ColumnParallelLinear(mod.in_features, mod.out_features, bias=mod.bias is not None, group=group)
                w, b = mod.weight, mod.bias
                if style == "column_gated":  # [gate; up] -> [gate_r; up_r]
                    g, u = w.chunk(2, dim=0)
                    w = torch.cat([comm.split(g, group, 0), comm.split(u, group, 0)])
                    if b is not None:
                        gb, ub = b.chunk(2)
                        b = torch.cat([comm.split(gb, group, 0), comm.split(ub, group, 0)])
                    new.weight.copy_(w)
                    if b is not None:
                        new.bias.copy_(b)
                else:
                    new.load_full(w, b)
            if style == "vocab_head":
                new.weight.tp_group = group  # type: ignore[attr-defined]  (the loss goes vocab-parallel)
            _mark(new, group, ("weight", "bias"), "gated_rows" if style == "column_gated" else "rows")
        elif style == "row":
            assert isinstance(mod, nn.Linear), f"{name}: row needs nn.Linear"
            new = RowParallelLinear(mod.in_features, mod.out_features, bias=mod.bias is not None, group=group)
            new.load_full(mod.weight, mod.bias)
            _mark(new, group, ("weight",), "cols")
        elif style == "vocab_embedding":
            assert isinstance(mod, nn.Embedding), f"{name}: vocab_embedding needs nn.Embedding"
            new = VocabParallelEmbedding(mod.num_embeddings, mod.embedding_dim, group=group)
            new.load_full(mod.weight)
            embeddings[id(mod.weight)] = new
            _mark(new, group, ("weight",), "rows")
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


@torch.no_grad()
def apply_sequence_parallel(model: nn.Module, layers: str, dim: int, group: Any) -> None:
    """Shard the residual stream between tensor-parallel regions along the sequence (Korthikanti et
    al. 2022): the input of the first block is split over TP, the output of the last one gathered;
    column-parallel layers all-gather their input and row-parallel ones reduce-scatter their
    output along ``dim``. Norms (and other replicated parameters) inside the blocks then see only
    their sequence shard, so their gradients are summed over TP after backward
    (`reduce_sequence_parallel_grads`). Call after `apply_tensor_parallel`, before cutting stages."""
    if comm._size(group) == 1:
        return
    blocks = getattr(model, layers)
    for block in blocks:
        for mod in block.modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                mod.sequence_parallel, mod.seq_dim = True, dim
                if isinstance(mod, RowParallelLinear) and mod.bias is not None:
                    mod.bias.sequence_parallel = True  # type: ignore[attr-defined]
        for p in block.parameters():
            if not getattr(p, "tensor_parallel", False):
                p.sequence_parallel = True  # type: ignore[attr-defined]

    def scatter(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (comm.scatter_seq(args[0], group, dim), *args[1:])

    def gather(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        # What follows runs replicated on every TP rank (final norm, then the head, whose input
        # gradient is already all-reduced), so the backward takes this rank's slice: a
        # reduce-scatter would count the full gradient TP times.
        return comm.gather_from(out, group, dim)

    blocks[0].register_forward_pre_hook(scatter)
    blocks[len(blocks) - 1].register_forward_hook(gather)


def grad_norm_squared(grads: Iterable[tuple[torch.Tensor, nn.Parameter]], *, tp_group: Any = None,
                      pp_group: Any = None, dp_group: Any = None) -> torch.Tensor:
    """Sum of squared gradients of the whole (unsharded) model from this rank's ``(gradient, its
    parameter)`` pairs: TP shards summed over TP, replicated ones counted once, the last stage's
    copy of a tied embedding skipped, stages summed over PP, and (for the distributed optimizer,
    whose ranks hold disjoint pieces) pieces summed over ``dp_group``."""
    sharded, replicated = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for g, p in grads:
        if getattr(p, "pipeline_duplicate", False):
            continue
        sq = g.detach().double().pow(2).sum()
        if getattr(p, "tensor_parallel", False):
            sharded += sq
        else:
            replicated += sq
    total = comm.all_reduce(sharded, tp_group) + replicated
    return comm.all_reduce(comm.all_reduce(total, dp_group), pp_group)


def clip_grad_norm(model: nn.Module, max_norm: float, tp_group: Any, pp_group: Any = None) -> float:
    """Clip by the global gradient norm of the unsharded model (see `grad_norm_squared`)."""
    total = grad_norm_squared(((p.grad, p) for p in model.parameters() if p.grad is not None),
                              tp_group=tp_group, pp_group=pp_group)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def parameters_per_rank(model: nn.Module, plan: Mapping[str, str], tp: int) -> int:
    """Parameters one tensor-parallel rank holds (planned modules split, the rest replicated)."""
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        module = name.rpartition(".")[0]
        split = tp > 1 and any(_matches(module, pat) for pat in plan)
        total += p.numel() // tp if split else p.numel()
    return total
