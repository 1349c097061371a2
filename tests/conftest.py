"""Fixtures for the core tests (helpers live in _core_helpers.py, importable by name)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


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


