"""A learn_sigma DiT as the released checkpoints are (a diffusers DiT pipeline: transformer, VAE,
scheduler), through `zoo convert --from diffusers` and `zoo generate`, against diffusers'
`DiTPipeline` with the same scheduler, steps and seed; and fine-tuned with its own objective."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")


def run_zoo(*argv: str) -> subprocess.CompletedProcess[str]:
    """``zoo ARGV`` in this process (module-scoped fixtures have no capsys)."""
    from zoo.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def _randomised(model: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def _dit(*, in_channels: int, learn_sigma: bool, classes: int, sample: int, seed: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = diffusers.DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=in_channels,
            out_channels=2 * in_channels if learn_sigma else in_channels, num_layers=2, sample_size=sample,
            patch_size=2, num_embeds_ada_norm=classes)
    _randomised(model, seed)
    blocks = model.transformer_blocks  # (a released checkpoint's per-block embedder copies are equal)
    with torch.no_grad():
        for blk in blocks[1:]:
            blk.norm1.emb.load_state_dict(blocks[0].norm1.emb.state_dict())
    return model.eval()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """A tiny DiT-XL/2-256-shaped pipeline: 4 latent channels, 1,000 classes (DiTPipeline's null
    class is 1,000), learned sigma, a DDIM scheduler as the releases ship, a 2x VAE."""
    root = tmp_path_factory.mktemp("dit-pipeline")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                                      down_block_types=("DownEncoderBlock2D",) * 2,
                                      up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, sample_size=16)
        pipe = diffusers.DiTPipeline(transformer=_dit(in_channels=4, learn_sigma=True, classes=1000, sample=8, seed=1),
                                     vae=_randomised(vae, 2, 0.05).eval(),
                                     scheduler=diffusers.DDIMScheduler(num_train_timesteps=1000, clip_sample=False))
        pipe.save_pretrained(root / "pipe")
    return root / "pipe"


def _theirs(pipe_dir: Path, scheduler: str, **call) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = diffusers.DiTPipeline.from_pretrained(str(pipe_dir))
        if scheduler == "ddpm":
            pipe.scheduler = diffusers.DDPMScheduler.from_config(pipe.scheduler.config)
        pipe.set_progress_bar_config(disable=True)
        return pipe(output_type="np", **call).images


@pytest.fixture(scope="module")
def converted(pipeline, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dit-zoo") / "zoo"
    r = run_zoo("convert", "--from", "diffusers", str(pipeline), str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_a_pipeline_imports_with_its_variance_channels_schedule_and_vae(pipeline, converted):
    from zoo.checkpoint.external import load

    cfg = load(converted).config
    assert (cfg.objective, cfg.learn_sigma, cfg.in_channels, cfg.num_classes) == ("vp", True, 4, 1000)
    assert (cfg.num_timesteps, cfg.beta_start, cfg.beta_end) == (1000, 1e-4, 0.02)
    assert Path(cfg.vae) == (pipeline / "vae").resolve()


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ddim_samples_are_dit_pipelines(pipeline, converted, guidance):
    """`zoo generate --class 3 --sampler ddim --num-steps 25 --seed 1` against DiTPipeline's images
    (its DDIM scheduler, 25 steps, a generator seeded 1): the floats within 1e-4, and the PNG the
    CLI writes within one level of the pipeline's own rounding to 8 bits."""
    from zoo_dit.diffusion import decoded, sample, to_pixels

    from zoo.checkpoint.external import load

    want = _theirs(pipeline, "ddim", class_labels=[3, 7], num_inference_steps=25, guidance_scale=guidance,
                   generator=torch.Generator().manual_seed(1))
    loaded = load(converted)
    tokens = sample(loaded.model, loaded.config, labels=[3, 7], sampler="ddim", num_steps=25, guidance=guidance, seed=1)
    got = to_pixels(decoded(tokens, loaded.config))[:, :, 0].permute(0, 2, 3, 1).numpy()
    assert np.abs(got - want).max() <= 1e-4
    assert want.std() > 0.01  # (a picture, not a constant)

    png = converted.parent / f"ddim-{guidance}.png"
    r = run_zoo("generate", "--checkpoint", str(converted), "--class", "3", "--sampler", "ddim", "--num-steps", "25",
                "--seed", "1", "--guidance", str(guidance), "--output", str(png))
    assert r.returncode == 0, r.stderr
    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    scale = (image.shape[0] - 4) // want.shape[1]  # (the grid's 2-pixel border; small images enlarged)
    ours = image[2:-2:scale, 2:-2:scale][: want.shape[1], : want.shape[2]]
    alone = _theirs(pipeline, "ddim", class_labels=[3], num_inference_steps=25, guidance_scale=guidance,
                    generator=torch.Generator().manual_seed(1))[0]
    assert np.abs(ours - (alone * 255).round().astype(int)).max() <= 1


def test_ddpm_samples_are_diffusers_ddpm_scheduler_with_the_learned_variance(pipeline, converted):
    """DiTPipeline hands its scheduler epsilon only; the original samples with the learned variance,
    which diffusers' `DDPMScheduler(variance_type="learned_range")` computes from the whole output:
    that loop (the pipeline's transformer, 10 leading-spaced steps, a generator seeded 4 drawing the
    latents and every step's noise) against `sample(sampler="ddpm", spacing="leading")`."""
    from zoo_dit.diffusion import sample

    from zoo.checkpoint.external import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = diffusers.DiTTransformer2DModel.from_pretrained(str(pipeline / "transformer")).eval()
    sched = diffusers.DDPMScheduler(num_train_timesteps=1000, variance_type="learned_range", clip_sample=False)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(1, 4, 8, 8, generator=g)
    with torch.no_grad():
        for t in sched.timesteps:
            out = transformer(latents, timestep=t.expand(1), class_labels=torch.tensor([3])).sample
            latents = sched.step(out, t, latents, generator=g).prev_sample
    loaded = load(converted)
    ours = sample(loaded.model, loaded.config, labels=[3], sampler="ddpm", num_steps=10, spacing="leading", seed=4)
    assert (ours[:, :, 0] - latents).abs().max() <= 1e-4 * max(1.0, latents.abs().max().item())
    assert latents.std() > 0.1


def test_a_cli_sampler_that_is_not_the_models_objectives_is_one_line(converted, tmp_path):
    r = run_zoo("generate", "--checkpoint", str(converted), "--class", "3", "--sampler", "heun",
                "--output", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "objective=vp samples with ddpm or ddim" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()


def test_a_learn_sigma_dit_fine_tunes_with_its_own_objective(tmp_path):
    """A pixel-space learn_sigma DiT (digits' shape) from diffusers, fine-tuned on the digits with
    model.objective=vp: its loss (epsilon MSE + the variational bound) falls."""
    src = tmp_path / "diffusers"
    _dit(in_channels=1, learn_sigma=True, classes=10, sample=8, seed=3).save_pretrained(src)
    r = run_zoo("convert", "--from", "diffusers", str(src), str(tmp_path / "zoo"))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    r = run_zoo("train", "--model", "dit", "--run-dir", str(run), f"checkpoint.load={tmp_path / 'zoo'}",
                "model.objective=vp", "model.learn_sigma=true", "model.hidden_size=16", "model.num_heads=2",
                "model.num_layers=2", "model.time_freq_shift=1", "model.mlp_norm_eps=1e-5", "train.steps=100",
                "train.eval_interval=0", "logging.interval=10", "optimizer.lr=1e-3", "train.ema=0",
                f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false", "logging.tensorboard=false")
    assert r.returncode == 0, r.stderr
    curve = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(curve) >= 5
    assert np.mean(curve[-2:]) < 0.75 * curve[0], curve


def test_a_facebookresearch_file_imports_with_its_variance_channels_and_exports_back(tmp_path):
    """`zoo convert --from facebook-dit FILE.pt DIR`: the sizes from the tensors (DiT-S/2's heads
    from the paper's table), learn_sigma and the VP diffusion; the model computes what the state dict's
    weights compute in zoo's own layout; `--to facebook-dit` writes the same tensors back. A file
    that is not a state dict, or of no known size, is one line and writes nothing."""
    import dataclasses

    from zoo_dit.convert import to_reference
    from zoo_dit.model import DiT, patchify
    from zoo_dit.plugin import DIT, _image

    from zoo.checkpoint.external import load

    cfg = dataclasses.replace(_image("S", 2), sample_size=8, num_classes=10, objective="vp", learn_sigma=True)
    torch.manual_seed(0)
    ref_model = _randomised(DiT(cfg, DIT), 5, 0.02).eval()
    original = to_reference(ref_model.state_dict(), cfg)
    torch.save(original, tmp_path / "DiT-S-2.pt")
    r = run_zoo("convert", "--from", "facebook-dit", str(tmp_path / "DiT-S-2.pt"), str(tmp_path / "zoo"))
    assert r.returncode == 0, r.stderr
    loaded = load(tmp_path / "zoo")
    got = loaded.config
    assert (got.num_heads, got.num_layers, got.hidden_size, got.patch_size, got.in_channels, got.sample_size,
            got.num_classes, got.learn_sigma, got.objective, got.time_freq_shift) == (6, 12, 384, 2, 4, 8, 10, True,
                                                                                       "vp", 0.0)
    x = torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    toks, pos = patchify(x, 1, 2, 2)
    kw = dict(positions=pos.expand(2, -1, -1), noise_level=torch.tensor([[10.0], [900.0]]),
              labels=torch.tensor([[3], [10]]))
    with torch.no_grad():
        out = loaded.model.eval()(toks, **kw)
        assert out.shape[-1] == 2 * 2 * 2 * 4 and torch.equal(out, ref_model(toks, **kw))
    r = run_zoo("convert", "--to", "facebook-dit", str(tmp_path / "zoo"), str(tmp_path / "back.pt"))
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)

    (tmp_path / "bad.pt").write_bytes(b"not a pickle")
    small = {k: v for k, v in original.items() if not k.startswith("blocks.11.")}
    torch.save(small, tmp_path / "small.pt")
    for name, words in (("bad.pt", "torch.load(weights_only=True)"), ("small.pt", "11 layers of width 384")):
        r = run_zoo("convert", "--from", "facebook-dit", str(tmp_path / name), str(tmp_path / f"out-{name}"))
        assert r.returncode == 1 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / f"out-{name}").exists()
