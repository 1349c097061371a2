"""Images and videos for families that make them (DiT samples, VLM inputs, validation previews),
written by maintained libraries rather than by hand: Pillow for PNG and GIF, PyAV (FFmpeg's
libraries, shipped inside its wheels, so nothing is fetched at run time) for MP4/H.264. Both are
optional dependencies of zoo-core (``pip install zoo-core[media]``); a missing one is a clear
error naming the package, never a crash at import.

Pixels are ``uint8`` arrays, ``(H, W, 3)`` for an image and ``(T, H, W, 3)`` for a video; `to_uint8`
and `grid` turn model outputs (float tensors in ``[-1, 1]`` or ``[0, 1]``, ``(N, C, H, W)``) into
them. Every file is written to a temporary name beside its target and renamed into place.

An `Artifact` is what a family's ``preview`` returns: an image, a video or a text, written by
`save` with the right suffix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from zoo.errors import ZooError


class MediaError(ZooError):
    """A media library is missing, or the pixels have the wrong shape."""


@dataclass(frozen=True)
class Artifact:
    """A validation preview: ``kind`` ``image`` (``data``: ``(H, W, 3)`` uint8), ``video``
    (``(T, H, W, 3)`` uint8, ``fps``) or ``text`` (a string)."""

    kind: Literal["image", "video", "text"]
    data: Any
    fps: float = 8.0

    def __post_init__(self) -> None:
        if self.kind == "text":
            if not isinstance(self.data, str):
                raise MediaError(f"a text artifact holds a str, got {type(self.data).__name__}")
            return
        if self.kind not in ("image", "video"):
            raise MediaError(f"artifact kind {self.kind!r}: one of image, video, text")
        arr = np.asarray(self.data)
        want = 3 if self.kind == "image" else 4
        if arr.dtype != np.uint8 or arr.ndim != want or arr.shape[-1] != 3:
            raise MediaError(f"an {self.kind} artifact holds uint8 pixels of shape "
                             f"{'(H, W, 3)' if want == 3 else '(T, H, W, 3)'}, got {arr.dtype} {arr.shape}")


def to_uint8(x: Any, *, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """A float tensor or array in ``value_range`` -> uint8, channels last: ``(C, H, W)`` or
    ``(N, C, H, W)`` become ``(H, W, 3)`` / ``(N, H, W, 3)`` (one channel is repeated)."""
    arr = x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float32)
    lo, hi = value_range
    arr = np.clip((arr - lo) / (hi - lo), 0.0, 1.0)
    arr = np.moveaxis(arr, -3, -1)  # channels last
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    if arr.shape[-1] != 3:
        raise MediaError(f"expected 1 or 3 channels, got {arr.shape[-1]}")
    return (arr * 255.0 + 0.5).astype(np.uint8)


def grid(images: Any, *, nrow: int | None = None, pad: int = 2, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """``(N, C, H, W)`` images (or ``(N, H, W, 3)`` uint8) tiled into one ``(H', W', 3)`` image,
    ``nrow`` per row (default: as square as possible), separated by ``pad`` white pixels."""
    arr = np.asarray(images) if isinstance(images, np.ndarray) and images.dtype == np.uint8 else to_uint8(images, value_range=value_range)
    if arr.ndim != 4:
        raise MediaError(f"grid takes a batch of images (N, C, H, W), got shape {arr.shape}")
    n, h, w, _ = arr.shape
    cols = nrow or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    out = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        out[y:y + h, x:x + w] = arr[i]
    return out


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise MediaError("writing PNG or GIF needs Pillow: pip install pillow (or zoo-core[media])") from None
    return Image


def _replace_into(path: Path, write: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # the suffix tells the libraries the format
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_png(path: str | os.PathLike[str], pixels: np.ndarray) -> Path:
    Image = _pil()
    pixels = np.ascontiguousarray(pixels)
    return _replace_into(Path(path), lambda tmp: Image.fromarray(pixels).save(tmp, format="PNG"))


def write_gif(path: str | os.PathLike[str], frames: Sequence[np.ndarray] | np.ndarray, *, fps: float = 8.0) -> Path:
    """An animated GIF that loops forever (GIF's palette: 256 colours per frame)."""
    Image = _pil()
    images = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    if not images:
        raise MediaError("a GIF needs at least one frame")

    def write(tmp: Path) -> None:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)

    return _replace_into(Path(path), write)


def write_mp4(path: str | os.PathLike[str], frames: Sequence[np.ndarray] | np.ndarray, *, fps: float = 24.0,
              codec: str = "libx264") -> Path:
    """An H.264 MP4 (yuv420p, which every player reads: odd sizes are padded by one pixel)."""
    try:
        import av
    except ImportError:
        raise MediaError("writing MP4 needs PyAV: pip install av (or zoo-core[media])") from None
    from fractions import Fraction

    arr = np.asarray(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise MediaError(f"a video is uint8 frames of shape (T, H, W, 3), got {arr.dtype} {arr.shape}")
    t, h, w, _ = arr.shape
    arr = np.pad(arr, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")

    def write(tmp: Path) -> None:
        with av.open(str(tmp), mode="w") as container:
            stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
            stream.width, stream.height, stream.pix_fmt = arr.shape[2], arr.shape[1], "yuv420p"
            for frame in arr:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():  # flush the encoder
                container.mux(packet)

    return _replace_into(Path(path), write)


def save(artifact: Artifact, stem: str | os.PathLike[str]) -> Path:
    """Write ``artifact`` as ``stem.png`` (image), ``stem.gif`` (video: every browser and
    TensorBoard-free viewer animates it) or ``stem.txt``; returns the path."""
    stem = Path(stem)
    if artifact.kind == "image":
        return write_png(stem.with_suffix(".png"), artifact.data)
    if artifact.kind == "video":
        return write_gif(stem.with_suffix(".gif"), artifact.data, fps=artifact.fps)
    from zoo.io import atomic_write_text

    path = stem.with_suffix(".txt")
    atomic_write_text(path, artifact.data if artifact.data.endswith("\n") else artifact.data + "\n")
    return path


__all__ = ["Artifact", "MediaError", "grid", "save", "to_uint8", "write_gif", "write_mp4", "write_png"]
