"""Installable-looking plugin distributions made on the fly, for registry tests.

`fake_distribution` writes a package and a ``*.dist-info`` directory (METADATA and
entry_points.txt) under ``root``; with ``root`` on ``sys.path`` (or ``PYTHONPATH`` for a
subprocess) `importlib.metadata` finds it exactly as it finds a pip-installed distribution, so the
registry is exercised through its real discovery path.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

__all__ = ["fake_distribution", "entry_points_under"]


def fake_distribution(
    root: str | Path,
    name: str,
    version: str,
    *,
    plugins: Mapping[str, str],
    files: Mapping[str, str],
) -> Path:
    """Create distribution ``name`` with ``plugins`` (entry-point name -> value) and source ``files``."""
    root = Path(root)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
    eps = "[zoo.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items())
    (info / "entry_points.txt").write_text(eps, encoding="utf-8")
    return info


def entry_points_under(*roots: str | Path) -> list:
    """The ``zoo.plugins`` entry points of the distributions under ``roots`` only."""
    import sys

    if sys.version_info >= (3, 12):
        from importlib.metadata import distributions
    else:
        from importlib_metadata import distributions
    out = []
    for dist in distributions(path=[str(r) for r in roots]):
        out += list(dist.entry_points.select(group="zoo.plugins"))
    return out
