"""Energon's loading API in zoo's form: `WorkerConfig`, `get_train_dataset`,
`get_val_dataset`, `get_loader` / `get_savable_loader`.

Every loader is savable, and exactly: each worker sends the state of its pipeline *after* each
batch along with the batch, and the loader keeps, per worker, the state that came with the
last batch it handed to the caller. `save_state_rank()` is therefore the position of what the
trainer consumed, never of what prefetching workers produced, with no snapshots and no replay
(Energon keeps periodic worker snapshots and replays from them).

Workers are started from a server process that imported torch once (`zoo.procs`: forkserver, with
the caller's environment, umask and output; safe beside threads, unlike Energon's fork), consumed
round-robin from the loader's next worker; a worker that dies or makes no batch within the
watchdog timeout stops the loader with an error naming the worker and the shard and sample it
was reading. A worker whose loader's process is gone (even a zombie not yet reaped) exits by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zoo import procs as zoo_procs
from zoo.data.energon.metadataset import combine_shuffle_over_epochs, is_metadataset, load_metadataset
from zoo.data.energon.pipeline import Leaf, Pipeline, PipelineConfig
from zoo.data.energon.task_encoder import DefaultTaskEncoder, TaskEncoder
from zoo.errors import ZooError

STATE_FORMAT = "zoo-energon-loader/1"


class LoaderError(ZooError, RuntimeError):
    """A worker died, hung or failed; or a saved state does not fit this loader."""


@dataclass(kw_only=True)
class WorkerConfig:
    """Which data-parallel rank this is, of how many, and its worker processes (0: in process)."""

    rank: int
    world_size: int
    num_workers: int
    data_parallel_group: Any = None
    seed_offset: int = 0

    @classmethod
    def default_worker_config(cls, num_workers: int = 4, data_parallel_group: Any = None) -> WorkerConfig:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(data_parallel_group), world_size=dist.get_world_size(data_parallel_group),
                       num_workers=num_workers, data_parallel_group=data_parallel_group)
        return cls(rank=0, world_size=1, num_workers=num_workers)

    @property
    def per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def global_workers(self) -> int:
        return self.world_size * self.per_rank

    def global_ids(self) -> list[int]:
        return list(range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank))


@dataclass
class EnergonDataset:
    """What `get_train_dataset` / `get_val_dataset` return: a pipeline for this rank's workers."""

    config: PipelineConfig
    worker_config: WorkerConfig
    virtual_epoch_length: int = 0
    limit: int | None = None


def _leaves(path: str, split_part: str, shuffle_over_epochs_multiplier: int | None = 1, **leaf_kw: Any
            ) -> tuple[tuple[Leaf, ...], str]:
    soe = combine_shuffle_over_epochs(1, shuffle_over_epochs_multiplier, "shuffle_over_epochs_multiplier")
    if is_metadataset(str(path)):
        leaves, mode = load_metadataset(str(path), split_part)
        return tuple(dataclasses.replace(leaf, shuffle_over_epochs=combine_shuffle_over_epochs(
            soe, leaf.shuffle_over_epochs, path)) for leaf in leaves), mode
    return (Leaf(path=str(path), split_part=split_part, shuffle_over_epochs=soe, **leaf_kw),), "single"


def get_train_dataset(path: str, *, worker_config: WorkerConfig, batch_size: int | None,
                      shuffle_buffer_size: int | None, max_samples_per_sequence: int | None,
                      split_part: str = "train", batch_drop_last: bool = False, packing_buffer_size: int | None = None,
                      virtual_epoch_length: int = 0, task_encoder: TaskEncoder | None = None, repeat: bool = True,
                      seed: int | None = None, parallel_slices: int = 16, allow_pickle: bool = False,
                      allow_code: bool = False, dataset_config: str = "dataset.yaml",
                      split_config: str = "split.yaml", shuffle_over_epochs_multiplier: int | None = 1) -> EnergonDataset:
    """A shuffled, repeating training pipeline (Energon's signature: batch_size,
    shuffle_buffer_size and max_samples_per_sequence have no defaults on purpose). ``seed``
    (default ``worker_config.seed_offset``) fixes the order; zoo's trainer passes ``train.seed``.
    ``shuffle_over_epochs_multiplier``: k >= 1 shuffles the slices of k epochs together, -1 draws
    them with replacement, None reads them in order (times a metadataset reference's own)."""
    leaves, mode = _leaves(path, split_part, shuffle_over_epochs_multiplier, dataset_config=dataset_config,
                           split_config=split_config)
    cfg = PipelineConfig(leaves=leaves, task_encoder=task_encoder or DefaultTaskEncoder(), training=True, blend=mode,
                         repeat=repeat, batch_size=batch_size, batch_drop_last=batch_drop_last,
                         shuffle_buffer_size=shuffle_buffer_size, max_samples_per_sequence=max_samples_per_sequence,
                         packing_buffer_size=packing_buffer_size, parallel_slices=parallel_slices,
                         seed=worker_config.seed_offset if seed is None else seed, allow_pickle=allow_pickle,
                         allow_code=allow_code)
    return EnergonDataset(cfg, worker_config, virtual_epoch_length)


def get_val_dataset(path: str, *, worker_config: WorkerConfig, batch_size: int | None, split_part: str = "val",
                    batch_drop_last: bool = False, packing_buffer_size: int | None = None, limit: int | None = None,
                    task_encoder: TaskEncoder | None = None, allow_pickle: bool = False, allow_code: bool = False,
                    dataset_config: str = "dataset.yaml", split_config: str = "split.yaml") -> EnergonDataset:
    """Every sample of the split once, in order (blends concatenated); ``limit`` caps the batches."""
    leaves, _ = _leaves(path, split_part, dataset_config=dataset_config, split_config=split_config)
    cfg = PipelineConfig(leaves=leaves, task_encoder=task_encoder or DefaultTaskEncoder(), training=False,
                         repeat=False, batch_size=batch_size, batch_drop_last=batch_drop_last,
                         packing_buffer_size=packing_buffer_size, allow_pickle=allow_pickle, allow_code=allow_code)
    return EnergonDataset(cfg, worker_config, limit=limit)


_BLOB_BYTES = 256 << 10


def _worker_main(cfg: PipelineConfig, g: int, G: int, state: dict[str, Any] | None, q: Any, status: Any,
                 parent: int, caller: Any) -> None:
    zoo_procs.adopt(caller)
    # Spawned, this worker's parent is the loader's process and it is re-parented when that dies;
    # forked from the server, its parent is the server, which outlives the loader while any of its
    # children (which hold the loader's end of its "alive" pipe) does: the loader's pid is watched.
    starter = os.getppid()

    def put(item: Any) -> bool:
        while True:
            try:
                q.put(item, timeout=1.0)
                return True
            except queue_mod.Full:
                if os.getppid() != starter or not zoo_procs.alive(parent):  # nobody will read this
                    return False

    def say(text: str) -> None:
        status.value = text.encode("utf-8", "replace")[:1000]

    blobs = True
    try:
        pipe = Pipeline(cfg, g, G, state=state, status=say)
        while True:
            try:
                batch = pipe.next()
            except StopIteration:
                put(("end", pipe.state()))
                return
            msg: tuple[Any, ...] = ("batch", batch, pipe.state(), pipe.sources)
            if blobs:
                # Small batches travel as one pickled blob: twice the batches/s of moving every
                # tensor through shared memory (a file descriptor per tensor). Past ~256 KiB
                # shared memory wins (no copy through the pipe): this worker switches for good.
                blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
                blobs = len(blob) <= _BLOB_BYTES
                msg = ("blob", blob)
            if not put(msg):
                return
    except BaseException as e:  # report everything: the loader raises it with the worker named
        put(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))


class Loader:
    """Iterates batches; `save_state_rank()` / `restore_state_rank()` (before iterating)."""

    def __init__(self, dataset: EnergonDataset, *, prefetch_factor: int = 2, watchdog_timeout_seconds: float = 60.0,
                 watchdog_initial_timeout_seconds: float | None = None) -> None:
        self.dataset = dataset
        wc = dataset.worker_config
        self.gids = wc.global_ids()
        self.G = wc.global_workers
        self.prefetch = max(1, prefetch_factor)
        self.timeout = watchdog_timeout_seconds
        self.initial_timeout = watchdog_initial_timeout_seconds or max(180.0, watchdog_timeout_seconds)
        self.states: list[dict[str, Any] | None] = [None] * len(self.gids)
        self.next_worker = 0
        self._procs: list[Any] = []
        self._pipes: list[Pipeline] = []
        self._queues: list[Any] = []
        self._status: list[Any] = []
        self._ended: list[bool] = []
        self._started = False
        self._epoch_left = 0
        self.sources: list[str] = []  # where the last batch's samples came from: dataset, shard, key

    # ------------------------------------------------------------------------------ state

    def save_state_rank(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "G": self.G, "global_ids": list(self.gids), "workers": list(self.states),
                "next": self.next_worker, "config": self.dataset.config.fingerprint()}

    def restore_state_rank(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if self._started:
            raise LoaderError("restore_state_rank must be called before iterating the loader")
        if state.get("format") != STATE_FORMAT:
            raise LoaderError(f"not a zoo Energon loader state (format {state.get('format')!r})")
        mine = self.dataset.config.fingerprint()
        diff = [k for k in mine if state["config"].get(k) != mine[k]]
        if diff:
            raise LoaderError(f"the saved data position belongs to another data pipeline: {', '.join(diff)} changed "
                              f"({state['config'].get(diff[0])!r} -> {mine[diff[0]]!r}); restoring would silently "
                              "change the data, so it is refused")
        if state["G"] != self.G or state["global_ids"] != self.gids:
            raise LoaderError(f"state of global workers {state['global_ids']} of {state['G']}, loader has "
                              f"{self.gids} of {self.G}; use restore_state_global for a layout change")
        self.states = list(state["workers"])
        self.next_worker = state["next"]

    def save_state_global(self) -> list[dict[str, Any]]:
        """Every data-parallel rank's state (a collective over the worker config's group)."""
        import torch.distributed as dist

        mine = self.save_state_rank()
        wc = self.dataset.worker_config
        if wc.world_size == 1:
            return [mine]
        out: list[Any] = [None] * wc.world_size
        dist.all_gather_object(out, mine, group=wc.data_parallel_group)
        return out

    def restore_state_global(self, states: list[dict[str, Any]]) -> None:
        self.restore_state_rank(redistribute(states, self.dataset.worker_config))

    # --------------------------------------------------------------------------- workers

    def _start(self) -> None:
        cfg = self.dataset.config
        self._started = True
        self._ended = [False] * len(self.gids)
        if self.dataset.worker_config.num_workers == 0:
            self._pipes = [Pipeline(cfg, self.gids[0], self.G, state=self.states[0])]
            return
        import torch.multiprocessing  # noqa: F401 - registers the shared-memory pickling of tensors

        ctx = zoo_procs.context()
        for i, g in enumerate(self.gids):
            q = ctx.Queue(maxsize=self.prefetch)
            status = ctx.Array("c", 1024, lock=False)
            p = ctx.Process(target=_worker_main, args=(cfg, g, self.G, self.states[i], q, status, os.getpid(),
                                                       zoo_procs.callers()),
                            daemon=True, name=f"zoo-data-worker-{g}")
            p.start()
            self._procs.append(p)
            self._queues.append(q)
            self._status.append(status)
        self._first = [True] * len(self.gids)

    def _receive(self, i: int) -> tuple[str, Any, Any, list[str]]:
        if self._pipes:
            pipe = self._pipes[i]
            try:
                batch = pipe.next()
            except StopIteration:
                return "end", None, pipe.state(), []
            return "batch", batch, pipe.state(), pipe.sources
        limit = self.initial_timeout if self._first[i] else self.timeout
        start = time.monotonic()
        while True:
            try:
                msg = self._queues[i].get(timeout=min(1.0, limit))
                break
            except (queue_mod.Empty, OSError, EOFError) as e:
                p, where = self._procs[i], self._status[i].value.decode("utf-8", "replace") or "its first sample"
                if not isinstance(e, queue_mod.Empty):  # the pipe broke: the worker died mid-message
                    p.join(timeout=10)
                if not p.is_alive():
                    self.close()
                    raise LoaderError(f"data worker {self.gids[i]} (pid {p.pid}) died with exit code {p.exitcode} "
                                      f"while reading {where}") from None
                if time.monotonic() - start > limit:
                    self.close()
                    raise LoaderError(f"data worker {self.gids[i]} (pid {p.pid}) made no batch in {limit:.0f} s "
                                      f"(watchdog); it was reading {where}") from None
        self._first[i] = False
        if msg[0] == "error":
            self.close()
            raise LoaderError(f"data worker {self.gids[i]}: {msg[1]}\n{msg[2]}")
        if msg[0] == "end":
            return "end", None, msg[1], []
        if msg[0] == "blob":
            msg = pickle.loads(msg[1])  # from our own worker: nothing untrusted
        return msg  # type: ignore[no-any-return]

    def _batches(self) -> Iterator[Any]:
        if not self._started:
            self._start()
        n = len(self.gids)
        while not all(self._ended):
            i = self.next_worker
            self.next_worker = (i + 1) % n
            if self._ended[i]:
                continue
            kind, batch, state, self.sources = self._receive(i)
            if kind == "end":
                self._ended[i] = True
                continue
            self.states[i] = state  # the position after the batch handed out now
            yield batch

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        if not ds.config.training:  # validation restarts from the beginning every time
            self.close()
            self.states, self.next_worker = [None] * len(self.gids), 0
            gen = self._batches()
            for i, batch in enumerate(gen):
                if ds.limit is not None and i >= ds.limit:
                    break
                yield batch
            self.close()
            return
        if not hasattr(self, "_gen"):
            self._gen = self._batches()
        if ds.virtual_epoch_length <= 0:
            yield from self._gen
            return
        for _ in range(ds.virtual_epoch_length):
            try:
                yield next(self._gen)
            except StopIteration:
                return

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for q in self._queues:
            q.cancel_join_thread()
            q.close()
        self._procs, self._queues, self._status, self._pipes = [], [], [], []
        self._started = False
        if hasattr(self, "_gen"):
            del self._gen

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


def get_loader(dataset: EnergonDataset, *, prefetch_factor: int = 2, watchdog_timeout_seconds: float = 60.0,
               **_: Any) -> Loader:
    return Loader(dataset, prefetch_factor=prefetch_factor, watchdog_timeout_seconds=watchdog_timeout_seconds)


def get_savable_loader(dataset: EnergonDataset, *, prefetch_factor: int = 2, watchdog_timeout_seconds: float = 60.0,
                       **_: Any) -> Loader:
    """The same loader as `get_loader`: every zoo loader can save its exact position cheaply."""
    return Loader(dataset, prefetch_factor=prefetch_factor, watchdog_timeout_seconds=watchdog_timeout_seconds)


def redistribute(states: list[dict[str, Any]], wc: WorkerConfig) -> dict[str, Any]:
    """This rank's state from every rank's saved state, possibly under another layout.

    The data order is a function of the *global* workers (ranks x workers per rank), so a change
    of data-parallel size or of workers per rank keeps exactly the same global batches when the
    number of global workers stays the same and every rank had consumed a whole round of its
    workers (``next == 0``: each rank's micro-batches per step a multiple of its workers). Any
    other change would silently alter the data and is refused.
    """
    if not states:
        raise LoaderError("no saved loader states")
    saved_G = states[0]["G"]
    flat = {g: s for st in states for g, s in zip(st["global_ids"], st["workers"])}
    if len(flat) != saved_G:
        raise LoaderError(f"saved loader states cover {len(flat)} of {saved_G} global workers")
    same = len(states) == wc.world_size and saved_G == wc.global_workers
    if same:
        return states[wc.rank]
    if all(s is None for s in flat.values()):  # nothing consumed yet: any layout starts fresh
        return {**states[0], "G": wc.global_workers, "global_ids": wc.global_ids(), "workers": [None] * wc.per_rank,
                "next": 0}
    if saved_G != wc.global_workers:
        raise LoaderError(
            f"the data position was saved with {len(states)} data-parallel rank(s) x {saved_G // len(states)} "
            f"worker(s) = {saved_G} global workers; this run has {wc.world_size} x {wc.per_rank} = "
            f"{wc.global_workers}. The sample order depends on the number of global workers, so resuming would "
            f"change the data: set data.num_workers so that ranks x workers = {saved_G}")
    if any(st["next"] for st in states):
        raise LoaderError("the data position was saved in the middle of a round over the workers (micro-batches per "
                          "step not a multiple of data.num_workers), so another layout cannot continue it exactly")
    return {**states[0], "G": saved_G, "global_ids": wc.global_ids(), "workers": [flat[g] for g in wc.global_ids()],
            "next": 0}


__all__ = ["EnergonDataset", "Loader", "LoaderError", "WorkerConfig", "get_loader", "get_savable_loader",
           "get_train_dataset", "get_val_dataset", "redistribute"]
