"""What `zoo train` sets in a process that computes on a CPU (the benchmarks set the same): freed
memory kept for reuse (`zoo.training.malloc`), the float32 products' library (`zoo.gemm`), the
fused elementwise kernels (`zoo.fused`) and zoo's C kernels with them (`zoo.native`), each from
its `TrainConfig` field."""

from __future__ import annotations

from typing import Any


def configure(train: Any, announce: bool = False) -> list[str]:
    """Apply ``train``'s (a `zoo.config.TrainConfig`) CPU settings to this process; returns what each
    chose (one line each). ``announce``: print `precision_note` where there is one."""
    from zoo import fused, gemm, native
    from zoo.training import malloc

    lines = [malloc.configure(train.cpu_malloc), gemm.configure(train.cpu_gemm), fused.configure(train.cpu_fused),
             native.configure(train.cpu_fused)]
    if announce and (note := precision_note(train.precision)):
        print(note, flush=True)
    return lines


def precision_note(precision: str, *, asked: str = "train.precision=bf16", fast: str = "train.precision=fp32"
                   ) -> str | None:
    """A note for bf16 computation (``asked``: how the user chose it) on a CPU where oneDNN has no bf16
    products (`zoo.gemm.bf16_is_native`: an AVX2-only CPU), so torch's bf16 products are fallbacks
    far slower than float32; else None."""
    from zoo import gemm

    if precision != "bf16" or gemm.bf16_is_native():
        return None
    return (f"note: {asked} on a CPU without bf16 products (no AVX-512 BF16, AMX or AVX-512): they "
            f"run 10-400x slower than float32 here; {fast} is the fast choice")
