"""A loss-curve PNG with no plotting library: numpy raster, zlib, and the PNG chunk format.

Training loss is drawn as a dark line, validation loss as red dots, on axes scaled to the data;
the file is small and needs nothing beyond what zoo already depends on.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _png(pixels: np.ndarray) -> bytes:
    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int]) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.linspace(x0, x1, n).round().astype(int)
    ys = np.linspace(y0, y1, n).round().astype(int)
    ok = (xs >= 0) & (xs < img.shape[1]) & (ys >= 0) & (ys < img.shape[0])
    img[ys[ok], xs[ok]] = color
    img[np.clip(ys[ok] + 1, 0, img.shape[0] - 1), xs[ok]] = color  # 2 px thick


def loss_curve(path: Path, steps: Sequence[float], losses: Sequence[float],
               val: Sequence[tuple[float, float]] = (), *, width: int = 640, height: int = 400) -> None:
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 50, width - 20, 20, height - 40
    ys_all = [v for v in losses if np.isfinite(v)] + [v for _, v in val if np.isfinite(v)]
    if not steps or not ys_all:
        path.write_bytes(_png(img))
        return
    x_lo, x_hi = min(steps), max(max(steps), min(steps) + 1)
    y_lo, y_hi = min(ys_all), max(ys_all)
    if y_hi - y_lo < 1e-9:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (right - left), bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top))

    grey = (200, 200, 200)
    for i in range(5):  # horizontal grid lines at quarters of the loss range
        y = top + i * (bottom - top) / 4
        _line(img, left, y, right, y, grey)
    _line(img, left, bottom, right, bottom, (0, 0, 0))
    _line(img, left, top, left, bottom, (0, 0, 0))
    pts = [px(x, y) for x, y in zip(steps, losses) if np.isfinite(y)]
    for (a, b), (c, d) in zip(pts, pts[1:]):
        _line(img, a, b, c, d, (30, 60, 160))
    for x, y in val:
        cx, cy = px(x, y)
        img[int(max(cy - 3, 0)):int(cy + 4), int(max(cx - 3, 0)):int(cx + 4)] = (200, 30, 30)
    path.write_bytes(_png(img))
