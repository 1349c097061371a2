"""GPT dataset machinery against megatron-core in one run: sample-index build time for 10M samples
(zoo's chunked torch CPU kernels against megatron-core's compiled C++ helper, same inputs, results
compared; first call and best of 5, with torch's default threads and with one thread) and random
sample reads per second from an indexed dataset (zoo's reader against megatron-core's).

    python benchmarks/gpt_dataset_vs_megatron.py [--samples 10000000] [--reads 200000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from zoo.data.gpt import build_document_index, build_sample_index
from zoo.data.indexed import IndexedDataset, IndexedDatasetWriter

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers as mc_helpers
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MCIndexedDataset


def timings(fn, reps: int) -> tuple[float, float, object]:
    """(first call, best call, result)."""
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times[0], min(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--docs", type=int, default=200_000)
    p.add_argument("--reads", type=int, default=200_000)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4000, size=args.docs).astype(np.int32)
    tokens_per_epoch = int(sizes.sum())
    epochs = -(-(args.samples * args.seq + 1) // tokens_per_epoch)
    doc_index = build_document_index(np.arange(args.docs, dtype=np.int32), epochs, np.random.RandomState(1), False)
    import torch

    first_mc, t_mc, ref = timings(lambda: mc_helpers.build_sample_idx(sizes, doc_index, args.seq, epochs, tokens_per_epoch,
                                                                      True, True), 5)
    first_zoo, t_zoo, ours = timings(lambda: build_sample_index(sizes, doc_index, args.seq, epochs, tokens_per_epoch), 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _, t_zoo1, ours1 = timings(lambda: build_sample_index(sizes, doc_index, args.seq, epochs, tokens_per_epoch), 5)
    torch.set_num_threads(threads)
    same = np.array_equal(ref, ours) and np.array_equal(ref, ours1)
    print(f"# {time.strftime('%Y-%m-%d')} sample index: {len(ours) - 1:,} samples of {args.seq} tokens over {epochs} epochs "
          f"of {args.docs:,} documents")
    print(f"sample index build, best of 5: megatron-core C++ {t_mc:.3f}s, zoo {t_zoo:.3f}s ({threads} torch threads) -> "
          f"zoo/megatron time {t_zoo / t_mc:.2f}x (target <= 1.0x); zoo on 1 thread {t_zoo1:.3f}s -> {t_zoo1 / t_mc:.2f}x; "
          f"identical: {same}")
    print(f"sample index build, first call: megatron-core C++ {first_mc:.3f}s, zoo {first_zoo:.3f}s -> "
          f"{first_zoo / first_mc:.2f}x")

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "d"
        with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
            for n in rng.integers(1, 2000, size=50_000):
                w.add_document(rng.integers(0, 60000, size=int(n)))
        ours_ds, mc_ds = IndexedDataset(prefix), MCIndexedDataset(str(prefix))
        picks = rng.integers(0, len(ours_ds), size=args.reads)

        def read(ds) -> int:
            total = 0
            for i in picks:
                total += int(ds[int(i)][0])
            return total

        _, t_mc_r, a = timings(lambda: read(mc_ds), 2)
        _, t_zoo_r, b = timings(lambda: read(ours_ds), 2)
        print(f"random reads: megatron-core {args.reads / t_mc_r:,.0f}/s, zoo {args.reads / t_zoo_r:,.0f}/s -> "
              f"zoo/megatron {t_mc_r / t_zoo_r:.2f}x (target >= 1.0x); same data: {a == b}")


if __name__ == "__main__":
    main()
