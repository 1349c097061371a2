"""The cost of the default instruments (`logging.timers=true`): the same `zoo train` run with the
timers on and off, alternating, the median step time of each (steps after the first two).

    python benchmarks/timers_overhead.py [--rounds 3 --steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["--model", "llama", "model.hidden_size=256", "model.num_heads=4", "model.head_dim=64",
        "model.ffn_hidden_size=768", "model.num_layers=4", "train.seq_length=128", "train.micro_batch_size=4",
        "logging.interval=1", "train.eval_interval=0", "logging.progress=false", "logging.tensorboard=false",
        "logging.plot=false", "checkpoint.interval=0", "train.preview=false"]


def step_ms(timers: bool, steps: int, cache: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "zoo", "train", *ARGS, "--run-dir", tmp, f"data.cache_dir={cache}",
               f"train.steps={steps}", f"logging.timers={str(timers).lower()}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()][2:]
    return statistics.median(4 * 128 / r["tokens_per_s"] * 1e3 for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    cache = os.environ.get("ZOO_BENCH_CACHE", str(Path(tempfile.gettempdir()) / "zoo-bench-cache"))
    on, off = [], []
    for _ in range(args.rounds):
        on.append(step_ms(True, args.steps, cache))
        off.append(step_ms(False, args.steps, cache))
    a, b = statistics.median(on), statistics.median(off)
    print(f"# {time.strftime('%Y-%m-%d')} LLaMA hidden 256 x 4 layers, 4 x 128 tokens per step, {os.cpu_count()} cores")
    print(f"step time: timers on {a:.1f} ms, off {b:.1f} ms (medians of {args.rounds} runs x {args.steps - 2} steps) "
          f"-> cost {(a - b) / b:+.2%}")


if __name__ == "__main__":
    main()
