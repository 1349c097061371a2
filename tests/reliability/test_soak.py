"""Soak: long runs must not grow. The Energon loader with 4 workers, and `zoo train` saving
checkpoints as it goes: resident memory (the whole process tree: main process and workers) is
sampled through the run and fitted with a line after a warm-up quarter, and the open file
descriptors of every process are counted; both must stay flat.

CI runs short versions (2,000 batches; 300 steps saving every 30). The full soak of issue 18 is
``ZOO_SOAK_BATCHES=20000 ZOO_SOAK_STEPS=2000 python -m pytest -s tests/reliability/test_soak.py``;
each test prints its slope (docs/reliability.md records them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _jobs import descendants, env, lines, llama_args

BATCHES = int(os.environ.get("ZOO_SOAK_BATCHES", "2000"))
STEPS = int(os.environ.get("ZOO_SOAK_STEPS", "300"))


def _tree(pid: int) -> tuple[float, int]:
    """Resident MB and open file descriptors of ``pid`` and everything below it."""
    rss, fds = 0.0, 0
    for p in descendants(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:  # gone meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) / 1024
    return rss, fds


def _slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys over xs after the first quarter, and the spread left around it."""
    x, y = np.asarray(xs[len(xs) // 4:]), np.asarray(ys[len(ys) // 4:])
    a, b = np.polyfit(x, y, 1)
    return float(a), float(np.abs(y - (a * x + b)).max())


def _no_growth(counts: list[int]) -> bool:
    """The floor of the last quarter's descriptor counts is no higher than the second quarter's.
    Momentary descriptors come and go (a checkpoint file open while a sample is taken, a process
    starting or ending) and may land in any quarter, so the highest count is noise; a leak, one
    descriptor kept per shard, batch or checkpoint, lifts every later count and so the floor."""
    q = len(counts) // 4
    return min(counts[-q:]) <= min(counts[q:2 * q])


def test_energon_loader_with_4_workers_stays_flat(tmp_path):
    from zoo.data.energon import WorkerConfig, get_loader, get_train_dataset
    from zoo.data.energon.media import prepare_images

    data = tmp_path / "digits"
    prepare_images(data, dataset="digits", shard_size=100)

    def loader():
        ds = get_train_dataset(str(data), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=4), batch_size=8,
                               shuffle_buffer_size=50, max_samples_per_sequence=20, seed=3)
        return get_loader(ds, watchdog_timeout_seconds=120)

    # multiprocessing starts its resource tracker (a process, a pipe) and a shared-memory arena
    # once per process
    warm = loader()
    next(iter(warm))
    warm.close()
    fds_before, procs_before = len(os.listdir("/proc/self/fd")), descendants(os.getpid())
    loader = loader()
    at, rss, fds = [], [], []
    every = max(BATCHES // 40, 1)
    started = time.monotonic()
    for i, _ in enumerate(loader):
        if i % every == 0:
            r, f = _tree(os.getpid())
            at.append(i), rss.append(r), fds.append(f)
        if i + 1 == BATCHES:
            break
    took = time.monotonic() - started
    loader.close()
    slope, spread = _slope(at, rss)
    growth = slope * (at[-1] - at[len(at) // 4])
    print(f"loader soak: {BATCHES} batches of 8 with 4 workers in {took:.0f} s; RSS {rss[len(rss) // 4]:.0f} -> "
          f"{rss[-1]:.0f} MB, slope {slope * 10_000:+.2f} MB per 10k batches, fds {min(fds)}..{max(fds)}")
    assert growth < 16 + spread, (at, rss)  # a fitted rise beyond the noise around the fit
    assert _no_growth(fds), fds  # no descriptor per shard or batch kept
    assert len(os.listdir("/proc/self/fd")) <= fds_before, "the closed loader left descriptors open"
    assert descendants(os.getpid()) == procs_before, "workers left running"


def test_zoo_train_with_periodic_checkpoints_stays_flat(tmp_path, corpus_cache):
    run = tmp_path / "run"
    args = llama_args(run, corpus_cache, f"train.steps={STEPS}", f"checkpoint.interval={max(STEPS // 20, 1)}",
                      "model.num_layers=2", "train.global_batch_size=4", "checkpoint.keep_last=2")
    proc = subprocess.Popen([sys.executable, "-m", "zoo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env())
    steps, rss, fds = [], [], []
    started = time.monotonic()
    while proc.poll() is None:
        n = lines(run / "metrics.jsonl")
        if n and (not steps or n > steps[-1]):
            r, f = _tree(proc.pid)
            if r:
                steps.append(n), rss.append(r), fds.append(f)
        time.sleep(0.05)
        assert time.monotonic() - started < 1500
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert len(list((run / "checkpoints").glob("step_*"))) == 2  # saved every interval, all but 2 removed
    slope, spread = _slope(steps, rss)
    growth = slope * (steps[-1] - steps[len(steps) // 4])
    print(f"train soak: {STEPS} steps, a checkpoint every {max(STEPS // 20, 1)}, in {time.monotonic() - started:.0f} s; "
          f"RSS {rss[len(rss) // 4]:.0f} -> {rss[-1]:.0f} MB, slope {slope * 1000:+.2f} MB per 1000 steps, "
          f"fds {min(fds)}..{max(fds)} ({len(steps)} samples)")
    assert growth < 16 + spread, (steps, rss)
    assert _no_growth(fds), fds
