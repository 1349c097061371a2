"""An N-dimensional process grid with named axes.

Ranks are laid out in the configured axis order with the leftmost axis varying fastest (default
``tp-cp-ep-dp-pp``: tensor-parallel ranks are neighbours, i.e. on one node). Any combination of
axes names a group: ``grid.group("tp")``, ``grid.group("dp", "cp")``. The dense grid has axes
tp, cp, dp, pp; the expert grid beside it (etp, ep, edp, pp) shares its pipeline groups
(Megatron's two grids). With world size 1 there are no process groups: `group` returns None and
the collectives in `zoo.parallel.comm` are skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any


class ProcessGrid:
    def __init__(self, sizes: Mapping[str, int], order: Sequence[str], *, rank: int, world_size: int,
                 create_groups: bool = True, share: ProcessGrid | None = None) -> None:
        """``share``: another grid over the same ranks whose groups are reused where the rank
        sets coincide (the expert grid's pipeline groups are the dense grid's)."""
        order = [a for a in order if a in sizes]
        total = 1
        for a in order:
            total *= sizes[a]
        if total != world_size:
            raise ValueError(f"grid {dict(sizes)} holds {total} ranks, the world has {world_size}")
        self.order, self.sizes, self.rank, self.world_size = list(order), dict(sizes), rank, world_size
        self.strides: dict[str, int] = {}
        stride = 1
        for a in self.order:
            self.strides[a] = stride
            stride *= self.sizes[a]
        self._groups: dict[tuple[str, ...], Any] = {}
        self._made: dict[tuple[int, ...], Any] = share._made if share is not None else {}
        self._create = create_groups
        if create_groups and world_size > 1:
            self._create_all()

    def coords(self, rank: int | None = None) -> dict[str, int]:
        r = self.rank if rank is None else rank
        return {a: (r // self.strides[a]) % self.sizes[a] for a in self.order}

    def ranks_of(self, axes: Sequence[str], rank: int | None = None) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except along ``axes``."""
        c = self.coords(rank)
        base = sum(c[a] * self.strides[a] for a in self.order if a not in axes)
        out = []
        for combo in itertools.product(*(range(self.sizes[a]) for a in axes)):
            out.append(base + sum(i * self.strides[a] for a, i in zip(axes, combo)))
        return sorted(out)

    def _key(self, axes: Sequence[str]) -> tuple[str, ...]:
        unknown = [a for a in axes if a not in self.sizes]
        if unknown:
            raise KeyError(f"no axis {unknown[0]!r} in this grid ({'-'.join(self.order)})")
        return tuple(a for a in self.order if a in axes)

    def _create_all(self) -> None:
        import torch.distributed as dist

        # Every rank must create every group, in the same order. Axes of size 1 add nothing: a
        # rank set is created once (tp x cp with cp=1 is the tp group) and single ranks get none.
        made = self._made
        for n in range(1, len(self.order) + 1):
            for axes in itertools.combinations(self.order, n):
                for r in range(self.world_size):
                    ranks = tuple(self.ranks_of(axes, r))
                    if len(ranks) > 1 and ranks not in made:
                        made[ranks] = dist.new_group(list(ranks))
                    if r == self.rank:
                        self._groups[axes] = made.get(ranks)

    def group(self, *axes: str) -> Any:
        """The process group along ``axes`` that contains this rank (None when it would hold this
        rank alone: the collectives in `zoo.parallel.comm` are then skipped)."""
        return self._groups.get(self._key(axes))

    def size(self, *axes: str) -> int:
        n = 1
        for a in self._key(axes):
            n *= self.sizes[a]
        return n

    def index(self, *axes: str) -> int:
        """This rank's position inside the group along ``axes``."""
        return self.ranks_of(self._key(axes)).index(self.rank)

    def group_at(self, axis: str, positions: Sequence[int]) -> Any:
        """The group of ranks that differ only along ``axis`` and sit at ``positions`` on it (e.g.
        the first and last pipeline stage: Megatron's embedding group). Collective: every rank
        calls it with the same arguments. None if this rank is not at one of ``positions``, or if
        the positions name fewer than two distinct places."""
        import torch.distributed as dist

        wanted = sorted({p % self.sizes[axis] for p in positions})
        if len(wanted) < 2 or self.world_size == 1:
            return None
        mine = None
        seen: set[tuple[int, ...]] = set()
        for r in range(self.world_size):
            line = self.ranks_of([axis], r)
            ranks = tuple(line[i] for i in wanted)
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks))
            if self.rank in ranks:
                mine = group
        return mine


def expert_grid(dense: ProcessGrid, *, etp: int, ep: int,
                order: Sequence[str] = ("tp", "cp", "ep", "dp", "pp")) -> ProcessGrid:
    """The expert grid beside a dense (tp, cp, dp, pp) grid: axes etp, ep, edp, pp in the
    configured ``order`` (parallel.order; tp -> etp, dp -> edp, cp dropped),
    ``edp = world / (etp * ep * pp)``. With pp last (the default), pipeline stage ``i`` holds the
    same ranks in both grids, so the pipeline groups are shared. Collective."""
    pp = dense.sizes.get("pp", 1)
    if dense.world_size % (etp * ep * pp):
        raise ValueError(f"world size {dense.world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}")
    sizes = {"etp": etp, "ep": ep, "edp": dense.world_size // (etp * ep * pp), "pp": pp}
    rename = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    grid = ProcessGrid(sizes, [rename[a] for a in order if a in rename], rank=dense.rank,
                       world_size=dense.world_size, create_groups=dense._create, share=dense)
    if grid.ranks_of(["pp"]) != dense.ranks_of(["pp"]):
        raise ValueError(f"parallel.order={'-'.join(order)}: the expert grid's pipeline stages differ from the "
                         "dense grid's; keep pp the last axis")
    return grid
