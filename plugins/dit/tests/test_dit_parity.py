"""DiT against diffusers' DiTTransformer2DModel (built from a tiny config, no download) and the
reference layout; EDM against the paper's formulas and diffusers' EDM scheduler."""

from __future__ import annotations

import math

import pytest
import torch
from zoo_dit import edm
from zoo_dit.convert import (
    config_from_diffusers,
    diffusers_config,
    from_diffusers,
    from_reference,
    to_diffusers,
    to_reference,
)
from zoo_dit.model import DiT, patchify, unpatchify
from zoo_dit.plugin import DIT, dit_tiny

from zoo.checkpoint.mapping import MappingError

diffusers = pytest.importorskip("diffusers")

TINY = {"num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 3, "out_channels": 3, "num_layers": 2,
        "sample_size": 8, "patch_size": 2, "num_embeds_ada_norm": 5, "norm_eps": 1e-5}


def _diffusers_model(seed: int = 0):
    torch.manual_seed(seed)
    m = diffusers.DiTTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in m.parameters():  # every weight nonzero (diffusers zero-initialises some)
            p.copy_(torch.randn_like(p) * 0.2)
        blocks = m.transformer_blocks
        for blk in blocks[1:]:  # one shared embedder, as in every converted checkpoint
            blk.norm1.emb.load_state_dict(blocks[0].norm1.emb.state_dict())
    return m


def _ours_forward(model: DiT, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    cfg = model.cfg  # (the whole batch patchified at once: diffusers' patch convolution checks that form)
    toks, pos = patchify(x[:, :, None], 1, cfg.patch_size, cfg.patch_size)
    out = model(toks, positions=pos.expand(len(x), -1, -1), noise_level=t[:, None], labels=y[:, None])
    g = x.shape[-1] // cfg.patch_size
    return unpatchify(out, (1, g, g), 1, cfg.patch_size, cfg.patch_size)[:, :, 0]


def test_diffusers_dit_converts_to_the_same_function_and_back():
    theirs = _diffusers_model()
    cfg = config_from_diffusers(dict(theirs.config))
    ours = DiT(cfg, DIT).eval()
    ours.load_state_dict(from_diffusers(theirs.state_dict(), cfg), strict=True)
    x = torch.randn(3, 3, 8, 8)
    t = torch.tensor([3.0, 250.0, 999.0])
    y = torch.tensor([0, 4, 5])  # 5: the null class
    with torch.no_grad():
        want = theirs(x, timestep=t, class_labels=y).sample
        got = _ours_forward(ours, x, t, y)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    back = to_diffusers(ours.state_dict(), cfg)
    ref = {k: v for k, v in theirs.state_dict().items() if not k.startswith("pos_embed.pos_embed")}
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
    assert diffusers_config(cfg)["num_embeds_ada_norm"] == 5


def test_diffusers_import_refuses_embedder_copies_that_differ_and_unknown_keys():
    theirs = _diffusers_model()
    cfg = config_from_diffusers(dict(theirs.config))
    sd = theirs.state_dict()
    sd["transformer_blocks.1.norm1.emb.timestep_embedder.linear_1.bias"] = sd[
        "transformer_blocks.1.norm1.emb.timestep_embedder.linear_1.bias"] + 1
    with pytest.raises(MappingError, match=r"transformer_blocks\.1\.norm1\.emb\.timestep_embedder\.linear_1\.bias differs"):
        from_diffusers(sd, cfg)
    sd = dict(theirs.state_dict(), extra=torch.zeros(1))
    with pytest.raises(MappingError, match="not consumed by any rule: extra"):
        from_diffusers(sd, cfg)
    with pytest.raises(MappingError, match="downscale_freq_shift=1"):
        diffusers_config(dit_tiny())  # Peebles & Xie's timestep frequencies: diffusers would differ


def test_reference_layout_round_trips_and_keeps_the_function():
    cfg = dit_tiny()
    torch.manual_seed(1)
    ours = DiT(cfg, DIT).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    ref = to_reference(ours.state_dict(), cfg)
    assert ref["blocks.0.attn.qkv.weight"].shape == (3 * cfg.hidden_size, cfg.hidden_size)
    assert ref["pos_embed"].shape == (1, (cfg.sample_size // cfg.patch_size) ** 2, cfg.hidden_size)
    # [q; k; v] there: the first hidden_size rows are q of every head, ours interleave per head
    hd = cfg.head_dim
    assert torch.equal(ref["blocks.0.attn.qkv.weight"][hd:2 * hd], ours.state_dict()["layers.0.attn.qkv.weight"][3 * hd:4 * hd])
    back = from_reference(ref, cfg)
    assert back.keys() == ours.state_dict().keys() and all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    bad = dict(ref, pos_embed=ref["pos_embed"] + 1)
    with pytest.raises(MappingError, match="pos_embed"):
        from_reference(bad, cfg)


def test_reference_learn_sigma_layout_keeps_the_variance_channels():
    """facebookresearch's released DiTs predict epsilon and the variance: final_layer.linear has
    2 x patch^2 x C outputs, per cell epsilon's C channels first; with learn_sigma zoo keeps all
    of them (and says what to set when a file has them and the config does not)."""
    import dataclasses

    cfg = dataclasses.replace(dit_tiny(), objective="vp", learn_sigma=True)
    torch.manual_seed(2)
    ours = DiT(cfg, DIT).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    ref = to_reference(ours.state_dict(), cfg)
    assert ref["final_layer.linear.weight"].shape[0] == 2 * cfg.patch_size**2 * cfg.in_channels
    back = from_reference(ref, cfg)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    with pytest.raises(MappingError, match="model.objective=vp model.learn_sigma=true"):
        from_reference(ref, dit_tiny())
    with pytest.raises(ValueError, match="set objective=vp"):
        dataclasses.replace(dit_tiny(), learn_sigma=True)


# ------------------------------------------------------------------------------------ EDM


def test_preconditioning_and_loss_weight_follow_the_paper():
    s = torch.tensor([0.002, 0.5, 3.0, 80.0], dtype=torch.float64)
    sd = 0.5
    c_skip, c_out, c_in, c_noise = edm.precondition(s, sd)
    assert torch.allclose(c_skip, sd**2 / (s**2 + sd**2))
    assert torch.allclose(c_out, s * sd / (s**2 + sd**2).sqrt())
    assert torch.allclose(c_in, 1 / (s**2 + sd**2).sqrt())
    assert torch.allclose(c_noise, s.log() / 4)
    assert torch.allclose(edm.loss_weight(s, sd) * c_out**2, torch.ones_like(s))  # lambda c_out^2 = 1
    sched = diffusers.EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=sd, rho=7.0)
    sample = torch.randn(2, 3)
    for sig in (0.01, 1.0, 40.0):
        st = torch.tensor(sig, dtype=torch.float64)
        c_skip, c_out, c_in, c_noise = edm.precondition(st, sd)
        assert torch.allclose(sched.precondition_inputs(sample, torch.tensor(sig)), sample * c_in.float())
        assert math.isclose(float(sched.precondition_noise(torch.tensor(sig))), float(c_noise), rel_tol=1e-6)
        model_out = torch.randn(2, 3)
        assert torch.allclose(sched.precondition_outputs(sample, model_out, torch.tensor(sig)),
                              c_skip.float() * sample + c_out.float() * model_out, atol=1e-6)


def test_karras_sigmas_equal_diffusers_edm_scheduler():
    sched = diffusers.EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5, rho=7.0,
                                        sigma_schedule="karras", final_sigmas_type="zero")
    for n in (1, 18, 35):
        sched.set_timesteps(n)
        ours = edm.karras_sigmas(n)
        assert torch.allclose(sched.sigmas.double(), ours, rtol=1e-6), n
    assert torch.allclose(edm.guide(torch.tensor(2.0), torch.tensor(1.0), 3.0, "standard"), torch.tensor(4.0))
    assert torch.allclose(edm.guide(torch.tensor(2.0), torch.tensor(1.0), 3.0, "dfm"), torch.tensor(5.0))


def _gaussian_error(num_steps: int, solver: str, *, wrong_point: bool = False) -> float:
    """Data ~ N(0, s0^2): the exact denoiser is D(x, s) = x s0^2 / (s0^2 + s^2) and the probability-flow
    ODE maps x(sigma_max) to x(0) = x(sigma_max) s0 / sqrt(s0^2 + sigma_max^2) exactly."""
    s0 = 0.5
    sigmas = edm.karras_sigmas(num_steps)
    noise = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def exact(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s0**2 / (s0**2 + s**2)

    if wrong_point:  # DFM's defect: the correction re-evaluates at (x_hat, t_hat)
        x = noise * sigmas[0]
        for i in range(num_steps):
            t, tn = sigmas[i], sigmas[i + 1]
            d = (x - exact(x, t)) / t
            xn = x + (tn - t) * d
            if tn > 0:
                d2 = (x - exact(x, t)) / t
                xn = x + (tn - t) * (d + d2) / 2
            x = xn
        got = x
    else:
        got = edm.sample(exact, noise, sigmas, solver=solver)
    want = noise * sigmas[0] * s0 / math.sqrt(s0**2 + float(sigmas[0]) ** 2)
    return float((got - want).abs().max())


def _order(solver: str, **kw: bool) -> float:
    steps = (16, 32, 64, 128)
    errs = [_gaussian_error(n, solver, **kw) for n in steps]
    return -math.log(errs[-1] / errs[0]) / math.log(steps[-1] / steps[0])


def test_heun_is_second_order_and_euler_first_order_on_a_known_denoiser():
    heun, euler = _order("heun"), _order("euler")
    assert heun > 1.8, heun
    assert 0.8 < euler < 1.3, euler
    assert _order("heun", wrong_point=True) < 1.3  # the test DFM's sampler fails


def test_churn_changes_samples_only_with_noise_and_stays_close_to_the_ode():
    s0 = 0.5
    noise = torch.randn(2048, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sig = edm.karras_sigmas(32)
    exact = lambda x, s: x * s0**2 / (s0**2 + s**2)  # noqa: E731
    a = edm.sample(exact, noise, sig, churn=10.0, s_tmin=0.05, s_tmax=50, generator=torch.Generator().manual_seed(1))
    b = edm.sample(exact, noise, sig)
    assert not torch.allclose(a, b)
    assert abs(float(a.std()) - s0) < 0.05 and abs(float(b.std()) - s0) < 0.05  # both sample N(0, s0^2)


def test_zoo_convert_diffusers_directories_both_ways(tmp_path, capsys):
    from zoo.checkpoint.external import load
    from zoo.cli import main

    theirs = _diffusers_model(seed=3)
    theirs.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "diffusers", str(tmp_path / "hf"), str(tmp_path / "zoo")]) == 0
    loaded = load(tmp_path / "zoo")
    assert loaded.family == "dit" and loaded.config.num_classes == 5
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([10.0, 700.0]), torch.tensor([1, 5])
    with torch.no_grad():
        want = theirs(x, timestep=t, class_labels=y).sample
        assert (_ours_forward(loaded.model.eval(), x, t, y) - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    assert main(["convert", "--to", "diffusers", str(tmp_path / "zoo"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "diffusion_pytorch_model.safetensors").is_file()
    back = diffusers.DiTTransformer2DModel.from_pretrained(tmp_path / "back")  # diffusers reads it as its own
    assert all(torch.equal(back.state_dict()[k], v) for k, v in theirs.state_dict().items())
    # Refusals name what is at fault; nothing is written.
    capsys.readouterr()
    assert main(["convert", "--to", "diffusers", str(tmp_path / "zoo"), str(tmp_path / "back")]) != 0
    assert "back already exists; nothing was overwritten" in capsys.readouterr().err
    sd = theirs.state_dict()
    sd["transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight"] += 1
    theirs.load_state_dict(sd)
    theirs.save_pretrained(tmp_path / "hf2")
    assert main(["convert", "--from", "diffusers", str(tmp_path / "hf2"), str(tmp_path / "zoo2")]) != 0
    assert "transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight differs" in capsys.readouterr().err
    assert not (tmp_path / "zoo2").exists()
