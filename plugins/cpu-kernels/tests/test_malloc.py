"""train.cpu_malloc (zoo.training.malloc): judged by the kernel's count of page faults, each case in
a fresh process (the setting is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from zoo_cpu_kernels import malloc
print(malloc.configure(sys.argv[1]))
def faults_of_a_64mb_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)  # 64 MB written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# The first rounds grow the heap (an aligned request need not fit the freed block it follows);
# within a few rounds the heap holds a block that fits and every later round reuses it (two to four
# rounds on a 2-core Zen 3; a suite run once saw all of rounds 6-8 fault: 12 rounds now, the last 4).
rounds = [faults_of_a_64mb_tensor() for _ in range(12)]
print(min(rounds[-4:]), rounds)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env}, timeout=120).stdout.split("\n")
    print(mode, env, out[1])  # every round's faults, shown when an assertion fails
    return out[0], int(out[1].split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_retained_memory_is_reused_without_page_faults():
    said, faults = _probe("retain")
    assert said.startswith("retain"), said
    assert faults < 1000  # a 64 MB tensor reuses the freed one's pages (16,384 of them)
    said, faults = _probe("system")
    assert said.startswith("system")
    assert faults > 8000  # glibc gave them back and faults them in again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_users_allocator_settings_win():
    said, faults = _probe("retain", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    assert said == "system (MALLOC_MMAP_THRESHOLD_ is set)"
    assert faults > 8000
    said, _ = _probe("retain", LD_PRELOAD="/nonexistent/libjemalloc.so.2")
    assert said == "system (jemalloc is preloaded)"
    said, _ = _probe("retain", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert said == "system (GLIBC_TUNABLES is set)"
    said, _ = _probe("retain", GLIBC_TUNABLES="glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1048576")
    assert said == "system (GLIBC_TUNABLES is set)"
    said, faults = _probe("retain", GLIBC_TUNABLES="glibc.rtld.nns=4")  # not about malloc
    assert said.startswith("retain") and faults < 1000
    # huge pages for the heap are no threshold of retain's: the two combine (the message is what
    # tells: in huge pages a 64 MB tensor takes ~32 faults either way)
    said, _ = _probe("retain", GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    assert said.startswith("retain"), said
