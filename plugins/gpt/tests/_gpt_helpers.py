"""Helpers for the GPT plugin tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def zoo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("ZOO_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=timeout, env=env)


def small_run(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    """A short LLaMA run on the embedded corpus: small enough for CI, real enough to learn."""
    return ["train", "--model", "llama", "--run-dir", str(run_dir), f"data.cache_dir={cache}",
            "train.seq_length=64", "train.micro_batch_size=8", "logging.interval=1", "train.eval_interval=0",
            "logging.progress=false", *extra]
