"""DiT data: Energon samples -> token sequences with their noise, through the core's loader.

The task encoder (`DiTTaskEncoder`) turns a sample (an image, a latent, a video clip; a class
or text embeddings) into tokens (`zoo_dit.model.patchify`) and draws, per sample and seeded by
the run seed and the sample's key, its noise level (EDM's sigma, or the VP diffusion's timestep),
its noise and its condition dropout. So
every sample of a pack has its own sigma (DFM shares one per pack), a restored run redraws
exactly what it drew before, and a sample seen again in a later epoch draws afresh.

With ``data.packing_buffer_size`` set, samples are packed first-fit-decreasing into rows of
``train.seq_length`` tokens (`select_samples_to_pack` / `pack_selected_samples`); the model keeps
attention inside each sample through ``segment_ids`` and the loss ignores padding.

Built-in datasets (no download): ``digits`` (scikit-learn's handwritten digits with their class)
prepared as an Energon dataset in the cache on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo.data.energon.task_encoder import Cooker, SkipSample, TaskEncoder, stateless
from zoo.errors import ConfigError
from zoo_dit import edm
from zoo_dit.model import patchify
from zoo_dit.plugin import DiTConfig

# Where a crude sample keeps what the DiT learns: VAE latents (`zoo prepare ... --vae`), DFM's
# .pth latents, or pixels (.npy clips in [-1, 1]).
_LATENT_PARTS = ("latent.npy", "latent", "pth", "safetensors", "npy")


def to_latent(sample: Any, cfg: DiTConfig, where: str) -> torch.Tensor:
    """The sample's image, video or stored latent as (C, T, H, W) in the model's value range."""
    x = getattr(sample, "image", None) if not isinstance(sample, dict) else None
    if x is not None:  # decoded pixels in [0, 1], (C, H, W): EDM trains on [-1, 1]
        x = x.float()
        if x.shape[0] != cfg.in_channels and cfg.in_channels == 1:
            x = x[:1]  # grey stored as RGB
        x = (x * 2 - 1)[:, None]
    elif isinstance(sample, dict) and any(k in sample for k in _LATENT_PARTS):
        x = next(sample[k] for k in _LATENT_PARTS if k in sample)
        x = torch.as_tensor(x).float()
        if x.dim() == 5:  # DFM stores [1, C, T, H, W]
            x = x[0]
        if x.dim() == 3:
            x = x[:, None]
    else:
        raise ValueError(f"{where}: a DiT sample needs an image or a latent (.pth/.npy part)")
    c, _, h, w = x.shape
    if c != cfg.in_channels:
        raise ValueError(f"{where}: the sample has {c} latent channels, the model takes {cfg.in_channels} "
                         "(model.in_channels)")
    p = cfg.patch_size
    if h % p or w % p or x.shape[1] % cfg.patch_t:
        raise ValueError(f"{where}: a {h}x{w} latent is not divisible by patch_size={p} "
                         f"(and {x.shape[1]} frames by patch_t={cfg.patch_t})")
    return x


# Text embeddings: zoo's t5.npy, DFM's .pickle (opted in) or what convert-pickle made of it.
TEXT_PARTS = ("text", "t5.npy", "pickle", "pickle.npy", "pickle.pth")


def noise_draw(cfg: DiTConfig, shape: torch.Size, generator: torch.Generator | None = None) -> dict[str, Any]:
    """A sample's noise level and noise: EDM's ``sigma`` (ln sigma ~ N(p_mean, p_std^2)), or the VP
    diffusion's ``timestep``, uniform over the schedule's."""
    if cfg.objective == "vp":
        level: dict[str, Any] = {"timestep": int(torch.randint(0, cfg.num_timesteps, (), generator=generator))}
    else:
        level = {"sigma": float(edm.sample_sigma(torch.randn((), generator=generator), cfg.p_mean, cfg.p_std))}
    return {**level, "noise": torch.randn(shape, generator=generator)}


class DiTTaskEncoder(TaskEncoder):
    # Crude datasets (DFM's: .pth latent, .pickle text, .json) arrive as dicts of decoded parts,
    # which encode_sample reads directly (a stateless cooker draws nothing: the pipeline runs it
    # without putting its caller's random streams back first).
    cookers = (Cooker(cook=stateless(lambda sample: sample)),)

    def __init__(self, cfg: DiTConfig, *, seq_length: int, packing: bool, multiple_of: int = 1) -> None:
        self.cfg, self.seq_length, self.packing = cfg, seq_length, packing
        self.multiple_of = multiple_of  # rows padded to a length the sequence splits divide

    @stateless(restore_seeds=True)
    def encode_sample(self, sample: Any) -> dict[str, Any]:
        cfg = self.cfg
        where = f"sample {getattr(sample, '__key__', None) or sample.get('__key__')}"
        latent = to_latent(sample, cfg, where)
        tokens, positions = patchify(latent, cfg.patch_t, cfg.patch_size, cfg.patch_size)
        if self.packing and len(tokens) > self.seq_length:
            raise SkipSample()  # longer than a whole row (train.seq_length)
        # Seeded per sample (run seed, key and epoch): sigma, noise and dropout are the sample's own.
        out: dict[str, Any] = {"latents": tokens, "positions": positions, **noise_draw(cfg, tokens.shape),
                               "grid": (latent.shape[1] // cfg.patch_t, latent.shape[2] // cfg.patch_size,
                                        latent.shape[3] // cfg.patch_size)}
        if cfg.num_classes:
            label = getattr(sample, "label", None) if not isinstance(sample, dict) else sample.get("cls")
            if label is None:
                raise ValueError(f"{where}: the model is class-conditional (model.num_classes={cfg.num_classes}) "
                                 "and the sample has no class (label / .cls)")
            label = int(label)
            if not 0 <= label < cfg.num_classes:
                raise ValueError(f"{where}: class {label} outside 0..{cfg.num_classes - 1}")
            out["label"] = cfg.num_classes if float(torch.rand(())) < cfg.class_dropout else label
        if cfg.text_dim:
            if isinstance(sample, dict):  # zoo's "t5.npy" part, DFM's ".pickle" (opted in), or a cooked "text"
                text = next((sample[k] for k in TEXT_PARTS if k in sample), None)
            else:
                text = getattr(sample, "text", None)
            if text is None:
                raise ValueError(f"{where}: the model is text-conditioned (model.text_dim={cfg.text_dim}) and the "
                                 "sample has no text embeddings")
            text = torch.as_tensor(text).float().reshape(-1, torch.as_tensor(text).shape[-1])
            if text.shape[-1] != cfg.text_dim:
                raise ValueError(f"{where}: text embeddings of width {text.shape[-1]}, the model takes "
                                 f"{cfg.text_dim} (model.text_dim)")
            out["text"] = torch.zeros_like(text) if float(torch.rand(())) < cfg.text_dropout else text
        return out

    def select_samples_to_pack(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """First-fit decreasing into rows of ``train.seq_length`` tokens."""
        bins: list[tuple[int, list[dict[str, Any]]]] = []
        for s in sorted(samples, key=lambda s: -len(s["latents"])):
            n = len(s["latents"])
            for i, (used, members) in enumerate(bins):
                if used + n <= self.seq_length:
                    bins[i] = (used + n, [*members, s])
                    break
            else:
                bins.append((n, [s]))
        return [members for _, members in bins]

    def pack_selected_samples(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return {"members": samples}

    def batch(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [it.get("members", [it]) for it in items]
        return collate(rows, self.cfg, multiple_of=self.multiple_of)


def collate(rows: list[list[dict[str, Any]]], cfg: DiTConfig, *, multiple_of: int = 1) -> dict[str, Any]:
    """Rows of samples -> the model's batch: tokens padded to the longest row, rounded up to
    ``multiple_of`` (context and sequence parallelism split rows evenly), with segment -1 and loss
    weight 0; per-sample values padded to the row with most samples.

    ``loss_weight`` (B, S) holds each token's share of the loss, fixed here, before a split:
    ``loss_average=sample`` gives every sample the same total (``T / N`` over its own tokens:
    the loss is the mean of the samples' means), ``token`` every real token 1."""
    b = len(rows)
    s = max(sum(len(m["latents"]) for m in row) for row in rows)
    s = -(-s // multiple_of) * multiple_of
    n = max(len(row) for row in rows)
    f = rows[0][0]["latents"].shape[-1]
    out: dict[str, Any] = {
        "latents": torch.zeros(b, s, f), "noise": torch.zeros(b, s, f),
        "positions": torch.zeros(b, s, 3, dtype=torch.long),
        "segment_ids": torch.full((b, s), -1, dtype=torch.long), "loss_weight": torch.zeros(b, s),
        "sigma": torch.ones(b, n), "sample_mask": torch.zeros(b, n),
    }
    if cfg.objective == "vp":  # (padding slots: timestep 0)
        out["timestep"] = torch.zeros(b, n, dtype=torch.long)
    if cfg.num_classes:
        out["labels"] = torch.full((b, n), cfg.num_classes, dtype=torch.long)
    if cfg.text_dim:
        length = max(sum(len(m["text"]) for m in row) for row in rows)
        out["context"] = torch.zeros(b, length, cfg.text_dim)
        out["context_segment_ids"] = torch.full((b, length), -2, dtype=torch.long)
    grids = []
    for i, row in enumerate(rows):
        at = ct = 0
        for j, m in enumerate(row):
            k = len(m["latents"])
            out["latents"][i, at:at + k] = m["latents"]
            out["noise"][i, at:at + k] = m["noise"]
            out["positions"][i, at:at + k] = m["positions"]
            out["segment_ids"][i, at:at + k] = j
            out["loss_weight"][i, at:at + k] = 1.0 if cfg.loss_average == "token" else 1.0 / k
            if cfg.objective == "vp":
                out["timestep"][i, j] = m["timestep"]
            else:
                out["sigma"][i, j] = m["sigma"]
            out["sample_mask"][i, j] = 1
            if cfg.num_classes:
                out["labels"][i, j] = m["label"]
            if cfg.text_dim:
                t = len(m["text"])
                out["context"][i, ct:ct + t] = m["text"]
                out["context_segment_ids"][i, ct:ct + t] = j
                ct += t
            at += k
            grids.append(m["grid"])
    if cfg.loss_average != "token":  # T / N per sample: the weights sum to the tokens, like the token mean's
        w = out["loss_weight"]
        w.mul_(w.gt(0).sum() / out["sample_mask"].sum())
    if n == 1 and s == min(len(r[0]["latents"]) for r in rows) and not cfg.text_dim:
        # One whole sample per row: plain attention, no mask to build. (With text the rows' captions
        # differ in length, and the segment ids keep queries off the padded text.)
        del out["segment_ids"]
    out["grids"] = torch.tensor(grids, dtype=torch.long)  # (samples, 3), row-major over rows
    return out


def _check_encoders(run: Any) -> None:
    """A dataset of VAE latents trains a model that decodes through that VAE (model.vae), and
    pixels one that decodes through none: a mismatch would train on one space and draw in another."""
    from zoo.data.energon.media import read_encoders

    if run.data.path is None or "://" in str(run.data.path) or not Path(run.data.path).is_dir():
        return
    vae = read_encoders(run.data.path).get("vae")
    mine = str(Path(run.model.vae).resolve()) if run.model.vae else ""
    if vae is not None and vae["path"] != mine:
        raise ConfigError(f"{run.data.path}: its latents come from the VAE {vae['path']}; set model.vae={vae['path']} "
                          f"(now {run.model.vae or 'unset'}), model.in_channels={vae['latent_channels']}")
    if vae is None and mine:
        raise ConfigError(f"model.vae={run.model.vae}: the dataset {run.data.path} holds no latents of it (prepare it "
                          "with zoo prepare images|video --vae DIR)")


def _check_classes(run: Any) -> None:
    """A class-conditional DiT trains on samples that carry a class: a typed dataset whose sample
    type has no ``label`` (captions, questions) is refused here, not at its first sample."""
    from zoo.data.energon.dataset import META, read_dataset_config
    from zoo.data.energon.storage import Storage

    if not run.model.num_classes or run.data.path is None or not (Path(run.data.path) / META).is_dir():
        return
    kind = read_dataset_config(Storage(run.data.path)).sample_class
    if kind is not None and "label" not in getattr(kind, "__dataclass_fields__", {}):
        raise ConfigError(f"data.path={run.data.path}: its samples are {kind.__name__}, without a class; the "
                          f"class-conditional DiT (model.num_classes={run.model.num_classes}) needs one per sample: "
                          "prepare the digits with `zoo prepare images DIR --dataset digits --sample-type "
                          "ImageClassificationSample` (a dataset of your own: field map label=cls)")


def task_encoder(run: Any) -> DiTTaskEncoder:
    _check_encoders(run)
    _check_classes(run)
    p = run.parallel
    # Context parallelism cuts a row into 2 cp chunks, sequence parallelism each into tp shards.
    multiple = 2 * p.cp if p.cp > 1 else 1
    multiple *= p.tp if p.sequence_parallel and p.tp > 1 else 1
    return DiTTaskEncoder(run.model, seq_length=run.train.seq_length, packing=bool(run.data.packing_buffer_size),
                          multiple_of=multiple)


# ------------------------------------------------------------------------------ built-in data


def prepare_digits(out: Path) -> None:
    """scikit-learn's 1,797 digits as an Energon dataset of ImageClassificationSample (png + cls)."""
    from zoo.data.energon.prepare import digit_samples, prepare_webdataset, write_shards

    write_shards(out, ((k, {"png": p["png"], "cls": p["cls"], "txt": p["txt"]}) for k, p in digit_samples()),
                 shard_size=100)
    prepare_webdataset(out, split=(16, 1, 1), sample_type="ImageClassificationSample",
                       field_map={"image": "png", "label": "cls"}, force_overwrite=True)


def prepare_moving_digits(out: Path, *, n: int = 2000, frames: int = 8, size: int = 16) -> None:
    """``n`` moving-digit clips as a crude Energon dataset (`zoo.data.energon.media.prepare_video`:
    ``npy`` (1, frames, size, size) in [-1, 1], ``txt`` caption, ``t5.npy`` its embeddings by the
    default text encoder, ``json``); 20 shards: 18 train, 1 val, 1 test."""
    from zoo.data.energon.media import prepare_video

    prepare_video(out, count=n, frames=frames, size=size, force_overwrite=True)


def build_digits(run: Any, **kw: Any) -> Any:
    from zoo.data.energon.training import build_cached

    return build_cached(run, "energon-digits-v1", prepare_digits, **kw)


def build_moving(run: Any, **kw: Any) -> Any:
    from zoo.data.energon.training import build_cached

    return build_cached(run, "energon-moving-digits-v1", prepare_moving_digits, **kw)


__all__ = ["DiTTaskEncoder", "build_digits", "build_moving", "collate", "prepare_digits", "prepare_moving_digits",
           "task_encoder", "to_latent"]
