"""`zoo train --model clip|llava` end to end on the built-in digits (default recipes): CLIP's
zero-shot accuracy and LLaVA's answers on held-out digits (the val and test splits, never trained
on), `zoo generate` for both, exact resume with frozen towers, bad data as one clear line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from zoo.testing import compiled_kernels, run_zoo

QUIET = ("logging.progress=false", "logging.tensorboard=false", "logging.plot=false")

# zoo train's default compiled CPU kernels (tests/conftest.py switches them off for the tests that
# only compare layouts): this module's quality thresholds were set with them
_compiled = pytest.fixture(scope="module", autouse=True)(compiled_kernels)


@pytest.fixture(autouse=True)
def _zoo_in_process(capsys, monkeypatch):
    monkeypatch.setitem(globals(), "zoo", functools.partial(run_zoo, capsys))


def zoo(*args: str):  # replaced per test by the in-process runner above
    raise AssertionError


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vlm-cache")


def _train(root: Path, family: str, cache: Path, *extra: str) -> Path:
    from zoo.cli import main

    run = root / family
    assert main(["train", "--model", family, "--run-dir", str(run), f"data.cache_dir={cache}", *QUIET, *extra]) == 0
    return run


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory, cache) -> Path:
    return _train(tmp_path_factory.mktemp("clip"), "clip", cache)


@pytest.fixture(scope="module")
def llava_run(tmp_path_factory, cache) -> Path:
    return _train(tmp_path_factory.mktemp("llava"), "llava", cache)


def _held_out(cache: Path, name: str):
    """Every sample of the val and test splits of a built-in dataset."""
    from zoo.data.energon.loader import Loader, WorkerConfig, get_val_dataset

    for split in ("val", "test"):
        ds = get_val_dataset(str(cache / name), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                             batch_size=None, split_part=split)
        yield from Loader(ds)


def test_clip_zero_shot_accuracy_on_held_out_digits(clip_run, cache, tmp_path):
    from zoo_vlm.data import CLIPTaskEncoder, image_tensor
    from zoo_vlm.generate import zero_shot

    from zoo.checkpoint.external import load
    from zoo.data.tokenizer import load_tokenizer

    loaded = load(clip_run)
    enc = CLIPTaskEncoder(loaded.config, load_tokenizer(loaded.tokenizer_dir))
    labels = torch.stack([enc.text_ids(f"a handwritten {d}", "label") for d in range(10)])
    samples = list(_held_out(cache, "energon-digits-captions-v1"))
    images = torch.stack([image_tensor(s.image, loaded.config, "") for s in samples])
    truth = torch.tensor([int(s.caption.split()[-1]) for s in samples])
    accuracy = float((zero_shot(loaded.model, images, labels).argmax(-1) == truth).float().mean())
    assert len(samples) > 300 and accuracy >= 0.8, accuracy
    # The CLI: a held-out digit written as a PNG, classified against label texts.
    s = samples[0]
    png = tmp_path / "digit.png"
    png.write_bytes(_png(s.image))
    out = zoo("generate", "--model", "clip", "--checkpoint", str(clip_run), "--image", str(png), "--labels",
              ",".join(f"a handwritten {d}" for d in range(10)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{png}: a handwritten ") and "(p=" in out.stdout
    bad = zoo("generate", "--model", "clip", "--checkpoint", str(clip_run), "--image", str(png), "--labels", "a 0,,a 1")
    assert bad.returncode == 2 and "an empty label" in bad.stderr, bad.stderr


def _png(image: torch.Tensor) -> bytes:
    from zoo.data.energon.prepare import png_bytes

    return png_bytes((image[0] * 255).round().to(torch.uint8).numpy())


def test_llava_answers_the_digit_question_on_held_out_digits(llava_run, cache, tmp_path):
    from zoo_vlm.data import LlavaTaskEncoder, image_tensor
    from zoo_vlm.generate import generate_answer

    from zoo.checkpoint.external import load
    from zoo.data.tokenizer import load_tokenizer

    loaded = load(llava_run)
    tok = load_tokenizer(loaded.tokenizer_dir)
    prompt = LlavaTaskEncoder(loaded.config, tok, seq_length=48).prompt_ids("What digit is this?")
    samples = list(_held_out(cache, "energon-digits-vqa-v1"))
    right = sum(tok.decode(generate_answer(loaded.model, loaded.config, image_tensor(s.image, loaded.config, "")[None],
                                           prompt, max_new_tokens=4, eos_id=tok.eod_id)).strip() == s.answers[0]
                for s in samples)
    assert right / len(samples) >= 0.8, right / len(samples)
    png = tmp_path / "digit.png"
    png.write_bytes(_png(samples[0].image))
    out = zoo("generate", "--model", "llava", "--checkpoint", str(llava_run), "--image", str(png), "--prompt",
              "What digit is this?", "--greedy")
    assert out.returncode == 0, out.stderr
    from zoo.data.energon.prepare import DIGIT_NAMES

    assert out.stdout.strip() in DIGIT_NAMES
    # The cache changes nothing: the same answer recomputing the whole sequence each step.
    again = zoo("generate", "--checkpoint", str(llava_run), "--image", str(png), "--prompt", "What digit is this?",
                "--greedy", "--no-cache")
    assert again.stdout == out.stdout
    wrong = zoo("generate", "--model", "clip", "--checkpoint", str(llava_run), "--image", str(png), "--prompt", "x")
    assert wrong.returncode == 2 and "holds a 'llava' model" in wrong.stderr


def _curve(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_stage_one_projector_only_resumes_exactly(tmp_path, cache):
    """LLaVA stage 1: vision tower and language model frozen, the projector trained; a run resumed
    from its step-3 checkpoint continues on the same curve to the same weights."""
    args = ("--model", "llava", "train.steps=6", "checkpoint.interval=3", "train.eval_interval=0",
            "logging.interval=1", "train.micro_batch_size=8", "data.num_workers=1", f"data.cache_dir={cache}",
            'train.freeze=["vision.*","embed.*","layers.*","norm.*","head.*"]', "optimizer.lr_mult={\"projector.*\": 2.0}",
            *QUIET)
    assert zoo("train", "--run-dir", str(tmp_path / "full"), *args).returncode == 0
    cont = tmp_path / "cont"
    (cont / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000003", cont / "checkpoints" / "step_00000003")
    assert zoo("train", "--run-dir", str(cont), *args).returncode == 0
    assert _curve(cont) == _curve(tmp_path / "full")[3:]
    from zoo.checkpoint.external import load

    a, b = load(tmp_path / "full").model.state_dict(), load(cont).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    from zoo_vlm.model import build_llava
    from zoo_vlm.plugin import LLAVA, llava_tiny

    torch.manual_seed(1234)  # train.seed: the initial weights
    init = build_llava(llava_tiny(), LLAVA).state_dict()
    moved = {k for k in a if not torch.equal(a[k], init[k])}
    assert moved and all(k.startswith("projector.") for k in moved), sorted(moved)[:5]


@pytest.mark.parametrize("family, override, message", [
    ("llava", "model.image_size=16", "a 3x8x8 image, the vision tower takes 3x16x16 (model.num_channels, model.image_size)"),
    ("llava", "train.seq_length=24", "positions (the image's 16 features included), more than train.seq_length=24"),
    ("clip", "model.max_seq_length=3", "tokens (end token included), the text tower's context is 3 (model.max_seq_length)"),
])
def test_bad_data_is_one_clear_line(tmp_path, cache, family, override, message):
    out = zoo("train", "--model", family, "--run-dir", str(tmp_path / "r"), override, "train.steps=1",
              f"data.cache_dir={cache}", *QUIET)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_prepare_images_writes_the_digits_as_vqa_samples(tmp_path):
    out = zoo("prepare", "images", str(tmp_path / "vqa"), "--dataset", "digits", "--sample-type", "VQASample")
    assert out.returncode == 0, out.stderr
    shown = zoo("data", "preview", str(tmp_path / "vqa"), "-n", "1")
    assert "context: What digit is this?" in shown.stdout and "answers: ['zero']" in shown.stdout, shown.stdout
