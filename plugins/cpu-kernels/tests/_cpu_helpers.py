"""Helpers for the CPU kernels' tests: the provider's selection for given ``train.cpu_*`` options,
as a run makes it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from zoo.kernels import Kernels, Selection


def cpu_kernels(**options: str) -> Kernels:
    """The kernels a CPU run selects under ``options`` (``cpu_fused``, ``cpu_gemm``, ...; ZOO_BACKENDS
    as the environment has it)."""
    from zoo_cpu_kernels import PROVIDER

    return Kernels("cpu", {"cpu": PROVIDER.select({"cpu_malloc": "system", **options})})



@contextlib.contextmanager
def gemm_kernels(mode: str = "auto", **kw: bool) -> Iterator[Any]:
    """`zoo_cpu_kernels.gemm`'s choice under ``train.cpu_gemm=mode`` active for the duration (its
    linear, product and tanh-GELU; nothing else of the provider's); yields the `Gemm`."""
    from zoo_cpu_kernels import gemm

    chosen = gemm.configure(mode, **kw)[0]
    impls = {"linear": chosen.linear, "mm": chosen.mm, "gelu_tanh": chosen.gelu_tanh,
             "gelu_tanh_backward": chosen.gelu_tanh_backward}
    with Kernels("cpu", {"gemm": Selection(impls)}).use():
        yield chosen
