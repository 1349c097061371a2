"""How well a text-to-video DiT trained on the built-in moving digits follows its captions: clips
generated for captions "a {digit} moving {direction}" (every digit, random directions), judged by
`zoo_dit.moving_digits.judge` (a classifier of the real digits; the centre of mass's path).
Used by the quality test and `benchmarks/dit_video_quality.py`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zoo_dit.diffusion import decoded, sample, to_pixels


def moving_digits_quality(model: Any, cfg: Any, *, n: int = 80, guidance: float = 4.0, num_steps: int = 18,
                          seed: int = 0) -> dict[str, Any]:
    """``{"digit", "direction"}`` fractions over ``n`` generated clips, and ``"clips"`` (n, T, H, W)
    in [0, 1] with their ``"captions"`` in the same order."""
    from zoo.data.encoders import TextEncoder
    from zoo_dit.moving_digits import DIRECTIONS, caption, judge

    rng = np.random.default_rng(seed)
    digits = [i % 10 for i in range(n)]
    directions = [DIRECTIONS[int(rng.integers(len(DIRECTIONS)))] for _ in range(n)]
    captions = [caption(d, r) for d, r in zip(digits, directions, strict=True)]
    embeddings = TextEncoder()(captions)  # the encoder the built-in dataset was embedded with
    clips: list[np.ndarray | None] = [None] * n
    # Captions of one length share a batch: the text is then never padded (sampling has no text mask).
    for length in sorted({len(e) for e in embeddings}):
        idx = [i for i, e in enumerate(embeddings) if len(e) == length]
        context = torch.from_numpy(np.stack([embeddings[i] for i in idx]))
        out = sample(model, cfg, context=context, num_steps=num_steps, guidance=guidance, seed=seed + length)
        pixels = to_pixels(decoded(out, cfg).float())[:, 0].numpy()  # (k, T, H, W), first channel
        for i, clip in zip(idx, pixels, strict=True):
            clips[i] = clip
    stacked = np.stack(clips)  # type: ignore[arg-type]
    return {**judge(stacked, digits, directions), "clips": stacked, "captions": captions}


__all__ = ["moving_digits_quality"]
