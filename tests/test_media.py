"""`zoo.media`: image grids, PNG, GIF and MP4 written through Pillow and PyAV, read back by the
same libraries' decoders; the loss curve drawn by matplotlib, and its absence handled."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from zoo import media


def _frames(t: int = 6, h: int = 30, w: int = 42) -> np.ndarray:
    """Smooth coloured gradients that move: what a lossy codec keeps well."""
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for i in range(t):
        r = (x * 255 / w + 20 * i) % 256
        g = y * 255 / h
        b = np.full_like(r, 40 * i % 256)
        out.append(np.stack([r, g, b], -1).astype(np.uint8))
    return np.stack(out)


def test_grid_tiles_images_in_order_with_gaps():
    imgs = torch.stack([torch.full((1, 2, 3), v) for v in (-1.0, 0.0, 1.0)])  # (N, C, H, W) in [-1, 1]
    out = media.grid(imgs, nrow=2, pad=1)
    assert out.shape == (2 * 3 + 1, 2 * 4 + 1, 3) and out.dtype == np.uint8
    assert (out[1:3, 1:4] == 0).all() and (out[1:3, 5:8] == 128).all() and (out[4:6, 1:4] == 255).all()
    assert (out[0] == 255).all() and (out[4:6, 5:8] == 255).all()  # gaps and the empty cell are white


def test_png_and_gif_round_trip(tmp_path):
    from PIL import Image, ImageSequence

    frames = _frames()
    png = media.write_png(tmp_path / "a.png", frames[0])
    with Image.open(png) as img:
        assert img.format == "PNG" and np.array_equal(np.asarray(img.convert("RGB")), frames[0])
    gif = media.write_gif(tmp_path / "a.gif", frames, fps=10)
    with Image.open(gif) as img:
        decoded = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(img)]
        assert img.format == "GIF" and img.info["duration"] == 100 and img.info["loop"] == 0
    assert len(decoded) == len(frames)
    assert max(np.abs(d.astype(int) - f).mean() for d, f in zip(decoded, frames)) < 6  # a 256-colour palette


def test_mp4_round_trip(tmp_path):
    import av

    frames = _frames(h=31)  # an odd height: padded by one row for yuv420p
    path = media.write_mp4(tmp_path / "v.mp4", frames, fps=12)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and float(stream.average_rate) == 12
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == len(frames) and decoded[0].shape == (32, 42, 3)
    assert np.mean([np.abs(d[:31].astype(int) - f).mean() for d, f in zip(decoded, frames)]) < 8
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_artifacts_are_checked_and_saved_with_their_suffix(tmp_path):
    assert media.save(media.Artifact("image", _frames()[0]), tmp_path / "s").name == "s.png"
    assert media.save(media.Artifact("video", _frames(), fps=4), tmp_path / "s").name == "s.gif"
    assert media.save(media.Artifact("text", "hello"), tmp_path / "s").read_text() == "hello\n"
    with pytest.raises(media.MediaError, match=r"uint8 pixels of shape \(H, W, 3\)"):
        media.Artifact("image", np.zeros((4, 4), np.float32))


def test_loss_curve_is_drawn_with_labels(tmp_path):
    from PIL import Image

    from zoo.training.plot import loss_curve

    steps = list(range(1, 51))
    assert loss_curve(tmp_path / "loss.png", steps, [5.0 / s**0.3 for s in steps], [(25, 2.5), (50, 2.2)],
                      title="llama (tiny)", log_scale=True) is None
    with Image.open(tmp_path / "loss.png") as img:
        assert img.format == "PNG" and img.size == (770, 462)
        pixels = np.asarray(img.convert("RGB")).astype(int)
    red = (pixels[..., 0] > 150) & (pixels[..., 1] < 90) & (pixels[..., 2] < 90)
    blue = (pixels[..., 2] > 120) & (pixels[..., 0] < 80)
    assert red.sum() > 20 and blue.sum() > 200  # validation markers and the training line were drawn


def test_without_matplotlib_one_line_says_no_plot_was_drawn(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None\n"
            "from pathlib import Path\nfrom zoo.training.plot import loss_curve\n"
            f"print(loss_curve(Path({str(tmp_path / 'loss.png')!r}), [1, 2], [3.0, 2.0]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "no loss plot drawn (loss.png): matplotlib is not installed (pip install matplotlib)"
    assert not (tmp_path / "loss.png").exists()
