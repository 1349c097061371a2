"""The objectives and samplers around the DiT network (EDM, or with ``model.objective=vp`` the
original DiT's discrete VP diffusion): the family's ``loss``, ``generate``, ``preview``,
``example_batch`` and throughput hooks.

The batch (`zoo_dit.data.collate`) carries clean tokens ``latents`` (B, S, F), their ``noise``,
per-sample ``sigma`` (B, N) drawn by the task encoder (vp: ``timestep``), ``positions``, optional ``segment_ids``,
``labels`` or ``context``, and ``loss_weight``. The loss is EDM's ``lambda(sigma) |D(x + sigma n) - x|^2``
per token (mean over features), averaged per sample and then over the samples of the micro-batch
(``loss_average=sample``), or over all tokens (``token``, DFM's weighting: big samples dominate).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo_dit import edm, vp
from zoo_dit.model import DiT, patchify, per_token, unpatchify
from zoo_dit.plugin import DiTConfig


def _cfg(model: nn.Module) -> DiTConfig:
    return model.cfg  # type: ignore[return-value]


def schedule(cfg: DiTConfig) -> vp.Schedule:
    return vp.Schedule(cfg.num_timesteps, cfg.beta_start, cfg.beta_end)


def split_output(out: torch.Tensor, cfg: DiTConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The network's tokens (..., out_features) -> the prediction (..., token_features) and, with
    learn_sigma, the variance interpolation ``v`` (each cell's channels: the prediction's first)."""
    if not cfg.learn_sigma:
        return out, None
    cells = out.unflatten(-1, (-1, 2 * cfg.in_channels))
    return cells[..., :cfg.in_channels].flatten(-2), cells[..., cfg.in_channels:].flatten(-2)


def _weighted(per_tok: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    # Per-token weights from `zoo_dit.data.collate` (each sample's tokens share 1/N of the weight,
    # or every token the same), made before context parallelism splits the row: each rank's
    # weighted mean, weighted by its share of the weight (the core's CP rule), is the exact total.
    w = batch["loss_weight"]
    return (per_tok * w).sum() / w.sum().clamp(min=torch.finfo(w.dtype).tiny)


def _vp_loss(model: nn.Module, batch: dict[str, Any], cfg: DiTConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """Peebles & Xie's objective: ``|eps_theta(x_t, t) - eps|^2`` per token (mean over features),
    plus with learn_sigma the variational bound's term at ``t`` (`vp.variational_bound`, bits per
    element) through the variance only, the mean's prediction detached; ``t`` uniform per sample."""
    seg = batch.get("segment_ids")
    sched = schedule(cfg)
    t = batch["timestep"]  # (B, N)
    t_tok = per_token(t[..., None], seg)  # (B, S or 1, 1)
    x0, noise = batch["latents"], batch["noise"]
    xt = vp.q_sample(sched, x0, t_tok, noise)
    kw = dict(positions=batch["positions"], labels=batch.get("labels"), segment_ids=seg,
              context=batch.get("context"), context_segment_ids=batch.get("context_segment_ids"))
    if "hidden" in batch:  # a later pipeline stage
        out = model(batch["hidden"], cond=batch["cond"], **kw)
    else:
        out = model(xt, noise_level=t.to(torch.float32), **kw)
    if isinstance(out, dict):
        return out, {}
    eps, v = split_output(out.float(), cfg)
    per_tok = (eps - noise).pow(2).mean(-1)  # (B, S)
    if v is not None:
        per_tok = per_tok + vp.variational_bound(sched, x0, xt, t_tok, eps.detach(), v).mean(-1).to(per_tok.dtype)
    sample_mask = batch["sample_mask"]
    sigma = vp.equivalent_sigma(sched, t).float()
    sigma_mean = (sigma * sample_mask).sum() / sample_mask.sum().clamp(min=1)
    return _weighted(per_tok, batch), {"sigma_mean": sigma_mean.detach()}


def loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    cfg = _cfg(model)
    if cfg.objective == "vp":
        return _vp_loss(model, batch, cfg)
    seg = batch.get("segment_ids")
    sigma = batch["sigma"]  # (B, N)
    sig_tok = per_token(sigma[..., None], seg)  # (B, S or 1, 1)
    x0 = batch["latents"]
    noisy = x0 + sig_tok * batch["noise"]
    c_skip, c_out, c_in, _ = edm.precondition(sig_tok, cfg.sigma_data)  # (c_noise: per sample, below)
    kw = dict(positions=batch["positions"], labels=batch.get("labels"), segment_ids=seg,
              context=batch.get("context"), context_segment_ids=batch.get("context_segment_ids"))
    if "hidden" in batch:  # a later pipeline stage: the previous one's hidden state and conditioning
        out = model(batch["hidden"], cond=batch["cond"], **kw)
    else:
        out = model((c_in * noisy).to(x0.dtype), noise_level=torch.log(sigma) / 4, **kw)
    if isinstance(out, dict):  # not the last stage
        return out, {}
    denoised = c_skip * noisy + c_out * out.float()
    per_tok = edm.loss_weight(sig_tok, cfg.sigma_data)[..., 0] * (denoised - x0).pow(2).mean(-1)  # (B, S)
    sample_mask = batch["sample_mask"]
    sigma_mean = (sigma * sample_mask).sum() / sample_mask.sum().clamp(min=1)
    return _weighted(per_tok, batch), {"sigma_mean": sigma_mean.detach()}


def example_batch(cfg: DiTConfig, *, batch_size: int, seq_length: int, generator: torch.Generator) -> dict[str, Any]:
    """Rows of ``seq_length`` tokens, each packed with random-size samples (2-4 patches a side;
    1-2 patch frames for video, with 2-5 text tokens) and padded at the end: the packing, the
    per-sample conditioning and the padding are what every parallel layout must get right."""
    from zoo_dit.data import collate, noise_draw

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    rows = []
    for _ in range(batch_size):
        row: list[dict[str, Any]] = []
        used = 0
        while True:
            gt, gh, gw = (randint(1, 2) if cfg.text_dim else 1), randint(2, 4), randint(2, 4)
            while gt * gh * gw > seq_length and gh * gw > 1:
                gh, gw = max(1, gh // 2), max(1, gw // 2)
            if used + gt * gh * gw > seq_length:
                break
            used += gt * gh * gw
            latent = torch.randn(cfg.in_channels, gt * cfg.patch_t, gh * cfg.patch_size, gw * cfg.patch_size,
                                 generator=generator)
            tokens, positions = patchify(latent, cfg.patch_t, cfg.patch_size, cfg.patch_size)
            m: dict[str, Any] = {"latents": tokens, "positions": positions,
                                 **noise_draw(cfg, tokens.shape, generator), "grid": (gt, gh, gw)}
            if cfg.num_classes:
                m["label"] = randint(0, cfg.num_classes)  # (num_classes: the null class)
            if cfg.text_dim:
                m["text"] = torch.randn(randint(2, 5), cfg.text_dim, generator=generator)
            row.append(m)
        rows.append(row)
    return collate(rows, cfg, multiple_of=seq_length)


def count_samples(batch: dict[str, Any]) -> int:
    return int(batch["sample_mask"].sum())


def flops_of_batch(model: nn.Module, run: Any) -> Callable[[dict[str, Any]], float]:
    """The training FLOPs each packed sample needs, from its own grid (samples differ in size):
    6 x (the weights applied to each of its tokens x tokens + the weights applied once per sample:
    the timestep MLP and every adaLN modulation, a third of a DiT's linear weights) + PaLM's
    12 x layers x width x tokens^2 for self-attention within the sample; with text, the
    cross-attention K/V over its own caption and the scores between the two. Layers whose input is
    data (the patch embedding of the noisy latents, the timestep MLP's first layer on sinusoids,
    K/V of the frozen text) compute no input gradient: 4 x, not 6 x. Padding, and the attention
    across packed samples that the masks throw away, are not counted."""
    cfg: DiTConfig = run.model
    each_token = each_sample = text_kv = 0.0  # FLOPs per token / per sample / per text token
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        passes = 4.0 if name in ("x_embed", "t_embed.fc1") or name.endswith("cross.kv") else 6.0
        if name.endswith("cross.kv"):
            text_kv += passes * m.weight.numel()
        elif name.startswith("t_embed") or "ada" in name.split("."):  # (layers.N.ada.1, final.ada.1)
            each_sample += passes * m.weight.numel()
        else:
            each_token += passes * m.weight.numel()
    attn = 12.0 * cfg.num_layers * cfg.hidden_size

    def flops(batch: dict[str, Any]) -> float:
        tokens = batch["grids"].prod(-1).double()  # per sample, row-major over rows like the grids
        total = each_token * tokens.sum() + each_sample * len(tokens) + attn * (tokens * tokens).sum()
        if "context_segment_ids" in batch:
            seg, n = batch["context_segment_ids"], batch["sample_mask"].sum(1).long().tolist()
            text = torch.cat([torch.bincount(s[s >= 0], minlength=k)[:k] for s, k in zip(seg, n)]).double()
            total += text_kv * text.sum() + attn * (tokens * text).sum()
        return float(total)

    return flops


# --------------------------------------------------------------------------------- sampling


def generate(model: DiT, cfg: DiTConfig, *, output: str | None = None, nrow: int | None = None,
             **request: Any) -> Any:
    """`sample` (the tensors), or with ``output`` the samples written there: an image grid
    (``.png``; a class-conditional model draws ``labels`` in order, ``nrow`` per row) or, for
    several frames, a clip (``.gif``/``.mp4``, the first sample). Returns the path written."""
    prompt = request.pop("prompt", None)
    encoder_dir = request.pop("text_encoder", None)
    if prompt is not None:
        if not cfg.text_dim:
            raise ValueError("this DiT is class-conditional: give --class, not --prompt")
        from zoo.data.encoders import TextEncoder

        encoder = TextEncoder(encoder_dir)  # the default: the built-in datasets' fixed-seed encoder
        if encoder.dim != cfg.text_dim:
            raise ValueError(f"the text encoder {encoder.name} gives {encoder.dim}-wide embeddings, the model takes "
                             f"{cfg.text_dim} (pass --text-encoder DIR: the T5 the dataset was embedded with)")
        (emb,) = encoder([prompt])
        request["context"] = torch.from_numpy(emb)[None]
    if output is not None and Path(output).suffix.lower() not in (".png", ".gif", ".mp4"):
        raise ValueError(f"--output {output}: write .png (a grid), .gif or .mp4 (a clip)")
    vae = _vae(cfg)
    if vae is not None:  # --height/--width are pixels: the model draws latents f times smaller
        unit = cfg.patch_size * vae.factor
        for name in ("height", "width"):
            size = request.get(name)
            if size is not None and size % unit:
                raise ValueError(f"--{name} {size}: must be divisible by the patch size {cfg.patch_size} x the VAE's "
                                 f"downsampling factor {vae.factor} = {unit}")
            if size is not None:
                request[name] = size // vae.factor
    out = decoded(sample(model, cfg, **request), cfg, vae)
    if output is None:
        return out
    from zoo import media

    path = Path(output)
    pixels = to_pixels(out.float())  # (N, C, T, H, W) in [0, 1]
    if pixels.shape[1] == 1:
        pixels = pixels.expand(-1, 3, -1, -1, -1)
    if path.suffix.lower() in (".gif", ".mp4"):
        frames = pixels[0].permute(1, 0, 2, 3)  # (T, C, H, W)
        scale = max(1, math.ceil(64 / frames.shape[-1]))
        frames = torch.nn.functional.interpolate(frames, scale_factor=scale, mode="nearest")
        clip = media.to_uint8(frames, value_range=(0.0, 1.0))
        return media.write_gif(path, clip, fps=4) if path.suffix.lower() == ".gif" else media.write_mp4(path, clip, fps=4)
    imgs = pixels[:, :, 0]
    # small images (8 x 8 digits) enlarged to >= 64 pixels, as the training previews are: viewable as written
    scale = max(1, math.ceil(64 / imgs.shape[-1]))
    imgs = torch.nn.functional.interpolate(imgs, scale_factor=scale, mode="nearest")
    if nrow is None:  # a few classes (--class 7 3 1) read in order along one row; more, as square as possible
        nrow = len(imgs) if len(imgs) <= 10 else math.ceil(math.sqrt(len(imgs)))
    return media.write_png(path, media.grid(imgs, nrow=nrow, value_range=(0.0, 1.0)))


SAMPLERS = {"edm": ("heun", "euler"), "vp": ("ddpm", "ddim")}


@torch.no_grad()
def sample(model: DiT, cfg: DiTConfig, *, labels: list[int] | None = None, context: torch.Tensor | None = None,
           num_samples: int | None = None, height: int | None = None, width: int | None = None,
           frames: int | None = None, num_steps: int | None = None, guidance: float = 1.0,
           guidance_form: str = "standard", guidance_channels: int | None = None, sampler: str | None = None,
           churn: float = 0.0, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0,
           eta: float = 0.0, spacing: vp.Spacing | None = None, seed: int = 0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Samples (N, C, T, H, W) in the model's value range (latent units; pixels in [-1, 1]).

    ``labels``: one class per sample (class-conditional), ``context`` (N, L, Dt) text embeddings
    (text-conditional). With ``guidance`` != 1 the conditional and unconditional (null class, or
    zeroed text) predictions come from one batched forward and are combined by ``guidance_form``.

    The sampler follows the model's objective: EDM's ``heun`` (default, 18 steps) or ``euler``;
    the VP diffusion's ancestral ``ddpm`` (default, 250 steps, the learned variance) or ``ddim``
    (50 steps; ``eta`` 0: deterministic). VP guidance combines the epsilon channels
    (``guidance_channels``: the first k of them, as facebookresearch's sample.py guides 3; default
    all, as diffusers' DiTPipeline) and keeps the conditional variance; its timesteps are spaced
    ``even`` for DDPM and ``leading`` for DDIM, as the original's respacing (`vp.timesteps`).
    """
    sampler = sampler or SAMPLERS[cfg.objective][0]
    if sampler not in SAMPLERS[cfg.objective]:
        raise ValueError(f"--sampler {sampler}: a model trained with objective={cfg.objective} samples with "
                         f"{' or '.join(SAMPLERS[cfg.objective])}")
    h, w = height or cfg.sample_size, width or cfg.sample_size
    t = frames or (cfg.num_frames if cfg.text_dim else 1)
    p = cfg.patch_size
    if h % p or w % p or t % cfg.patch_t:
        raise ValueError(f"height={h}, width={w}: each must be divisible by the patch size {p} (in latent units)"
                         + (f", frames={t} by patch_t={cfg.patch_t}" if t % cfg.patch_t else ""))
    n = len(labels) if labels is not None else (len(context) if context is not None else (num_samples or 1))
    if cfg.num_classes and labels is None:
        raise ValueError("this DiT is class-conditional: give the classes to draw (labels)")
    # (the class embedder's last row, num_classes, is the null class guidance draws against)
    outside = [y for y in labels or () if not 0 <= y < cfg.num_classes] if cfg.num_classes else []
    if outside:
        raise ValueError(f"class {outside[0]}: this DiT draws classes 0-{cfg.num_classes - 1}")
    if cfg.text_dim and context is None:
        raise ValueError("this DiT is text-conditional: give text embeddings (context)")
    if guidance_channels is not None and not 1 <= guidance_channels <= cfg.in_channels:
        raise ValueError(f"guidance_channels={guidance_channels}: between 1 and the model's {cfg.in_channels}")
    gen = generator or torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    _, positions = patchify(torch.zeros(1, t, h, w), cfg.patch_t, p, p)
    grid = (t // cfg.patch_t, h // p, w // p)
    guided = guidance != 1.0 or guidance_form == "dfm"
    pos = positions[None].expand(2 * n if guided else n, -1, -1).to(dev)
    lab = None
    if cfg.num_classes:
        lab = torch.tensor(labels, dtype=torch.long)
        lab = (torch.cat([lab, torch.full_like(lab, cfg.num_classes)]) if guided else lab)[:, None].to(dev)
    ctx = None
    if cfg.text_dim:
        assert context is not None
        ctx = context.to(dev, dtype)
        ctx = torch.cat([ctx, torch.zeros_like(ctx)]) if guided else ctx

    def forward(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        xin = torch.cat([x, x]) if guided else x
        return model(xin.to(dtype), positions=pos, noise_level=level.reshape(1, 1).expand(len(xin), 1).to(dev),
                     labels=lab, context=ctx).float()

    was = model.training
    model.eval()
    try:
        if cfg.objective == "vp":
            def image_noise() -> torch.Tensor:
                # drawn in the image layout (N, C, T, H, W), as diffusers' pipelines and schedulers
                # draw theirs: a seed gives their latents and their DDPM noise
                return patchify(torch.randn(n, cfg.in_channels, t, h, w, generator=gen), cfg.patch_t, p, p)[0].to(
                    dev, torch.float64)

            x = image_noise()
            kept = vp.timesteps(schedule(cfg), num_steps or (250 if sampler == "ddpm" else 50),
                                spacing or ("even" if sampler == "ddpm" else "leading"))

            def predict(x_: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
                eps, v = split_output(forward(x_, torch.tensor(float(step))), cfg)
                if not guided:
                    return eps.double(), None if v is None else v.double()
                cond, uncond = eps.chunk(2)
                k = guidance_channels or cfg.in_channels
                mixed = edm.guide(cond, uncond, guidance, guidance_form)  # type: ignore[arg-type]
                cells = cond.unflatten(-1, (-1, cfg.in_channels)).clone()
                cells[..., :k] = mixed.unflatten(-1, (-1, cfg.in_channels))[..., :k]
                return cells.flatten(-2).double(), None if v is None else v.chunk(2)[0].double()

            x = _vp_chain(x, kept, schedule(cfg), predict, sampler, eta, image_noise)
            tokens = x.float()
        else:
            def denoise(x_: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
                xin = torch.cat([x_, x_]) if guided else x_
                s = sigma.reshape(1, 1).expand(len(xin), 1).to(dev, torch.float32)
                c_skip, c_out, c_in, c_noise = edm.precondition(s, cfg.sigma_data)
                out = model((c_in[..., None] * xin).to(dtype), positions=pos, noise_level=c_noise, labels=lab,
                            context=ctx)
                d = c_skip[..., None] * xin + c_out[..., None] * out.float()
                if not guided:
                    return d
                cond, uncond = d.chunk(2)
                return edm.guide(cond, uncond, guidance, guidance_form)  # type: ignore[arg-type]

            noise = torch.randn(n, len(positions), cfg.token_features, generator=gen).to(dev)
            sigmas = edm.karras_sigmas(num_steps or 18, sigma_min=sigma_min, sigma_max=sigma_max, rho=rho).to(dev)
            tokens = edm.sample(denoise, noise, sigmas, solver=sampler, churn=churn, generator=gen)  # type: ignore[arg-type]
    finally:
        model.train(was)
    return unpatchify(tokens.cpu(), grid, cfg.patch_t, p, p)


def _vp_chain(x: torch.Tensor, kept: list[int], sched: vp.Schedule,
              predict: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]], sampler: str,
              eta: float, draw_noise: Callable[[], torch.Tensor]) -> torch.Tensor:
    """From ``x`` at ``kept[0]`` down the kept timesteps to ``x_0`` (float64 state)."""
    for i, step in enumerate(kept):
        prev = kept[i + 1] if i + 1 < len(kept) else -1
        abar_t, abar_s = (sched.abar(torch.tensor(s_)).to(x.device) for s_ in (step, prev))
        eps, v = predict(x, step)
        last = prev < 0
        stochastic = sampler == "ddpm" or eta > 0
        noise = None if last or not stochastic else draw_noise()
        if sampler == "ddpm":
            x = vp.ddpm_step(x, eps, v, abar_t, abar_s, noise)
        else:
            x = vp.ddim_step(x, eps, abar_t, abar_s, eta=eta, noise=noise)
    return x


def _vae(cfg: DiTConfig) -> Any:
    return _load_vae(cfg.vae) if cfg.vae else None


@functools.lru_cache(maxsize=2)
def _load_vae(path: str) -> Any:
    # Loaded once per process: training previews decode at every validation.
    from zoo.data.encoders import ImageVAE

    return ImageVAE(path)


def decoded(x: torch.Tensor, cfg: DiTConfig, vae: Any = None) -> torch.Tensor:
    """Samples (N, C, T, h, w) in model units -> pixels in [-1, 1]: through the VAE the training
    latents came from (``model.vae``), frame by frame, or as they are (a pixel-space model)."""
    vae = vae if vae is not None else _vae(cfg)
    if vae is None:
        return x
    n, c, t, h, w = x.shape
    frames = vae.decode(x.permute(0, 2, 1, 3, 4).reshape(n * t, c, h, w))
    return frames.reshape(n, t, *frames.shape[1:]).permute(0, 2, 1, 3, 4)


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """Model-range samples ([-1, 1] pixels) -> [0, 1]."""
    return ((x + 1) / 2).clamp(0, 1)


def preview(model: DiT, cfg: DiTConfig, batch: dict[str, Any], *, generator: torch.Generator) -> Any:
    """A grid of one sample per class (class-conditional), or of the batch's first texts."""
    from zoo.media import Artifact, grid

    if cfg.num_classes:
        k = min(cfg.num_classes, 10)
        out = sample(model, cfg, labels=[i % k for i in range(2 * k)], num_steps=18, guidance=1.5,
                     sampler="ddim" if cfg.objective == "vp" else None,
                       generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, (), generator=generator,
                                                                                 device=generator.device))))
    else:
        ctx = batch["context"][:4] if batch["context"].dim() == 3 else None
        out = sample(model, cfg, context=ctx, num_steps=18, guidance=1.5,
                     sampler="ddim" if cfg.objective == "vp" else None)
    imgs = to_pixels(decoded(out, cfg)[:, :, 0].float())  # first frame
    if imgs.shape[1] == 1:
        imgs = imgs.expand(-1, 3, -1, -1)
    scale = max(1, math.ceil(64 / imgs.shape[-1]))
    imgs = torch.nn.functional.interpolate(imgs, scale_factor=scale, mode="nearest")
    return Artifact("image", grid(imgs, nrow=k if cfg.num_classes else 4))


__all__ = ["count_samples", "decoded", "example_batch", "flops_of_batch", "generate", "loss", "preview", "sample", "to_pixels"]
