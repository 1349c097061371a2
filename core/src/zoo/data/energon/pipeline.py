"""One global worker's sample pipeline, every stage savable between two batches.

Stages, in Energon's order: read (the worker's share of every dataset, cut into slices read
a few at a time in a shuffled order) -> blend -> shuffle buffer -> ``encode_sample`` -> packing
-> batch or group-batch -> ``encode_batch``. Every sample carries a restore key (which dataset
and sample index, which output of which hook), so a stage's state is its random generator and
the *keys* of what it buffers, never the data: `Pipeline.state()` is a small JSON-able dict, and
`Pipeline(state=...)` rebuilds the buffers by re-reading those samples through `.tar.idx`.

Randomness comes from NumPy generators seeded by (run seed, number of global workers, global
worker id, dataset, purpose), so a run's order follows from its seed, and a layout with the same
number of global workers (data-parallel ranks x workers per rank) reproduces it exactly.

Where this differs from Energon on purpose: an open slice is drawn with probability proportional
to what it has *left* (all open slices end together, so no slice lingers into a tail); samples
that ``select_samples_to_pack`` leaves out stay buffered for the next round instead of being
dropped; a dataset with fewer samples than global workers is read whole by every worker in
training (Energon crashes, upstream PR #145) and leaves workers idle in validation.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zoo.data.energon.dataset import DatasetError, WebDataset, make_sample
from zoo.data.energon.reader import LeafReader, resolve_subset, rng_state, seeded_rng, set_rng_state, worker_range
from zoo.data.energon.task_encoder import Reseeder, SkipSample, TaskEncoder, pure

Key = tuple[Any, ...]


@dataclass(frozen=True)
class Leaf:
    """One dataset of a (meta)dataset, after subset ranges are resolved against its length."""

    path: str
    split_part: str = "train"
    weight: float = 1.0
    repetitions: float = 1.0
    subflavors: dict[str, Any] = field(default_factory=dict)
    subset: tuple[tuple[Any, Any], ...] = ()  # ranges applied innermost first (percent strings or indices)
    dataset_config: str = "dataset.yaml"
    split_config: str = "split.yaml"
    shuffle_over_epochs: int | None = 1  # Energon's (`zoo.data.energon.reader.LeafReader`)


@dataclass(frozen=True)
class PipelineConfig:
    leaves: tuple[Leaf, ...]
    task_encoder: TaskEncoder
    training: bool
    blend: str = "single"  # "single", "blend" (weights) or "epochized" (repetitions)
    repeat: bool = True
    batch_size: int | None = None
    batch_drop_last: bool = False
    shuffle_buffer_size: int | None = None
    max_samples_per_sequence: int | None = None
    packing_buffer_size: int | None = None
    parallel_slices: int = 16
    seed: int = 0
    allow_pickle: bool = False
    allow_code: bool = False

    def fingerprint(self) -> dict[str, Any]:
        """What must not change across a restore for the saved state to mean the same data."""
        # (shuffle_over_epochs only where it is not Energon's default, so states saved before it existed restore)
        leaves = [{k: v for k, v in dataclasses.asdict(leaf).items() if k != "shuffle_over_epochs" or v != 1}
                  for leaf in self.leaves]
        return json.loads(json.dumps({"leaves": leaves, "blend": self.blend,
                "repeat": self.repeat, "batch_size": self.batch_size, "batch_drop_last": self.batch_drop_last,
                "shuffle_buffer_size": self.shuffle_buffer_size,
                "max_samples_per_sequence": self.max_samples_per_sequence,
                "packing_buffer_size": self.packing_buffer_size, "parallel_slices": self.parallel_slices,
                "seed": self.seed, "task_encoder": type(self.task_encoder).__qualname__}))


def tuplify(x: Any) -> Any:
    return tuple(tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


class Pipeline:
    """Batches of global worker ``g`` of ``G``; ``state`` (from `state()`) resumes after the
    batch it was taken at. ``status(text)`` is told what is being read (for the watchdog)."""

    def __init__(self, cfg: PipelineConfig, g: int, G: int, *, state: dict[str, Any] | None = None,
                 status: Callable[[str], None] | None = None) -> None:
        self.cfg, self.g, self.G = cfg, g, G
        self.te = cfg.task_encoder
        self.status = status or (lambda _: None)
        self.datasets = [WebDataset(leaf.path, split_part=leaf.split_part, dataset_config=leaf.dataset_config,
                                    split_config=leaf.split_config, allow_pickle=cfg.allow_pickle,
                                    allow_code=cfg.allow_code) for leaf in cfg.leaves]
        self.readers: list[LeafReader] = []
        rotation = 0
        for k, (leaf, ds) in enumerate(zip(cfg.leaves, self.datasets)):
            lo, hi = resolve_subset(leaf.subset, len(ds), ds.path)
            n = hi - lo
            if cfg.training and 0 < n < G:
                a, b = lo, hi  # too few samples to share: every worker reads them all, in its own order
            else:
                a, b = worker_range(n, g, G, rotation)
                a, b = lo + a, lo + b
            rotation += n
            limit = None if cfg.training else b - a
            self.readers.append(LeafReader(ds, a, b, training=cfg.training, msps=cfg.max_samples_per_sequence,
                                           parallel=cfg.parallel_slices, limit=limit,
                                           seed_words=(cfg.seed, G, g, k), shuffle_over_epochs=leaf.shuffle_over_epochs))
        self.blend_rng = seeded_rng(cfg.seed, G, g, 1 << 20)
        self.quota = self._quotas()
        self.current = 0  # validation: the dataset being read
        self.shuffle_rng = seeded_rng(cfg.seed, G, g, 1 << 21)
        self.shuffle: list[tuple[Key, Any]] = []
        self.pending: list[tuple[Key, Any]] = []  # encode_sample outputs not yet passed on
        self.pack_buffer: list[tuple[Key, Any]] = []
        self.pack_queue: list[list[tuple[Key, Any]]] = []
        self.buckets: dict[Any, list[tuple[Key, Any]]] = {}
        self.batches = 0
        self.exhausted = False
        # Where each sample read came from (dataset shard and key, by restore key), until its batch
        # is made; `sources` then names the last batch's samples (for the trainer's error messages).
        self.where: dict[Key, str] = {}
        self.sources: list[str] = []
        # Reseeded hooks leave the global RNGs to the next one; the caller's states come back
        # before any other user code runs and before a batch (or a restore) is done.
        self.seeds = Reseeder()
        self.pure_cookers = not self.te.overrides("cook_crude_sample") and all(pure(c.cook) for c in self.te.cookers)
        if state is not None:
            try:
                self.restore(state)
            finally:
                self.seeds.restore()

    # --------------------------------------------------------------------------- reading

    def _quotas(self) -> list[int]:
        if self.cfg.blend != "epochized":
            return []
        return [int(round(leaf.repetitions * r.n)) for leaf, r in zip(self.cfg.leaves, self.readers)]

    def _pick(self) -> tuple[int, int]:
        cfg, readers = self.cfg, self.readers
        if not cfg.training:
            while self.current < len(readers):
                try:
                    return self.current, readers[self.current].next()
                except StopIteration:
                    self.current += 1
            raise StopIteration
        if cfg.blend == "epochized":
            if not any(self.quota):
                if not cfg.repeat:
                    raise StopIteration
                self.quota = self._quotas()
                if not any(self.quota):
                    raise StopIteration
            q = np.array(self.quota, dtype=np.float64)
            k = int(self.blend_rng.choice(len(q), p=q / q.sum()))
            self.quota[k] -= 1
        elif len(readers) > 1:
            w = np.array([leaf.weight if r.n else 0.0 for leaf, r in zip(cfg.leaves, readers)])
            if w.sum() <= 0:
                raise StopIteration
            k = int(self.blend_rng.choice(len(w), p=w / w.sum()))
        else:
            k = 0
        return k, readers[k].next()

    def make(self, k: int, idx: int, key: Key) -> Any:
        ds, leaf = self.datasets[k], self.cfg.leaves[k]
        sid, j = ds.locate(idx)
        self.status(f"{ds.shard_where(ds.shards[sid])} sample {j}")
        if ds.config is not None and ds.config.sample_loader:
            self.seeds.restore()  # dataset.yaml's sample_loader is the user's code
        sample = make_sample(ds, idx, restore_key=key, subflavors=leaf.subflavors, decode=self.te.decoder)
        crude = isinstance(sample, dict) and "__shard__" in sample
        where = ds.where(ds.shards[sid], sample["__key__"] if crude else sample.__key__)
        self.status(where)  # what the hooks that follow work on
        if len(self.where) >= 4096:  # samples skipped by a hook never reach a batch
            self.where = dict(list(self.where.items())[2048:])
        self.where[key] = where
        if crude:
            if not self.pure_cookers:  # the user's code, which may draw from the caller's streams
                self.seeds.restore()
            sample = self.te.cook_crude_sample(sample, sample["__subflavors__"], where)
        return sample

    def _read(self) -> tuple[Key, Any]:
        k, idx = self._pick()
        # The epoch is part of the key: a hook seeded by key (random crops, a diffusion model's
        # noise) draws afresh each time the sample comes round again.
        key: Key = ("s", k, idx, self.readers[k].pass_id)
        return key, self.make(k, idx, key)

    # --------------------------------------------------------------------------- stages

    def _shuffled(self) -> tuple[Key, Any]:
        size = self.cfg.shuffle_buffer_size
        if not size or size <= 1:
            return self._read()
        while len(self.shuffle) < size and not self.exhausted:
            try:
                self.shuffle.append(self._read())
            except StopIteration:
                self.exhausted = True
        if not self.shuffle:
            raise StopIteration
        i = int(self.shuffle_rng.integers(len(self.shuffle)))
        item = self.shuffle[i]
        self.shuffle[i] = self.shuffle[-1]
        self.shuffle.pop()
        return item

    def _encode(self, key: Key, sample: Any) -> list[tuple[Key, Any]]:
        if not self.te.overrides("encode_sample"):
            return [(key, sample)]
        try:
            out = self.seeds.call(self.te.encode_sample, sample, seed=self.cfg.seed, key=key)
        except SkipSample:
            return []
        outs = list(out) if _is_gen(self.te.encode_sample) or inspect.isgenerator(out) else [out]
        return [(("e", key, i), o) for i, o in enumerate(outs)]

    def _encoded(self) -> tuple[Key, Any]:
        skipped = 0
        while not self.pending:
            key, sample = self._shuffled()
            self.pending = self._encode(key, sample)
            skipped += not self.pending
            # A training stream repeats: if the task encoder skips every sample, no batch ever comes
            # (a DiT packing images longer than train.seq_length spun here, deaf to SIGTERM's save).
            if skipped > 2 * sum(r.n for r in self.readers) + (self.cfg.shuffle_buffer_size or 0):
                raise DatasetError(f"{self.where.get(key, key)}: the task encoder skipped every sample of two "
                                   f"epochs ({skipped:,} in a row, SkipSample), so no batch can be made: does any "
                                   "sample fit (e.g. a DiT's image tokens within train.seq_length when packing)?")
        return self.pending.pop(0)

    def _pack(self, group: list[tuple[Key, Any]]) -> tuple[Key, Any]:
        key: Key = ("p", tuple(k for k, _ in group))
        members = [self.seeds.call(self.te.postencode_sample, s, seed=self.cfg.seed, key=k) for k, s in group] \
            if self.te.overrides("postencode_sample") else [s for _, s in group]
        return key, self.seeds.call(self.te.pack_selected_samples, members, seed=self.cfg.seed, key=key)

    def _packed(self) -> tuple[Key, Any]:
        size = self.cfg.packing_buffer_size
        if not size:
            return self._encoded()
        while not self.pack_queue:
            ended = False
            while len(self.pack_buffer) < size:
                try:
                    self.pack_buffer.append(self._encoded())
                except StopIteration:
                    ended = True
                    break
            if not self.pack_buffer:
                raise StopIteration
            by_id = {id(s): (k, s) for k, s in self.pack_buffer}
            self.seeds.restore()
            groups = self.te.select_samples_to_pack([s for _, s in self.pack_buffer])
            queue, used = [], set()
            for group in groups:
                entries = []
                for s in group:
                    if id(s) not in by_id or id(s) in used:
                        raise ValueError("select_samples_to_pack must return groups of the samples it was given, "
                                         "each at most once")
                    used.add(id(s))
                    entries.append(by_id[id(s)])
                if entries:
                    queue.append(entries)
            if not queue:
                if ended:
                    self.pack_buffer = []
                    raise StopIteration
                raise ValueError(f"select_samples_to_pack chose nothing from a full buffer of {len(self.pack_buffer)} "
                                 "samples (raise packing_buffer_size, or skip samples that never fit in encode_sample)")
            self.pack_buffer = [(k, s) for k, s in self.pack_buffer if id(s) not in used]
            self.pack_queue = queue
        return self._pack(self.pack_queue.pop(0))

    def next(self) -> Any:
        """The next batch (or sample when batch_size is None); StopIteration at the end."""
        try:
            return self._next()
        finally:
            self.seeds.restore()

    def _next(self) -> Any:
        cfg, te = self.cfg, self.te
        if cfg.batch_size is None and not te.overrides("batch_group_criterion"):
            key, out = self._packed()
            keys = [key]
        elif te.overrides("batch_group_criterion"):
            keys, out = self._group_batch()
        else:
            items = []
            while len(items) < cfg.batch_size:  # type: ignore[operator]
                try:
                    items.append(self._packed())
                except StopIteration:
                    break
            if not items or (len(items) < cfg.batch_size and cfg.batch_drop_last):  # type: ignore[operator]
                raise StopIteration
            self.seeds.restore()
            keys, out = [k for k, _ in items], te.batch([x for _, x in items])
        if te.overrides("encode_batch"):
            self.seeds.restore()
            out = te.encode_batch(out)
        self.sources = [self.where.get(k, repr(k)) for k in _leaf_keys(keys)]
        self.batches += 1
        return out

    def _group_batch(self) -> Any:
        te, cfg = self.te, self.cfg
        while True:
            try:
                key, s = self._packed()
            except StopIteration:
                self.seeds.restore()
                for gkey in list(self.buckets):
                    items = self.buckets.pop(gkey)
                    if not cfg.batch_drop_last:
                        return [k for k, _ in items], te.batch([x for _, x in items])
                raise
            self.seeds.restore()
            gkey, size = te.batch_group_criterion(s)
            if size is None:
                size = cfg.batch_size
            if size is None:
                raise ValueError("batch_group_criterion returned no batch size and none was given (batch_size)")
            bucket = self.buckets.setdefault(gkey, [])
            bucket.append((key, s))
            if len(bucket) >= size:
                del self.buckets[gkey]
                return [k for k, _ in bucket], te.batch([x for _, x in bucket])

    # --------------------------------------------------------------------------- state

    def rebuild(self, key: Key) -> Any:
        """The sample (encoded, packed) a restore key names, rebuilt from the dataset."""
        kind = key[0]
        if kind == "s":
            return self.make(key[1], key[2], key)
        if kind == "e":
            outs = self._encode(key[1], self.rebuild(key[1]))
            for k, o in outs:
                if k == key:
                    return o
            raise ValueError(f"restore: encode_sample no longer yields output {key[2]} for {key[1]} (not stateless?)")
        if kind == "p":
            return self._pack([(k, self.rebuild(k)) for k in key[1]])[1]
        raise ValueError(f"restore: unknown key {key!r}")

    def state(self) -> dict[str, Any]:
        keys = lambda items: [list(k) for k, _ in items]  # noqa: E731
        return {"readers": [r.state() for r in self.readers], "blend_rng": rng_state(self.blend_rng),
                "quota": list(self.quota), "current": self.current, "shuffle_rng": rng_state(self.shuffle_rng),
                "shuffle": keys(self.shuffle), "pending": keys(self.pending), "pack_buffer": keys(self.pack_buffer),
                "pack_queue": [keys(g) for g in self.pack_queue],
                "buckets": [keys(b) for b in self.buckets.values()], "batches": self.batches,
                "exhausted": self.exhausted}

    def restore(self, st: dict[str, Any]) -> None:
        for r, rs in zip(self.readers, st["readers"]):
            r.restore(rs)
        set_rng_state(self.blend_rng, st["blend_rng"])
        set_rng_state(self.shuffle_rng, st["shuffle_rng"])
        self.quota, self.current = list(st["quota"]), st["current"]
        self.batches, self.exhausted = st["batches"], st["exhausted"]
        items = lambda ks: [(tuplify(k), self.rebuild(tuplify(k))) for k in ks]  # noqa: E731
        self.shuffle = items(st["shuffle"])
        self.pending = items(st["pending"])
        self.pack_buffer = items(st["pack_buffer"])
        self.pack_queue = [items(g) for g in st["pack_queue"]]
        self.buckets = {}
        for bucket in st["buckets"]:
            entries = items(bucket)
            self.seeds.restore()
            gkey, _ = self.te.batch_group_criterion(entries[0][1])
            self.buckets[gkey] = entries


def _leaf_keys(keys: list[Key]) -> list[Key]:
    """The samples read (``("s", ...)`` keys) behind encoded outputs and packs, in order."""
    out: list[Key] = []
    for key in keys:
        if key[0] == "s":
            out.append(key)
        elif key[0] == "e":
            out.extend(_leaf_keys([key[1]]))
        elif key[0] == "p":
            out.extend(_leaf_keys(list(key[1])))
    return out


def _is_gen(fn: Any) -> bool:
    return inspect.isgeneratorfunction(getattr(fn, "__func__", fn))


__all__ = ["Leaf", "Pipeline", "PipelineConfig", "tuplify"]
