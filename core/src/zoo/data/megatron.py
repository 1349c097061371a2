"""Training batches from Megatron indexed data: ``data.path=PREFIX`` (``zoo prepare`` output or
files made by Megatron-LM's ``preprocess_data.py``).

The sample sequence is Megatron's (`zoo.data.gpt`). The three indices of each split are cached as
``.npy`` files named by a hash of everything that determines them, built under a file lock by
whichever process gets there first and read memory-mapped by the others: every rank can build them
deterministically, so no shared filesystem is needed. Each data-parallel rank reads its slice of
every global batch, starting from the consumed-sample count stored in checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zoo.data.gpt import GPTIndices, build_indices, masks_and_positions, sample_tokens, split_ranges
from zoo.data.indexed import IndexedDataset
from zoo.errors import ConfigError

INDEX_VERSION = 1


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def cached_indices(ds: IndexedDataset, *, split: str, split_spec: str | None, seq_length: int, num_samples: int | None,
                   seed: int, cache_dir: Path) -> GPTIndices:
    """``split_spec=None``: the split uses every document (a per-split blend)."""
    if split_spec is None:
        lo, hi = 0, len(ds)
    else:
        ranges = split_ranges(split_spec, len(ds))
        if ranges[split] is None:
            raise ConfigError(f"data.split={split_spec!r} leaves the {split} split of {ds.idx_path} empty")
        lo, hi = ranges[split]
    description = json.dumps({"v": INDEX_VERSION, "idx": str(ds.idx_path.resolve()), "size": ds.idx_path.stat().st_size,
                              "mtime": int(ds.idx_path.stat().st_mtime), "split": split, "range": [lo, hi],
                              "seq_length": seq_length, "num_samples": num_samples, "seed": seed}, sort_keys=True)
    digest = hashlib.md5(description.encode()).hexdigest()
    names = {k: cache_dir / f"{digest}-GPTDataset-{split}-{k}_index.npy" for k in ("document", "sample", "shuffle")}
    done = cache_dir / f"{digest}-GPTDataset-{split}-description.txt"
    if not done.exists():
        with file_lock(cache_dir / f".{digest}.lock"):
            if not done.exists():
                idx = build_indices(ds.sequence_lengths, np.arange(lo, hi, dtype=np.int32), seq_length=seq_length,
                                    num_samples=num_samples, seed=seed)
                _save_npy(names["document"], idx.document_index)
                _save_npy(names["sample"], idx.sample_index)
                _save_npy(names["shuffle"], idx.shuffle_index)
                done.write_text(description)  # last: the indices are complete
    return GPTIndices(*(np.load(names[k], mmap_mode="r") for k in ("document", "sample", "shuffle")))


def parse_blend(path: Any) -> list[tuple[float | None, str]]:
    """Megatron's ``"0.5 A 0.3 B"`` (or ``"A B"``, or one prefix), or a YAML list: ``[{path, weight}]``,
    ``[0.5, A, 0.3, B]`` or ``[A, B]``. Returns (weight or None, prefix) pairs."""
    if isinstance(path, str):
        items: list[Any] = path.split()
    elif isinstance(path, list):
        if path and all(isinstance(x, dict) for x in path):
            try:
                return [(float(x["weight"]) if "weight" in x else None, str(x["path"])) for x in path]
            except KeyError:
                raise ConfigError("data.path: every entry of a list of mappings needs a 'path'") from None
        items = list(path)
    else:
        raise ConfigError(f"data.path: expected a prefix, a Megatron blend string or a list, got {type(path).__name__}")
    if not items:
        raise ConfigError("data.path is empty")
    if len(items) % 2 == 1:  # Megatron: an odd count is a list of prefixes without weights
        return [(None, str(x)) for x in items]
    pairs = []
    for w, p in zip(items[::2], items[1::2]):
        try:
            pairs.append((float(w), str(p)))
        except (TypeError, ValueError):
            raise ConfigError(f"data.path: {w!r} is not a weight; write 'WEIGHT PREFIX WEIGHT PREFIX ...'") from None
    return pairs


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: each sample goes to the dataset furthest behind its share
    (``weight * max(i, 1) - taken``, first dataset on ties)."""
    which = np.zeros(size, dtype=np.int16)
    local = np.zeros(size, dtype=np.int64)
    wl, tl = [float(x) for x in weights], [0] * len(weights)
    for i in range(size):
        x = float(max(i, 1))
        best, best_err = 0, wl[0] * x - tl[0]
        for d in range(1, len(wl)):
            err = wl[d] * x - tl[d]
            if err > best_err:
                best, best_err = d, err
        which[i] = best
        local[i] = tl[best]
        tl[best] += 1
    return which, local


def samples_needed(run: Any, split: str, dp_size: int) -> int:
    from zoo.config.rampup import samples_for

    gbs = run.train.global_batch_size or run.train.micro_batch_size * dp_size
    if split == "train":
        return samples_for(run.train, run.train.steps, gbs)
    # Megatron's count: every validation reads eval_steps batches from the start of the split.
    evals = run.train.steps // run.train.eval_interval + 1 if run.train.eval_interval else 1
    return evals * run.train.eval_steps * run.train.micro_batch_size * dp_size


def eod_id(run: Any, known: int | None = None) -> int:
    """The end-of-document id: data.eod_id, else data.tokenizer's, else ``known`` (the dataset's own
    tokenizer, as the built-in corpus has)."""
    if run.data.eod_id is not None:
        return int(run.data.eod_id)
    if run.data.tokenizer:
        from zoo.data.tokenizer import load_tokenizer

        return load_tokenizer(run.data.tokenizer).eod_id
    if known is not None:
        return known
    raise ConfigError("data.reset_position_ids / reset_attention_mask / eod_mask_loss need the end-of-document id: "
                      "set data.tokenizer or data.eod_id")


def document_fields(tokens: np.ndarray, eod: int, *, reset_position_ids: bool, eod_mask_loss: bool,
                    segments: bool) -> dict[str, Any]:
    """Per-token ``loss_mask``, ``position_ids`` and (for attention inside documents) ``segment_ids``:
    the document each token belongs to within its sample, starting after each EOD (as Megatron)."""
    import torch

    masks, positions = zip(*(masks_and_positions(row, eod, reset_position_ids=reset_position_ids,
                                                 eod_mask_loss=eod_mask_loss)[:2] for row in tokens))
    out = {"loss_mask": torch.from_numpy(np.stack(masks)), "position_ids": torch.from_numpy(np.stack(positions))}
    if segments:
        after_eod = np.zeros_like(tokens, dtype=np.int64)
        after_eod[:, 1:] = tokens[:, :-1] == eod
        out["segment_ids"] = torch.from_numpy(np.cumsum(after_eod, axis=1))
    return out


SURPLUS = 0.005  # Megatron builds each blended dataset 0.5% larger than its share


def _normalize(weights: list[float]) -> list[float]:
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    return (np.asarray(weights, dtype=np.float64) / total).tolist()


class Source:
    """The samples of one split: a single dataset, or a Megatron blend of several."""

    def __init__(self, run: Any, blend: list[tuple[float | None, str]], *, split: str, target: int | None,
                 cache_dir: Path, whole: bool = False) -> None:
        seq = run.train.seq_length
        spec = None if whole else run.data.split
        self.seq = seq
        prefixes = [p for _, p in blend]
        weights = [w for w, _ in blend]
        self.datasets = [IndexedDataset(p) for p in prefixes]
        if len(blend) == 1 and weights[0] is None:
            self.indices = [cached_indices(self.datasets[0], split=split, split_spec=spec, seq_length=seq,
                                           num_samples=target, seed=run.train.seed, cache_dir=cache_dir)]
            self.which = None
            return
        if any(w is None for w in weights) and not all(w is None for w in weights):
            raise ConfigError("data.path: give a weight for every dataset of a blend, or for none")
        if weights[0] is not None:
            norm = _normalize([float(w) for w in weights])  # type: ignore[arg-type]
            sizes = [int(np.ceil(np.ceil(target * w) * (1 + SURPLUS))) if target is not None else None for w in norm]
            self.indices = [cached_indices(ds, split=split, split_spec=spec, seq_length=seq, num_samples=n,
                                           seed=run.train.seed, cache_dir=cache_dir) for ds, n in zip(self.datasets, sizes)]
            size = sum(int(np.ceil(target * w)) for w in norm) if target is not None else None
            if size is None:
                raise ConfigError("data.path: a weighted blend needs a sample count (train.steps)")
        else:  # no weights: each dataset weighs its own number of samples (one epoch)
            self.indices = [cached_indices(ds, split=split, split_spec=spec, seq_length=seq, num_samples=None,
                                           seed=run.train.seed, cache_dir=cache_dir) for ds in self.datasets]
            norm = [float(len(ix)) for ix in self.indices]
            size = int(sum(norm)) if target is None else min(target, int(sum(norm)))
            norm = _normalize(norm)
        self.which, self.local = blending_indices(norm, size)

    def __len__(self) -> int:
        return len(self.indices[0]) if self.which is None else len(self.which)

    def sample(self, g: int) -> tuple[int, np.ndarray]:
        """(dataset id, tokens) of sample ``g``."""
        if self.which is None:
            return 0, sample_tokens(self.datasets[0], self.indices[0], g, seq_length=self.seq)[0]
        d = int(self.which[g])
        return d, sample_tokens(self.datasets[d], self.indices[d], int(self.local[g]), seq_length=self.seq)[0]


def batches(run: Any, blend: list[tuple[float | None, str]], *, split: str, dp_rank: int, dp_size: int,
            consumed_samples: int, cache_dir: Path, whole: bool = False, eod: int | None = None
            ) -> Iterator[dict[str, Any]]:
    """Micro-batches of ``blend`` (weight, prefix) pairs for one data-parallel rank; ``whole``: the
    split uses every document of its datasets (a per-split blend) instead of ``data.split``; ``eod``:
    the end-of-document id the dataset's own tokenizer has (see `eod_id`)."""
    import torch

    source = Source(run, blend, split=split, target=samples_needed(run, split, dp_size), cache_dir=cache_dir, whole=whole)
    from zoo.config.rampup import rank_micro_batches

    final = run.train.global_batch_size or run.train.micro_batch_size * dp_size
    d = run.data
    documents = d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss
    eod = eod_id(run, eod) if documents else None
    for picks in rank_micro_batches(run.train, split=split, consumed=consumed_samples, dp_rank=dp_rank,
                                    dp_size=dp_size, final=final):
        rows = np.stack([source.sample(g % len(source))[1] for g in picks])
        t = torch.from_numpy(rows)
        batch = {"tokens": t[:, :-1], "labels": t[:, 1:]}
        if eod is not None:
            batch.update(document_fields(rows[:, :-1], eod, reset_position_ids=d.reset_position_ids,
                                         eod_mask_loss=d.eod_mask_loss, segments=d.reset_attention_mask))
        yield batch


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> Iterator[dict[str, Any]]:
    """The ``megatron`` dataset: ``data.path`` (with ``data.split``) and/or per-split ``data.<split>_path``,
    each a prefix or a Megatron blend of prefixes."""
    per_split = getattr(run.data, f"{split}_path", None)
    blend = parse_blend(per_split or run.data.path) if (per_split or run.data.path) else None
    if blend is None:
        raise ConfigError(f"no data for the {split} split: set data.path or data.{split}_path")
    cache = Path(run.data.cache_dir) if run.data.cache_dir else Path(blend[0][1]).parent / "cache"
    return batches(run, blend, split=split, dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed_samples,
                   cache_dir=cache, whole=bool(per_split))
