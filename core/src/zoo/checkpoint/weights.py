"""A model's weights in training checkpoints and as a run's starting point.

`ModelState` is the model as a `zoo.checkpoint.state.Stateful`: this rank's parameters and
buffers under their single-process names, split as `zoo.parallel.sharding.Placements` says; tied
aliases are stored once. `load_initial_weights` reads ``checkpoint.load``: a Hugging Face
directory (only the rows and columns of each HF tensor this rank's pieces come from) or a zoo
checkpoint of either format (only this rank's pieces).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.checkpoint.mapping import MappingError, check_shapes
from zoo.checkpoint.model_dir import read_meta
from zoo.checkpoint.reader import open_reader, weight_source
from zoo.checkpoint.state import Checkpoint
from zoo.checkpoint.tensorio import CheckpointError
from zoo.parallel.sharding import Placements, Split, TPShard, aliases, local


class ModelState:
    """This rank's part of the model, saved and restored under single-process names."""

    key = "model"

    def __init__(self, model: nn.Module, placements: Placements) -> None:
        self.model, self.placements = model, placements
        self._aliases = aliases(model)

    def _own(self) -> dict[str, torch.Tensor]:
        """The tensors this rank stores: not an alias, not the second copy of a tied parameter
        (their local data: an FSDP parameter's shard)."""
        out = {}
        for name, t in self._tensors().items():
            placement = self.placements.get(name)
            if name not in self._aliases and not (placement is not None and placement.duplicate):
                out[name] = local(t)
        return out

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers by state-dict name (the live tensors, not copies)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        persistent = self.model.state_dict(keep_vars=True).keys()
        named.update({n: b for n, b in self.model.named_buffers(remove_duplicate=False) if n in persistent})
        return named

    def state_tensors(self) -> list[tuple[str, torch.Tensor, TPShard | Split | None]]:
        return [(self.placements.canonical(n), t, self.placements.split(n)) for n, t in self._own().items()]

    def state_json(self) -> None:
        return None

    def load_state(self, ckpt: Checkpoint, saved: Any) -> None:
        # Read straight into the parameters where the reader can (no second copy of the model).
        self.load(lambda name, t: ckpt.read(self.placements.canonical(name), t.shape, self.placements.split(name),
                                            into=t.detach()), what=str(ckpt.path))

    @torch.no_grad()
    def load(self, read: Any, *, what: str) -> None:
        """Fill the model from ``read(local name, local data) -> this rank's piece``, copied into
        the local data in place (an FSDP parameter's shard, a tensor-parallel piece)."""
        tensors = {n: local(t) for n, t in self._tensors().items() if n not in self._aliases}
        state = {name: read(name, t) for name, t in tensors.items()}
        try:
            check_shapes(tensors, state, what=what)
        except MappingError as e:
            raise CheckpointError(str(e)) from None
        for name, t in tensors.items():
            if state[name].data_ptr() != t.data_ptr() or state[name].dtype != t.dtype:  # (not read in place)
                t.copy_(state[name])


def load_initial_weights(source: str, *, model: nn.Module, placements: Placements, family: str,
                         weights: str = "auto") -> dict[str, torch.Tensor]:
    """This rank's tensors for ``checkpoint.load``, under its local names: from a Hugging Face
    directory (``hf:DIR``, read lazily, keeping only this rank's pieces) or a zoo checkpoint (a
    training checkpoint's moving average when it has one and ``weights`` allows; a run directory
    gives its newest complete checkpoint). The result
    is what `ModelState.load` copies in (after its shape check)."""
    path = Path(source.removeprefix("hf:"))
    if source.startswith("hf:") or (path / "config.json").is_file() and not (path / "zoo.json").is_file():
        return _from_hf(path, model=model, placements=placements, family=family)
    from zoo.checkpoint.model_dir import resolve_checkpoint

    path = resolve_checkpoint(path)  # (a run directory: its newest complete checkpoint, as zoo generate reads it)
    md = read_meta(path)
    if md.family != family:
        raise CheckpointError(f"{path}: a checkpoint of {md.family!r}, not {family!r}")
    reader = open_reader(md)
    try:
        source_of = weight_source(list(reader.names()), weights, where=path)
        ties = md.meta.get("ties", {})
        out = {}
        state, aliases = _local_state(model)
        for name, t in state.items():
            canon = placements.canonical(name)
            out[name] = reader.read_local(source_of(ties.get(canon, canon)), t.shape, placements.split(name),
                                          what=f" (loading {path})")
        return {**out, **{alias: out[name] for alias, name in aliases.items()}}
    finally:
        reader.close()


def _from_hf(path: Path, *, model: nn.Module, placements: Placements, family: str) -> dict[str, torch.Tensor]:
    from zoo.checkpoint.external import _hf_source, library_format
    from zoo.checkpoint.mapping import MappingError, from_external
    from zoo.checkpoint.slicing import read_sliced
    from zoo.checkpoint.tensorio import LazyTensors

    entry, fmt, config, _, where = _hf_source(path, library_format(path) or "hf")
    if entry.family.name != family:
        raise CheckpointError(f"{path}: a {entry.family.name!r} model, not {family!r}")
    lazy = LazyTensors(where)
    state, aliases = _local_state(model)
    try:
        if any(placements.split(n) is not None for n in state):  # read only the boxes this rank's pieces come from
            wanted: dict[str, tuple[tuple[int, ...], Any]] = {}
            for name, t in state.items():
                shard = placements.split(name)
                shape = shard.global_shape(t.shape) if shard is not None else tuple(t.shape)
                wanted[placements.canonical(name)] = (shape, shard.cut if shard is not None else (lambda x: x))
            got = read_sliced(fmt.table_for(config, list(lazy)), lazy, config, wanted)
            return {name: got[placements.canonical(aliases.get(name, name))] for name in (*state, *aliases)}
        keep = {n for name in state for n in (name, placements.canonical(name))}
        full = from_external(fmt.table_for(config, list(lazy)), lazy, config, keep=keep)
    except MappingError as e:
        raise CheckpointError(f"{path}: {e}") from None
    missing = [placements.canonical(n) for n in state if placements.canonical(n) not in full]
    if missing:
        raise CheckpointError(f"{path}: the checkpoint lacks {missing[0]!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    # (nothing split: whole tensors)
    return {name: full[placements.canonical(aliases.get(name, name))] for name in (*state, *aliases)}


def _local_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This rank's tensors by their first name, and the other names of tied ones (an LM head tied
    to the embedding: placements describe the first name only, so a tied head under tensor
    parallelism took the whole embedding for its shard) -> their first name."""
    state, aliases, first = {}, {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        state[name] = local(t.detach())
    return state, aliases


__all__ = ["ModelState", "load_initial_weights"]
