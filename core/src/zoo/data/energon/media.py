"""`zoo prepare images|video`: captioned images (a folder, or scikit-learn's digits) and the
built-in moving-digit clips as prepared Energon datasets, optionally with each sample's VAE
latents (``latent.npy``, a local diffusers AutoencoderKL) and caption embeddings (``t5.npy``, a
local T5 encoder) stored beside it; ``.nv-meta/encoders.json`` records the encoders."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zoo.data.energon import samples as S
from zoo.data.energon.dataset import META, DatasetError
from zoo.data.energon.prepare import (
    PrepareResult,
    digit_samples,
    folder_samples,
    prepare_webdataset,
    write_shards,
)
from zoo.io import atomic_write_text

ENCODERS = "encoders.json"  # in .nv-meta/: what made the latent.npy / t5.npy parts


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def _encoders(vae: str | None, text_encoder: str | None, *, default_text: bool = False) -> tuple[Any, Any]:
    """Load the encoders (errors name the directory at fault)."""
    from zoo.data.encoders import ImageVAE, TextEncoder

    try:
        v = ImageVAE(vae) if vae else None
        t = TextEncoder(text_encoder) if (text_encoder or default_text) else None
    except (OSError, ValueError) as e:
        raise DatasetError(str(e).splitlines()[0]) from None
    return v, t


def encode_samples(samples: Iterable[tuple[str, dict[str, Any]]], *, vae: Any = None, text_encoder: Any = None,
                   batch: int = 32) -> Iterable[tuple[str, dict[str, bytes]]]:
    """Adds ``latent.npy`` (the VAE's latents of the ``pixels`` entry, ``(C, H, W)`` in [-1, 1], or
    of a clip's frames ``(C, T, H, W)``) and ``t5.npy`` (the caption's embeddings) to each sample,
    ``batch`` samples at a time; the ``pixels`` entry itself is not written."""
    import torch

    def flush(chunk: list[tuple[str, dict[str, Any]]]) -> Iterable[tuple[str, dict[str, bytes]]]:
        if vae is not None:
            for key, parts in chunk:
                x = torch.from_numpy(parts["pixels"]).float()
                frames = x.transpose(0, 1) if x.dim() == 4 else x[None]  # (T, C, H, W)
                try:
                    vae.check_size(frames.shape[-2], frames.shape[-1], key)
                except ValueError as e:
                    raise DatasetError(str(e)) from None
                lat = torch.cat([vae.encode(frames[i:i + batch]) for i in range(0, len(frames), batch)])
                parts["latent.npy"] = _npy((lat.transpose(0, 1) if x.dim() == 4 else lat[0]).numpy().astype(np.float32))
        if text_encoder is not None:
            embs = text_encoder([p["txt"].decode("utf-8") for _, p in chunk])
            for (_, parts), emb in zip(chunk, embs):
                parts["t5.npy"] = _npy(emb)
        for key, parts in chunk:
            parts.pop("pixels", None)
            yield key, parts

    chunk: list[tuple[str, dict[str, Any]]] = []
    for item in samples:
        chunk.append(item)
        if len(chunk) == batch:
            yield from flush(chunk)
            chunk = []
    if chunk:
        yield from flush(chunk)


def _write_encoders(out: Path, vae: Any, text_encoder: Any) -> None:
    doc: dict[str, Any] = {}
    if vae is not None:
        doc["vae"] = {"path": str(Path(vae.path).resolve()), "factor": vae.factor, "latent_channels": vae.channels,
                      "scaling_factor": vae.scaling_factor}
    if text_encoder is not None:
        doc["text_encoder"] = {"name": text_encoder.name, "dim": text_encoder.dim}
    atomic_write_text(out / META / ENCODERS, json.dumps(doc, indent=2))


def read_encoders(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A prepared dataset's ``.nv-meta/encoders.json`` (empty when its parts are not encoded)."""
    p = Path(path) / META / ENCODERS
    return json.loads(p.read_text()) if p.is_file() else {}


def _with_pixels(samples: Iterable[tuple[str, dict[str, bytes]]]) -> Iterable[tuple[str, dict[str, Any]]]:
    """Each image sample with its pixels in [-1, 1] ``(C, H, W)`` beside its bytes (for the VAE)."""
    for key, parts in samples:
        ext = next(e for e in S.IMAGE_EXTENSIONS if e in parts)
        img = S.decode_part(ext, parts[ext], where=key).numpy()
        yield key, {**parts, "pixels": img * 2 - 1}


def prepare_images(out: str | os.PathLike[str], *, dataset: str | None = None, folder: str | None = None,
                   captions: str | None = None, shard_size: int = 100, split: Sequence[float] = (8, 1, 1),
                   size: int = 8, repeat: int = 1, vae: str | None = None, text_encoder: str | None = None,
                   force_overwrite: bool = False, progress: bool = False,
                   sample_type: str = "CaptioningSample") -> PrepareResult:
    """A captioned image dataset, sharded and prepared: the built-in ``digits`` (sample type
    CaptioningSample, field map image=png, caption=txt; the class in ``cls``, a VQA pair in
    ``json``; with ``sample_type="VQASample"`` typed as that pair: context=json[question],
    answers=json[answers]; with "ImageClassificationSample" image=png, label=cls, what a
    class-conditional DiT trains on) or a folder of images with captions. With ``vae`` and/or ``text_encoder`` (local
    directories) each sample also gets ``latent.npy`` / ``t5.npy`` and the dataset is crude (a
    DiT's task encoder reads the parts); ``.nv-meta/encoders.json`` records the encoders."""
    out = Path(out)
    if (out / META).exists() and not force_overwrite:
        raise DatasetError(f"{out}: already holds a prepared dataset; pass --force-overwrite to replace it")
    if (dataset is None) == (folder is None):
        raise DatasetError("give either --dataset digits or --folder DIR")
    if dataset is not None and dataset != "digits":
        raise DatasetError(f"--dataset {dataset!r}: the built-in image dataset is 'digits'")
    if sample_type not in ("CaptioningSample", "VQASample", "ImageClassificationSample"):
        raise DatasetError(f"--sample-type {sample_type!r}: CaptioningSample, VQASample or ImageClassificationSample")
    if sample_type != "CaptioningSample" and (dataset is None or vae or text_encoder):
        raise DatasetError(f"--sample-type {sample_type}: the built-in digits carry a class, question and answer; a "
                           "folder of captioned images does not (and encoded datasets are crude, their class in cls)")
    enc_vae, enc_text = _encoders(vae, text_encoder)
    samples: Iterable[Any] = digit_samples(size=size, repeat=repeat) if dataset else folder_samples(Path(folder), Path(captions) if captions else None)  # type: ignore[arg-type]
    if enc_vae is not None or enc_text is not None:
        samples = encode_samples(_with_pixels(samples) if enc_vae else samples, vae=enc_vae, text_encoder=enc_text)
    _write_then_prepare(out, samples, shard_size)
    if enc_vae is not None or enc_text is not None:
        res = prepare_webdataset(out, split=split, crude=True, force_overwrite=True, progress=progress)
        _write_encoders(out, enc_vae, enc_text)
        return res
    if sample_type == "VQASample":
        return prepare_webdataset(out, split=split, sample_type="VQASample", force_overwrite=True, progress=progress,
                                  field_map={"image": "png", "context": "json[question]", "answers": "json[answers]"})
    if sample_type == "ImageClassificationSample":
        return prepare_webdataset(out, split=split, sample_type=sample_type, force_overwrite=True, progress=progress,
                                  field_map={"image": "png", "label": "cls"})
    fmap = {"image": "png", "caption": "txt"} if dataset else {"image": ",".join(
        e for e in ("jpg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm")), "caption": "txt"}
    return prepare_webdataset(out, split=split, sample_type="CaptioningSample", field_map=fmap,
                              force_overwrite=True, progress=progress)


def _write_then_prepare(out: Path, samples: Iterable[tuple[str, dict[str, bytes]]], shard_size: int) -> None:
    """Shards written; on an error (an image the VAE cannot take) none of this run's are left."""
    fresh = not out.exists()
    try:
        write_shards(out, samples, shard_size=shard_size)
    except BaseException:
        import shutil

        if fresh:  # remove what this run wrote
            shutil.rmtree(out, ignore_errors=True)
        raise


def prepare_video(out: str | os.PathLike[str], *, dataset: str = "moving-digits", count: int = 2000, frames: int = 8,
                  size: int = 16, shard_size: int | None = None, split: Sequence[float] = (18, 1, 1),
                  vae: str | None = None, text_encoder: str | None = None, force_overwrite: bool = False,
                  progress: bool = False) -> PrepareResult:
    """The clips of a built-in video dataset (one a plugin declares with `DatasetSpec.clips`, such as
    DiT's ``moving-digits``) as a crude dataset: ``npy`` (1, T, H, W) pixels in [-1, 1], ``txt``
    caption, ``t5.npy`` its embeddings (``text_encoder``, or the default fixed-seed tiny T5), ``json``
    (what the source says a clip shows), with ``vae`` also ``latent.npy`` (C, T, H/f, W/f, each frame
    encoded)."""
    out = Path(out)
    if (out / META).exists() and not force_overwrite:
        raise DatasetError(f"{out}: already holds a prepared dataset; pass --force-overwrite to replace it")
    source = video_source(dataset)
    try:  # the source checks its options before anything is written
        first = next(iter(source(1, frames=frames, size=size)))
    except ValueError as e:
        raise DatasetError(str(e)) from None
    if first[0].ndim != 3:
        raise DatasetError(f"dataset {dataset!r}: its clips source gave pixels of shape {tuple(first[0].shape)}, "
                           "not (frames, height, width)")
    enc_vae, enc_text = _encoders(vae, text_encoder, default_text=True)

    def samples() -> Iterable[tuple[str, dict[str, Any]]]:
        for k, (clip, text, info) in enumerate(source(count, frames=frames, size=size)):
            pixels = (np.asarray(clip, dtype=np.float32) * 2 - 1)[None]  # (1, T, H, W)
            yield f"{k:06d}", {"npy": _npy(pixels), "txt": text.encode(), "pixels": pixels,
                               "json": json.dumps({**info, "text_encoder": enc_text.name}).encode()}

    _write_then_prepare(out, encode_samples(samples(), vae=enc_vae, text_encoder=enc_text),
                        shard_size or max(1, count // 20))
    res = prepare_webdataset(out, split=split, crude=True, force_overwrite=True, progress=progress)
    _write_encoders(out, enc_vae, enc_text)
    return res


def video_sources() -> dict[str, Any]:
    """The installed datasets that declare a clip source, by name, with the plugin that owns each."""
    from zoo.registry import get_registry

    return {name: (spec, info) for name, (spec, info) in sorted(get_registry().datasets.items())
            if spec.clips is not None}


def video_source(dataset: str) -> Any:
    """The clip source of the built-in video dataset ``dataset``; an unknown name lists the installed ones."""
    from zoo.errors import suggest
    from zoo.family import resolve

    known = video_sources()
    if dataset not in known:
        have = ", ".join(known) or "none: the plugin that ships one (zoo-dit: moving-digits) is not installed"
        raise DatasetError(f"--dataset {dataset!r}: not a built-in video dataset{suggest(dataset, known)} "
                           f"(installed: {have})")
    spec, info = known[dataset]
    return resolve(spec.clips, owner=str(info))


__all__ = ["ENCODERS", "encode_samples", "prepare_images", "prepare_video", "read_encoders", "video_source",
           "video_sources"]
