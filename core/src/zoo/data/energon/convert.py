"""`zoo prepare convert-pickle`: rewrite a dataset's `.pickle`/`.pyd` parts as `.pickle.npy` (or
`.pickle.pth`), so it loads without ``allow_pickle``.

The pickles are read with an allow-list unpickler that rebuilds only tensors, arrays and plain
containers (what DFM's T5 embeddings are): a pickle that asks for anything else (a function
call, a class) is refused, so converting an untrusted dataset runs none of its code. Each shard
is rewritten to a temporary file and renamed; indices are rebuilt at the end.
"""

from __future__ import annotations

import collections
import io
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zoo.data.energon.dataset import DatasetError
from zoo.data.energon.prepare import find_shards, prepare_webdataset
from zoo.data.energon.samples import PICKLE_EXTENSIONS
from zoo.io import atomic_write_bytes


def _storage_from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)  # torch's own format: no code runs


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
for _mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED[(_mod, "_reconstruct")] = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct  # type: ignore[attr-defined]
    _ALLOWED[(_mod, "scalar")] = np._core.multiarray.scalar if hasattr(np, "_core") else np.core.multiarray.scalar  # type: ignore[attr-defined]
for _name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"):
    _ALLOWED[("torch", _name)] = getattr(torch, _name)
for _name in ("FloatStorage", "HalfStorage", "BFloat16Storage", "DoubleStorage", "LongStorage", "IntStorage",
              "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"):
    _ALLOWED[("torch", _name)] = getattr(torch, _name)


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not a tensor, array or container: refused "
                                         "(converting would run the dataset's code)") from None


def safe_unpickle(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()


def _converted(value: Any, to: str) -> tuple[str, bytes]:
    if to == "pth":
        buf = io.BytesIO()
        torch.save(value, buf)
        return "pth", buf.getvalue()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        # NumPy has no bfloat16: widen to float32, which holds every bfloat16 value exactly.
        value = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if not isinstance(value, np.ndarray):
        raise DatasetError(f"holds a {type(value).__name__}, not a tensor or array: use --to pth")
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)
    return "npy", buf.getvalue()


def convert_pickle(root: str | Path, *, to: str = "npy", progress: bool = False) -> int:
    """Rewrite every pickled part under ``root``; returns how many were converted."""
    root = Path(root)
    converted = 0
    for rel in find_shards(root):
        path = root / rel
        out = io.BytesIO()
        changed = False
        with tarfile.open(path, "r:") as src, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
            for m in src:
                f = src.extractfile(m) if m.isreg() else None
                data = f.read() if f is not None else None
                base, _, ext = m.name.rpartition(".")
                if data is not None and ext in PICKLE_EXTENSIONS:
                    try:
                        new_ext, data = _converted(safe_unpickle(data), to)
                    except (pickle.UnpicklingError, DatasetError, EOFError, ValueError) as e:
                        raise DatasetError(f"{path}/{m.name}: {e}") from None
                    # k.pickle -> k.pickle.npy: the part keeps its origin in its name and cannot
                    # collide with a .npy part the sample already has.
                    m = tarfile.TarInfo(f"{base}.{ext}.{new_ext}")
                    m.size, m.mode, m.mtime = len(data), 0o644, 0
                    converted += 1
                    changed = True
                dst.addfile(m, io.BytesIO(data) if data is not None else None)
        if changed:
            atomic_write_bytes(path, out.getvalue())
    if (root / ".nv-meta" / ".info.json").exists():
        prepare_webdataset(root, tar_index_only=True, progress=progress)
    return converted


__all__ = ["SafeUnpickler", "convert_pickle", "safe_unpickle"]
