"""Byte-level text from Python's own pydoc topics: deterministic, no download.

The text is split by position: the first 95% trains, the rest validates. Each data-parallel rank
draws its own windows from a generator seeded by (seed, split, rank), so ranks see different data
and a rerun sees the same data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _corpus() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def build(run: Any, *, split: str, rank: int, world_size: int) -> Iterator[dict[str, torch.Tensor]]:
    data = _corpus()
    cut = int(len(data) * 0.95)
    data = data[:cut] if split == "train" else data[cut:]
    seq, mbs = run.train.seq_length, run.train.micro_batch_size
    gen = torch.Generator().manual_seed(run.train.seed * 1000 + (0 if split == "train" else 1) * 100 + rank)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (mbs,), generator=gen)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield {"tokens": window[:, :-1], "labels": window[:, 1:]}
