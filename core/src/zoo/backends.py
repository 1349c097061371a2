"""Optional accelerated backends, found at run time, each with the pure-PyTorch path zoo uses
without it.

None of these is a dependency: they need CUDA and a matching build, and they fail in two ways when
the machine does not suit them: `ImportError` (not installed) or `RuntimeError` (installed, but built
for another CUDA or torch, or no GPU). Both mean "not available" here, once per process, with the
reason kept for `zoo list --backends`. ``ZOO_BACKENDS=off`` (or a comma list of names to turn off,
e.g. ``ZOO_BACKENDS=-flash-attn``) forces the PyTorch paths, to compare or to rule a kernel out.
``-inductor`` turns off the CPU elementwise kernels torch's compiler builds (`zoo_cpu_kernels.fused`), as
``train.cpu_fused=eager`` does for one run: part of torch, not listed here, but each process that
compiles one first spends seconds importing the compiler. ``-native`` turns off zoo's own C kernels
(`zoo_cpu_kernels.native`: built with the system's C compiler at first use).

A caller asks for the one function it uses, ``kernel("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined",
"mamba_chunk_scan_combined")``, and takes its own fallback when the answer is None.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Backend:
    name: str  # what users and ZOO_BACKENDS call it (the pip name)
    module: str  # its import name
    provides: str
    fallback: str  # what zoo does without it


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("flash-attn", "flash_attn", "fused attention kernels (CUDA)",
            "torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient / math kernels)"),
    Backend("transformer-engine", "transformer_engine.pytorch", "fused linear, norm and fp8 GEMMs (CUDA)",
            "torch.nn.Linear and zoo.nn's norms under autocast"),
    Backend("apex", "apex", "fused Adam and norms (CUDA)", "torch.optim.AdamW and zoo.nn's norms"),
    Backend("mamba-ssm", "mamba_ssm", "Mamba-1 selective scan and Mamba-2 fused chunk scan (CUDA)",
            "zoo_mamba.ssm's chunked scan in PyTorch (checked against the recurrence)"),
    Backend("causal-conv1d", "causal_conv1d", "fused depthwise causal convolution (CUDA)",
            "zoo_mamba.ssm's shifted multiply-adds (CPU), torch.nn.functional.conv1d (other devices)"),
)}


def switched_off(name: str) -> bool:
    """Whether ``ZOO_BACKENDS`` turns backend ``name`` off (``off``/``none``: all of them)."""
    spec = os.environ.get("ZOO_BACKENDS", "").strip()
    if spec in ("off", "none"):
        return True
    return f"-{name}" in {s.strip() for s in spec.split(",")}


@functools.cache
def probe(name: str) -> tuple[Any, str]:
    """(the backend's module, "available") or (None, why not); tried once per process."""
    backend = BACKENDS[name]  # KeyError: a caller's typo, not a user's
    if switched_off(name):
        return None, "switched off by ZOO_BACKENDS"
    try:
        module = importlib.import_module(backend.module)
    except (ImportError, RuntimeError) as e:  # not installed / built for another CUDA, torch or no GPU
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return module, f"available ({getattr(module, '__version__', 'version unknown')})"


def kernel(name: str, module: str, attribute: str) -> Any:
    """``module.attribute`` of backend ``name``, or None when the backend (or that part of it) is
    not usable here."""
    if probe(name)[0] is None:
        return None
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, RuntimeError, AttributeError):  # an older or partial build
        return None


def report() -> list[tuple[str, str, str, str]]:
    """(name, provides, status, fallback) of every backend, for `zoo list --backends`."""
    return [(b.name, b.provides, probe(b.name)[1], b.fallback) for b in BACKENDS.values()]


__all__ = ["BACKENDS", "Backend", "kernel", "probe", "report", "switched_off"]
