"""`zoo train --model dit` end to end on the built-in digits: sample quality judged by a classifier
that never saw the model, `zoo generate`, exact resume (EMA and data position), clear errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zoo.testing import compiled_kernels, run_zoo

# zoo train's default compiled CPU kernels (tests/conftest.py switches them off for the tests that
# only compare layouts): this module's quality thresholds were set with them
_compiled = pytest.fixture(scope="module", autouse=True)(compiled_kernels)


def zoo(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("ZOO_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _curve(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The default recipe (`zoo train --model dit`), as a user runs it."""
    root = tmp_path_factory.mktemp("dit")
    run = root / "run"
    out = zoo("train", "--model", "dit", "--run-dir", str(run), f"data.cache_dir={root / 'cache'}",
              "logging.progress=false", "logging.tensorboard=false")
    assert out.returncode == 0, out.stdout + out.stderr
    return run


def _classifier():
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    d = load_digits()
    return LogisticRegression(max_iter=5000).fit(d.data / 16.0, d.target)


def test_class_conditional_samples_are_recognised_as_their_class(trained):
    from zoo_dit.diffusion import sample

    from zoo.checkpoint.external import load

    loaded = load(trained)  # the EMA weights (the recipe keeps them)
    labels = [i % 10 for i in range(300)]
    out = sample(loaded.model, loaded.config, labels=labels, num_steps=18, guidance=1.5, seed=0)
    pixels = ((out[:, 0, 0] + 1) / 2).clamp(0, 1).reshape(len(labels), 64).numpy()
    accuracy = float((_classifier().predict(pixels) == np.array(labels)).mean())
    assert accuracy >= 0.9, accuracy
    assert list((trained / "samples").glob("step_*.png"))  # a preview grid at each validation


def test_the_original_dits_vp_objective_trains_and_samples_the_asked_class(tmp_path):
    """`model.objective=vp model.learn_sigma=true` (Peebles & Xie's loss: epsilon MSE + the
    variational bound through the learned variance) on the digits, 2,400 steps of the recipe
    (about 90 s on 2 cores; VP needs three times EDM's steps here: at 800 its samples were read as
    their class a third of the time): DDIM and DDPM samples read as their class by the classifier."""
    from zoo_dit.diffusion import sample

    from zoo.checkpoint.external import load

    run = tmp_path / "vp"
    out = zoo("train", "--model", "dit", "--run-dir", str(run), "model.objective=vp", "model.learn_sigma=true",
              "train.steps=2400", "train.eval_interval=1200", f"data.cache_dir={tmp_path / 'cache'}",
              "logging.progress=false", "logging.tensorboard=false")
    assert out.returncode == 0, out.stdout + out.stderr
    loaded = load(run)
    labels = [i % 10 for i in range(200)]
    for sampler, steps in (("ddim", 50), ("ddpm", 100)):
        x = sample(loaded.model, loaded.config, labels=labels, sampler=sampler, num_steps=steps, guidance=1.5, seed=0)
        pixels = ((x[:, 0, 0] + 1) / 2).clamp(0, 1).reshape(len(labels), 64).numpy()
        accuracy = float((_classifier().predict(pixels) == np.array(labels)).mean())
        assert accuracy >= 0.85, (sampler, accuracy)


def test_bf16_parameters_still_draw_the_asked_class(trained):
    """`zoo generate --dtype bf16`'s load: every parameter bf16 (half the bytes), sampled under bf16
    autocast as the command runs it; the classifier still reads the asked digits."""
    from zoo_dit.diffusion import sample

    from zoo.checkpoint.external import load

    full, half = load(trained), load(trained, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())
    size = sum(p.numel() * p.element_size() for p in half.model.parameters())
    assert 2 * size == sum(p.numel() * p.element_size() for p in full.model.parameters())
    labels = [i % 10 for i in range(100)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sample(half.model, half.config, labels=labels, num_steps=18, guidance=1.5, seed=0)
    pixels = ((out[:, 0, 0].float() + 1) / 2).clamp(0, 1).reshape(len(labels), 64).numpy()
    accuracy = float((_classifier().predict(pixels) == np.array(labels)).mean())
    assert accuracy >= 0.9, accuracy


def test_generate_cli_writes_a_grid_and_refuses_bad_sizes(trained, tmp_path, capsys):
    from PIL import Image

    zoo = functools.partial(run_zoo, capsys)  # in this process: seven commands, no interpreter starts

    out = zoo("generate", "--checkpoint", str(trained), "--class", "7", "3", "--num-steps", "18", "--guidance", "1.5",
              "--seed", "42", "--output", str(tmp_path / "grid.png"))
    assert out.returncode == 0, out.stderr
    img = np.asarray(Image.open(tmp_path / "grid.png"))
    assert img.shape == (64 + 4, 2 * 64 + 6, 3)  # two 8x8 samples enlarged 8x, side by side (one row)
    half = zoo("generate", "--checkpoint", str(trained), "--class", "7", "3", "--num-steps", "18", "--guidance", "1.5",
               "--seed", "42", "--dtype", "bf16", "--output", str(tmp_path / "grid16.png"))
    assert half.returncode == 0, half.stderr
    assert np.asarray(Image.open(tmp_path / "grid16.png")).shape == img.shape
    bad = zoo("generate", "--checkpoint", str(trained), "--class", "7", "--height", "7", "--output", str(tmp_path / "b.png"))
    assert bad.returncode == 2 and "divisible by the patch size 2" in bad.stderr and not (tmp_path / "b.png").exists()
    bad = zoo("generate", "--checkpoint", str(trained), "--output", str(tmp_path / "c.png"))
    assert bad.returncode == 2 and "class-conditional" in bad.stderr
    for label in ("10", "-1"):  # 10 is the null class's row: guidance's, not one to ask for
        bad = zoo("generate", "--checkpoint", str(trained), "--class", "3", label, "--output", str(tmp_path / "d.png"))
        assert bad.returncode == 2 and f"class {label}: this DiT draws classes 0-9" in bad.stderr, bad.stderr
    assert not (tmp_path / "d.png").exists()


def test_resume_is_exact_including_ema_and_data_position(tmp_path, capsys):
    zoo = functools.partial(run_zoo, capsys)
    args = ("train.steps=6", "checkpoint.interval=3", "train.eval_interval=0", "logging.interval=1", "train.micro_batch_size=16",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", "data.num_workers=1",
            f"data.cache_dir={tmp_path / 'cache'}")
    full = zoo("train", "--model", "dit", "--run-dir", str(tmp_path / "full"), *args)
    assert full.returncode == 0, full.stderr
    cont = tmp_path / "cont"
    (cont / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000003", cont / "checkpoints" / "step_00000003")
    out = zoo("train", "--model", "dit", "--run-dir", str(cont), *args)
    assert out.returncode == 0, out.stderr
    assert _curve(cont) == _curve(tmp_path / "full")[3:]
    from zoo.checkpoint.external import load

    a = load(tmp_path / "full", weights="ema").model.state_dict()
    b = load(cont, weights="ema").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_wrong_latent_channels_is_one_clear_line(tmp_path, capsys):
    out = run_zoo(capsys, "train", "--model", "dit", "--run-dir", str(tmp_path / "r"), "model.in_channels=4", "train.steps=1",
              f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false")
    assert out.returncode != 0
    assert "has 3 latent channels, the model takes 4 (model.in_channels)" in out.stderr
