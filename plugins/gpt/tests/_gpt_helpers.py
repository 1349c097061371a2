"""Helpers for the GPT plugin tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# ``zoo ARGS`` on N ranks as torchrun starts them, forked from a server that imported torch once
# (~4 s for 4 ranks against torchrun's ~17 on 2 cores)
from zoo.testing import run_zoo_ranks as ranks  # noqa: F401


def zoo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("ZOO_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=timeout, env=env)


def small_run(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    """A short LLaMA run on the embedded corpus: small enough for CI, real enough to learn. No
    TensorBoard files and no loss plot (2 s a run); the tests of those switch them back on."""
    return ["train", "--model", "llama", "--run-dir", str(run_dir), f"data.cache_dir={cache}",
            "train.seq_length=64", "train.micro_batch_size=8", "logging.interval=1", "train.eval_interval=0",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", *extra]


def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N -m zoo ARGS`` (one thread per process: CI has 2 cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_PLUGINS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "zoo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def curve(run_dir: Path) -> list[float]:
    """The training losses a run logged, in order."""
    import json

    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

