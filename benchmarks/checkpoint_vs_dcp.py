"""Sharded checkpoint save/load throughput against torch.distributed.checkpoint (DCP) and the
disk, the training stall of an async save, and the peak memory of loading and of HF export.

A LLaMA (hidden 1024, 8 layers, vocab 32000: about 170M parameters) with AdamW state is held by 1
gloo process, then by 2 at tensor parallel 2 (each rank half of every matrix). For each:

- zoo saves (every rank its shard file, index, COMPLETE) and DCP saves the same per-rank tensors
  (``torch.distributed.checkpoint`` with its file-system writer, as Megatron does);
- loads of the model + optimizer state (each rank reads only its slices), **warm** (the files in
  the page cache, as on a restart soon after the save) and **cold** (every checkpoint file's pages
  dropped with ``POSIX_FADV_DONTNEED`` first, as after a reboot or on another node);
- each case is the median of ROUNDS rounds, zoo and DCP alternating;
- ``dd`` measures the disk in the same run: write (``oflag=direct`` and buffered +
  ``conv=fdatasync``) and read, cold (pages dropped) and from the page cache; cold loads are
  reported as a fraction of the cold read speed.

At 2 ranks also: an async save's training stall against a synchronous save, and in fresh
processes the peak RSS of loading the checkpoint into one process and of ``zoo convert --to hf``.

    python benchmarks/checkpoint_vs_dcp.py [--hidden 1024 --layers 8] [--ranks 1 2] [--dir /tmp/zoo-ckpt-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zoo.testing import run_distributed

ROUNDS = 5


def _config(hidden: int, layers: int) -> dict[str, Any]:
    return {"vocab_size": 32000, "hidden_size": hidden, "num_layers": layers, "num_heads": hidden // 64,
            "num_kv_heads": hidden // 128, "head_dim": 64, "ffn_hidden_size": int(hidden * 2.75) // 64 * 64,
            "max_seq_length": 2048, "norm_eps": 1e-5, "tie_embeddings": False, "layer_spec": "llama"}


def _rank(root: str, hidden: int, layers: int, extras: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zoo.checkpoint.sharded import Saver
    from zoo.checkpoint.state import Checkpoint, TrainState, save
    from zoo.checkpoint.weights import ModelState
    from zoo.config import RunConfig
    from zoo.family import resolve
    from zoo.parallel.engine import Parallel
    from zoo.registry import get_registry
    from zoo.testing import layout_for
    from zoo.training.optim import OptimizerState, param_groups
    from zoo_gpt.plugin import GPTConfig

    fam = get_registry().get("llama").family
    cfg = GPTConfig(**_config(hidden, layers))
    torch.manual_seed(0)
    model = resolve(fam.build, owner="bench")(cfg, fam.spec_for(cfg))
    one = not dist.is_initialized()  # (one rank: zoo makes no process group, DCP needs none)
    rank, world = (0, 1) if one else (dist.get_rank(), dist.get_world_size())

    def barrier() -> None:
        if not one:
            dist.barrier()

    par = Parallel(model, fam, layout_for(fam, world, model=cfg, tp=world), rank=rank)
    model = par.model
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    for p in model.parameters():  # Adam state of the right shapes, as after a step
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = {f"{names[id(p)]}::{k}": v for p, st in opt.state.items() for k, v in st.items()}
    local_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    local_bytes += sum(v.numel() * v.element_size() for v in opt_state.values())
    run = RunConfig(family="llama", flavor="bench", model=cfg)
    items = [ModelState(model, par.placements), OptimizerState(opt, model, par, distributed=False)]
    ckpt_root = Path(root) / "zoo"

    def zoo_save(step: int, saver: Saver) -> Any:
        return save(ckpt_root, state=TrainState(step, 0), run=run, par=par, items=items, ties={}, saver=saver,
                    token="bench", tokenizer_dir=None, keep_last=None, rank=rank, world_size=world, timeout_s=600)

    out: dict[str, Any] = {"bytes": local_bytes}
    state = {f"r{rank}/{k}": v for k, v in {**model.state_dict(), **opt_state}.items()}

    def timed(fn: Any) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    def save_ours(step: int) -> None:
        zoo_save(step, Saver(asynchronous=False))
        barrier()
        if rank == 0:  # rank 0 finalizes after every marker: the save ends with COMPLETE
            while not (ckpt_root / f"step_{step:08d}" / "COMPLETE").exists():
                time.sleep(0.001)

    def save_dcp(step: int) -> None:  # the same per-rank tensors, each rank's shards under its own keys
        dcp.save(state, no_dist=one, checkpoint_id=str(Path(root) / f"dcp{step}"))

    def evict() -> None:
        # Loads start cold (after a restart the files are not cached): drop both checkpoints'
        # pages, which also undoes the cache advantage of DCP's buffered writes over our direct ones.
        for d in (ckpt_root / "step_00000001", Path(root) / "dcp1"):
            for f in d.rglob("*"):
                if f.is_file():
                    fd = os.open(f, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)

    def load_ours(cold: bool) -> None:  # this rank's slices of every tensor, model and optimizer
        if cold:
            evict()
        with Checkpoint(ckpt_root / "step_00000001", family="llama", rank=rank, world_size=world) as ckpt:
            ckpt.restore(*items)

    def load_dcp(cold: bool) -> None:
        if cold:
            evict()
        dcp.load({k: torch.empty_like(v) for k, v in state.items()}, no_dist=one, checkpoint_id=str(Path(root) / "dcp1"))

    # Alternating, ROUNDS times each, the median: this VM's disk write-back makes single timings
    # swing by 3x, and whoever runs second reuses memory the first freed.
    import statistics

    for key in ("save", "warm", "cold"):
        if key == "warm":  # both checkpoints into the page cache (zoo's direct writes bypassed it)
            load_ours(False), load_dcp(False)
        ours, theirs = [], []
        for i in range(ROUNDS):
            if key == "save":
                ours.append(timed(lambda i=i: save_ours(1 + 10 * i)))
                theirs.append(timed(lambda i=i: save_dcp(1 + 10 * i)))
            else:
                cold = key == "cold"
                ours.append(timed(lambda cold=cold: load_ours(cold)))
                theirs.append(timed(lambda cold=cold: load_dcp(cold)))
        out[f"zoo_{key}_s"], out[f"dcp_{key}_s"] = statistics.median(ours), statistics.median(theirs)
    if not extras:
        return out
    # Async as `zoo train` runs it: the save writes from the live tensors while the next forward
    # and backward run; the optimizer update waits for it. Stall = time blocked in save() + time
    # blocked in that wait, against a training step without a save.
    tokens = torch.randint(0, cfg.vocab_size, (1, 512))

    def fwd_bwd() -> None:
        loss = model(tokens, labels=tokens)
        loss.backward()

    out["step_s"] = timed(fwd_bwd)
    saver = Saver(asynchronous=True, copy=False)
    barrier()
    t0 = time.perf_counter()
    zoo_save(2, saver)
    blocked = time.perf_counter() - t0
    fwd_bwd()
    t1 = time.perf_counter()
    saver.wait()
    out["async_stall_s"] = blocked + time.perf_counter() - t1
    barrier()
    # The copying variant (for callers that change tensors right away): blocked for the snapshot.
    saver = Saver(asynchronous=True, copy=True)
    for step in (3, 4):
        saver.wait()
        barrier()
        t0 = time.perf_counter()
        zoo_save(step, saver)
        out["copy_first_s" if step == 3 else "copy_s"] = time.perf_counter() - t0
    saver.wait()
    barrier()
    return out


def _dd(path: Path, nbytes: int) -> dict[str, float]:
    """Disk bandwidth in bytes/s: writes with O_DIRECT (the device) and through the page cache +
    fdatasync; reads cold (the file's pages dropped first) and from the page cache."""
    mb = max(nbytes // 2**20, 64) // 64 * 64

    def timed(*args: str) -> float:
        t0 = time.perf_counter()
        subprocess.run(["dd", *args], check=True, capture_output=True)
        return mb * 2**20 / (time.perf_counter() - t0)

    out = {"write_direct": timed("if=/dev/zero", f"of={path}", "bs=64M", f"count={mb // 64}", "oflag=direct"),
           "write": timed("if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync")}
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    out["read_cold"] = timed(f"if={path}", "of=/dev/null", "bs=1M")
    out["read_cached"] = timed(f"if={path}", "of=/dev/null", "bs=1M")
    path.unlink()
    return out


_PEAK = """
import resource, sys, torch
sys.argv = sys.argv[1:]
if sys.argv[0] == "load":
    from zoo.checkpoint.external import load
    load(sys.argv[1])
elif sys.argv[0] == "baseline":  # what the imports alone cost
    import zoo.cli, zoo.checkpoint.external, zoo_gpt.model, transformers
else:
    from zoo.cli import main
    main(["convert", "--to", "hf", sys.argv[1], sys.argv[2]])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dir", default="/tmp/zoo-ckpt-bench")
    args = p.parse_args()
    root = Path(args.dir)
    results: dict[int, list[dict[str, Any]]] = {}
    for world in args.ranks:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        results[world] = run_distributed(_rank, world, str(root), args.hidden, args.layers, world == max(args.ranks),
                                         timeout=1800)
    total = sum(r["bytes"] for r in results[max(args.ranks)])
    disk = _dd(root / "dd.bin", total)
    gb = 1e9
    print(f"# {time.strftime('%Y-%m-%d')} LLaMA hidden {args.hidden} x {args.layers} layers: {total / gb:.2f} GB of model "
          f"+ AdamW state; median of {ROUNDS} alternating rounds; {os.cpu_count()} cores")
    print(f"disk (dd): write {disk['write_direct'] / gb:.2f} GB/s direct, {disk['write'] / gb:.2f} GB/s buffered + "
          f"fdatasync; read {disk['read_cold'] / gb:.2f} GB/s cold, {disk['read_cached'] / gb:.2f} GB/s from the page cache")
    print("ranks | save zoo / DCP GB/s (x DCP) | warm load zoo / DCP GB/s (x DCP) | cold load zoo / DCP GB/s (x DCP) "
          "| cold load zoo / disk read")
    for world, res in results.items():
        worst = {k: max(r[k] for r in res) for k in res[0] if k.endswith("_s")}
        row = [f"{world:5d}"]
        for key in ("save", "warm", "cold"):
            z, d = worst[f"zoo_{key}_s"], worst[f"dcp_{key}_s"]
            row.append(f"{total / z / gb:.2f} / {total / d / gb:.2f} ({d / z:.2f}x)")
        row.append(f"{total / worst['zoo_cold_s'] / disk['read_cold']:.0%}")
        print(" | ".join(row))
    worst = {k: max(r[k] for r in results[max(args.ranks)]) for k in results[max(args.ranks)][0] if k.endswith("_s")}
    print(f"async save ({max(args.ranks)} ranks): training stalled {worst['async_stall_s'] * 1e3:.0f} ms (a "
          f"forward+backward takes {worst['step_s'] * 1e3:.0f} ms) vs synchronous save {worst['zoo_save_s'] * 1e3:.0f} ms "
          f"= {worst['async_stall_s'] / worst['zoo_save_s']:.1%}; the copying variant blocks {worst['copy_s'] * 1e3:.0f} ms "
          f"(first time, allocating its buffers, {worst['copy_first_s'] * 1e3:.0f} ms)")
    ckpt = root / "zoo" / "step_00000001"
    sizes = [int(torch.tensor(t["shape"]).prod()) * 4 for n, t in
             json.loads((ckpt / "index.json").read_text())["tensors"].items() if "::" not in n]
    model_bytes, largest = sum(sizes), max(sizes)
    baseline = _peak("baseline")
    load_peak = _peak("load", str(ckpt))
    export_peak = _peak("export", str(ckpt), str(root / "hf"))
    print(f"peak RSS: load into one process {load_peak / gb:.2f} GB, HF export {export_peak / gb:.2f} GB "
          f"(model {model_bytes / gb:.2f} GB fp32, largest tensor {largest / gb:.2f} GB, "
          f"the imports alone {baseline / gb:.2f} GB)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
