"""A float32 weight gradient ``g.T @ x`` on a CPU, as `zoo_cpu_kernels.gemm` computes it (oneDNN's inner product,
copying the smaller operand into a dense transpose and reading the other in place as a transposed
weight: `zoo_cpu_kernels.gemm.Gemm._product`), against copying both operands (zoo before 2026-11-27) and against
torch's own BLAS (`torch.mm(g.t(), x)`, which reads transposed operands in place), at the weight
gradients of the benchmarks' models. Each variant's median over alternating rounds, every call
with its operands evicted from the caches first (as inside a training step, where they come from
memory). Worth rerunning on a new CPU kind: the choice is made from the operands' layouts, not timed.

    python benchmarks/gemm_operands.py [--rounds 21] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

# (model, M rows, in, out): a weight gradient (out, in) = g (M, out).T @ x (M, in)
SHAPES = [
    ("video DiT tiny fc1", 2048, 128, 512),
    ("video DiT tiny fc2", 2048, 512, 128),
    ("DiT-S fc1", 2048, 384, 1536),
    ("DiT-S fc2", 2048, 1536, 384),
    ("Mamba-2 in_proj", 2048, 256, 1288),
    ("Mamba-2 out_proj", 2048, 512, 256),
    ("LLaMA mlp", 2048, 512, 1536),
    ("video DiT, 16k tokens", 16384, 128, 384),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from zoo_cpu_kernels import gemm

    try:
        chosen = gemm.configure("onednn", fused_on=True)[0]
    except RuntimeError:
        raise SystemExit("this torch build has no working oneDNN matmul: nothing to compare") from None

    def two_copies(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return gemm._onednn_linear(chosen._dense(g.t()), chosen._dense(x.t()))

    def one_copy(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return chosen._dense(chosen._product(g.t(), x))

    def blas(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(g.t(), x)

    variants = {"both copied": two_copies, "zoo (one copied)": one_copy, "torch BLAS": blas}
    evict = torch.empty(64 << 18)  # 64 MiB, written before each call
    print(f"# {platform.machine()} {a.threads} threads, torch {torch.__version__}; median ms of {a.rounds} "
          "alternating rounds, operands from memory")
    print(f"{'weight gradient':24} {'M x in x out':>18} " + " ".join(f"{n:>17}" for n in variants) + "  zoo vs both")
    for name, m, i, o in SHAPES:
        g, x = torch.randn(m, o), torch.randn(m, i)
        ref = g.double().t() @ x.double()
        for fn in variants.values():  # warm-up (and the transposition kernel's compile), checked
            err = float((fn(g, x).double() - ref).norm() / ref.norm())
            assert err < 1e-5, (name, fn.__name__, err)
        times: dict[str, list[float]] = {n: [] for n in variants}
        for _ in range(a.rounds):
            for n, fn in variants.items():
                evict.add_(1)
                t = time.perf_counter()
                fn(g, x)
                times[n].append(time.perf_counter() - t)
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        print(f"{name:24} {f'{m} x {i} x {o}':>18} " + " ".join(f"{med[n]:>17.2f}" for n in variants)
              + f"  {med['both copied'] / med['zoo (one copied)']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
