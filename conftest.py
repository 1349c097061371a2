"""Fixtures shared by the core's and every first-party plugin's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """One tokenized corpus cache for the whole session, whichever family trains on it (BPE
    training takes a few seconds)."""
    return tmp_path_factory.mktemp("zoo-cache")
