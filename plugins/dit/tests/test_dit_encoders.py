"""`zoo prepare images|video --vae DIR --text-encoder DIR`: latents and caption embeddings made by
a diffusers AutoencoderKL and a transformers T5 encoder (tiny, random, built from configs and
saved locally), checked against those libraries called directly; a DiT trained on the latents
decodes its samples through the same VAE; sizes the VAE cannot take are one clear line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zoo.testing import run_zoo

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from diffusers import AutoencoderKL

    from zoo.data.encoders import TextEncoder

    root = tmp_path_factory.mktemp("encoders")
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=16)
    vae.save_pretrained(root / "vae")
    t5 = TextEncoder()  # a T5 encoder and tokenizer saved as any local T5 directory
    t5.model.save_pretrained(root / "t5")
    t5.tokenizer.save_pretrained(root / "t5")
    return root


def _first_sample(path, split: str = "train") -> dict:
    from zoo.data.energon.dataset import WebDataset, make_sample

    ds = WebDataset(str(path), split_part=split)
    return make_sample(ds, 0, restore_key=("s", 0), subflavors=None)


def test_prepared_latents_and_embeddings_equal_the_libraries_own(encoders, tmp_path, capsys):
    from diffusers import AutoencoderKL
    from sklearn.datasets import load_digits
    from transformers import AutoTokenizer, T5EncoderModel

    out = run_zoo(capsys, "prepare", "images", str(tmp_path / "img"), "--dataset", "digits", "--shard-size", "200",
               "--vae", str(encoders / "vae"), "--text-encoder", str(encoders / "t5"))
    assert out.returncode == 0, out.stderr
    meta = json.loads((tmp_path / "img" / ".nv-meta" / "encoders.json").read_text())
    assert meta["vae"]["factor"] == 2 and meta["vae"]["latent_channels"] == 4 and meta["text_encoder"]["dim"] == 64
    s = _first_sample(tmp_path / "img")
    i = int(s["__key__"].removeprefix("digit"))
    digits = load_digits()
    pixels = np.rint(digits.images[i] * (255.0 / 16.0)).astype(np.uint8) / 255.0 * 2 - 1
    vae = AutoencoderKL.from_pretrained(encoders / "vae", low_cpu_mem_usage=False).eval()
    with torch.no_grad():
        x = torch.from_numpy(pixels).float()[None, None].expand(1, 3, 8, 8)
        want = vae.encode(x).latent_dist.mean[0] * vae.config.scaling_factor
    assert s["latent.npy"].shape == (4, 4, 4) and np.allclose(s["latent.npy"], want.numpy(), atol=1e-6)
    tok = AutoTokenizer.from_pretrained(encoders / "t5")
    t5 = T5EncoderModel.from_pretrained(encoders / "t5").eval()
    with torch.no_grad():
        ids = tok([s["txt"]], return_tensors="pt")
        emb = t5(**ids).last_hidden_state[0]
    assert s["txt"] == f"a handwritten {digits.target[i]}" and np.allclose(s["t5.npy"], emb.numpy(), atol=1e-6)

    # Clips: every frame through the VAE, (C, T, H/f, W/f).
    out = run_zoo(capsys, "prepare", "video", str(tmp_path / "vid"), "--count", "20", "--vae", str(encoders / "vae"))
    assert out.returncode == 0, out.stderr
    clip = _first_sample(tmp_path / "vid")
    frames = torch.from_numpy(clip["npy"][0]).float()[:, None].expand(-1, 3, -1, -1)
    with torch.no_grad():
        want = vae.encode(frames).latent_dist.mean * vae.config.scaling_factor  # (T, C, h, w)
    assert clip["latent.npy"].shape == (4, 8, 8, 8)
    assert np.allclose(clip["latent.npy"], want.transpose(0, 1).numpy(), atol=1e-5)

    # A size the VAE cannot halve: one line naming the sample, nothing written.
    bad = run_zoo(capsys, "prepare", "images", str(tmp_path / "bad"), "--dataset", "digits", "--size", "9", "--vae",
               str(encoders / "vae"))
    assert bad.returncode != 0 and "digit00000: 9x9 pixels do not divide by the VAE's downsampling factor 2" \
        in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()

    # A DiT on those latents: it must name the VAE, trains, and draws pixels through it.
    args = ("train", "--model", "dit", "--run-dir", str(tmp_path / "run"), f"data.path={tmp_path / 'img'}",
            "model.in_channels=4", "model.sample_size=4", "train.steps=2", "train.micro_batch_size=8",
            "train.eval_interval=0", "logging.interval=1")
    unset = run_zoo(capsys, *args)
    assert unset.returncode == 2 and f"set model.vae={encoders / 'vae'}" in unset.stderr
    ok = run_zoo(capsys, *args, f"model.vae={encoders / 'vae'}")
    assert ok.returncode == 0, ok.stderr
    gen = run_zoo(capsys, "generate", "--checkpoint", str(tmp_path / "run"), "--class", "3", "--num-steps", "2", "--height",
               "16", "--width", "8", "--output", str(tmp_path / "g.png"))
    assert gen.returncode == 0, gen.stderr
    from PIL import Image

    # 16x8 pixels (8x4 latents) decoded, enlarged 8x for the grid (to >= 64 pixels; + 2 px border each side)
    assert Image.open(tmp_path / "g.png").size == (8 * 8 + 4, 16 * 8 + 4)
    wrong = run_zoo(capsys, "generate", "--checkpoint", str(tmp_path / "run"), "--class", "3", "--height", "6", "--output",
                 str(tmp_path / "h.png"))
    assert wrong.returncode == 2 and "--height 6: must be divisible by the patch size 2 x the VAE's downsampling " \
        "factor 2 = 4" in wrong.stderr and not (tmp_path / "h.png").exists()


def test_prepared_digits_train_a_class_conditional_dit_only_with_their_classes(tmp_path, capsys):
    """`zoo prepare images --dataset digits` types samples for CLIP (captions): a class-conditional
    DiT refuses them up front, naming the sample type that carries the class, and trains on that."""
    from sklearn.datasets import load_digits

    for name, extra in (("cap", ()), ("cls", ("--sample-type", "ImageClassificationSample"))):
        out = run_zoo(capsys, "prepare", "images", str(tmp_path / name), "--dataset", "digits", "--shard-size", "200",
                      *extra)
        assert out.returncode == 0, out.stderr
    sample = _first_sample(tmp_path / "cls")
    index = int(sample.__key__.removeprefix("digit"))
    assert sample.label == int(load_digits().target[index])  # the class itself, not the caption's text
    args = ("train", "--model", "dit", "train.steps=2", "train.eval_interval=0", "logging.interval=1")
    bad = run_zoo(capsys, *args, "--run-dir", str(tmp_path / "r1"), f"data.path={tmp_path / 'cap'}")
    assert bad.returncode == 2 and "its samples are CaptioningSample, without a class" in bad.stderr
    assert "--sample-type ImageClassificationSample" in bad.stderr and not (tmp_path / "r1" / "checkpoints").exists()
    ok = run_zoo(capsys, *args, "--run-dir", str(tmp_path / "r2"), f"data.path={tmp_path / 'cls'}")
    assert ok.returncode == 0, ok.stderr
