"""The original DiT's discrete VP diffusion (`zoo_dit.vp`) against diffusers' schedulers step by
step, and its objective's terms against torch.distributions."""

from __future__ import annotations

import math
import random

import pytest
import torch
from zoo_dit import vp

diffusers = pytest.importorskip("diffusers")


def _draws(seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 4, 4)
    return g, shape


def _float64(scheduler):
    """diffusers' scheduler with its tables in float64, as the original DiT's are (its own float32
    ``1 - abar_t / abar_s`` loses a thousandth of beta at small t): the step formulas compared
    exactly. (Sampling through the float32 tables is compared in test_dit_sampling.)"""
    sched = vp.Schedule(scheduler.config.num_train_timesteps, scheduler.config.beta_start, scheduler.config.beta_end)
    scheduler.betas = sched.betas
    scheduler.alphas = 1.0 - sched.betas
    scheduler.alphas_cumprod = sched.alphas_cumprod
    if hasattr(scheduler, "final_alpha_cumprod"):
        scheduler.final_alpha_cumprod = torch.tensor(1.0, dtype=torch.float64)
    return scheduler


def _state(sched: vp.Schedule, t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``x_t`` of data in [-1, 1] and a prediction of its noise off by a little, as a trained
    network's would be."""
    x0 = torch.rand(2, 3, 4, 4, generator=g) * 2 - 1
    noise = torch.randn(x0.shape, generator=g)
    x = vp.q_sample(sched, x0, torch.tensor(t), noise)
    return x, noise + 0.1 * torch.randn(x0.shape, generator=g)


@pytest.mark.parametrize("seed", range(3))
def test_schedule_and_forward_process_are_diffusers(seed):
    rng = random.Random(seed)
    total = rng.choice([1000, 250, 37])
    start, end = rng.choice([(1e-4, 0.02), (8.5e-4, 0.012), (1e-3, 0.2)])
    sched = vp.Schedule(total, start, end)
    theirs = diffusers.DDPMScheduler(num_train_timesteps=total, beta_start=start, beta_end=end, beta_schedule="linear")
    # diffusers keeps its tables in float32
    assert torch.allclose(sched.alphas_cumprod.float(), theirs.alphas_cumprod, rtol=1e-5, atol=0)
    g, shape = _draws(seed)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.randint(0, total, (shape[0],), generator=g)
    want = theirs.add_noise(x0, noise, t)
    assert (vp.q_sample(sched, x0, t[:, None, None, None], noise) - want).abs().max() <= 1e-5


def test_leading_spacing_is_diffusers_and_even_spacing_keeps_both_ends():
    sched = vp.Schedule()
    for n in (1, 7, 25, 50, 250, 1000):
        s = diffusers.DDIMScheduler(num_train_timesteps=1000)
        s.set_timesteps(n)
        assert vp.timesteps(sched, n, "leading") == s.timesteps.tolist()
        even = vp.timesteps(sched, n, "even")
        assert len(even) == n and even == sorted(even, reverse=True)
        assert even[-1] == 0 and (n == 1 or even[0] == 999)
    assert vp.timesteps(sched, 1000, "even") == list(range(999, -1, -1))
    with pytest.raises(ValueError, match="num_steps=1001"):
        vp.timesteps(sched, 1001)


@pytest.mark.parametrize("variance", ["learned_range", "fixed_large"])
@pytest.mark.parametrize("num_steps", [1000, 50, 7])
def test_ddpm_steps_are_diffusers_ddpm_scheduler(variance, num_steps):
    """Every step of a chain, from the same x_t and the same noise: learned-range variance (the
    prediction's second half) or the fixed large one."""
    sched = vp.Schedule()
    theirs = _float64(diffusers.DDPMScheduler(num_train_timesteps=1000, variance_type=variance, clip_sample=False))
    theirs.set_timesteps(num_steps)
    kept = vp.timesteps(sched, num_steps, "leading")
    g = torch.Generator().manual_seed(num_steps)
    for i, t in enumerate(theirs.timesteps.tolist()):
        x, eps = (a.double() for a in _state(sched, t, g))
        v = torch.rand(x.shape, generator=g, dtype=torch.float64) * 2 - 1
        out = torch.cat([eps, v], 1) if variance == "learned_range" else eps
        noise_seed = 1000 + i
        want = theirs.step(out, t, x, generator=torch.Generator().manual_seed(noise_seed)).prev_sample
        prev = kept[i + 1] if i + 1 < len(kept) else -1
        abar_t, abar_s = sched.abar(torch.tensor(t)), sched.abar(torch.tensor(prev))
        noise = None if prev < 0 else torch.randn(x.shape, generator=torch.Generator().manual_seed(noise_seed),
                                                  dtype=torch.float64)
        got = vp.ddpm_step(x, eps, v if variance == "learned_range" else None, abar_t, abar_s, noise)
        assert (got - want).abs().max() <= 1e-10, (t, variance)


@pytest.mark.parametrize("eta", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("num_steps", [25, 50, 3])
def test_ddim_steps_are_diffusers_ddim_scheduler(eta, num_steps):
    sched = vp.Schedule()
    theirs = _float64(diffusers.DDIMScheduler(num_train_timesteps=1000, clip_sample=False, set_alpha_to_one=True))
    theirs.set_timesteps(num_steps)
    kept = vp.timesteps(sched, num_steps, "leading")
    g = torch.Generator().manual_seed(7 + num_steps)
    for i, t in enumerate(theirs.timesteps.tolist()):
        x, eps = (a.double() for a in _state(sched, t, g))
        noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
        want = theirs.step(eps, t, x, eta=eta, variance_noise=noise).prev_sample
        prev = kept[i + 1] if i + 1 < len(kept) else -1
        got = vp.ddim_step(x, eps, sched.abar(torch.tensor(t)), sched.abar(torch.tensor(prev)), eta=eta, noise=noise)
        assert (got - want).abs().max() <= 1e-10, t


def test_normal_kl_is_torch_distributions():
    g = torch.Generator().manual_seed(0)
    m1, m2 = torch.randn(50, generator=g), torch.randn(50, generator=g)
    lv1, lv2 = torch.randn(50, generator=g), torch.randn(50, generator=g)
    want = torch.distributions.kl_divergence(torch.distributions.Normal(m1, (0.5 * lv1).exp()),
                                             torch.distributions.Normal(m2, (0.5 * lv2).exp()))
    assert torch.allclose(vp.normal_kl(m1, lv1, m2, lv2), want, rtol=1e-5, atol=1e-6)


def test_discretized_likelihood_is_the_gaussian_mass_of_the_pixel_bin():
    """Data on the 256 levels of [-1, 1]: the bin's mass under N(mean, s^2) (exact CDF; the
    DDPM papers' tanh approximation of it is within ~1e-3), the edge bins their tails; the
    masses of all levels sum to 1."""
    levels = torch.linspace(-1, 1, 256, dtype=torch.float64)
    for mean, log_scale in ((0.1, math.log(0.05)), (-0.7, math.log(0.3)), (0.95, math.log(0.01))):
        m, ls = torch.full_like(levels, mean), torch.full_like(levels, log_scale)
        got = vp.discretized_gaussian_log_likelihood(levels, m, ls).exp()
        normal = torch.distributions.Normal(torch.tensor(mean, dtype=torch.float64),
                                            torch.tensor(math.exp(log_scale), dtype=torch.float64))
        hi = normal.cdf(levels + 1 / 255)
        lo = normal.cdf(levels - 1 / 255)
        want = torch.where(levels < -0.999, hi, torch.where(levels > 0.999, 1 - lo, hi - lo))
        assert (got - want).abs().max() <= 2e-3
        assert abs(got.sum().item() - 1.0) <= 2e-3


def test_variational_bound_is_the_kl_of_the_posteriors_and_the_decoder_nll_at_zero():
    sched = vp.Schedule()
    g = torch.Generator().manual_seed(3)
    x0 = torch.rand(4, 6, generator=g) * 2 - 1
    noise, eps, v = (torch.randn(4, 6, generator=g) for _ in range(3))
    v = v.tanh()
    t = torch.tensor([0, 1, 500, 999])[:, None]
    xt = vp.q_sample(sched, x0.double(), t, noise.double())
    got = vp.variational_bound(sched, x0, xt, t, eps, v)
    # KL between the true posterior and N(model mean, learned variance), by torch.distributions
    betas, abar = sched.betas, sched.alphas_cumprod
    for row, step in enumerate(t[:, 0].tolist()):
        a_t = abar[step]
        a_s = abar[step - 1] if step > 0 else torch.tensor(1.0, dtype=torch.float64)
        beta = betas[step]
        x0_hat = (xt[row] - (1 - a_t).sqrt() * eps[row].double()) / a_t.sqrt()
        coef1, coef2 = beta * a_s.sqrt() / (1 - a_t), (1 - a_s) * (1 - beta).sqrt() / (1 - a_t)
        post_var = beta * (1 - a_s) / (1 - a_t)
        clipped = betas[1] * (1 - abar[0]) / (1 - abar[1])  # beta~_1 where beta~_0 = 0
        low = torch.log(post_var if step > 0 else clipped)
        logvar = (v[row].double() + 1) / 2 * torch.log(beta) + (1 - v[row].double()) / 2 * low
        model = torch.distributions.Normal(coef1 * x0_hat + coef2 * xt[row], (0.5 * logvar).exp())
        if step == 0:  # the decoder: -log of the bin's mass, in bits
            want = -vp.discretized_gaussian_log_likelihood(x0[row].double(), model.mean, 0.5 * logvar) / math.log(2)
        else:
            true = torch.distributions.Normal(coef1 * x0[row].double() + coef2 * xt[row], post_var.sqrt())
            want = torch.distributions.kl_divergence(true, model) / math.log(2)
        assert torch.allclose(got[row], want, rtol=1e-6, atol=1e-9), step
