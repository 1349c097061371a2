"""Reading and writing safetensors files and sharded safetensors directories, with errors that
name the file and what is wrong. No pickle anywhere."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import crc32c
import torch

from zoo.errors import ZooError, reading

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL"}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes without a copy (bf16 has no NumPy type: viewed as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")


_ALIGN = 4096  # O_DIRECT: buffer address, size and file offset multiples of the block size
_CHUNK = 16 << 20


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], *, direct: bool = True) -> dict[str, int]:
    """A safetensors file written tensor by tensor (no serialised copy of the whole file in
    memory), fsynced; returns each tensor's CRC-32C, computed on the bytes as they are written.

    With ``direct`` the data bypasses the page cache (O_DIRECT, through one aligned 16 MB bounce
    buffer): page-cache write-back throttling, not the disk, is what limits buffered writes of
    several ranks at once. Where O_DIRECT is unavailable (tmpfs, other systems) it writes buffered."""
    header: dict[str, Any] = {}
    offset = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad the header so the data starts on a block boundary (the format allows trailing spaces).
    raw += b" " * (-(8 + len(raw)) % (_ALIGN if direct else 8))
    head = len(raw).to_bytes(8, "little") + raw
    tmp = path.with_name(f".{path.name}.tmp")
    datas = [(key, tensor_bytes(t.detach().cpu().contiguous())) for key, t in tensors.items()]
    crcs: dict[str, int] = {}
    if direct and _write_direct(tmp, head, datas, crcs):
        os.replace(tmp, path)
        return crcs
    with open(tmp, "wb") as f:
        f.write(head)
        for key, data in datas:
            f.write(data)
            crcs[key] = crc32c.crc32c(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return crcs


def _write_direct(path: Path, head: bytes, datas: list[tuple[str, memoryview]], crcs: dict[str, int]) -> bool:
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o666)  # the umask decides the mode
    except OSError:
        return False
    buf = mmap.mmap(-1, _CHUNK)  # page-aligned
    view = memoryview(buf)
    try:
        fill = 0
        total = 0

        def put(data: memoryview) -> None:
            nonlocal fill, total
            pos = 0
            while pos < len(data):
                n = min(len(data) - pos, _CHUNK - fill)
                view[fill:fill + n] = data[pos:pos + n]
                fill, pos = fill + n, pos + n
                if fill == _CHUNK:
                    os.write(fd, view)
                    total += fill
                    fill = 0

        put(memoryview(head))
        for key, data in datas:
            crcs[key] = crc32c.crc32c(data)
            put(data)
        size = total + fill
        if fill:  # the last block, padded to the alignment, then the file cut to its true size
            padded = -(-fill // _ALIGN) * _ALIGN
            view[fill:padded] = bytes(padded - fill)
            os.write(fd, view[:padded])
        os.ftruncate(fd, size)
        os.fsync(fd)
        return True
    except OSError:  # the file system refused direct I/O after all: the caller writes buffered
        return False
    finally:
        view.release()
        buf.close()
        os.close(fd)


# ------------------------------------------------------------------------------------- saving


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ZooError):
    """A checkpoint or weights file is missing, incomplete, corrupted or of another model."""


def read_json(path: Path, *, kind: type | None = dict) -> Any:
    """A JSON document of a checkpoint or model directory (an object unless ``kind`` says
    otherwise); a broken one is a `CheckpointError` naming the file."""
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    if kind is not None and not isinstance(doc, kind):
        raise CheckpointError(f"{path}: expected a JSON {kind.__name__}, found a {type(doc).__name__}")
    return doc


def read_weight_map(path: Path) -> dict[str, str]:
    """``weight_map`` of a safetensors index: tensor name -> shard file in the same folder."""
    index = read_json(path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
            for k, v in weight_map.items()):
        raise CheckpointError(f"{path}: not a valid safetensors index ('weight_map' must map tensor names to "
                              "file names in the same folder)")
    for name in sorted(set(weight_map.values())):
        try:
            there = (path.parent / name).is_file()
        except OSError:  # a name the filesystem refuses (too long, ...)
            there = False
        if not there:
            raise CheckpointError(f"{path}: lists shard {name}, which is not in {path.parent}")
    return weight_map


def relative_name(name: Any) -> str:
    if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts:
        raise ValueError(f"{str(name)[:80]!r} is not a file inside the checkpoint")
    return name


def checksum_field(version: Any) -> str:
    """The key of a piece's checksum in a sharded index: CRC-32C from format 3 on, CRC-32 before."""
    return "crc32" if version == 2 else "crc32c"


def check_sharded_index(index: dict[str, Any], where: Path) -> None:
    """Everything a load reads from index.json, checked once: a damaged or hand-edited index fails
    here, naming the file, not as a KeyError halfway through a restore (or as a huge allocation)."""
    def dims(v: Any, n: int | None = None) -> bool:
        return isinstance(v, list) and all(type(x) is int and 0 <= x < 2**48 for x in v) and n in (None, len(v))

    tensors, files = index.get("tensors"), index.get("files")
    checksum = checksum_field(index.get("format_version"))
    if not isinstance(tensors, dict) or not isinstance(files, dict) or not all(
            type(v) is int and v >= 0 for v in files.values()):
        raise CheckpointError(f"{where}: needs 'tensors' and 'files' (file name -> size) objects")
    with reading(where, CheckpointError):
        for rel in files:
            relative_name(rel)
        for name, t in tensors.items():
            if not (isinstance(t, dict) and dims(t.get("shape")) and isinstance(t.get("pieces"), list)
                    and isinstance(getattr(torch, str(t.get("dtype")), None), torch.dtype)):
                raise ValueError(f"entry {name!r} needs a shape, a torch dtype and a list of pieces")
            for p in t["pieces"]:
                if not (isinstance(p, dict) and p.get("file") in files and isinstance(p.get("key"), str)
                        and dims(p.get("offset"), len(t["shape"])) and dims(p.get("shape"), len(t["shape"]))
                        and type(p.get(checksum)) is int
                        and all(o + s <= g for o, s, g in zip(p["offset"], p["shape"], t["shape"]))):
                    raise ValueError(f"a piece of {name!r} is malformed: {str(p)[:150]}")


def load_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file as _load

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return _load(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str] | None = None) -> None:
    """Write atomically; tensors that share storage (tied weights) must be de-duplicated first."""
    from safetensors.torch import save_file as _save

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    _save({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_dir(directory: str | os.PathLike[str], *, stem: str = "model") -> dict[str, torch.Tensor]:
    """All tensors of a directory holding ``model.safetensors`` or a sharded index (``stem``:
    diffusers names its files ``diffusion_pytorch_model``)."""
    d = Path(directory)
    INDEX, SINGLE = f"{stem}.safetensors.index.json", f"{stem}.safetensors"  # noqa: N806
    if (d / INDEX).is_file():
        weight_map = read_weight_map(d / INDEX)
        out: dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            part = load_file(d / name)
            out.update(part)
        missing = [k for k in weight_map if k not in out]
        if missing:
            raise CheckpointError(f"{d / INDEX}: lists tensors absent from its shards: {', '.join(missing[:5])}")
        return out
    if (d / SINGLE).is_file():
        return load_file(d / SINGLE)
    raise CheckpointError(f"{d}: no {SINGLE} or {INDEX}")


def write_dir(directory: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], *, max_shard_bytes: int) -> None:
    """One file, or shards of at most ``max_shard_bytes`` plus the index transformers reads."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"format": "pt"}
    if total <= max_shard_bytes:
        save_file(tensors, d / SINGLE, metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, d / name, metadata=meta)
        weight_map.update({k: name for k in shard})
    from zoo.io import atomic_write_text

    atomic_write_text(d / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def unique_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a state dict into tensors with distinct storage and ``{alias: original}`` for ties."""
    seen: dict[tuple[Any, ...], str] = {}
    unique, ties = {}, {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride())) if v.device.type != "meta" else (k,)
        if key in seen:
            ties[k] = seen[key]
        else:
            seen[key] = k
            unique[k] = v
    return unique, ties


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "tokenizer.model", "generation_config.json", "chat_template.jinja"]
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


class ShardStream:
    """Writes a safetensors directory (one file, or shards plus the index transformers reads)
    from tensors handed over one at a time. Each tensor's bytes go to disk at once (a data file
    per shard, prefixed with the header when the shard closes, by a kernel-side copy), so memory
    holds one tensor, never a shard or the model."""

    _DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}

    def __init__(self, directory: str | os.PathLike[str], *, max_shard_bytes: int,
                 dtype: torch.dtype | None = None, stem: str = "model") -> None:
        self.dir = Path(directory)
        self.stem = stem  # the file names' (diffusers: diffusion_pytorch_model)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max, self.dtype = max_shard_bytes, dtype
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.first_dtype: torch.dtype | None = None
        self._data: Any = None
        self._header: dict[str, Any] = {}
        self._size = 0

    def put(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to(self.dtype) if self.dtype is not None else t.detach()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if self._data is not None and self._size and self._size + nbytes > self.max:
            self._flush()
        if self._data is None:
            self._data = open(self.dir / f".part-{len(self.parts) + 1:05d}.data", "wb")  # noqa: SIM115
            self._header, self._size = {}, 0
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        self._data.write(memoryview(raw.numpy()).cast("B") if t.numel() else b"")
        self._header[key] = {"dtype": self._DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self._size, self._size + nbytes]}
        self._size += nbytes
        self.total += nbytes
        self.first_dtype = self.first_dtype or t.dtype

    def _flush(self) -> None:
        data_path = Path(self._data.name)
        self._data.close()
        self._data = None
        header = dict(self._header)
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = self.dir / f".part-{len(self.parts) + 1:05d}.safetensors"
        with open(path, "wb") as out, open(data_path, "rb") as src:
            out.write(len(raw).to_bytes(8, "little") + raw)
            shutil.copyfileobj(src, out, 1 << 24)
        data_path.unlink()
        self.parts.append((path, [k for k in header if k != "__metadata__"]))

    def close(self) -> None:
        if self._data is not None or not self.parts:
            if self._data is None:  # no tensor at all: an empty file is still a valid result
                self._data = open(self.dir / ".part-00001.data", "wb")  # noqa: SIM115
                self._header, self._size = {}, 0
            self._flush()
        if len(self.parts) == 1:
            os.replace(self.parts[0][0], self.dir / f"{self.stem}.safetensors")
            return
        weight_map = {}
        n = len(self.parts)
        for i, (path, keys) in enumerate(self.parts, start=1):
            name = f"{self.stem}-{i:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        from zoo.io import atomic_write_text

        atomic_write_text(self.dir / f"{self.stem}.safetensors.index.json",
                          json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2))


class LazyTensors(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors directory (one file or an index of shards), each read from
    disk only when accessed."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from safetensors import SafetensorError, safe_open

        d = Path(directory)
        files: dict[str, Path] = {}
        if (d / INDEX).is_file():
            files = {k: d / v for k, v in read_weight_map(d / INDEX).items()}
        elif (d / SINGLE).is_file():
            files = {}
        else:
            raise CheckpointError(f"{d}: no {SINGLE} or {INDEX}")
        self._handles: dict[Path, Any] = {}
        paths = sorted(set(files.values())) or [d / SINGLE]
        for path in paths:
            if not path.is_file():
                raise CheckpointError(f"{path}: file not found")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
        if not files:
            files = {k: paths[0] for k in self._handles[paths[0]].keys()}  # noqa: SIM118 (not a dict)
        self._where = files
        self.read: list[str] = []  # the keys read so far, in order

    def shape_of(self, key: str) -> tuple[int, ...]:
        """From the file header: no tensor data is read."""
        return tuple(self._handles[self._where[key]].get_slice(key).get_shape())

    def read_box(self, key: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> torch.Tensor:
        """``tensor[rows[0]:rows[1]]`` (and ``[:, cols[0]:cols[1]]``), reading only those bytes."""
        box = (slice(*rows),) if cols is None else (slice(*rows), slice(*cols))
        self.read.append(f"{key}[{rows[0]}:{rows[1]}]" + ("" if cols is None else f"[:, {cols[0]}:{cols[1]}]"))
        return self._handles[self._where[key]].get_slice(key)[box]

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self._where[key]
        self.read.append(key)
        try:
            return self._handles[path].get_tensor(key)
        except Exception as e:  # a shard without the tensor its index promises
            raise CheckpointError(f"{path}: cannot read {key!r} ({e})") from None

    def __iter__(self) -> Any:
        return iter(self._where)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)
