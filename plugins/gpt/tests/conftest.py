from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every collective of every distributed test checks its tensors' devices against the backend.
os.environ.setdefault("ZOO_CHECK_COLLECTIVES", "1")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """One tokenized corpus cache for the whole session (BPE training takes a few seconds)."""
    return tmp_path_factory.mktemp("zoo-cache")


