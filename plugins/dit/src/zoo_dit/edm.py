"""EDM (Karras, Aittala, Aila, Laine 2022, "Elucidating the Design Space of Diffusion-Based
Generative Models"): preconditioning, the training noise distribution and loss weight, the
Karras noise schedule and the deterministic Heun sampler (its Algorithm 2 with optional churn).

Notation follows the paper: ``sigma`` is the noise level, ``sd`` the data standard deviation
(``sigma_data``), ``F`` the raw network, ``D(x; sigma) = c_skip x + c_out F(c_in x; c_noise)`` the
denoiser. Everything here is plain tensor math, independent of the network.

Where this differs from NeMo DFM on purpose: the Heun correction evaluates the denoiser at
``(x_next, t_next)`` (DFM re-evaluates at ``(x_hat, t_hat)``, which makes its "second-order" step
Euler at twice the cost), and classifier-free guidance names both combinations (DFM's
``cond + g (cond - uncond)`` weights the conditional prediction by ``1 + g``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # D(x, sigma) -> x0 estimate
Guidance = Literal["standard", "dfm"]


def precondition(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, ...]:
    """``(c_skip, c_out, c_in, c_noise)`` of the paper's Table 1 (EDM column)."""
    s2, d2 = sigma * sigma, sigma_data * sigma_data
    root = torch.sqrt(s2 + d2)
    return d2 / (s2 + d2), sigma * sigma_data / root, 1.0 / root, torch.log(sigma) / 4


def loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """``lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2``: makes the effective weight of F's error 1."""
    return (sigma * sigma + sigma_data**2) / (sigma * sigma_data) ** 2


def sample_sigma(u: torch.Tensor, p_mean: float, p_std: float) -> torch.Tensor:
    """``ln sigma ~ N(P_mean, P_std^2)`` from standard normal draws ``u``."""
    return torch.exp(p_mean + p_std * u)


def karras_sigmas(num_steps: int, *, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The paper's eq. 5 time steps ``sigma_0 = sigma_max > ... > sigma_{N-1} = sigma_min``, then 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: at least one sampling step")
    i = torch.arange(num_steps, dtype=dtype)
    inv = 1.0 / rho
    ramp = i / max(num_steps - 1, 1)
    sig = (sigma_max**inv + ramp * (sigma_min**inv - sigma_max**inv)) ** rho
    return torch.cat([sig, torch.zeros(1, dtype=dtype)])


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float, form: Guidance = "standard") -> torch.Tensor:
    """Classifier-free guidance of two denoised estimates.

    ``standard`` (Ho & Salimans): ``uncond + g (cond - uncond)``; g = 1 is the conditional model.
    ``dfm`` (NeMo DFM's EDM pipeline): ``cond + g (cond - uncond)``, i.e. ``standard`` with g + 1.
    """
    if form == "standard":
        return uncond + scale * (cond - uncond)
    if form == "dfm":
        return cond + scale * (cond - uncond)
    raise ValueError(f"guidance form {form!r}: 'standard' or 'dfm'")


@torch.no_grad()
def sample(denoise: Denoiser, noise: torch.Tensor, sigmas: torch.Tensor, *, solver: Literal["heun", "euler"] = "heun",
           churn: float = 0.0, s_tmin: float = 0.0, s_tmax: float = math.inf, s_noise: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Algorithm 2 of the paper: integrate the probability-flow ODE from ``sigmas[0]`` to ``sigmas[-1]``.

    ``noise`` is a standard normal draw of the output's shape; the start is ``noise * sigmas[0]``.
    The state is kept in float64 (as NVlabs' reference does) and handed to ``denoise`` in the noise's
    dtype. Heun costs two denoiser calls per step except the last one (to sigma = 0), which is an
    Euler step; ``churn`` > 0 adds the paper's stochastic "churn" noise between ``s_tmin`` and ``s_tmax``.
    """
    if solver not in ("heun", "euler"):
        raise ValueError(f"solver {solver!r}: 'heun' or 'euler'")
    n = len(sigmas) - 1
    dtype = noise.dtype
    x = noise.to(torch.float64) * sigmas[0]

    def d(x_: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return denoise(x_.to(dtype), s.to(dtype)).to(torch.float64)

    for i in range(n):
        t_cur, t_next = sigmas[i], sigmas[i + 1]
        gamma = min(churn / n, math.sqrt(2) - 1) if churn > 0 and s_tmin <= float(t_cur) <= s_tmax else 0.0
        t_hat = t_cur + gamma * t_cur
        x_hat = x
        if gamma > 0:
            # Drawn where the generator lives (a CPU generator drives a GPU sampling run too).
            eps = torch.randn(x.shape, generator=generator, dtype=torch.float64,
                              device=generator.device if generator is not None else x.device).to(x.device)
            x_hat = x + torch.sqrt(t_hat**2 - t_cur**2) * s_noise * eps
        slope = (x_hat - d(x_hat, t_hat)) / t_hat
        x = x_hat + (t_next - t_hat) * slope
        if solver == "heun" and float(t_next) > 0:
            # The correction is the slope at the *end* of the step, (x_next, t_next).
            slope_next = (x - d(x, t_next)) / t_next
            x = x_hat + (t_next - t_hat) * (slope + slope_next) / 2
    return x.to(dtype)


__all__ = ["Guidance", "guide", "karras_sigmas", "loss_weight", "precondition", "sample", "sample_sigma"]
