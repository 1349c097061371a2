"""Record a fixed set of `zoo train` runs, and compare two records bit for bit.

A change that should not alter behaviour (a refactor, a kernel moved between packages) is checked
by recording before and after it on the same machine and comparing:

    python benchmarks/bitwise.py record /tmp/before
    ... change ...
    python benchmarks/bitwise.py record /tmp/after
    python benchmarks/bitwise.py compare /tmp/before /tmp/after

Each configuration is a real `zoo train` (through torchrun where it has several ranks) with the
default CPU kernels on, logging every step. A record keeps every logged loss, gradient norm and
validation loss, and every tensor of the final checkpoint (model, optimizer and RNG state of every
rank). ``compare`` reports each difference; ``--atol`` admits differences up to that size (for a
kernel that moved and computes in another order: say so where the result is quoted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["train.steps=4", "logging.interval=1", "logging.tensorboard=false", "logging.plot=false",
          "logging.progress=false", "train.eval_interval=2", "train.eval_steps=2", "train.preview=false"]

# (name, ranks, model, overrides)
CONFIGS: list[tuple[str, int, str, list[str]]] = [
    ("llama-fp32", 1, "llama", []),
    ("llama-fp16", 1, "llama", ["train.precision=fp16"]),
    ("gpt2-bf16", 1, "gpt2", ["train.precision=bf16"]),
    ("dit-bf16", 1, "dit", ["train.precision=bf16"]),
    ("gpt2-tp2xpp2-sp", 4, "gpt2", ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    ("llama-cp2-zero", 4, "llama", ["parallel.cp=2", "parallel.zero=1"]),
    ("llama-dp2-fsdp", 2, "llama", ["parallel.fsdp=2"]),
    ("mixtral-ep2", 2, "mixtral", ["parallel.ep=2"]),
    ("mamba2-cp2", 2, "mamba2", ["parallel.cp=2"]),
    ("dit-tp2", 2, "dit", ["parallel.tp=2"]),
]


def _train(name: str, ranks: int, model: str, overrides: list[str], run_dir: Path) -> None:
    args = ["train", "--model", model, "--run-dir", str(run_dir), *COMMON, *overrides]
    if ranks == 1:
        cmd = [sys.executable, "-m", "zoo", *args]
        env = dict(os.environ)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "zoo", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_BACKENDS", None)  # the defaults a user gets
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"{name}: zoo train failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    (run_dir / "stdout.txt").write_text(done.stdout)
    print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)


def _checkpoint_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    out = {}
    for f in sorted(latest.rglob("*.safetensors")):
        for key, t in load_file(f).items():
            out[f"{f.relative_to(latest)}:{key}"] = t
    return out


def record(out: Path, only: list[str]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name, ranks, model, overrides in CONFIGS:
        if only and name not in only:
            continue
        run_dir = out / "runs" / name
        _train(name, ranks, model, overrides, run_dir)
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        metrics = [{k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r} for r in logged]
        (out / f"{name}.json").write_text(json.dumps(metrics, indent=1))
        save_file({k: v.contiguous() for k, v in _checkpoint_tensors(run_dir).items()}, out / f"{name}.safetensors")


def compare(a: Path, b: Path, atol: float) -> int:
    from safetensors.torch import load_file

    bad = 0
    for name, *_ in CONFIGS:
        if not (a / f"{name}.json").exists() or not (b / f"{name}.json").exists():
            print(f"{name}: missing from {'the first' if not (a / f'{name}.json').exists() else 'the second'} record")
            bad += 1
            continue
        ma, mb = json.loads((a / f"{name}.json").read_text()), json.loads((b / f"{name}.json").read_text())
        diffs = []
        if len(ma) != len(mb):
            diffs.append(f"{len(ma)} against {len(mb)} logged steps")
        for ra, rb in zip(ma, mb, strict=False):
            for k in sorted(set(ra) | set(rb)):
                va, vb = ra.get(k), rb.get(k)
                if va != vb and not (isinstance(va, float) and isinstance(vb, float) and abs(va - vb) <= atol):
                    diffs.append(f"step {ra.get('step')} {k}: {va!r} against {vb!r}")
        ta, tb = load_file(a / f"{name}.safetensors"), load_file(b / f"{name}.safetensors")
        if set(ta) != set(tb):
            diffs.append(f"checkpoint keys differ: {sorted(set(ta) ^ set(tb))[:5]}")
        worst = 0.0
        for k in sorted(set(ta) & set(tb)):
            x, y = ta[k], tb[k]
            if x.dtype != y.dtype or x.shape != y.shape:
                diffs.append(f"{k}: {x.dtype}{tuple(x.shape)} against {y.dtype}{tuple(y.shape)}")
            elif not x.view(-1).view(__import__("torch").uint8).equal(y.view(-1).view(__import__("torch").uint8)):
                d = float((x.double() - y.double()).abs().max()) if x.is_floating_point() else float("inf")
                worst = max(worst, d)
                if d > atol:
                    diffs.append(f"{k}: max |difference| {d:.3g}")
        verdict = "bitwise equal" if not diffs and worst == 0 else (f"equal within {worst:.2g}" if not diffs
                                                                     else "DIFFERENT")
        print(f"{name}: {len(ma)} steps, {len(ta)} checkpoint tensors: {verdict}")
        for d in diffs[:10]:
            print(f"    {d}")
        bad += bool(diffs)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--only", nargs="*", default=[], help="configuration names (default: all)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--atol", type=float, default=0.0)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out, args.only)
        return 0
    return compare(args.a, args.b, args.atol)


if __name__ == "__main__":
    sys.exit(main())
