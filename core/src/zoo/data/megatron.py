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

from zoo.data.gpt import GPTIndices, build_indices, sample_tokens, split_ranges
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


def cached_indices(ds: IndexedDataset, *, split: str, split_spec: str, seq_length: int, num_samples: int | None,
                   seed: int, cache_dir: Path) -> GPTIndices:
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


def samples_needed(run: Any, split: str, dp_size: int) -> int:
    gbs = run.train.global_batch_size or run.train.micro_batch_size * dp_size
    if split == "train":
        return run.train.steps * gbs
    # Megatron's count: every validation reads eval_steps batches from the start of the split.
    evals = run.train.steps // run.train.eval_interval + 1 if run.train.eval_interval else 1
    return evals * run.train.eval_steps * run.train.micro_batch_size * dp_size


def batches(run: Any, prefix: str | Path, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int,
            cache_dir: Path) -> Iterator[dict[str, Any]]:
    import torch

    ds = IndexedDataset(prefix)
    seq = run.train.seq_length
    idx = cached_indices(ds, split=split, split_spec=run.data.split, seq_length=seq,
                         num_samples=samples_needed(run, split, dp_size), seed=run.train.seed, cache_dir=cache_dir)
    mbs = run.train.micro_batch_size
    gbs = run.train.global_batch_size or mbs * dp_size
    per_rank = gbs // dp_size
    g = consumed_samples
    while True:
        mine = g + dp_rank * per_rank
        for m in range(per_rank // mbs):
            rows = [sample_tokens(ds, idx, (mine + m * mbs + j) % len(idx), seq_length=seq)[0] for j in range(mbs)]
            t = torch.from_numpy(np.stack(rows))
            yield {"tokens": t[:, :-1], "labels": t[:, 1:]}
        g += gbs


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> Iterator[dict[str, Any]]:
    """The ``megatron`` dataset: ``data.path`` names the prefix of a ``.bin/.idx`` pair."""
    path = run.data.path
    if not isinstance(path, str) or not path.strip():
        raise ConfigError("data.path: give the prefix of a Megatron .bin/.idx pair (e.g. my_corpus_text_document)")
    parts = path.split()
    if len(parts) != 1:
        raise ConfigError(f"data.path={path!r}: blends of several datasets are not supported yet; give one prefix")
    cache = Path(run.data.cache_dir) if run.data.cache_dir else Path(parts[0]).parent / "cache"
    return batches(run, parts[0], split=split, dp_rank=dp_rank, dp_size=dp_size,
                   consumed_samples=consumed_samples, cache_dir=cache)
