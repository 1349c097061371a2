"""Every family's config refuses sizes it cannot build before anything is allocated: a count that is
not a positive integer, or sizes that add up to more than `zoo.config.MAX_PARAMETERS` (a config
file claiming 10^13 layers must fail in milliseconds with one line, not build for hours)."""

from __future__ import annotations

import pytest

from zoo.testing import run_zoo

# model: the keys that multiply its parameters
CASES = {"llama": ["num_layers", "hidden_size"], "mixtral": ["num_experts", "num_layers"],
         "mamba2": ["num_layers", "expand"], "hybrid": ["num_layers", "hidden_size"],
         "dit": ["num_layers", "hidden_size"], "dit-video": ["hidden_size", "num_layers"],
         "clip": ["vision_num_layers", "text_num_layers"], "llava": ["vision_num_layers", "num_layers"]}
HUGE = 10**13


def test_every_flavor_of_every_family_passes_its_own_checks():
    from zoo.registry import get_registry

    reg = get_registry()
    for name in CASES:
        for make in reg.get(name).family.flavors.values():
            make()  # __post_init__ runs the checks


@pytest.mark.parametrize("model", list(CASES))
def test_huge_and_zero_sizes_are_one_line_errors_naming_the_key(model, capsys):
    for key in CASES[model]:
        if model == "hybrid" and key == "num_layers":
            continue  # its layer count is the pattern's length; hidden_size covers it
        out = run_zoo(capsys, "train", "--model", model, "--dry-run", f"model.{key}={HUGE}")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert lines[0].startswith("zoo: error:") and f"{key}={HUGE}" in lines[0] and "parameters" in lines[0], lines
    key = CASES[model][-1]
    out = run_zoo(capsys, "train", "--model", model, "--dry-run", f"model.{key}=0")
    assert out.returncode == 2 and f"{key}=0 must be at least 1" in out.stderr, out.stderr
