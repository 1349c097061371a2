"""Progress display and throughput accounting (tokens/s, model FLOPs utilisation)."""

from __future__ import annotations

import sys
import time
from typing import Any

_PEAK: dict[tuple[str, str], float] = {}


def matmul_flops_per_token(model: Any, seq_length: int) -> float:
    """Training FLOPs per token: 6 x (weights used in matmuls) + attention (PaLM, Chowdhery et al. 2022 app. B).

    Counts every `nn.Linear` weight once (a tied head counts once, embedding lookups are free) and
    adds ``12 * layers * hidden * seq`` for the attention scores and values when the config names
    ``num_layers`` and ``hidden_size``.
    """
    from torch import nn

    seen, n = set(), 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            n += mod.weight.numel()
    cfg = getattr(model, "cfg", None)
    attn = 0.0
    if cfg is not None and hasattr(cfg, "num_layers") and hasattr(cfg, "hidden_size"):
        attn = 12.0 * cfg.num_layers * cfg.hidden_size * seq_length
    return 6.0 * n + attn


def measured_peak_flops(device: str, dtype: Any) -> float:
    """GEMM throughput measured on this device (the denominator of MFU), cached per process."""
    import torch

    key = (device, str(dtype))
    if key in _PEAK:
        return _PEAK[key]
    n = 1024 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    reps, best = 3 if device == "cpu" else 20, float("inf")
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    _PEAK[key] = 2 * n**3 / best
    return _PEAK[key]


class Progress:
    """A one-line bar on a terminal, a plain line per logging interval otherwise."""

    def __init__(self, total: int, *, enabled: bool, start: int = 0) -> None:
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.start = start

    def update(self, step: int, fields: dict[str, str], *, log_line: bool) -> None:
        if not self.enabled:
            return
        done = step / max(self.total, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        if self.tty:
            bar = "#" * int(done * 20)
            sys.stderr.write(f"\r[{bar:<20}] {step}/{self.total} {text} eta {eta:.0f}s\x1b[K")
            if step == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif log_line:
            print(f"step {step}/{self.total} {text}", flush=True)
