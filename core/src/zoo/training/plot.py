"""The loss curve of a run, drawn with matplotlib: training and validation loss against the
optimizer step, labelled axes with numbers, a legend, the model in the title, optionally a log
loss axis. matplotlib is part of the default install; zoo-core alone runs without it and says
that no plot was drawn."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def loss_curve(path: Path, steps: Sequence[float], losses: Sequence[float], val: Sequence[tuple[float, float]] = (),
               *, title: str = "", log_scale: bool = False) -> str | None:
    """Write the curve to ``path`` (PNG); returns None, or a one-line note when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # a bare Figure renders to files (Agg) without touching pyplot's backend
    except ImportError:
        return f"no loss plot drawn ({path.name}): matplotlib is not installed (pip install matplotlib)"
    fig = Figure(figsize=(7.0, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="#1f4e9c", linewidth=1.4, label="train loss")
    if val:
        vs, vl = zip(*val)
        ax.plot(vs, vl, color="#c0392b", marker="o", markersize=4, linewidth=1.0, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (log scale)" if log_scale else ""))
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, which="major", color="#dddddd", linewidth=0.8)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title)
    ax.legend(loc="upper right", frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return None


__all__ = ["loss_curve"]
