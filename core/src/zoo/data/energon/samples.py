"""Energon's sample types and part decoding.

The sample classes carry Energon's names and fields (``CaptioningSample(image, caption)``, ...)
plus its base fields (``__key__``, ``__restore_key__``, ``__subflavors__``, ``__sources__``), so a
task encoder written for megatron-energon reads them unchanged. Parts decode by their last
extension as Energon's default decoder does (images as float RGB ``C x H x W`` in [0, 1]);
``.pickle``/``.pyd`` parts run arbitrary code when loaded and are refused unless the user opts in.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a part is decoded: `zoo --help` and `zoo prepare` stay light
    import torch

import numpy as np

from zoo.errors import ZooError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "bmp", "tif", "tiff")
VIDEO_EXTENSIONS = ("mp4", "avi", "mov", "webm", "mkv")
PICKLE_EXTENSIONS = ("pickle", "pyd")


class DecodeError(ZooError, ValueError):
    """A part that cannot be decoded; the message names the shard, key and part."""


@dataclass(kw_only=True)
class Sample:
    __key__: str = ""
    __restore_key__: tuple[Any, ...] = ()
    __subflavors__: dict[str, Any] | None = None
    __sources__: tuple[Any, ...] | None = None

    @classmethod
    def derive_from(cls, base: Sample | dict[str, Any], **fields: Any) -> Any:
        """A new sample of ``cls`` keeping ``base``'s key, restore key, subflavors and sources."""
        return cls(**basic_sample_keys(base), **fields)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def basic_sample_keys(sample: Sample | dict[str, Any]) -> dict[str, Any]:
    """The base fields a cooked or encoded sample must carry to stay restorable."""
    get = sample.get if isinstance(sample, dict) else lambda k, d=None: getattr(sample, k, d)
    return {k: get(k) for k in ("__key__", "__restore_key__", "__subflavors__", "__sources__")}


@dataclass(kw_only=True)
class CaptioningSample(Sample):
    image: torch.Tensor
    caption: str


@dataclass(kw_only=True)
class ImageSample(Sample):
    image: torch.Tensor


@dataclass(kw_only=True)
class ImageClassificationSample(Sample):
    image: torch.Tensor
    label: int | None = None
    label_name: str | None = None


@dataclass(kw_only=True)
class TextSample(Sample):
    text: str


@dataclass(kw_only=True)
class VQASample(Sample):
    image: torch.Tensor
    context: str
    answers: list[str] | None = None
    answer_weights: torch.Tensor | None = None


@dataclass(kw_only=True)
class MultiChoiceVQASample(Sample):
    image: torch.Tensor
    context: str
    choices: list[str] | None = None
    correct_choice_idx: int = 0


@dataclass(kw_only=True)
class InterleavedSample(Sample):
    sequence: list[Any] = field(default_factory=list)


@dataclass(kw_only=True)
class VidQASample(Sample):
    video: torch.Tensor
    context: str
    answers: list[str] | None = None
    answer_weights: torch.Tensor | None = None


SAMPLE_TYPES: dict[str, type[Sample]] = {c.__name__: c for c in (
    CaptioningSample, ImageSample, ImageClassificationSample, TextSample, VQASample, MultiChoiceVQASample,
    InterleavedSample, VidQASample)}


def sample_type(module: str, name: str, *, where: str) -> type[Sample]:
    """The class a dataset.yaml's ``sample_type`` names. Energon's names (``megatron.energon``) map
    to ours; the deprecated ``XxxWebdataset`` factory names to their sample types."""
    base = name[:-len("Webdataset")] + "Sample" if name.endswith("Webdataset") else name
    if module in ("megatron.energon", "zoo.data.energon") and base in SAMPLE_TYPES:
        return SAMPLE_TYPES[base]
    from zoo.errors import suggest

    raise DecodeError(f"{where}: unknown sample type {module}.{name}; known: {', '.join(sorted(SAMPLE_TYPES))} "
                      f"(or __class__: CrudeWebdataset for plain dicts){suggest(base, SAMPLE_TYPES)}")


# Pillow's format names by extension: opening with the format named skips probing every plugin
# (half of the cost of a small image); a part whose extension lies is retried with probing.
_PIL_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "ppm": "PPM", "pgm": "PPM", "pbm": "PPM", "pnm": "PPM",
                "webp": "WEBP", "bmp": "BMP", "tif": "TIFF", "tiff": "TIFF"}
_255 = np.float32(255.0)


def _image(data: bytes, ext: str = "") -> torch.Tensor:
    """Float RGB ``C x H x W`` in [0, 1]. Converted in numpy: for small images torch's per-op
    overhead costs more than the decode; the result is bit-identical to ``.float().div_(255)``."""
    import torch
    from PIL import Image, UnidentifiedImageError

    fmt = _PIL_FORMATS.get(ext)
    try:
        img = Image.open(io.BytesIO(data), formats=(fmt,) if fmt else None)
    except UnidentifiedImageError:
        if fmt is None:
            raise
        img = Image.open(io.BytesIO(data))
    with img:
        img.load()
        if img.mode not in ("L", "RGB"):
            img = img.convert("RGB")
        w, h = img.size
        channels = 1 if img.mode == "L" else 3
        pixels = np.frombuffer(img.tobytes(), dtype=np.uint8).reshape(h, w, channels).transpose(2, 0, 1)
    out = np.empty((3, h, w), dtype=np.float32)
    np.divide(pixels, _255, out=out)  # a grey image broadcasts over the three channels
    return torch.from_numpy(out)


def _video(data: bytes) -> torch.Tensor:
    """Every frame as float RGB ``T x C x H x W`` in [0, 1] (PyAV; its wheels carry FFmpeg)."""
    import torch

    try:
        import av
    except ImportError as e:
        raise DecodeError("video parts need PyAV: pip install av") from e
    with av.open(io.BytesIO(data)) as container:
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    if not frames:
        raise DecodeError("the video holds no decodable frame")
    return torch.stack(frames).permute(0, 3, 1, 2).float().div_(255.0)


def decode_part(part: str, data: bytes, *, allow_pickle: bool = False, where: str = "") -> Any:
    """One part's value by its last extension; unknown extensions stay bytes."""
    ext = part.rsplit(".", 1)[-1].lower()
    try:
        if ext in ("txt", "text"):
            return data.decode("utf-8")
        if ext == "json":
            return json.loads(data)
        if ext in ("cls", "cls2", "id", "index", "inx"):
            return int(data.decode("ascii").strip())
        if ext == "npy":
            return np.load(io.BytesIO(data), allow_pickle=False)
        if ext in ("pth", "pt"):
            import torch

            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if ext == "safetensors":
            from safetensors.torch import load

            return load(data)
        if ext in IMAGE_EXTENSIONS:
            return _image(data, ext)
        if ext in VIDEO_EXTENSIONS:
            return _video(data)
        if ext in PICKLE_EXTENSIONS:
            if not allow_pickle:
                raise DecodeError(
                    f"{where}: a .{ext} part runs arbitrary code when loaded, so it is refused. If you trust this "
                    f"dataset set data.allow_pickle=true (allow_pickle=True in Python); better, convert it once "
                    f"with `zoo prepare convert-pickle DATASET` (tensors and arrays become .npy parts, no code runs)")
            import pickle

            return pickle.loads(data)
    except DecodeError:
        raise
    except Exception as e:
        raise DecodeError(f"{where}: cannot decode part {part!r} ({len(data)} bytes): {type(e).__name__}: {e}") from e
    return data


def field_value(parts: dict[str, bytes], spec: str, *, allow_pickle: bool, where: str, cache: dict[str, Any]) -> Any:
    """A dataset.yaml field_map entry: ``"jpg"``, alternatives ``"jpg,png"`` (the first present),
    ``"json[key][0]"`` (into a decoded part)."""
    for alt in (a.strip() for a in spec.split(",")):
        part, _, access = alt.partition("[")
        if part not in parts:
            continue
        if part not in cache:
            cache[part] = decode_part(part, parts[part], allow_pickle=allow_pickle, where=f"{where}/{part}")
        value = cache[part]
        if access:
            for item in ("[" + access).strip("[]").split("]["):
                try:
                    value = value[int(item)] if isinstance(value, list) else value[item]
                except (KeyError, IndexError, ValueError, TypeError):
                    raise DecodeError(f"{where}: field_map {spec!r}: part {part!r} has no [{item}]") from None
        return value
    raise DecodeError(f"{where}: field_map {spec!r} (dataset.yaml) names no part of this sample "
                      f"(it has {', '.join(sorted(parts))})")


__all__ = ["SAMPLE_TYPES", "CaptioningSample", "DecodeError", "ImageClassificationSample", "ImageSample",
           "InterleavedSample", "MultiChoiceVQASample", "Sample", "TextSample", "VQASample", "VidQASample",
           "basic_sample_keys", "decode_part", "field_value", "sample_type"]
