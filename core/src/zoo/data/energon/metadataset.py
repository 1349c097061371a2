"""Energon metadataset YAML (``__class__: MetadatasetV2``): per split a tree of ``blend``
(weights), ``blend_epochized`` (repetitions), ``subflavors``, ``subset: {range: [a, b]}`` and
nested metadatasets, flattened here into leaves with their effective weight or repetitions and
``shuffle_over_epochs_multiplier`` (Energon's rule for nesting them: `combine_shuffle_over_epochs`).

Relative paths resolve against the YAML file's folder. ``join`` and ``aux`` need Energon's
by-key SQLite index, which zoo does not build (training never reads it): they are refused by
name. A blend nested in a blend multiplies the normalised weights; epochized blends multiply
repetitions; mixing the two kinds in one tree is refused (the result would have no clear meaning).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from zoo.data.energon.dataset import DatasetError, is_dataset
from zoo.data.energon.pipeline import Leaf
from zoo.errors import reading

_LEAF_KEYS = {"path", "split_part", "subflavors", "subset", "dataset_config", "split_config",
              "shuffle_over_epochs_multiplier", "weight", "repetitions"}


def is_metadataset(path: str) -> bool:
    return str(path).endswith((".yaml", ".yml")) and os.path.isfile(path)


def load_metadataset(path: str, split: str) -> tuple[tuple[Leaf, ...], str]:
    """(leaves, blend mode) of ``split`` in the metadataset at ``path``."""
    doc = _read(path)
    splits = doc.get("splits")
    if not isinstance(splits, dict):
        raise DatasetError(f"{path}: a metadataset needs 'splits: {{train: ..., val: ...}}'")
    if split not in splits:
        raise DatasetError(f"{path}: no split {split!r} (it has {', '.join(splits)})")
    mode: list[str] = []
    with reading(path, DatasetError):
        leaves = _node(splits[split], Path(path).parent, split, 1.0, 1.0, {}, (), mode, where=f"{path}: splits.{split}")
    return tuple(leaves), (mode[0] if mode else "single")


def split_names(path: str) -> list[str]:
    splits = _read(path).get("splits")
    if not isinstance(splits, dict) or not splits:
        raise DatasetError(f"{path}: a metadataset needs 'splits: {{train: ..., val: ...}}'")
    return [str(k) for k in splits]


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DatasetError(f"{path}: cannot read the metadataset: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict):
        raise DatasetError(f"{path}: a metadataset is a mapping with 'splits:', this file holds a {type(doc).__name__}")
    if doc.get("__class__") not in (None, "MetadatasetV2"):
        raise DatasetError(f"{path}: __class__ {doc.get('__class__')!r}: only MetadatasetV2 metadatasets are read")
    return doc


def combine_shuffle_over_epochs(outer: int | None, inner: Any, where: str) -> int | None:
    """Energon's rule for a reference's ``shuffle_over_epochs_multiplier`` inside an outer one:
    null (no shuffling) wins, then -1 (slices drawn with replacement), else the product."""
    if inner is not None and (type(inner) is not int or not (inner >= 1 or inner == -1)):
        raise DatasetError(f"{where}: shuffle_over_epochs_multiplier must be a whole number >= 1, -1 (slices drawn "
                           f"with replacement) or null (no shuffling), not {inner!r}")
    if outer is None or inner is None:
        return None
    return -1 if -1 in (outer, inner) else outer * inner


def _node(node: Any, base: Path, split: str, weight: float, reps: float, flavors: dict[str, Any],
          subset: tuple[Any, ...], mode: list[str], *, where: str, soe: int | None = 1) -> list[Leaf]:
    if not isinstance(node, dict):
        raise DatasetError(f"{where}: expected a mapping, got {type(node).__name__}")
    for bad in ("join", "aux"):
        if bad in node:
            raise DatasetError(f"{where}: '{bad}' needs Energon's by-key SQLite index, which zoo does not build; "
                               "pre-join the parts into one dataset's samples instead")
    flavors = {**flavors, **(node.get("subflavors") or {})}
    if "subset" in node:
        rng = (node["subset"] or {}).get("range")
        if not (isinstance(rng, list) and len(rng) == 2):
            raise DatasetError(f"{where}: subset needs range: [start, end]")
        subset = (tuple(rng), *subset)  # inner (deeper) ranges apply first
    for kind, own in (("blend", "weight"), ("blend_epochized", "repetitions")):
        if kind not in node:
            continue
        tag = "blend" if kind == "blend" else "epochized"
        if mode and mode[0] != tag:
            raise DatasetError(f"{where}: a {kind} inside a {'blend' if mode[0] == 'blend' else 'blend_epochized'} "
                               "is not supported; use one kind per split")
        mode[:] = [tag]
        entries = node[kind]
        if not isinstance(entries, list) or not entries:
            raise DatasetError(f"{where}.{kind}: expected a non-empty list")
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not float(e.get(own, 1.0)) >= 0:
                raise DatasetError(f"{where}.{kind}[{i}]: {own} must be a number, not negative")
        total = sum(float(e.get("weight", 1.0)) for e in entries) if kind == "blend" else 1.0
        if not total > 0:
            raise DatasetError(f"{where}.{kind}: the weights sum to {total:g}; at least one must be positive")
        out: list[Leaf] = []
        for i, e in enumerate(entries):
            w = weight * float(e.get("weight", 1.0)) / total if kind == "blend" else weight
            r = reps * float(e.get("repetitions", 1.0)) if kind == "blend_epochized" else reps
            out += _node(e, base, split, w, r, flavors, subset, mode, where=f"{where}.{kind}[{i}]", soe=soe)
        return out
    if "path" not in node:
        raise DatasetError(f"{where}: needs path (a dataset or a metadataset), blend or blend_epochized")
    unknown = set(node) - _LEAF_KEYS
    if unknown:
        from zoo.errors import suggest

        key = sorted(unknown)[0]
        raise DatasetError(f"{where}: unknown key {key!r}{suggest(key, _LEAF_KEYS)}")
    soe = combine_shuffle_over_epochs(soe, node.get("shuffle_over_epochs_multiplier", 1), where)
    path = str(node["path"])
    if "://" not in path and not os.path.isabs(path):
        path = str((base / path).resolve())
    if "://" not in path and not (is_metadataset(path) or is_dataset(path)):
        raise DatasetError(f"{where}: {path} is neither a prepared Energon dataset nor a metadataset"
                           + ("" if os.path.exists(path) else " (it does not exist)"))
    if is_metadataset(path):
        inner = _read(path).get("splits", {})
        part = node.get("split_part", split)
        if part not in inner:
            raise DatasetError(f"{path}: no split {part!r} (referenced from {where})")
        return _node(inner[part], Path(path).parent, part, weight, reps, flavors, subset, mode,
                     where=f"{path}: splits.{part}", soe=soe)
    return [Leaf(path=path, split_part=node.get("split_part", split), weight=weight, repetitions=reps,
                 subflavors=flavors, subset=subset, dataset_config=node.get("dataset_config", "dataset.yaml"),
                 split_config=node.get("split_config", "split.yaml"), shuffle_over_epochs=soe)]


__all__ = ["is_metadataset", "load_metadataset"]
