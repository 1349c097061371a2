"""Checkpoints that are one file of tensors with no config beside it, in a format a family
declares (`FileFormat`): read as safetensors or through ``torch.load(weights_only=True)`` (no code
in the file runs), written atomically."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.checkpoint.tensorio import CheckpointError


@dataclass(frozen=True, kw_only=True)
class FileFormat:
    """A checkpoint that is one file of tensors with no config beside it (facebookresearch's DiT
    ``.pt``), declared by a family under its own name in ``checkpoint_formats`` (`zoo convert
    --from NAME FILE DIR`, ``--to NAME RUN FILE``).

    ``read(tensors)`` gives the zoo config the tensors describe and the zoo state; ``write(config,
    state)`` the tensors of the file. The core reads the file (safetensors, or a ``.pt``/``.pth``
    through ``torch.load(weights_only=True)``: no code in it runs) and writes it atomically."""

    read: Callable[[Mapping[str, Any]], tuple[Any, Mapping[str, Any]]]
    write: Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]


def read_tensor_file(path: Path) -> Mapping[str, Any]:
    """The tensors of a safetensors file or of a plain ``torch.save``d state dict (a training
    checkpoint's ``ema`` or ``model`` entry when it holds those)."""
    import torch

    from zoo.checkpoint.tensorio import load_file

    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    if path.suffix == ".safetensors":
        return load_file(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # (torch raises UnpicklingError, RuntimeError, EOFError... on a file it refuses)
        reason = " ".join(str(e).split())[:200]
        raise CheckpointError(f"{path}: not a state dict torch.load(weights_only=True) reads ({type(e).__name__}: "
                              f"{reason}); only tensors are read from such files, never code") from None
    if isinstance(obj, dict):
        for key in ("ema", "model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return obj


def write_tensor_file(tensors: Mapping[str, Any], dst: Path) -> Path:
    """One file: safetensors for a ``.safetensors`` name, else ``torch.save``'s (tensors only)."""
    import torch

    from zoo.checkpoint.tensorio import save_file
    from zoo.io import atomic_write_bytes

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix == ".safetensors":
        save_file(tensors, dst)
    else:
        buf = io.BytesIO()
        torch.save(tensors, buf)
        atomic_write_bytes(dst, buf.getvalue())
    return dst


__all__ = ["FileFormat", "read_tensor_file", "write_tensor_file"]
