"""The trainer's Energon dataset: ``zoo train --model X data.path=DATASET_DIR_OR_METADATASET.yaml``.

Each data-parallel rank loads its own global workers' batches (micro-batches of
``train.micro_batch_size``), made by the family's task encoder (``Family.task_encoder``), seeded
by ``train.seed``. The loader's position is saved in every checkpoint (`DataPosition`, a few
kilobytes of JSON per rank: generator states, slice offsets, buffered sample keys) and restored
from it, so a resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from zoo.errors import ConfigError


def task_encoder_for(family: Any, run: Any) -> Any:
    from zoo.data.energon.task_encoder import DefaultTaskEncoder
    from zoo.family import resolve

    if family is None:  # (the API without a family: energon's default batches)
        return DefaultTaskEncoder()
    if family.task_encoder is None:
        raise _no_task_encoder(family, run)
    return resolve(family.task_encoder, owner=f"family {family.name!r}")(run)


def check_reader(family: Any, run: Any) -> None:
    """`zoo train` (dry runs too), before anything is written: a run on Energon data needs the
    family's task encoder, without which its loss would meet energon's default batches (collated
    samples) and fail on a missing key at the first step."""
    d = run.data
    energon = d.dataset == "energon" or (not d.dataset and bool(d.path) and path_kind(d.path) == "energon")
    if energon and family.task_encoder is None:
        raise _no_task_encoder(family, run)


def _no_task_encoder(family: Any, run: Any) -> ConfigError:
    where = "a Megatron .bin/.idx prefix (zoo prepare text)" if family.task == "causal_lm" else "its own data"
    return ConfigError(f"data.path={run.data.path}: an Energon dataset, and family {family.name!r} declares no task "
                       f"encoder (Family.task_encoder) to make its batches from Energon samples; give it {where}, "
                       "or data.dataset=NAME (zoo list)")


class _Batches:
    """The loader as the trainer's iterator, with the position of what was consumed."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._it = iter(loader)
        self.recent: collections.deque[list[str]] = collections.deque(maxlen=256)  # the batches' sample names

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self.recent.append(self.loader.sources)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.save_state_rank()

    def close(self) -> None:
        self.loader.close()


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0,
          state: dict[str, Any] | None = None, family: Any = None) -> _Batches:
    from zoo.data.energon.loader import Loader, WorkerConfig, get_train_dataset, get_val_dataset, redistribute

    d = run.data
    path = d.path
    if not isinstance(path, str):
        raise ConfigError(f"data.path={path!r}: an Energon dataset is one directory, URL or metadataset .yaml")
    te = task_encoder_for(family, run)
    mbs = run.train.micro_batch_size
    if split == "train":
        wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=d.num_workers)
        ds = get_train_dataset(path, worker_config=wc, batch_size=mbs, shuffle_buffer_size=d.shuffle_buffer_size,
                               max_samples_per_sequence=d.max_samples_per_sequence,
                               packing_buffer_size=d.packing_buffer_size, task_encoder=te, seed=run.train.seed,
                               allow_pickle=d.allow_pickle, allow_code=d.allow_code,
                               shuffle_over_epochs_multiplier=d.shuffle_over_epochs_multiplier)
    else:  # validation: every sample once, in order, in this process (it is short and restarts each time)
        wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=0)
        ds = get_val_dataset(path, worker_config=wc, batch_size=mbs, split_part="val" if split == "valid" else split,
                             packing_buffer_size=d.packing_buffer_size, task_encoder=te,
                             allow_pickle=d.allow_pickle, allow_code=d.allow_code)
    loader = Loader(ds, prefetch_factor=d.prefetch_factor, watchdog_timeout_seconds=d.watchdog_timeout)
    if split == "train":
        if state is not None:
            ranks = state["ranks"]
            changed = len(ranks) != dp_size or ranks[0]["G"] != wc.global_workers
            gbs = run.train.global_batch_size or mbs * dp_size
            if changed and (gbs // (mbs * dp_size)) % wc.per_rank:
                raise ConfigError(f"resuming with {dp_size} data-parallel rank(s) x {wc.per_rank} worker(s): each rank "
                                  f"takes {gbs // (mbs * dp_size)} micro-batches per step, not a multiple of its "
                                  "workers, so the global batches would differ from the saved run's; choose "
                                  "data.num_workers dividing the micro-batches per step")
            loader.restore_state_rank(redistribute(ranks, wc))
        elif consumed_samples:
            raise ConfigError(f"the checkpoint resumed (after {consumed_samples:,} samples) holds no Energon data "
                              f"position for data.path={path}; it was trained on other data")
    return _Batches(loader)


def prepared_once(root: Path, name: str, make: Callable[[Path], Any]) -> Path:
    """``root/name``, prepared once by ``make(tmpdir)`` into a temporary sibling renamed in place,
    so a crash leaves no half-prepared dataset and concurrent ranks or runs do not collide."""
    target = root / name
    if (target / ".nv-meta" / "split.yaml").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.partial-"))
    try:
        make(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another rank or run prepared it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def build_cached(run: Any, name: str, make: Callable[[Path], Any], **kw: Any) -> _Batches:
    """`build` on a built-in dataset: prepared by ``make`` into the run's cache (once), under ``name``."""
    from zoo.data.corpus import cache_root

    if run.data.path is not None:
        raise ConfigError("data.path and a built-in dataset: give one (data.dataset names the built-in one)")
    path = prepared_once(cache_root(run), name, make)
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, path=str(path)))
    return build(run, **kw)


class DataPosition:
    """The `Stateful` checkpoint item holding every data-parallel rank's loader position."""

    key = "data"

    def __init__(self, par: Any, *, micro_batches: int = 1) -> None:
        self.par, self.micro_batches = par, micro_batches
        self.batches: _Batches | None = None
        self.saved: dict[str, Any] | None = None

    def sources(self) -> list[str]:
        """Where the samples of the step just taken came from (dataset, shard, key), every
        data-parallel rank's; a collective when there are several ranks."""
        recent = list(self.batches.recent)[-self.micro_batches:] if self.batches is not None else []
        return [name for names in self._by_dp_rank([n for names in recent for n in names]) for name in names]

    def state_tensors(self) -> list[Any]:
        return []

    def state_json(self) -> dict[str, Any] | None:
        if self.batches is None:
            return self.saved
        return {"ranks": self._by_dp_rank(self.batches.state_dict())}

    def _by_dp_rank(self, mine: Any) -> list[Any]:
        """Every data-parallel rank's ``mine``, in rank order (a collective over all ranks; the
        ranks of one data-parallel replica read the same data, so one of them speaks for it)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, (self.par.dp_rank, mine))
        else:
            every = [(self.par.dp_rank, mine)]
        by_rank = dict(every)
        return [by_rank[r] for r in sorted(by_rank)]

    def load_state(self, ckpt: Any, saved: Any) -> None:
        self.saved = saved


def path_kind(path: Any) -> str:
    """``energon`` for a prepared WebDataset directory (or URL) or a metadataset YAML, ``sft`` for
    JSON-lines conversations, else Megatron data."""
    first = path[0] if isinstance(path, list) and path else path
    if isinstance(first, str) and first.endswith(".jsonl"):
        return "sft"
    if isinstance(path, str):
        from zoo.data.energon.dataset import is_dataset
        from zoo.data.energon.metadataset import is_metadataset

        if is_metadataset(path) or ("://" in path or Path(path).is_dir()) and is_dataset(path):
            return "energon"
    return "megatron"


__all__ = ["DataPosition", "build", "build_cached", "check_reader", "path_kind", "prepared_once", "task_encoder_for"]
