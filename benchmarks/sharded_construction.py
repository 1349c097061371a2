"""A model too large for every rank to build whole, built shard by shard on 4 gloo ranks, under
tp2 x pp2 and under fsdp4.

LLaMA 3.2 3B's architecture (the ``3-3B`` flavor) with ``num_layers=20`` under tp2 x pp2: 2.41B
parameters, 9.6 GB in fp32; four ranks each building the whole model (what zoo did before) need
4 x 9.6 = 38.5 GB, more than this 24 GiB (25.8 GB) machine has. Under fsdp4 the same architecture
with ``num_layers=16`` and a 32000-token vocabulary (1.71B parameters, 6.8 GB; 4 x 6.8 = 27.4 GB,
still more than the machine): FSDP gathers the tied embedding whole on every rank for the step, and
with LLaMA 3's 128256 x 3072 one (0.8 GB in bf16, its fp32 gradient in the fused loss 1.6 GB, its
gradient and reduce-scatter buffer) four ranks' steps do not fit beside each other on 24 GiB.
Each rank records the build on the meta device and materialises only its own part
(`zoo.parallel.materialize`); this measures, per rank, the peak resident memory during construction
against the rank's share plus the largest full tensor (a vocabulary embedding, or a block's MLP
weight), then casts to bf16 and runs a forward
and backward step of one micro-batch (through the pipeline; with FSDP gathering one block at a time).

Run: ``python benchmarks/sharded_construction.py [--layout tp2pp2|fsdp4]`` (about 15 minutes on 2
cores: bf16 GEMMs on a CPU without native bf16 run at a small fraction of fp32 speed).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import torch

from zoo.testing import run_distributed

MODELS = {"tp2pp2": {"num_layers": 20}, "fsdp4": {"num_layers": 16, "vocab_size": 32000}}
SEQ = 32


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Samples this process's resident memory every 5 ms."""

    def __init__(self) -> None:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss())


def _rank(layout: dict[str, Any], model: dict[str, int]) -> dict[str, Any]:
    import torch.distributed as dist

    from zoo.family import resolve
    from zoo.parallel.engine import Parallel
    from zoo.parallel.materialize import record_build
    from zoo.registry import get_registry
    from zoo.testing import layout_for

    fam = get_registry().get("llama").family
    cfg = fam.flavors["3-3B"]()
    for key, value in model.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    before = _rss()
    sampler = _Peak()
    t0 = time.perf_counter()
    meta, record = record_build(resolve(fam.build, owner="bench"), cfg, fam.spec_for(cfg))
    full_params = sum(p.numel() for p in meta.parameters())
    largest = max(p.numel() * p.element_size() for p in meta.parameters())
    par = Parallel(meta, fam, layout_for(fam, dist.get_world_size(), model=cfg, seq_length=SEQ, **layout),
                   rank=dist.get_rank(), init=record)
    del meta, record
    build_s = time.perf_counter() - t0
    peak = sampler.stop()
    from zoo.parallel.sharding import local

    share = sum(local(p).numel() * p.element_size() for p in par.model.parameters())
    # The step: bf16 parameters and gradients (fp32 ones of this share would exceed the machine
    # with four ranks at once), one micro-batch through the 1F1B schedule.
    par.model.to(torch.bfloat16)
    # Hand the freed fp32 shards back to the OS: glibc keeps freed heap blocks of this size in the
    # process, and four ranks' worth would be counted against the step.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    batch = resolve(fam.example_batch, owner="bench")(cfg, batch_size=1, seq_length=SEQ,
                                                      generator=torch.Generator().manual_seed(1))
    t1 = time.perf_counter()
    out = par.forward_backward([batch], resolve(fam.loss, owner="bench"), seq_length=SEQ)
    par.finish_grads()
    step_s = time.perf_counter() - t1
    grads = sum(1 for p in par.model.parameters() if p.grad is not None and torch.isfinite(local(p.grad)).all())
    return {"rank": dist.get_rank(), "full_params": full_params, "share": share, "largest": largest,
            "rss_before": before, "peak": peak, "build_s": build_s, "step_s": step_s, "loss": float(out.loss),
            "grads": grads, "params": sum(1 for _ in par.model.parameters())}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["tp2pp2", "fsdp4", "both"], default="both")
    args = ap.parse_args()
    gb = 1e9
    layouts = {"tp2pp2": {"tp": 2, "pp": 2}, "fsdp4": {"fsdp": 4}}
    for name in (["tp2pp2", "fsdp4"] if args.layout == "both" else [args.layout]):
        model = " ".join(f"{k}={v}" for k, v in MODELS[name].items())
        print(f"# {time.strftime('%Y-%m-%d')} LLaMA 3-3B architecture, {model}, 4 gloo ranks, {name}")
        results = run_distributed(_rank, 4, layouts[name], MODELS[name], timeout=1800, collective_timeout=1700)
        full = results[0]["full_params"]
        print(f"full model: {full / 1e9:.2f}B parameters = {full * 4 / gb:.1f} GB fp32; x4 ranks = {4 * full * 4 / gb:.1f} GB")
        print("| rank | share (GB) | largest tensor (GB) | construction peak RSS - RSS before (GB) | ratio to share + "
              "largest | build s | fwd+bwd s | loss | params with grads |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            delta = r["peak"] - r["rss_before"]
            ratio = delta / (r["share"] + r["largest"])
            print(f"| {r['rank']} | {r['share'] / gb:.2f} | {r['largest'] / gb:.2f} | {delta / gb:.2f} (absolute "
                  f"{r['peak'] / gb:.2f}) | {ratio:.2f} | {r['build_s']:.0f} | {r['step_s']:.1f} | {r['loss']:.3f} | "
                  f"{r['grads']}/{r['params']} |")


if __name__ == "__main__":
    main()
