"""zoo's Energon loader and `zoo prepare webdataset` against megatron-energon on the same shards.

Data: scikit-learn's digits as PNGs with captions (repeated to the requested size, keys unique),
in 64 shards. Both prepare a copy of the same tars (`energon prepare` with as many workers as
zoo). Both loaders do the same work per sample: read through `.tar.idx`, decode the PNG to a
float RGB tensor and the caption, batch 32 (CaptioningSample, shuffle buffer 100, slices of
100), with 0 and 2 workers. Each measurement runs in a fresh process: time to the first batch,
then samples/s over the next batches, and the peak RSS of the process and its workers (sampled),
at two dataset sizes to show it does not grow with the dataset.

    python benchmarks/energon_loader_vs_megatron_energon.py [--samples 12500 50000] [--batches 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHARDS = 64
BATCH = 32


def _rss_tree(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
    except psutil.Error:
        return 0


def measure(which: str, path: str, workers: int, batches: int) -> dict:
    """One run in this (fresh) process: first-batch time, samples/s, peak RSS of the tree."""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_tree(os.getpid()))
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    if which == "zoo":
        from zoo.data.energon import WorkerConfig, get_loader, get_train_dataset

        ds = get_train_dataset(path, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
                               batch_size=BATCH, shuffle_buffer_size=100, max_samples_per_sequence=100)
        loader = get_loader(ds)
    else:
        from megatron.energon import WorkerConfig, get_loader, get_train_dataset

        ds = get_train_dataset(path, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
                               batch_size=BATCH, shuffle_buffer_size=100, max_samples_per_sequence=100)
        loader = get_loader(ds)
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    assert tuple(first.image.shape) == (BATCH, 3, 8, 8) if hasattr(first, "image") else tuple(first["image"].shape) == (BATCH, 3, 8, 8)
    for _ in range(batches):
        next(it)
    t2 = time.perf_counter()
    stop.set()
    return {"first_batch_s": t1 - t0, "samples_per_s": batches * BATCH / (t2 - t1), "peak_rss_mb": peak[0] / 1e6}


def build(root: Path, n: int) -> Path:
    from zoo.data.energon.prepare import digit_samples, write_shards

    raw = root / f"raw{n}"
    if not raw.exists():
        repeat = -(-n // 1797)
        samples = (s for _, s in zip(range(n), digit_samples(repeat=repeat)))
        write_shards(raw, ((k, {"png": p["png"], "txt": p["txt"]}) for k, p in samples), shard_size=-(-n // SHARDS))
    return raw


def prepare_both(raw: Path, root: Path, workers: int) -> tuple[Path, Path, float, float]:
    paths = []
    for name in ("zoo", "energon"):
        dst = root / f"{raw.name}-{name}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(raw / "shards", dst / "shards")
        paths.append(dst)
    fm = '{"image": "png", "caption": "txt"}'
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zoo", "prepare", "webdataset", str(paths[0]), "--split", "1,0,0",
                    "--sample-type", "CaptioningSample", "--field-map", "image=png,caption=txt", "--no-progress",
                    "--num-workers", str(workers)], check=True, capture_output=True)
    zoo_s = time.perf_counter() - t
    energon = shutil.which("energon") or str(Path(sys.executable).parent / "energon")
    t = time.perf_counter()
    subprocess.run([energon, "prepare", str(paths[1]), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
                    "CaptioningSample", "--field-map", fm, "--no-progress", "--num-workers", str(workers)],
                   check=True, capture_output=True)
    energon_s = time.perf_counter() - t
    return paths[0], paths[1], zoo_s, energon_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, nargs="+", default=[12_500, 50_000])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--dir", help="where to build the shards (default: a temporary directory)")
    ap.add_argument("--measure", nargs=4, metavar=("WHICH", "PATH", "WORKERS", "BATCHES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        which, path, w, b = args.measure
        print(json.dumps(measure(which, path, int(w), int(b))))
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="zoo-energon-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores; {SHARDS} shards; batch {BATCH}; PNG decode + caption")
    for n in args.samples:
        raw = build(root, n)
        zoo_path, en_path, zs, es = prepare_both(raw, root, workers=max(args.workers))
        print(f"\n{n:,} samples: prepare  zoo {zs:6.2f}s  energon {es:6.2f}s  -> {es / zs:5.1f}x faster")
        for w in args.workers:
            res = {}
            for which, path in (("zoo", zoo_path), ("energon", en_path)):
                out = subprocess.run([sys.executable, __file__, "--measure", which, str(path), str(w), str(args.batches)],
                                     check=True, capture_output=True, text=True)
                res[which] = json.loads(out.stdout.strip().splitlines()[-1])
            z, e = res["zoo"], res["energon"]
            print(f"  workers {w}: samples/s zoo {z['samples_per_s']:8,.0f}  energon {e['samples_per_s']:8,.0f}  -> "
                  f"{z['samples_per_s'] / e['samples_per_s']:4.2f}x | first batch zoo {z['first_batch_s']:5.2f}s "
                  f"energon {e['first_batch_s']:5.2f}s | peak RSS zoo {z['peak_rss_mb']:6.0f} MB energon "
                  f"{e['peak_rss_mb']:6.0f} MB")


if __name__ == "__main__":
    main()
