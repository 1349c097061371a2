"""Sample quality of `zoo train --model dit-video` (its default recipe) on the built-in moving digits.

Trains the default recipe into ``--run`` (or judges a run already there), generates clips for
captions "a {digit} moving {direction}" (every digit, random directions) at each guidance scale, and
prints how often a logistic regression fitted on scikit-learn's real digits recognises the caption's
digit (majority over frames) and how often the centre of mass moves the caption's way
(`zoo_dit.quality`). The issue's bar: digit >= 80%, direction >= 80%. With ``--grid`` writes ten
clips, one per row (frames left to right), as a PNG.

    python benchmarks/dit_video_quality.py --run runs/dit-video-tiny [--n 100] [--guidance 1.5 4 6] [--grid clips.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/dit-video-tiny", help="run directory (trained here first if it has no checkpoint)")
    p.add_argument("--n", type=int, default=100, help="clips per guidance scale")
    p.add_argument("--guidance", type=float, nargs="+", default=[1.5, 4.0, 6.0])
    p.add_argument("--grid", help="write ten clips (one per row) to this PNG")
    p.add_argument("overrides", nargs="*", help="a.b=c overrides for the training run")
    a = p.parse_args()
    run = Path(a.run)
    if not (run / "checkpoints" / "latest").exists():
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "zoo", "train", "--model", "dit-video", "--run-dir", str(run),
                        *a.overrides], check=True)
        print(f"trained in {time.perf_counter() - t:.0f} s")

    import numpy as np
    from zoo_dit.quality import moving_digits_quality

    from zoo.checkpoint.external import load

    loaded = load(str(run))  # the EMA weights when the run kept them (the recipe does)
    for g in a.guidance:
        t = time.perf_counter()
        q = moving_digits_quality(loaded.model, loaded.config, n=a.n, guidance=g)
        print(json.dumps({"guidance": g, "digit": q["digit"], "direction": q["direction"], "clips": a.n,
                          "sample_s": round(time.perf_counter() - t, 1)}), flush=True)
        if a.grid and g == a.guidance[-1]:
            from PIL import Image

            rows = [np.concatenate(list(c), axis=1) for c in q["clips"][:10]]  # (H, T*W) each
            pixels = (np.concatenate(rows, axis=0) * 255).astype(np.uint8)
            Image.fromarray(pixels).resize((pixels.shape[1] * 4, pixels.shape[0] * 4), Image.NEAREST).save(a.grid)
            print(f"{a.grid}: rows {', '.join(repr(c) for c in q['captions'][:10])}")


if __name__ == "__main__":
    main()
