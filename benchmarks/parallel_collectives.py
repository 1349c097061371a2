"""Collectives per training step for every parallel layout, counted on gloo against theory;
step time split into compute and communication; optimizer memory with and without ZeRO-1.

Each layout runs one warm-up step and one measured step of the tiny LLaMA (2 layers, hidden 128,
4 heads / 2 KV heads, micro-batch 2 x 64 tokens, 4 micro-batches) through
`zoo.parallel.engine.Parallel`, the path `zoo train` takes. Every `torch.distributed` call is
wrapped to count calls and bytes by kind. The theory column is Megatron-LM's accounting, derived
here from the model's sizes (not from zoo's code):

- TP, per micro-batch: forward 1 all-reduce (vocab-parallel embedding) + 2 per layer (row-parallel
  outputs) + 3 for vocab-parallel cross entropy; backward 2 per layer (column-parallel inputs) + 1
  (the head's input). With sequence parallelism each layer's all-reduces become all-gather +
  reduce-scatter pairs, plus the gather after the last layer and its conjugate, plus one
  all-reduce of the norm gradients per step.
- PP: one send per micro-batch per stage boundary in each direction (``2 (pp vpp - 1) M`` in all),
  plus one all-reduce of tied embeddings (none here: LLaMA's are untied) and one of the loss.
- CP (ring attention), per layer and micro-batch: ``cp - 1`` key/value hops forward, ``cp - 1`` hops
  back plus ``cp`` hops of their gradients.
- DP: ``<= ceil(parameters / bucket)`` bucket reductions per step (plus the loss average).

    python benchmarks/parallel_collectives.py [--bucket-size 200000]
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from typing import Any

import torch

from zoo.testing import run_distributed

B, S, M, LAYERS = 2, 64, 4, 2
_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter_single": "reduce_scatter",
          "reduce_scatter_tensor": "reduce_scatter", "isend": "send", "send": "send",
          "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


def _instrument() -> tuple[Counter, Counter, list[float]]:
    import torch.distributed as dist

    calls, nbytes, blocked = Counter(), Counter(), [0.0]

    def size(kind: str, args: tuple, kwargs: dict) -> int:
        # The logical volume: the whole buffer a collective reduces or assembles.
        if kind == "all_gather":
            return args[1].numel() * args[1].element_size() * len(args[0])
        t = args[1] if kind == "reduce_scatter" else (args[0] if args else next(iter(kwargs.values())))
        return t.numel() * t.element_size()

    for name, kind in _KINDS.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Any = fn, _kind: str = kind, **kwargs: Any) -> Any:
            calls[_kind] += 1
            nbytes[_kind] += size(_kind, args, kwargs)
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                if not kwargs.get("async_op") and _kind != "send":
                    blocked[0] += time.perf_counter() - t0

        setattr(dist, name, wrapped)
    recv = dist.recv

    def timed_recv(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return recv(*args, **kwargs)
        finally:
            blocked[0] += time.perf_counter() - t0

    dist.recv = timed_recv
    return calls, nbytes, blocked


def _step(layout: dict, bucket_size: int, zero: bool) -> dict:
    import torch.distributed as dist

    from zoo.family import resolve
    from zoo.parallel.engine import Parallel
    from zoo.registry import get_registry
    from zoo.training.optim import param_groups

    calls, nbytes, blocked = _instrument()
    fam = get_registry().get("llama").family
    cfg = fam.flavors["tiny"]()
    cfg.num_layers = layout.pop("layers", LAYERS)
    torch.manual_seed(0)
    model = resolve(fam.build, owner="bench")(cfg, fam.spec_for(cfg))
    params = sum(p.numel() for p in model.parameters())
    example, loss_fn = resolve(fam.example_batch, owner="bench"), resolve(fam.loss, owner="bench")
    from zoo.testing import layout_for
    from zoo.training.optim import ParamRules

    par = Parallel(model, fam, layout_for(fam, dist.get_world_size(), model=cfg, seq_length=S, micro_batches=M, **layout),
                   rank=dist.get_rank())
    buckets = par.make_buckets(bucket_size, shard=zero)
    if zero and buckets is not None:
        from zoo.parallel.zero import DistributedOptimizer

        rules = ParamRules(0.1)
        opt = DistributedOptimizer(buckets, lambda g: torch.optim.AdamW(g, lr=1e-3), group_of=lambda p: rules.options("", p))
        state = lambda: opt.state_bytes()  # noqa: E731
    else:
        opt = torch.optim.AdamW(param_groups(par.model, 0.1), lr=1e-3)

        def state() -> int:  # fp32 weights are the master copy, plus Adam's two moments
            n = sum(p.numel() * 4 for p in par.model.parameters())
            return n + sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
    gen = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    for _ in range(2):  # a warm-up step, then the measured one
        batches = [example(cfg, batch_size=B, seq_length=S, generator=gen) for _ in range(M)]
        calls.clear(), nbytes.clear()
        blocked[0] = 0.0
        t0 = time.perf_counter()
        par.forward_backward(batches, loss_fn, seq_length=S)
        par.finish_grads()
        elapsed = time.perf_counter() - t0
        fb_calls, fb_bytes, fb_blocked = dict(calls), dict(nbytes), blocked[0]
        calls.clear()
        if zero and buckets is not None:
            opt.step(max_norm=1.0, norm_squared=par.grad_norm_squared)
        else:
            par.clip(1.0)
            opt.step()
            opt.zero_grad(set_to_none=buckets is None)
            if buckets is not None:
                buckets.zero_grad()
        out = {"calls": fb_calls, "bytes": fb_bytes, "optimizer_calls": dict(calls), "step_s": elapsed,
               "blocked_s": fb_blocked, "state": state(), "params": params, "rank": dist.get_rank(),
               "buckets": len(buckets.buckets) if buckets is not None else 0,
               "bucket_bytes": sum(b.buffer.numel() * b.buffer.element_size() for b in buckets.buckets) if buckets else 0,
               "params_local": sum(p.numel() for p in par.model.parameters())}
    return out


def _theory(layout: dict, *, world: int, zero: bool, buckets: int, bucket_bytes: int, rank_pp: int) -> tuple[Counter, int]:
    """Collective calls (by kind) and bytes of one step (forward + backward of M micro-batches and
    the gradient reductions) on one rank, from Megatron-LM's accounting (module docstring)."""
    t: Counter = Counter()
    tp, pp, cp, vpp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1), layout.get("vpp", 1)
    sp = layout.get("sequence_parallel", False)
    layers = layout.get("layers", LAYERS) // pp  # this rank's layers
    hidden, kv_heads, head_dim = 128, 2, 32  # the tiny LLaMA
    dp = world // (tp * pp * cp)
    first, last = rank_pp == 0, rank_pp == pp - 1
    act = B * (S // cp) * hidden * 4  # one micro-batch's hidden state, float32
    ce = 3 * B * (S // cp) * 4  # max, target logit, sum of exponentials per token
    nbytes = 0
    if tp > 1 and sp:
        gathers = 4 * layers + last + first
        t["all_gather"] += M * gathers
        t["reduce_scatter"] += M * 4 * layers
        t["all_reduce"] += M * (first + 3 * last + last) + 1  # embedding, CE, head input; norm grads
        nbytes += M * (gathers + 4 * layers + first + last) * act + M * last * ce + 2 * layers * hidden * 4
    elif tp > 1:
        t["all_reduce"] += M * (4 * layers + first + 3 * last + last)
        nbytes += M * (4 * layers + first + last) * act + M * last * ce
    if pp > 1:
        stages = [c * pp + rank_pp for c in range(vpp)]
        hops = sum((s < pp * vpp - 1) + (s > 0) for s in stages)
        t["send"] += M * hops
        t["all_reduce"] += 1  # the loss (and any declared metrics: none for LLaMA), from the last stage to all
        nbytes += M * hops * act // (tp if sp else 1) + 4
    if cp > 1:
        kv = 2 * B * (kv_heads // tp) * (S // cp) * head_dim * 4
        t["send"] += M * layers * (3 * cp - 2)
        nbytes += M * layers * (3 * cp - 2) * kv
    if dp * cp > 1:
        t["reduce_scatter" if zero else "all_reduce"] += buckets
        t["all_reduce"] += 1  # the loss average
        nbytes += bucket_bytes + 4
    return t, nbytes


LAYOUTS = [
    ("tp2", 2, {"tp": 2}, False),
    ("tp2 + sequence parallel", 2, {"tp": 2, "sequence_parallel": True}, False),
    ("pp2 (1F1B)", 2, {"pp": 2}, False),
    ("pp2 x vpp2 (interleaved, 4 layers)", 2, {"pp": 2, "vpp": 2, "layers": 4}, False),
    ("cp2 (ring attention)", 2, {"cp": 2}, False),
    ("dp2", 2, {}, False),
    ("dp2 + ZeRO-1", 2, {}, True),
    ("tp2 x pp2", 4, {"tp": 2, "pp": 2}, False),
    ("cp2 x dp2 + ZeRO-1", 4, {"cp": 2}, True),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket-size", type=int, default=200_000)
    args = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')} tiny LLaMA, micro-batch {B} x {S}, {M} micro-batches per step, gloo, "
          f"bucket {args.bucket_size:,} elements")
    print("| layout | rank | calls per step (measured) | theory | bytes (measured) | theory | step | in blocking comm |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    memory = {}
    for name, world, layout, zero in LAYOUTS:
        results = run_distributed(_step, world, dict(layout), args.bucket_size, zero, timeout=600)
        for r in sorted({0, world - 1}):
            got = results[r]
            pp = layout.get("pp", 1)
            theory, tbytes = _theory(layout, world=world, zero=zero, buckets=got["buckets"],
                                     bucket_bytes=got["bucket_bytes"], rank_pp=r // (world // pp))
            measured = ", ".join(f"{k} {v}" for k, v in sorted(got["calls"].items()))
            expect = ", ".join(f"{k} {v}" for k, v in sorted(theory.items()))
            mbytes = sum(got["bytes"].values())
            flag = "" if Counter(got["calls"]) == theory and mbytes == tbytes else " **differs**"
            print(f"| {name} | {r} | {measured} | {expect}{flag} | {mbytes:,} | {tbytes:,} | "
                  f"{got['step_s'] * 1e3:.0f} ms | {got['blocked_s'] * 1e3:.0f} ms |")
            if got["buckets"]:
                bound = math.ceil(got["params_local"] / args.bucket_size)
                assert got["buckets"] <= bound, (name, got["buckets"], bound)
        if name in ("dp2", "dp2 + ZeRO-1"):
            memory[name] = results[0]["state"]
    print("\nbucket reductions per step never exceed ceil(parameters / bucket) (checked for every layout)")
    ratio = memory["dp2 + ZeRO-1"] / memory["dp2"]
    print(f"\noptimizer state per rank: plain AdamW {memory['dp2']:,} B, ZeRO-1 {memory['dp2 + ZeRO-1']:,} B "
          f"= {ratio:.3f} of plain (theory 1/DP = 0.500, + padding)")


if __name__ == "__main__":
    main()
