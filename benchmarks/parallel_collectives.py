"""Data-parallel gradient reduction and ZeRO-1 memory, measured on gloo against theory.

For the tiny LLaMA at DP=2 (2 gloo processes) this counts the all-reduces one optimizer step
issues with the core's gradient buckets, and the bytes they move, against the minimum
(``ceil(parameters / bucket_size)`` reductions of every gradient once), splits a step's time into
compute and the wait for communication, and measures optimizer state bytes per rank with and
without the distributed optimizer (ZeRO-1) against ``1/DP`` of the unsharded state.

    python benchmarks/parallel_collectives.py [--bucket-size 200000]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from zoo.testing import run_distributed


def _rank(bucket_size: int, zero: bool) -> dict:
    import torch.distributed as dist

    from zoo.family import resolve
    from zoo.parallel.data_parallel import GradBuckets
    from zoo.parallel.zero import DistributedOptimizer
    from zoo.registry import get_registry

    fam = get_registry().get("llama").family
    cfg = fam.flavors["tiny"]()
    torch.manual_seed(0)
    model = resolve(fam.build, owner="bench")(cfg, fam.spec_for(cfg))
    batch = resolve(fam.example_batch, owner="bench")(cfg, batch_size=8, seq_length=128, generator=torch.Generator().manual_seed(1))
    buckets = GradBuckets(model, dist.group.WORLD, bucket_size=bucket_size, shard=zero)
    if zero:
        opt = DistributedOptimizer(buckets, lambda g: torch.optim.AdamW(g, lr=1e-3), weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compute = wait = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        loss = model(batch["tokens"], labels=batch["labels"])
        loss.backward()
        t1 = time.perf_counter()
        buckets.finish()
        t2 = time.perf_counter()
        opt.step()
        buckets.zero_grad()
        compute, wait = t1 - t0, t2 - t1
    if zero:
        state = opt.state_bytes()
    else:
        state = sum(p.numel() * 4 for p in model.parameters())  # fp32 weights are the master copy
        state += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
    return {"launched_per_step": buckets.launched / 3, "buckets": len(buckets.buckets),
            "bytes": sum(b.buffer.numel() * b.buffer.element_size() for b in buckets.buckets),
            "params": sum(p.numel() for p in model.parameters()), "state": state,
            "compute_s": compute, "wait_s": wait}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket-size", type=int, default=200_000)
    args = p.parse_args()
    plain = run_distributed(_rank, 2, args.bucket_size, False, timeout=300)[0]
    zero = run_distributed(_rank, 2, args.bucket_size, True, timeout=300)[0]
    n = plain["params"]
    minimum = math.ceil(n / args.bucket_size)
    print(f"# {time.strftime('%Y-%m-%d')} tiny LLaMA ({n:,} parameters), DP=2 on gloo, bucket {args.bucket_size:,} elements")
    print(f"all-reduces per step: {plain['launched_per_step']:.0f} (theory: <= ceil(params / bucket) = {minimum}); "
          f"bytes reduced per step: {plain['bytes']:,} (theory: 4 x params = {4 * n:,}, + padding)")
    print(f"step time: compute (forward+backward) {plain['compute_s'] * 1e3:.1f} ms, waiting for the last "
          f"reductions after backward {plain['wait_s'] * 1e3:.1f} ms (the rest overlapped backward)")
    print(f"optimizer state per rank: plain {plain['state']:,} B, ZeRO-1 {zero['state']:,} B "
          f"= {zero['state'] / plain['state']:.3f} of plain (theory 1/DP = 0.500, + padding)")


if __name__ == "__main__":
    main()
