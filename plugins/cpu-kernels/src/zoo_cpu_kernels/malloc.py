"""Freed host memory kept for reuse during a CPU run (glibc's malloc), as torch's caching
allocator keeps freed GPU memory.

glibc hands a freed block larger than its mmap threshold (128 KB, rising with use to at most
32 MB) back to the system, and the next allocation of that size faults fresh zeroed pages back in.
A training step allocates and frees the same activation-sized tensors every step, so on a CPU it
pays for zeroing them every step (a tenth of a bf16 LLaMA step on a small VM, for a few percent
more peak RSS). ``retain`` raises the mmap and trim thresholds to 1 GiB; the process then
holds its step's high-water mark, which the step reaches anyway.

What the user set wins: any ``MALLOC_*`` tuning variable in the environment, a ``GLIBC_TUNABLES``
entry for the same settings (the mmap and trim thresholds, the top pad, the mmap count), or
another allocator preloaded (jemalloc, tcmalloc: glibc's settings do not reach it),
leaves everything as it is. Other malloc tunables combine with ``retain``: transparent huge pages
for the heap (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` where the kernel's THP mode is "madvise")
keep freed memory in huge pages too (docs/parallelism.md has what they gained).
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_RETAIN_BYTES = 1 << 30
# The settings whose user value wins over retain's, each as a variable (MALLOC_<NAME>_) or a glibc
# tunable (GLIBC_TUNABLES=glibc.malloc.<name>=<value>:...); other tunables (hugetlb) combine with it.
_USER_SETTINGS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def configure(mode: str) -> str:
    """Applies ``train.cpu_malloc`` (``retain`` or ``system``) to this process; returns what was done."""
    if mode == "system":
        return "system (glibc's defaults)"
    user = [f"MALLOC_{n.upper()}_" for n in _USER_SETTINGS if f"MALLOC_{n.upper()}_" in os.environ]
    tunables = {t.split("=", 1)[0].strip() for t in os.environ.get("GLIBC_TUNABLES", "").split(":")}
    if tunables & {f"glibc.malloc.{n}" for n in _USER_SETTINGS}:
        user.append("GLIBC_TUNABLES")
    if user:
        return f"system ({user[0]} is set)"
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((name for name in _OTHER_ALLOCATORS if name in preload), None)
    if other:
        return f"system ({other} is preloaded)"
    if not sys.platform.startswith("linux"):
        return "system (not glibc)"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (present in glibc only: musl has mallopt as a no-op)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN_BYTES) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN_BYTES) == 1
    except (OSError, AttributeError):
        return "system (not glibc)"
    return "retain (freed blocks up to 1 GiB kept for reuse)" if ok else "system (mallopt refused)"


__all__ = ["configure"]
