"""Reading the tensors of a zoo model or checkpoint directory, whatever its format.

A `Reader` gives the same view of format 1 (full tensors in ``model.safetensors`` and
``optimizer.safetensors``) and format 2 (per-rank pieces, `zoo.checkpoint.sharded`): tensor names,
global shapes, and `read_local`, which returns this rank's piece of a tensor given how the
parameter is split (`zoo.parallel.sharding.TPShard`). Restoring a run, loading initial weights,
exporting and `zoo.load_model` all read through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from zoo.checkpoint.model_dir import ModelDir, is_model_tensor
from zoo.checkpoint.sharded import ShardedCheckpoint
from zoo.checkpoint.tensorio import CheckpointError
from zoo.parallel.sharding import Split, TPShard


class Reader(Protocol):
    def names(self) -> Iterator[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read_local(self, name: str, local_shape: Sequence[int], shard: TPShard | Split | None, *, what: str = "",
                   into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece; a reader may fill ``into`` and return it, or return a new tensor."""
        ...

    def full(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


class FullReader:
    """Format 1: full tensors from safetensors files, cut to this rank's piece on read."""

    def __init__(self, path: Path, files: Sequence[str]) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = path
        self._handles: dict[str, Any] = {}
        for f in files:
            p = path / f
            if not p.is_file():
                if f == "model.safetensors":
                    raise CheckpointError(f"{path}: model.safetensors is missing")
                continue
            try:
                handle = safe_open(str(p), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{p}: not a readable safetensors file ({e})") from None
            for key in handle.keys():  # noqa: SIM118 (not a dict)
                self._handles[key] = handle

    def names(self) -> Iterator[str]:
        return iter(self._handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def full(self, name: str) -> torch.Tensor:
        if name not in self._handles:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        return self._handles[name].get_tensor(name)

    def read_local(self, name: str, local_shape: Sequence[int], shard: TPShard | Split | None, *, what: str = "",
                   into: torch.Tensor | None = None) -> torch.Tensor:
        if name not in self._handles:
            raise CheckpointError(f"{self.path}: the checkpoint lacks {name!r}{what}")
        full = self.full(name)
        wanted = shard.global_shape(local_shape) if shard is not None else tuple(local_shape)
        if tuple(full.shape) != tuple(wanted):
            raise CheckpointError(f"{self.path}: {name!r} has shape {list(full.shape)} in the checkpoint, "
                                  f"the model needs {list(wanted)}{what}")
        return shard.cut(full) if shard is not None else full

    def close(self) -> None:
        self._handles.clear()


def open_reader(md: ModelDir) -> Reader:
    if md.meta.get("sharded"):
        return ShardedCheckpoint(md.path)
    return FullReader(md.path, ["model.safetensors", "optimizer.safetensors", "ema.safetensors"])


EMA = "ema/"  # checkpoint names of the parameters' moving average: "ema/<parameter name>"


def weight_source(names: Sequence[str], weights: str, *, where: Path) -> Callable[[str], str]:
    """Which checkpoint tensor holds each model tensor: the raw parameters, or their moving
    average where the checkpoint has one (``weights``: ``auto`` takes the average when present)."""
    if weights not in ("auto", "ema", "raw"):
        raise ValueError(f"weights={weights!r}: one of auto, ema, raw")
    have = {n[len(EMA):] for n in names if n.startswith(EMA)}
    if weights == "ema" and not have:
        raise CheckpointError(f"{where}: --weights ema, but this checkpoint holds no moving average (train.ema was 0)")
    if weights == "raw" or not have:
        return lambda name: name
    return lambda name: EMA + name if name in have else name


def read_model_state(md: ModelDir, *, weights: str = "auto") -> dict[str, Any]:
    """The model's full tensors (a sharded training checkpoint is assembled tensor by tensor);
    ``weights`` as in `weight_source`."""
    reader = open_reader(md)
    try:
        names = list(reader.names())
        source = weight_source(names, weights, where=md.path)
        state = {name: reader.full(source(name)) for name in names if is_model_tensor(name)}
    finally:
        reader.close()
    for alias, original in md.meta.get("ties", {}).items():
        if original not in state:
            raise CheckpointError(f"{md.path}: tied tensor {alias!r} refers to missing {original!r}")
        state[alias] = state[original]
    return state


class _LazyState(Mapping[str, Any]):
    """A model's tensors read on access (``shapes`` without reading), one at a time."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], Any], ties: Mapping[str, str]) -> None:
        self.shapes = {**shapes, **{a: shapes[o] for a, o in ties.items() if o in shapes}}
        self._read, self._ties = read, ties

    def __getitem__(self, key: str) -> Any:
        if key not in self.shapes:
            raise KeyError(key)
        return self._read(self._ties.get(key, key))

    def __iter__(self) -> Any:
        return iter(self.shapes)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self.shapes

    def __len__(self) -> int:
        return len(self.shapes)


class Shape:
    """A stand-in with only a ``shape``, for shape checks that read no data."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def lazy_model_state(md: ModelDir, *, weights: str = "auto") -> _LazyState:
    """Like `read_model_state`, but each tensor is read only when asked for; ``.shapes`` costs
    no tensor data."""
    ties = md.meta.get("ties", {})
    reader = open_reader(md)
    names = list(reader.names())
    source = weight_source(names, weights, where=md.path)
    shapes = {n: reader.shape(n) for n in names if is_model_tensor(n)}
    return _LazyState(shapes, lambda name: reader.full(source(name)), ties)
