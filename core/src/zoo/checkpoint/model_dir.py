"""zoo model directories: what is in one, how it is written atomically and checked when read.

::

    zoo.json            format version, family, flavor, model config, tied-tensor aliases
    model.safetensors   the model's tensors (tied aliases stored once)            (format 1)
    index.json, shards/ per-rank pieces of every tensor                            (format 2, sharded)
    tokenizer.json      when the model has a tokenizer
    COMPLETE            written last: a directory without it is never loaded

Training checkpoints (`zoo.checkpoint.state`) are model directories with optimizer and loop
state added, so everything that reads a model reads a training checkpoint too. Directories are
written into a temporary sibling and renamed into place; files and directories get the modes the
user's umask gives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.checkpoint.mapping import MappingError, check_shapes
from zoo.checkpoint.tensorio import CheckpointError, copy_tokenizer_files, read_json, save_file, unique_tensors
from zoo.errors import UsageError
from zoo.io import atomic_write_text, make_dir_like_user

if TYPE_CHECKING:
    from zoo.registry import FamilyEntry

FORMAT_VERSION = 1  # one file of full tensors
SHARDED_FORMAT_VERSION = 3  # per-rank pieces (`zoo.checkpoint.sharded`); 2: CRC-32 instead of CRC-32C
META = "zoo.json"
COMPLETE = "COMPLETE"


@dataclass
class ModelDir:
    path: Path
    meta: dict[str, Any]

    @property
    def family(self) -> str:
        return str(self.meta["family"])



def read_meta(path: str | os.PathLike[str]) -> ModelDir:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint directory")
    if not (p / META).is_file():
        hint = " (it looks like a Hugging Face model: use `zoo convert --from hf`)" if (p / "config.json").is_file() else ""
        raise CheckpointError(f"{p}: not a zoo checkpoint (no {META}){hint}")
    if not (p / COMPLETE).is_file():
        raise CheckpointError(f"{p}: incomplete checkpoint (no {COMPLETE} marker: the save was interrupted)")
    meta = read_json(p / META)
    version = meta.get("format_version")
    if meta.get("sharded"):
        if not isinstance(version, int) or version > SHARDED_FORMAT_VERSION:
            raise CheckpointError(f"{p / META}: checkpoint format version {version!r}; this zoo reads versions up to "
                                  f"{SHARDED_FORMAT_VERSION} (upgrade zoo-core)")
    elif not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{p / META}: checkpoint format version {version!r}; this zoo reads versions up to {FORMAT_VERSION} (upgrade zoo-core)")
    for key in ("family", "model_config"):
        if key not in meta:
            raise CheckpointError(f"{p / META}: missing {key!r}")
    return ModelDir(p, meta)


def write_model_dir(
    dst: str | os.PathLike[str],
    *,
    family: str,
    flavor: str,
    config: Any,
    state: Mapping[str, Any],
    extra_meta: Mapping[str, Any] | None = None,
    files: Mapping[str, bytes] | None = None,
    tensor_files: Mapping[str, Mapping[str, Any]] | None = None,
    tokenizer_from: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a complete zoo model directory atomically (temp dir, marker last, rename)."""
    from zoo.config import plain

    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise UsageError(f"{dst} already exists; nothing was overwritten")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_dir_like_user(Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-")))
    try:
        unique, ties = unique_tensors(state)
        save_file(unique, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, tensors in (tensor_files or {}).items():
            save_file(tensors, tmp / name)
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
        meta = {"format": "zoo", "format_version": FORMAT_VERSION, "family": family, "flavor": flavor,
                "model_config": plain(config), "ties": ties, **(extra_meta or {})}
        atomic_write_text(tmp / META, json.dumps(meta, indent=2))
        complete_and_move(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def complete_and_move(tmp: Path, dst: Path) -> None:
    """Mark a fully written directory complete (the marker last, everything synced first) and move
    it to ``dst``, replacing what is there; a crash at any point leaves either the old ``dst`` or
    the new one, never a directory without its marker under that name."""
    _fsync_dir(tmp)
    (tmp / COMPLETE).write_text("")  # last: only now is the directory a checkpoint
    _fsync_dir(tmp)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / COMPLETE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete checkpoint of a checkpoint root or run directory."""
    p = Path(path)
    for root in (p, p / "checkpoints"):
        if root.is_dir() and not (root / "zoo.json").exists():
            found = latest(root)
            if found is not None:
                return found
    return p


def config_for(entry: FamilyEntry, data: Mapping[str, Any], *, source: str) -> Any:
    from zoo.config import config_from_dict

    return config_from_dict(entry.family.config, data, source=source)


def build_empty(entry: FamilyEntry, config: Any, *, device: str = "cpu") -> Any:
    import torch

    from zoo.family import resolve

    build = resolve(entry.family.build, owner=str(entry.plugin))
    with torch.device(device):
        return build(config, entry.family.spec_for(config))


def load_into(model: Any, state: Mapping[str, Any], *, what: str) -> None:
    expected = model.state_dict()
    try:
        check_shapes(expected, state, what=what)
    except MappingError as e:
        raise CheckpointError(str(e)) from None
    model.load_state_dict(dict(state), strict=True)


def is_model_tensor(name: str) -> bool:
    """Whether a checkpoint tensor name is a model tensor (not ``param::optimizer_field`` nor a
    registered state's ``item/param``)."""
    return "::" not in name and "/" not in name
