"""The discrete variance-preserving diffusion the original DiT is trained and sampled with
(Ho, Jain, Abbeel 2020, "Denoising Diffusion Probabilistic Models"; the learned variance of
Nichol & Dhariwal 2021, "Improved Denoising Diffusion Probabilistic Models"; DDIM of Song, Meng,
Ermon 2021; the objective of Peebles & Xie 2023).

Notation: ``T`` training timesteps, ``beta_t`` the linear schedule, ``abar_t`` the cumulative
product of ``1 - beta``; ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``. The network predicts
``eps`` and, with learn_sigma, an interpolation ``v`` in [-1, 1] between the log variances
``log beta_t`` and ``log beta~_t`` (the posterior's). Tables are float64, as the original's.

A sampling run keeps a subset of the timesteps (``timesteps``); a step from ``t`` to the next
kept ``s < t`` uses the schedule those two define (``abar_s`` with ``abar`` = 1 past the end), so
the same `ddpm_step` / `ddim_step` serve the full chain and a respaced one.
Everything here is plain tensor math, independent of the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Spacing = Literal["leading", "even"]


@dataclass(frozen=True)
class Schedule:
    """The linear beta schedule of ``num_timesteps`` steps (DiT: 1000 from 1e-4 to 0.02)."""

    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02

    @property
    def betas(self) -> torch.Tensor:
        return torch.linspace(self.beta_start, self.beta_end, self.num_timesteps, dtype=torch.float64)

    @property
    def alphas_cumprod(self) -> torch.Tensor:
        return torch.cumprod(1.0 - self.betas, 0)

    def abar(self, t: torch.Tensor) -> torch.Tensor:
        """``abar`` at integer timesteps ``t`` (any shape; ``t`` < 0 gives 1: before the first step)."""
        table = self.alphas_cumprod.to(t.device)
        return torch.where(t >= 0, table[t.clamp(min=0)], torch.ones((), dtype=table.dtype, device=t.device))


def timesteps(schedule: Schedule, num_steps: int, spacing: Spacing = "leading") -> list[int]:
    """The kept timesteps, descending. ``leading``: ``i * (T // n)`` (diffusers' default spacing,
    and the original's ``ddimN``); ``even``: ``round(i (T - 1) / (n - 1))`` (the original's
    respacing of DDPM, which keeps the last step ``T - 1``)."""
    total = schedule.num_timesteps
    if not 1 <= num_steps <= total:
        raise ValueError(f"num_steps={num_steps}: between 1 and the model's {total} timesteps")
    if spacing == "leading":
        kept = [i * (total // num_steps) for i in range(num_steps)]
    elif spacing == "even":
        stride = (total - 1) / (num_steps - 1) if num_steps > 1 else 1.0
        kept = sorted({round(i * stride) for i in range(num_steps)})
    else:
        raise ValueError(f"timestep spacing {spacing!r}: 'leading' or 'even'")
    return kept[::-1]


def q_sample(schedule: Schedule, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x_t`` for ``t`` broadcastable against ``x0``."""
    a = schedule.abar(t)
    return (a.sqrt() * x0.double() + (1 - a).sqrt() * noise.double()).to(x0.dtype)


def equivalent_sigma(schedule: Schedule, t: torch.Tensor) -> torch.Tensor:
    """The noise level of ``x_t / sqrt(abar_t) = x_0 + sigma eps``: ``sqrt((1 - abar) / abar)`` (EDM's sigma)."""
    a = schedule.abar(t)
    return ((1 - a) / a).sqrt()


def predict_x0(x: torch.Tensor, eps: torch.Tensor, abar_t: torch.Tensor) -> torch.Tensor:
    return (x - (1 - abar_t).sqrt() * eps) / abar_t.sqrt()


def posterior(x0: torch.Tensor, x: torch.Tensor, abar_t: torch.Tensor, abar_s: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of ``q(x_s | x_t, x_0)`` for the step ``t -> s`` (``beta = 1 - abar_t / abar_s``)."""
    beta = 1 - abar_t / abar_s
    mean = (beta * abar_s.sqrt() * x0 + (1 - abar_s) * (1 - beta).sqrt() * x) / (1 - abar_t)
    return mean, beta * (1 - abar_s) / (1 - abar_t)


def log_variance(v: torch.Tensor | None, abar_t: torch.Tensor, abar_s: torch.Tensor,
                 clipped_min: torch.Tensor | None = None) -> torch.Tensor:
    """The model's log variance of the step ``t -> s``: learned range ``frac log beta + (1 - frac)
    log beta~`` with ``frac = (v + 1) / 2`` (``v`` given), else the fixed large ``log beta``.
    ``clipped_min``: ``log beta~`` where the posterior's is 0 (the first step; the original uses
    the next step's there)."""
    beta = 1 - abar_t / abar_s
    post = beta * (1 - abar_s) / (1 - abar_t)
    low = torch.log(post.clamp(min=1e-20)) if clipped_min is None else torch.where(post > 0, torch.log(
        post.clamp(min=1e-20)), clipped_min)
    high = torch.log(beta)
    if v is None:
        return high
    frac = (v + 1) / 2
    return frac * high + (1 - frac) * low


def ddpm_step(x: torch.Tensor, eps: torch.Tensor, v: torch.Tensor | None, abar_t: torch.Tensor,
              abar_s: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """One ancestral step ``x_t -> x_s`` (``noise`` None: the last step, to the mean)."""
    mean, _ = posterior(predict_x0(x, eps, abar_t), x, abar_t, abar_s)
    if noise is None:
        return mean
    return mean + torch.exp(0.5 * log_variance(v, abar_t, abar_s)) * noise


def ddim_step(x: torch.Tensor, eps: torch.Tensor, abar_t: torch.Tensor, abar_s: torch.Tensor, *,
              eta: float = 0.0, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One DDIM step ``x_t -> x_s``; ``eta`` = 0 is deterministic, 1 the DDPM posterior's spread."""
    x0 = predict_x0(x, eps, abar_t)
    sigma = eta * ((1 - abar_s) / (1 - abar_t) * (1 - abar_t / abar_s)).sqrt()
    out = abar_s.sqrt() * x0 + (1 - abar_s - sigma**2).clamp(min=0).sqrt() * eps
    if eta > 0 and noise is not None:
        out = out + sigma * noise
    return out


# ------------------------------------------------------------------------------ the objective


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` per element, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_cdf(x: torch.Tensor) -> torch.Tensor:
    # the tanh approximation of the standard normal CDF the DDPM papers' likelihood uses
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``x`` (data in [-1, 1] quantised to 256 levels) under ``N(mean, e^(2 log_scale))``
    integrated over its bin; the edge bins take the tails. Per element, in nats."""
    centred = x - mean
    inv = torch.exp(-log_scale)
    cdf_plus = _approx_cdf(inv * (centred + 1.0 / 255.0))
    cdf_min = _approx_cdf(inv * (centred - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def variational_bound(schedule: Schedule, x0: torch.Tensor, x: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
    """The bound's term at ``t`` in bits per element: ``KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t))``,
    and at ``t`` = 0 the decoder's negative log-likelihood of ``x_0``. The mean comes from ``eps``
    as given (the objective passes it detached: the bound trains the variance only)."""
    abar_t, abar_s = schedule.abar(t), schedule.abar(t - 1)
    x0, x, eps, v = x0.double(), x.double(), eps.double(), v.double()
    true_mean, true_var = posterior(x0, x, abar_t, abar_s)
    clipped_min = torch.log(posterior(x0, x, schedule.abar(torch.ones_like(t)), schedule.abar(torch.zeros_like(t)))[1])
    logvar = log_variance(v, abar_t, abar_s, clipped_min)
    model_mean, _ = posterior(predict_x0(x, eps, abar_t), x, abar_t, abar_s)
    true_logvar = torch.log(true_var.clamp(min=1e-20)).where(true_var > 0, clipped_min)
    kl = normal_kl(true_mean, true_logvar, model_mean, logvar) / math.log(2.0)
    nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * logvar) / math.log(2.0)
    return torch.where(t == 0, nll, kl)


__all__ = ["Schedule", "Spacing", "ddim_step", "ddpm_step", "discretized_gaussian_log_likelihood", "equivalent_sigma",
           "log_variance", "normal_kl", "posterior", "predict_x0", "q_sample", "timesteps", "variational_bound"]
