"""Byte-level text from Python's own pydoc topics: deterministic, no download.

The text is split by position: the first 95% trains, the rest validates. Sample ``g`` of the
stream is a window whose start is drawn from a generator seeded by (seed, split, g), so a sample
depends only on its index: data-parallel ranks read disjoint slices of each global batch, and a
resumed run continues with exactly the samples an uninterrupted one would have read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _corpus() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    data = _corpus()
    cut = int(len(data) * 0.95)
    data = data[:cut] if split == "train" else data[cut:]
    seq, mbs = run.train.seq_length, run.train.micro_batch_size
    gbs = run.train.global_batch_size or mbs * dp_size
    per_rank = gbs // dp_size
    salt = 0 if split == "train" else 1

    def sample(g: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(((run.train.seed * 2 + salt) << 40) + g)
        start = int(torch.randint(0, len(data) - seq - 1, (1,), generator=gen))
        return data[start : start + seq + 1]

    g = consumed_samples
    while True:
        mine = g + dp_rank * per_rank
        for m in range(per_rank // mbs):
            window = torch.stack([sample(mine + m * mbs + j) for j in range(mbs)])
            yield {"tokens": window[:, :-1], "labels": window[:, 1:]}
        g += gbs
