"""Fixtures for the core tests (helpers live in _core_helpers.py, importable by name)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# MKL may use fewer threads when the machine is busy (MKL_DYNAMIC), which changes how a matrix
# product is split and so its last bits: tests that compare two runs in one process need the
# same split every time. Set before the first matrix product; subprocesses inherit it.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
# Every collective of every distributed test (gloo processes, torchrun jobs) checks that its
# tensors live on a device the group's backend serves (`zoo.parallel.distributed.check_collectives`).
os.environ.setdefault("ZOO_CHECK_COLLECTIVES", "1")
# The compiled CPU kernels (`zoo.fused`) cost each process that builds one ~3 s of importing torch's
# compiler, and most tests start processes (ranks, `zoo` commands) that train a few steps. They are
# off here, on where they are tested: tests/test_fused.py (each kernel against float64, recomputation
# bitwise under them) and the end-to-end training tests of LLaMA, DiT (images and video), the VLMs and
# Mamba, which drop this setting (`zoo.testing.compiled_kernels`).
os.environ.setdefault("ZOO_BACKENDS", "-inductor")


@pytest.fixture
def plugin_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A directory on sys.path for fake distributions; their modules are forgotten afterwards."""
    import importlib

    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", None) and str(root) in str(sys.modules[name].__file__):
            del sys.modules[name]
    importlib.invalidate_caches()


