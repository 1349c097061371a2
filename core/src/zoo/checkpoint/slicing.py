"""Reading only the part of external checkpoint tensors that one rank's pieces are made of.

The mapping tables (`zoo.checkpoint.mapping`) are pure data movement (concatenate, split,
interleave, transpose, stack), so running a table on tensors of element ids instead of values
gives, for every element of the output, the element of the input it comes from: cut that as the
rank's piece is cut, and the ids bound the block to read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zoo.checkpoint.mapping import MappingError, MappingTable, Tensor, _map_in, _strip_prefix


def read_sliced(table: MappingTable, theirs: Any, config: Any,
                wanted: Mapping[str, tuple[tuple[int, ...], Callable[[Tensor], Tensor]]]) -> dict[str, Tensor]:
    """Some of our tensors, each cut by ``wanted[name] = (global shape, cut)``, reading only the
    part of the external tensors the cut needs. ``theirs`` must tell shapes (``shape_of``) and read
    boxes (``read_box``), like `zoo.checkpoint.tensorio.LazyTensors`.

    The mapping is pure data movement (concatenate, split, interleave, transpose, stack), so running
    it on tensors of element ids instead of values gives, for every element of the output, the
    element of the input it comes from: cut that, and the ids bound the block to read. One
    output at a time, so the ids never cover more than one tensor's sources."""
    import torch

    view = _strip_prefix(table, theirs)
    names = dict(getattr(view, "names", {})) or {k: k for k in view}  # stripped -> original key
    dry = {k: torch.empty(theirs.shape_of(names[k]), device="meta") for k in view}
    _, sources = _map_in(table, dry, config, set(wanted))
    out: dict[str, Tensor] = {}
    for name, (shape, cut) in wanted.items():
        srcs = sorted(sources.get(name, ()))
        sizes = [int(dry[s].numel()) for s in srcs]
        id_type = torch.int32 if sum(sizes) < 2**31 else torch.int64
        ids, base = {}, 0
        for s, n in zip(srcs, sizes):
            ids[s] = torch.arange(base, base + n, dtype=id_type).view(dry[s].shape)
            base += n
        full, _ = _map_in(table, {**dry, **ids}, config, None)  # everything else stays shape-only
        if tuple(full[name].shape) != tuple(shape):
            raise MappingError(f"{name}: the mapping makes shape {tuple(full[name].shape)}, the model needs {tuple(shape)}")
        local = cut(full[name])
        del full
        values: Tensor | None = None
        base = 0
        for s, n in zip(srcs, sizes):
            inside = (local >= base) & (local < base + n)
            flat = (local[inside] - base).long()
            base += n
            if not flat.numel():
                continue
            if dry[s].dim() == 2:  # the bounding box of rows and columns (a column shard reads its columns)
                cols = dry[s].shape[1]
                r, c = flat // cols, flat % cols
                lo, hi, clo, chi = int(r.min()), int(r.max()) + 1, int(c.min()), int(c.max()) + 1
                block = theirs.read_box(names[s], (lo, hi), (clo, chi))
                where = (r - lo) * (chi - clo) + (c - clo)
            elif dry[s].dim():  # rows (stacked experts and the like)
                row = int(dry[s].numel() // dry[s].shape[0])
                lo, hi = int(flat.min()) // row, int(flat.max()) // row + 1
                block = theirs.read_box(names[s], (lo, hi))
                where = flat - lo * row
            else:
                block, where = theirs[names[s]], flat
            if values is None:
                values = torch.empty(local.shape, dtype=block.dtype)
            values[inside] = block.reshape(-1)[where]
        if values is None:
            raise MappingError(f"{name}: no source tensor found for it")
        out[name] = values
    return out

