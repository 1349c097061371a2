"""How this rank's parameters relate to the single-process model: one typed description.

`TPShard` says how a tensor-parallel parameter is split (its style, over how many ranks, which
piece this rank holds) and owns the geometry: the global shape, where the local pieces sit in the
global tensor (`regions`), cutting a full tensor (`cut`) and gathering one back (`gather`). The
tensor-parallel layers create their parameters from it, clipping sums squares by it, and
checkpoints, HF import and format-1 loading read and write boxes computed by it: the geometry is
written once, here.

`Placement` adds what the other layouts say about a parameter: its single-process name (a tied
head on the last pipeline stage is the first stage's embedding), whether it is applied to sequence
shards (its gradient is summed over TP) and whether it is the second copy of a tied parameter
(summed over the embedding group, counted and written once). `Placements` holds them for one rank,
by local name and by parameter.

Styles: ``rows`` (dim 0 split contiguously: column-parallel weights and biases, vocabulary rows),
``cols`` (dim 1 split: row-parallel weights), ``gated_rows`` (a fused ``[gate; up]`` whose halves
are split per rank and re-joined as ``[gate_r; up_r]``) and ``segments`` (its generalisation: dim 0
packs segments of the given sizes, e.g. Mamba-2's ``[z, x, B, C, dt]``, each split contiguously and
re-joined in order, so every rank holds whole heads and groups of each).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Style = Literal["rows", "cols", "gated_rows", "segments"]
STYLES: tuple[str, ...] = ("rows", "cols", "gated_rows", "segments")

# (slices of the local tensor, offset of that region in the global tensor)
Region = tuple[tuple[slice, ...], tuple[int, ...]]


@dataclass(frozen=True)
class TPShard:
    """``style`` over ``size`` tensor-parallel ranks; this rank holds piece ``rank``. ``group`` is
    the process group (for `gather`; not part of the description's identity)."""

    style: Style
    size: int
    rank: int
    group: Any = field(default=None, compare=False, repr=False)
    segments: tuple[int, ...] = ()  # "segments": the global sizes along dim 0, in order

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"unknown tensor-parallel style {self.style!r}; one of {', '.join(STYLES)}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside size {self.size}")
        if (self.style == "segments") != bool(self.segments):
            raise ValueError("segment sizes are given with the segments style, and only with it")

    def local_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(global_shape)
        dim = 1 if self.style == "cols" else 0
        if self.style == "segments":
            if sum(self.segments) != shape[0] or any(n % self.size for n in self.segments):
                raise ValueError(f"segments {self.segments} of dim 0 of {tuple(global_shape)} do not each split "
                                 f"over tp={self.size}")
        elif shape[dim] % (self.size * (2 if self.style == "gated_rows" else 1)):
            raise ValueError(f"dim {dim} of {tuple(global_shape)} does not split {self.style} over tp={self.size}")
        shape[dim] //= self.size
        return tuple(shape)

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[1 if self.style == "cols" else 0] *= self.size
        return tuple(shape)

    def regions(self, local_shape: Sequence[int], rank: int | None = None) -> list[Region]:
        """Where piece ``rank`` (default: this rank's) of a tensor of ``local_shape`` sits in the global tensor."""
        r = self.rank if rank is None else rank
        shape = tuple(local_shape)
        zero = (0,) * len(shape)
        whole = tuple(slice(None) for _ in shape)
        if self.style == "cols":
            return [(whole, (0, r * shape[1], *zero[2:]))]
        if self.style == "rows":
            return [(whole, (r * shape[0], *zero[1:]))]
        # local [seg0_r; seg1_r; ...], global [seg0_0 .. seg0_n; seg1_0 .. seg1_n; ...]
        sizes = self.segments if self.style == "segments" else (shape[0] * self.size // 2,) * 2
        rest = tuple(slice(None) for _ in shape[1:])
        out, local_at, global_at = [], 0, 0
        for n in sizes:
            piece = n // self.size
            out.append(((slice(local_at, local_at + piece), *rest), (global_at + r * piece, *zero[1:])))
            local_at, global_at = local_at + piece, global_at + n
        return out

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor (a new contiguous tensor)."""
        local = self.local_shape(full.shape)
        out = torch.empty(local, dtype=full.dtype, device=full.device)
        for sl, offset in self.regions(local):
            part = out[sl]
            part.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, part.shape))])
        return out

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's piece (collective over ``group``)."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        pieces = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        full = torch.empty(self.global_shape(local.shape), dtype=local.dtype, device=local.device)
        for r, piece in enumerate(pieces):
            for sl, offset in self.regions(local.shape, r):
                part = piece[sl]
                full[tuple(slice(o, o + n) for o, n in zip(offset, part.shape))] = part
        return full


@dataclass(frozen=True)
class EPShard(TPShard):
    """Experts (dim 0 of a ``(E, ...)`` parameter) split contiguously over the expert-parallel group:
    a ``rows`` split in geometry (checkpoints, loading and gathering read it as one), but reduced,
    counted in norms and written by the expert layout's own rules (`zoo.parallel.engine`)."""


@dataclass(frozen=True)
class ExpertShard(EPShard):
    """Experts split over EP (dim 0) and each expert's MLP over expert tensor parallelism (ETP):
    ``gate_up`` (E, [gate; up] or F, D) by its rows ``dim=1`` (each half of a gated one split
    alike), ``down`` (E, D, F) by its columns ``dim=2``. ``size``/``rank``/``group`` are the
    expert model-parallel group's (ep x etp ranks, etp varying faster: piece ``ep_rank * etp +
    etp_rank``), so `TPShard.cut` and `gather` hold; ``etp`` is the inner split."""

    etp: int = 1
    dim: int = 1
    gated: bool = False

    def local_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        shape, ep = list(global_shape), self.size // self.etp
        if shape[0] % ep or shape[self.dim] % (self.etp * (2 if self.gated else 1)):
            raise ValueError(f"{tuple(global_shape)} does not split over ep={ep} (dim 0) and etp={self.etp} "
                             f"(dim {self.dim})")
        shape[0] //= ep
        shape[self.dim] //= self.etp
        return tuple(shape)

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[0] *= self.size // self.etp
        shape[self.dim] *= self.etp
        return tuple(shape)

    def regions(self, local_shape: Sequence[int], rank: int | None = None) -> list[Region]:
        r = self.rank if rank is None else rank
        e, t = divmod(r, self.etp)
        shape = tuple(local_shape)
        inner = shape[self.dim] // (2 if self.gated else 1)  # one half's (or the whole) local width
        out = []
        for half in range(2 if self.gated else 1):
            sl = [slice(None)] * len(shape)
            sl[self.dim] = slice(half * inner, (half + 1) * inner)
            offset = [0] * len(shape)
            offset[0], offset[self.dim] = e * shape[0], half * inner * self.etp + t * inner
            out.append((tuple(sl), tuple(offset)))
        return out


@dataclass(frozen=True)
class FSDPChunk:
    """FSDP's split of a (tensor-parallel local) parameter over ``size`` data-parallel ranks:
    ``torch.chunk`` along dim 0 of its ``rows`` rows, this rank holding chunk ``rank`` (possibly
    shorter, or empty, at the end), as torch's ``fully_shard`` lays it out."""

    size: int
    rank: int
    rows: int

    def bounds(self) -> tuple[int, int]:
        per = -(-self.rows // self.size) if self.rows else 0
        start = min(self.rank * per, self.rows)
        return start, min(start + per, self.rows)


@dataclass(frozen=True)
class Split:
    """A parameter split by tensor parallelism (``tp``, optional) and then by FSDP (``fsdp``):
    the same geometry interface as `TPShard`, for checkpoints and loading."""

    tp: TPShard | None
    fsdp: FSDPChunk

    def _tp_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        return (self.fsdp.rows, *tuple(local_shape)[1:])

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = self._tp_shape(local_shape)
        return self.tp.global_shape(shape) if self.tp is not None else shape

    def regions(self, local_shape: Sequence[int]) -> list[Region]:
        shape = self._tp_shape(local_shape)
        _, tp_regions = regions(shape, self.tp)
        start, stop = self.fsdp.bounds()
        out = []
        for sl, offset in tp_regions:
            s0, s1, _ = sl[0].indices(shape[0])
            lo, hi = max(start, s0), min(stop, s1)
            if lo < hi:
                out.append(((slice(lo - start, hi - start), *sl[1:]), (offset[0] + lo - s0, *offset[1:])))
        return out

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        piece = self.tp.cut(full) if self.tp is not None else full
        start, stop = self.fsdp.bounds()
        return piece[start:stop].contiguous()


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's, gradient's or state's local data: an FSDP (DTensor) one's shard, else itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (local data) shaped as ``param`` is: wrapped as a DTensor with its mesh and
    placements when ``param`` is an FSDP parameter (optimizer state must match its parameter)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False)


def groups_by_param(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Each parameter's optimizer group, by ``id`` (one pass, for `optimizer_state` over a model)."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def optimizer_state(group: Mapping[str, Any], param: torch.Tensor, field: str, value: torch.Tensor) -> torch.Tensor:
    """A loaded optimizer state entry of ``param`` (in optimizer group ``group``) placed as torch's
    own ``load_state_dict`` places it: on the parameter's device in its dtype (an FSDP parameter's
    state sharded as it is), and the step count a CPU scalar unless the group runs a fused or
    capturable kernel, which reads it on the device as float32 (a CPU step there fails the first
    update on a GPU)."""
    device = local(param).device
    if field == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=device)
        return value
    return like(param, value.to(dtype=param.dtype if param.is_floating_point() else value.dtype, device=device))


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameter names of a model: alias -> the first name of the same parameter (tied
    tensors are stored once and their gradients summed once)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def regions(local_shape: Sequence[int], shard: TPShard | Split | None) -> tuple[tuple[int, ...], list[Region]]:
    """The global shape of a tensor and where this rank's local tensor sits in it (``None``:
    replicated, the whole tensor)."""
    shape = tuple(local_shape)
    if shard is None or isinstance(shard, TPShard) and shard.size == 1:
        return shape, [(tuple(slice(None) for _ in shape), (0,) * len(shape))]
    return shard.global_shape(shape), shard.regions(shape)


@dataclass(frozen=True)
class Placement:
    """One of this rank's parameters, described against the single-process model."""

    name: str  # its single-process name
    shard: TPShard | None = None  # tensor-parallel split; None: whole on every TP rank
    sequence_parallel: bool = False  # applied to sequence shards or a rank's heads: its gradient is summed over TP
    tied: bool = False  # shared by the first and last pipeline stage: gradients summed over both
    duplicate: bool = False  # the last stage's copy of a tied parameter: counted in norms and written once
    fsdp: FSDPChunk | None = None  # FSDP's split over the data-parallel ranks, after tensor parallelism's

    @property
    def split(self) -> TPShard | Split | None:
        """The whole geometry of this rank's local data (what checkpoints read and write)."""
        return Split(self.shard, self.fsdp) if self.fsdp is not None else self.shard


class Placements(Mapping[str, Placement]):
    """This rank's placements by local parameter name; `of` finds one by the parameter itself."""

    def __init__(self, model: torch.nn.Module, by_name: Mapping[str, Placement]) -> None:
        self._by_name = dict(by_name)
        self._by_id = {id(p): self._by_name[n] for n, p in model.named_parameters() if n in self._by_name}

    def __getitem__(self, name: str) -> Placement:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def of(self, p: torch.Tensor) -> Placement | None:
        return self._by_id.get(id(p))

    def shard(self, name: str) -> TPShard | None:
        """The tensor-parallel split of a local parameter (or of a buffer, which is never split)."""
        placement = self._by_name.get(name)
        return placement.shard if placement is not None else None

    def split(self, name: str) -> TPShard | Split | None:
        """The whole split of a local parameter's data (tensor parallel, then FSDP)."""
        placement = self._by_name.get(name)
        return placement.split if placement is not None else None

    def canonical(self, name: str) -> str:
        placement = self._by_name.get(name)
        return placement.name if placement is not None else name

    @staticmethod
    def plain(model: torch.nn.Module) -> Placements:
        """One process: every parameter is itself."""
        return Placements(model, {n: Placement(n) for n, _ in model.named_parameters()})


__all__ = ["STYLES", "EPShard", "ExpertShard", "FSDPChunk", "Placement", "Placements", "Region", "Split", "Style", "TPShard", "aliases", "like", "local",
           "regions"]
