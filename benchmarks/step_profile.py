"""Where a training step's time goes, zoo's against its peer's (HF's Mamba-2, diffusers' DiT), on a
CPU or a GPU: the median step, the host's queuing time (on a GPU: the time until the host has
queued the step's work; close to the step when launches, not the GPU, bound it), the device's
busy time and kernel count per step, and the ops taking the most host time and the most device
time (torch.profiler over two steps). The models, batches and losses are those of
`benchmarks/mamba_vs_hf.py` and `benchmarks/dit_vs_diffusers.py`; one process, the sides in turn.

    python benchmarks/step_profile.py --model mamba2 --seq 2048 [--device cuda]
    python benchmarks/step_profile.py --model dit --batch 64 --dtype bf16 --device cuda
    python benchmarks/step_profile.py --model dit --dtype bf16 --shapes --rows 40   # ops by input shapes
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def sides(a: argparse.Namespace) -> list[tuple[str, torch.nn.Module, Callable[[], torch.Tensor]]]:
    """(name, model, loss of one fixed batch) for the peer, then zoo."""
    if a.model == "mamba2":
        from mamba_vs_hf import build

        x = torch.randint(0, a.vocab, (1, a.seq + 1), generator=torch.Generator().manual_seed(1)).to(a.device)
        out = []
        for impl in ("hf", "zoo"):
            ns = argparse.Namespace(kind="mamba2", impl=impl, device=a.device, vocab=a.vocab, hidden=a.hidden,
                                    layers=a.layers, state=a.state, chunk=a.chunk)
            model, loss_of = build(ns)
            out.append((impl, model, lambda m=model, f=loss_of: f(m, x[:, :-1], x[:, 1:])))
        return out
    from dit_vs_diffusers import build_pair

    from zoo.nn import recompute

    pair = build_pair(a, torch.device(a.device))

    def zoo_loss() -> torch.Tensor:
        with recompute.scope(a.recompute):  # as `zoo train` runs it (train.recompute)
            return pair.edm_loss(pair.f_ours, a.dtype)

    return [("diffusers", pair.theirs, lambda: pair.edm_loss(pair.f_theirs, a.dtype)), ("zoo", pair.ours, zoo_loss)]


def profile_side(name: str, model: torch.nn.Module, loss_of: Callable[[], torch.Tensor], a: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model.train()

    def step() -> float:
        t0 = time.perf_counter()
        loss_of().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(3):
        step()
        sync()
    steps, host = [], []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        host.append(step())
        sync()
        steps.append(time.perf_counter() - t0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=a.shapes) as prof:
        for _ in range(2):
            step()
        sync()
    events = prof.key_averages(group_by_input_shape=a.shapes)
    line = (f"== {name}: step {sorted(steps)[len(steps) // 2] * 1e3:.1f} ms, host queuing "
            f"{sorted(host)[len(host) // 2] * 1e3:.1f} ms")
    if cuda:
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        line += (f", device busy {sum(e.device_time_total for e in kernels) / 2e3:.1f} ms, "
                 f"{sum(e.count for e in kernels) / 2:.0f} kernels a step")
    print(line, flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=60))
    if a.python:  # the host's time by Python function (what the op table cannot show: time between ops)
        import cProfile
        import pstats

        with cProfile.Profile() as pyprof:
            for _ in range(2):
                step()
            sync()
        pstats.Stats(pyprof).sort_stats("tottime").print_stats(a.rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mamba2", "dit"], default="mamba2")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--rows", type=int, default=15, help="ops listed per table")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--python", action="store_true", help="also the host's time by Python function (cProfile)")
    p.add_argument("--shapes", action="store_true", help="ops apart by their inputs' shapes (which product, which copy)")
    p.add_argument("--layers", type=int, help="default: 2 (Mamba-2), 6 (DiT), as their benchmarks")
    p.add_argument("--hidden", type=int, help="default: 256 (Mamba-2), 384 (DiT)")
    # Mamba-2: mamba_vs_hf.py's sizes
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--chunk", type=int, default=256)
    # DiT: dit_vs_diffusers.py's sizes, the precision, zoo's recomputation
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--recompute", choices=["none", "elementwise"], default="elementwise")
    a = p.parse_args()
    a.layers = a.layers or (2 if a.model == "mamba2" else 6)
    a.hidden = a.hidden or (256 if a.model == "mamba2" else 384)
    torch.set_num_threads(a.threads)
    if a.device == "cpu":
        from llama_vs_hf import zoo_process_settings

        zoo_process_settings()
    for name, model, loss_of in sides(a):
        profile_side(name, model, loss_of, a)


if __name__ == "__main__":
    main()
