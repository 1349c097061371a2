"""Property-based conversion parity: random small configurations of every architecture zoo
converts (`_parity_draws`), each through the user's path against the library's own model
(`_parity_harness`). Each draw ends equal or refused in one line, never silently different; a
failing draw names the seed and the configuration that reproduce it:

    python -m pytest tests/conversion -k "LlamaForCausalLM and 7"

The default run draws a few per architecture; ``-m slow`` draws 50 more of each.
"""

from __future__ import annotations

import pytest
from _parity_draws import ARCHITECTURES, draw
from _parity_harness import run

DEFAULT_DRAWS = 3
SLOW_DRAWS = 50


def _one(architecture: str, seed: int, tmp_path) -> str:
    d = draw(architecture, seed)
    outcome = run(d, seed, tmp_path)
    return outcome.status


@pytest.mark.parametrize("seed", range(DEFAULT_DRAWS))
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_drawn_checkpoint_converts_exactly_or_is_refused(architecture, seed, tmp_path):
    assert _one(architecture, seed, tmp_path) in ("equal", "refused")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DEFAULT_DRAWS, DEFAULT_DRAWS + SLOW_DRAWS))
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_many_drawn_checkpoints_convert_exactly_or_are_refused(architecture, seed, tmp_path):
    assert _one(architecture, seed, tmp_path) in ("equal", "refused")
