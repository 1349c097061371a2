"""`zoo train --model dit-video` on the built-in moving digits, as a user runs it, judged by
`zoo_dit.quality` (a classifier of the real digits and the centre of mass's path, neither of
which saw the model). The recipe's full 4,000 steps take ~11 minutes on 2 cores, too long for the
suite: here its first 600 steps, by which the motion follows the caption; the digit bar of the full
recipe is `benchmarks/dit_video_quality.py`'s, recorded in docs/dit.md."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zoo.testing import compiled_kernels

# zoo train's default compiled CPU kernels (tests/conftest.py switches them off for the tests that
# only compare layouts): this module's quality thresholds were set with them
_compiled = pytest.fixture(scope="module", autouse=True)(compiled_kernels)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("dit-video")
    run = root / "run"
    env = {k: v for k, v in os.environ.items() if k != "ZOO_PLUGINS"}
    out = subprocess.run([sys.executable, "-m", "zoo", "train", "--model", "dit-video", "--run-dir", str(run),
                          f"data.cache_dir={root / 'cache'}", "train.steps=600", "train.eval_interval=600",
                          "logging.progress=false", "logging.tensorboard=false"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return run


def test_generated_clips_move_the_way_their_caption_says(trained):
    from zoo_dit.quality import moving_digits_quality

    from zoo.checkpoint.external import load

    loaded = load(str(trained))
    q = moving_digits_quality(loaded.model, loaded.config, n=40, guidance=4.0)
    assert q["direction"] >= 0.8, q["direction"]
    assert q["clips"].shape == (40, 8, 16, 16) and q["clips"].min() >= 0.0 and q["clips"].max() <= 1.0
    assert list((trained / "samples").glob("step_*.png"))  # the preview at the validation
