"""Training checkpoints: the loop's position (`TrainState`), every rank's random states, and
whatever registered itself as `Stateful` (the model, the optimizer, the loss scaler, the moving
average of the weights, a router's expert bias...), saved and restored the same way under any
layout.

Layout under ``checkpoint.dir``::

    step_00000100/   a sharded checkpoint (`zoo.checkpoint.sharded`): zoo.json, index.json,
                     shards/, state.json, config.yaml, tokenizer.json, COMPLETE (last)
    latest           name of the newest complete checkpoint (updated atomically after COMPLETE)

A directory without ``COMPLETE`` is never loaded; ``resume=auto`` takes the newest complete one,
so a process killed at any moment leaves the previous checkpoint as the one picked. Format 1 (one
file of full tensors per kind, written by zoo 0.1) is still restored, through the same `Reader`
view (`zoo.checkpoint.reader`). No pickle: tensors in safetensors, the rest in JSON.

A `Stateful` gives its tensors under single-process names with how tensor parallelism split them
(`state_tensors`), and JSON (`state_json`, stored in ``state.json`` under its ``key``); it reads
them back with `load_state`, asking the `Checkpoint` for this rank's piece of each tensor. Which
rank writes a tensor (one replica of each piece) is decided here, not by the items.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from zoo.checkpoint import rng as rng_mod
from zoo.checkpoint.model_dir import ModelDir, complete_checkpoints, latest, read_meta, resolve_checkpoint, step_dir
from zoo.checkpoint.reader import Reader, open_reader
from zoo.checkpoint.sharded import Entry, Saver, finalize, snapshot, write_rank
from zoo.checkpoint.tensorio import CheckpointError, load_file, read_json
from zoo.config import RunConfig, plain
from zoo.errors import ConfigError, reading
from zoo.parallel.engine import Parallel
from zoo.parallel.sharding import Split, TPShard


@dataclass
class TrainState:
    """Where the loop is: optimizer steps taken and samples consumed from the global data stream
    (so the data loader continues exactly where it stopped), and the steps skipped so far (a
    non-finite gradient norm or an fp16 overflow), so a resumed run's count and its limit on
    skips in a row go on from where they were."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    skipped_in_a_row: int = 0


class Stateful(Protocol):
    """Something saved with and restored from training checkpoints."""

    key: str  # its entry in state.json

    def state_tensors(self) -> list[tuple[str, torch.Tensor, TPShard | Split | None]]:
        """(single-process name, this rank's tensor, its split) for every tensor this rank holds
        (second copies of tied parameters left out). Called on every rank at the same step: it
        may communicate."""
        ...

    def state_json(self) -> Any: ...

    def load_state(self, ckpt: Checkpoint, saved: Any) -> None:
        """Read back (``saved``: what `state_json` returned, None when the checkpoint has none)."""
        ...


class Checkpoint:
    """A checkpoint opened to restore a run from, in either format."""

    def __init__(self, path: Path, *, family: str, rank: int, world_size: int) -> None:
        md = read_meta(path)
        if md.family != family:
            raise ConfigError(f"{path}: a checkpoint of {md.family!r}, not {family!r} (its zoo.json says so)")
        if md.meta.get("kind") != "train" or not (path / "state.json").is_file():
            raise CheckpointError(f"{path}: a model checkpoint without training state (zoo.json kind "
                                  f"{md.meta.get('kind')!r}); use checkpoint.load to start from its weights")
        self.path, self.md = path, md
        self.reader: Reader = open_reader(md)
        self._names = set(self.reader.names())
        self.json: dict[str, Any] = read_json(path / "state.json")
        self.rank, self.world_size = rank, world_size

    def names(self) -> Iterator[str]:
        return iter(self._names)

    def has(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def read(self, name: str, local_shape: Sequence[int], shard: TPShard | Split | None, *,
             into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece of ``name`` for a tensor of ``local_shape`` split as ``shard`` says
        (read into ``into`` where the reader can: check the result ``is into``)."""
        return self.reader.read_local(name, local_shape, shard, what=f" (loading {self.path})", into=into)

    def full(self, name: str) -> torch.Tensor:
        return self.reader.full(name)

    def restore(self, *items: Stateful) -> None:
        for item in items:
            # What an item reads from state.json (its param groups, counters) is checked against
            # the model as it is used: a value of the wrong shape or type names the file.
            with reading(self.path / "state.json", CheckpointError, f"entry {item.key!r}"):
                item.load_state(self, self.json.get(item.key))

    def train_state(self) -> TrainState:
        with reading(self.path / "state.json", CheckpointError):
            # (checkpoints written before the skip counts were saved hold none: 0)
            values = {k: self.json.get(k, 0) if k.startswith("skipped") else self.json[k]
                      for k in ("step", "consumed_samples", "skipped_steps", "skipped_in_a_row")}
            bad = {k: v for k, v in values.items() if not (type(v) is int and v >= 0)}
            if bad:
                raise ValueError(", ".join(f"{k} {v!r}" for k, v in bad.items()) + " must be non-negative integers")
            return TrainState(**values)

    def rng(self) -> rng_mod.RNGState:
        """This rank's random states; under another world size rank 0's, without the
        tensor-parallel dropout stream (another layout starts its streams afresh)."""
        if self.md.meta.get("sharded"):
            from zoo.checkpoint.sharded import ShardedCheckpoint

            assert isinstance(self.reader, ShardedCheckpoint)
            same_world = self.reader.index.get("world_size") == self.world_size
            state = self.reader.rng(self.rank if same_world else 0)
            if not same_world:
                state.extra.pop("tp_stream", None)
            return state
        # Format 1: one RNG file, Python's and NumPy's states in state.json.
        with reading(self.path / "state.json", CheckpointError, "random states"):
            return rng_mod.from_saved(load_file(self.path / "rng.safetensors"),
                                      {"python": self.json["python_rng"], "numpy": self.json["numpy_rng"]})

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def save(root: Path, *, state: TrainState, run: RunConfig, par: Parallel, items: Sequence[Stateful],
         ties: dict[str, str], saver: Saver, token: str, tokenizer_dir: Path | None, keep_last: int | None,
         rank: int, world_size: int, timeout_s: float) -> Path:
    """Every rank calls this at the same step; the snapshot is taken now, the writing is done by
    ``saver`` (now, or in the background). Returns the directory the checkpoint will have."""
    saver.wait()  # at most one save in flight, and its snapshot buffers are free again
    entries = [Entry(name, t, split, _writes(par, split)) for item in items for name, t, split in item.state_tensors()]
    snap = snapshot(entries, copy=saver.asynchronous and saver.copy, pool=saver.pool,
                    rng={"tp_stream": par.tp_rng.state()})
    dst = step_dir(root, state.step)
    tmp = root / f".{dst.name}.partial-{token}"
    state_json = {"step": state.step, "consumed_samples": state.consumed_samples, "skipped_steps": state.skipped_steps,
                  "skipped_in_a_row": state.skipped_in_a_row,
                  **{item.key: item.state_json() for item in items}}
    meta = {"format": "zoo", "family": run.family, "flavor": run.flavor, "model_config": plain(run.model),
            "ties": ties, "kind": "train", "step": state.step}
    config_yaml = run.to_yaml().encode()

    def work() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".step_*.partial-*"):  # killed saves of earlier runs
                if not stale.name.endswith(f"-{token}"):
                    shutil.rmtree(stale, ignore_errors=True)
        try:
            write_rank(tmp, rank, snap)
            if rank == 0:
                finalize(tmp, dst, world_size=world_size, meta=meta, state=state_json,
                         files={"config.yaml": config_yaml}, tokenizer_from=tokenizer_dir, timeout_s=timeout_s)
        except (OSError, CheckpointError) as e:
            # Nothing was moved into place, so the newest complete checkpoint is still the last one;
            # the partial directory goes (it is what filled the disk).
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            before = complete_checkpoints(root)
            kept = f"the newest complete one is still {before[-1][1]}" if before else "there is no earlier one"
            raise CheckpointError(f"could not write checkpoint {dst}: {e}; {kept}") from e
        if rank == 0 and keep_last:
            for _, old in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    saver.submit(work)
    return dst


def _writes(par: Parallel, split: TPShard | Split | None) -> bool:
    """Whether this rank writes a tensor: one replica of every piece. Data- and context-parallel
    ranks replicate everything except FSDP's pieces (each rank's own, sharded over both; under
    HSDP the first group of sharding ranks writes them); TP ranks hold their own pieces of split
    tensors and replicas of the rest; expert-parallel experts are written by the first of their
    expert-data-parallel replicas, or under FSDP, whose pieces of them no rank replicates, by
    every rank."""
    from zoo.parallel.sharding import EPShard

    if isinstance(split, EPShard):
        return par.edp_rank == 0
    if isinstance(split, Split) and isinstance(split.tp, EPShard):  # FSDP over the expert-data-parallel ranks
        return True
    fsdp = isinstance(split, Split)
    tp = split.tp if isinstance(split, Split) else split
    mine = par.fsdp_replica == 0 if fsdp else par.cp_rank == 0 and par.dp_rank == 0
    return mine and (tp is not None or par.tp_rank == 0)


__all__ = ["Checkpoint", "ModelDir", "Stateful", "TrainState", "complete_checkpoints", "latest", "resolve_checkpoint",
           "save", "step_dir"]
