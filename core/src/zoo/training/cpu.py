"""What `zoo train` sets in a process that computes on a CPU (the benchmarks set the same): freed
memory kept for reuse (`zoo.training.malloc`), the float32 products' library (`zoo.gemm`) and the
fused elementwise kernels (`zoo.fused`), each from its `TrainConfig` field."""

from __future__ import annotations

from typing import Any


def configure(train: Any) -> list[str]:
    """Apply ``train``'s (a `zoo.config.TrainConfig`) CPU settings to this process; returns what each
    chose (one line each)."""
    from zoo import fused, gemm
    from zoo.training import malloc

    return [malloc.configure(train.cpu_malloc), gemm.configure(train.cpu_gemm), fused.configure(train.cpu_fused)]
