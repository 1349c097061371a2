"""MFU of every family's real training step (`zoo train`), in fp32 and bf16, on this machine.

Each family trains a few steps at a benchmark width (hidden 384-512, the family's own data) in a
fresh process; the table gives the median of the logged steps after the first two: units/s, the
model FLOP/s the trainer logs (the family's declared FLOPs per unit) and MFU against the GEMM peak
this benchmark measures once, for every row alike, of the precision used (the better of that
precision's and fp32's, so a CPU whose bf16 GEMM is slower than fp32 is judged against fp32). The
MFU each run logged, against its own start-up probe, is shown beside it: a probe that met a slow
moment of a shared VM makes that MFU read high. The peaks are printed with the table. The
per-family peer comparisons (HF, diffusers) are in each family's own benchmark; this one is the
MFU table of docs/benchmarks.md.

    python benchmarks/mfu_by_family.py                    # every family, fp32 and bf16
    python benchmarks/mfu_by_family.py --models llama dit --precisions bf16
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = ["train.seq_length=256", "train.micro_batch_size=8"]
# model: (overrides giving it a benchmark width, what its throughput counts)
WIDTHS = {
    "llama": ["model.hidden_size=512", "model.num_heads=8", "model.head_dim=64", "model.ffn_hidden_size=1536",
              "model.num_layers=4", *TEXT],
    "mixtral": ["model.hidden_size=512", "model.num_heads=8", "model.head_dim=64", "model.ffn_hidden_size=768",
                "model.num_layers=4", *TEXT],
    "mamba2": ["model.hidden_size=512", "model.ssm_head_dim=64", *TEXT],
    "hybrid": ["model.hidden_size=512", "model.ssm_head_dim=64", "model.num_heads=8", "model.head_dim=64",
               "model.ffn_hidden_size=1536", *TEXT],
    "dit": ["model.hidden_size=384", "model.num_heads=6", "train.micro_batch_size=64"],
    "dit-video": ["model.hidden_size=384", "model.num_heads=6", "train.micro_batch_size=16"],
    "clip": ["model.vision_hidden_size=256", "model.vision_ffn_hidden_size=1024", "model.text_hidden_size=256",
             "model.text_ffn_hidden_size=1024", "train.micro_batch_size=64"],
    "llava": ["model.hidden_size=512", "model.num_heads=8", "model.head_dim=64", "model.ffn_hidden_size=1536",
              "train.micro_batch_size=16"],
}


def run(model: str, precision: str, steps: int, cache: Path, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "zoo", "train", "--model", model, "--run-dir", tmp, f"data.cache_dir={cache}",
               f"train.steps={steps}", "logging.interval=1", "train.eval_interval=0", "logging.progress=false",
               "logging.tensorboard=false", "logging.plot=false", "checkpoint.interval=0", "train.preview=false",
               f"train.precision={precision}", *WIDTHS[model]]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            raise SystemExit(f"{model} {precision}: {out.stderr.strip().splitlines()[-1]}")
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()][2:]
    rate_key = next(k for k in rows[0] if k.endswith("_per_s"))
    return {"mfu": statistics.median(r["mfu"] for r in rows), "rate": statistics.median(r[rate_key] for r in rows),
            "flops_per_s": statistics.median(r["flops_per_s"] for r in rows), "unit": rate_key[:-6]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"],
                   help="default: fp32 and bf16 (fp32 alone on a CPU without bf16 instructions)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))

    from llama_vs_hf import bf16_skipped, gemm_peak

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        gemm_peak(argparse.Namespace(threads=args.threads, device="cpu"))
    peak = json.loads(buf.getvalue())
    print(f"# {time.strftime('%Y-%m-%d')} {args.threads} threads; GEMM peak fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s (MFU is against the better of the two for bf16; 'run MFU' is "
          f"what the run logged, against the 1024^3 product its process timed at start-up)")
    if args.precisions is None:
        skip = bf16_skipped(peak, False, override="--precisions fp32 bf16")
        if skip:
            print(f"# {skip}")
        args.precisions = ["fp32"] if skip else ["fp32", "bf16"]
    print(f"{'model':<10} {'precision':<9} {'units/s':>10} {'unit':<7} {'GFLOP/s':>8} {'MFU':>6} {'run MFU':>8}")
    cache = Path(tempfile.gettempdir()) / "zoo-mfu-cache"
    for model in args.models:
        for precision in args.precisions:
            r = run(model, precision, args.steps, cache, args.threads)
            best = max(peak["fp32"], peak[precision])
            print(f"{model:<10} {precision:<9} {r['rate']:>10.0f} {r['unit']:<7} {r['flops_per_s'] / 1e9:>8.1f} "
                  f"{r['flops_per_s'] / best:>6.1%} {r['mfu']:>8.1%}", flush=True)


if __name__ == "__main__":
    main()
