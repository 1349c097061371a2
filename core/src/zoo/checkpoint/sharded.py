"""Sharded training checkpoints: every rank writes only what it owns, any layout reads them.

Layout of ``step_00000100/`` (format version 3; version 2 differs only in its pieces' checksum,
CRC-32 instead of CRC-32C, and version 1 is the single-file form of `zoo.checkpoint`: both still
read)::

    zoo.json                  family, flavor, model config, format version, "sharded": true
    index.json                every tensor's global shape and dtype, and its pieces: file, key,
                              offset in the global tensor, shape, CRC-32C; every file's size
    shards/rank00003.safetensors   the pieces rank 3 owns (a replicated tensor is written once)
    shards/rank00003.json     rank 3's piece list, checksum and RNG states (its "done" marker)
    state.json                step, consumed samples, optimizer param groups (global names), scaler
    config.yaml, tokenizer.json
    COMPLETE                  written last

Names are the single-process model's (``layers.7.attn.qkv.weight``: pipeline stages keep global
layer indices), optimizer state is ``name::exp_avg`` etc. in the parameter's global shape, so a
checkpoint is the same whatever layout wrote it. Loading computes, for each tensor this rank holds
(a tensor-parallel shard of a parameter of its stages), the global box it covers and reads only the
overlapping byte ranges of the pieces (safetensors slices). Nothing is pickled.

Writing: all ranks write into ``.step_00000100.partial-<run token>``; each rank's JSON marker comes
after its tensors are on disk; global rank 0 waits for every marker, writes the index, state and
COMPLETE, renames the directory into place and updates ``latest`` atomically. A directory without
COMPLETE never has a step name, so a killed save is never loaded. With ``async_save`` the tensors
are copied to host memory in the training thread and written by a background thread (at most one
save in flight; the next save, or the end of training, waits for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch

from zoo.checkpoint import rng as rng_mod
from zoo.checkpoint.model_dir import META, SHARDED_FORMAT_VERSION, _fsync_dir, complete_and_move
from zoo.checkpoint.tensorio import (
    CheckpointError,
    check_sharded_index,
    checksum_field,
    read_json,
    relative_name,
    tensor_bytes,
    write_safetensors,
)
from zoo.errors import reading
from zoo.io import atomic_write_text
from zoo.parallel.sharding import Split, TPShard, regions

FORMAT_VERSION = SHARDED_FORMAT_VERSION
# A piece's checksum: CRC-32C from the crc32c package runs at memory speed with the CPU's CRC
# instruction (12 GB/s here against zlib's CRC-32 at 4) and releases the GIL; format 2 used CRC-32.
CHECKSUMS: dict[str, Callable[[Any], int]] = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
INDEX = "index.json"
SHARDS = "shards"


@dataclass
class Entry:
    """One tensor this rank holds: its single-process name, local data, how tensor parallelism
    split it, and whether this rank is the one replica that writes it."""

    name: str
    tensor: torch.Tensor
    shard: TPShard | Split | None
    write: bool


_AHEAD = 64 << 20  # loading: how far ahead of the piece being read the kernel is asked to read


@dataclass
class _Snapshot:
    """What one rank saves, already copied off the live tensors (so training may go on)."""

    tensors: dict[str, torch.Tensor]  # file key -> data
    pieces: list[dict[str, Any]]  # name, key, offset, shape
    globals: dict[str, dict[str, Any]]  # name -> shape, dtype (for every tensor this rank holds)
    rng: rng_mod.RNGState


def snapshot(entries: Sequence[Entry], *, copy: bool = True, pool: dict[str, torch.Tensor] | None = None,
             rng: Mapping[str, torch.Tensor] | None = None) -> _Snapshot:
    """What to write; ``copy`` (an asynchronous save) copies the tensors off, so training can
    change them meanwhile, into ``pool``'s buffers when they fit (reused from the previous save:
    no fresh allocation, whose page faults would cost more than the copy). A synchronous save
    writes straight from the live tensors."""
    tensors, pieces, globals_ = {}, [], {}
    for e in entries:
        shape, regs = regions(e.tensor.shape, e.shard)
        globals_[e.name] = {"shape": list(shape), "dtype": str(e.tensor.dtype).removeprefix("torch.")}
        if not e.write:
            continue
        for i, (sl, offset) in enumerate(regs):
            key = f"{e.name}#{i}"
            data = e.tensor.detach()[sl]
            if copy:
                buf = pool.get(key) if pool is not None else None
                if buf is None or buf.shape != data.shape or buf.dtype != data.dtype:
                    buf = torch.empty(data.shape, dtype=data.dtype, device="cpu")
                    if pool is not None:
                        pool[key] = buf
                data = buf.copy_(data)
            else:
                data = data.cpu().contiguous()
            tensors[key] = data
            pieces.append({"name": e.name, "key": key, "offset": list(offset), "shape": list(data.shape)})
    # (``rng``: extra streams, e.g. this rank's tensor-parallel one)
    return _Snapshot(tensors, pieces, globals_, rng_mod.capture(rng))


def _rank_name(rank: int) -> str:
    return f"rank{rank:05d}"


def write_rank(tmp: Path, rank: int, snap: _Snapshot) -> None:
    """This rank's tensors, then its marker (the marker says the tensors are complete)."""
    shards = tmp / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    name = _rank_name(rank)
    path = shards / f"{name}.safetensors"
    try:
        crcs = write_safetensors(path, snap.tensors)
        write_safetensors(shards / f"{name}.rng.safetensors", {**snap.rng.tensors, **snap.rng.extra})
    except OSError as e:  # tell global rank 0, which waits for every rank's marker, at once
        with contextlib.suppress(OSError):
            (shards / f"{name}.failed").write_text(str(e))
        raise
    pieces = [{**p, "crc32c": crcs[p["key"]]} for p in snap.pieces]
    marker = {"rank": rank, "file": f"{SHARDS}/{name}.safetensors", "size": path.stat().st_size,
              "rng_file": f"{SHARDS}/{name}.rng.safetensors", "rng": snap.rng.json(),
              "pieces": pieces, "tensors": snap.globals}
    atomic_write_text(shards / f"{name}.json", json.dumps(marker))


def finalize(tmp: Path, dst: Path, *, world_size: int, meta: Mapping[str, Any], state: Mapping[str, Any],
             files: Mapping[str, bytes], tokenizer_from: Path | None, timeout_s: float) -> Path:
    """Global rank 0: wait for every rank's marker, write the index and the rest, mark complete,
    move into place."""
    from zoo.checkpoint.tensorio import copy_tokenizer_files

    deadline = time.monotonic() + timeout_s
    markers = []
    for r in range(world_size):
        path = tmp / SHARDS / f"{_rank_name(r)}.json"
        while not path.is_file():
            failed = path.with_suffix(".failed")
            if failed.is_file():
                raise CheckpointError(f"rank {r} could not write its part: {failed.read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise CheckpointError(f"{tmp}: rank {r} did not finish its part of the checkpoint in {timeout_s:.0f} s")
            time.sleep(0.01)
        markers.append(json.loads(path.read_text()))
    tensors: dict[str, dict[str, Any]] = {}
    for m in markers:
        for name, g in m["tensors"].items():
            t = tensors.setdefault(name, {"shape": g["shape"], "dtype": g["dtype"], "pieces": []})
            if t["shape"] != g["shape"] or t["dtype"] != g["dtype"]:
                raise CheckpointError(f"{tmp}: ranks disagree on {name!r}: {t['shape']} {t['dtype']} vs {g['shape']} {g['dtype']}")
        for p in m["pieces"]:
            tensors[p["name"]]["pieces"].append({"file": m["file"], "key": p["key"], "offset": p["offset"],
                                                 "shape": p["shape"], "crc32c": p["crc32c"]})
    for name, t in tensors.items():  # every element written exactly once
        covered = sum(int(np.prod(p["shape"])) for p in t["pieces"])
        if covered != int(np.prod(t["shape"])):
            raise CheckpointError(f"{tmp}: {name!r} has {covered} of {int(np.prod(t['shape']))} elements written")
    index = {"format": "zoo-sharded", "format_version": FORMAT_VERSION, "world_size": world_size,
             "tensors": tensors, "files": {m["file"]: m["size"] for m in markers},
             "rng": {str(m["rank"]): {"file": m["rng_file"], "other": m["rng"]} for m in markers}}
    atomic_write_text(tmp / INDEX, json.dumps(index))
    atomic_write_text(tmp / "state.json", json.dumps(state))
    for name, data in files.items():
        atomic_write_text(tmp / name, data.decode())
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, tmp)
    atomic_write_text(tmp / META, json.dumps({**meta, "format_version": FORMAT_VERSION, "sharded": True}, indent=2))
    _fsync_dir(tmp / SHARDS)
    # Replaces a checkpoint of the same step left by a run that resumed from before it.
    complete_and_move(tmp, dst)
    atomic_write_text(dst.parent / "latest", dst.name + "\n")
    return dst


class Saver:
    """Runs saves synchronously or in a background thread, one at a time.

    An asynchronous save either copies the tensors to host buffers first (``copy=True``: the
    caller may change them at once) or writes straight from the live tensors (``copy=False``:
    the caller promises to `wait` before it changes them, as the training loop does before each
    optimizer update, so a save overlaps the next forward and backward at no memory cost)."""

    def __init__(self, *, asynchronous: bool, copy: bool = True, on_error: str = "stop", announce: bool = True) -> None:
        self.asynchronous, self.copy, self.on_error, self.announce = asynchronous, copy, on_error, announce
        self.failures = 0
        self.pool: dict[str, torch.Tensor] = {}  # host buffers of the snapshot, reused save after save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Block until the save in flight is written; re-raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            self._failed(error)

    def _failed(self, error: BaseException) -> None:
        """A failed save: raised, or with ``on_error="continue"`` announced and counted."""
        if self.on_error != "continue" or not isinstance(error, CheckpointError):
            raise error
        self.failures += 1
        if self.announce:
            print(f"zoo: warning: {error}; training continues (checkpoint.on_save_error=continue)", flush=True,
                  file=sys.stderr)

    def submit(self, work: Callable[[], None]) -> None:
        self.wait()  # at most one save in flight
        if not self.asynchronous:
            try:
                work()
            except CheckpointError as e:
                self._failed(e)
            return

        def run() -> None:
            try:
                work()
            except BaseException as e:  # surfaced by the next wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="zoo-checkpoint", daemon=True)
        self._thread.start()


# ------------------------------------------------------------------------------------- loading


class ShardedCheckpoint:
    """Reads global boxes of tensors from a sharded checkpoint, touching only the bytes needed."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX
        if not index_path.is_file():
            raise CheckpointError(f"{self.path}: sharded checkpoint without {INDEX}")
        index = read_json(index_path)
        version = index.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 2:
            raise CheckpointError(f"{index_path}: sharded format version {version!r}; this zoo reads versions 2 to "
                                  f"{FORMAT_VERSION} (upgrade zoo-core for newer ones)")
        check_sharded_index(index, index_path)
        self.index = index
        self.tensors: dict[str, dict[str, Any]] = index["tensors"]
        self.checksum = checksum_field(version)
        self._open: dict[str, Any] = {}
        self._advised: dict[str, int] = {}  # per file: where the read-ahead asked for so far ends

    def _file(self, rel: str) -> tuple[Any, int, dict[str, Any]]:
        """(open file, where its data starts, its safetensors header)."""
        entry = self._open.get(rel)
        if entry is None:
            path = self.path / rel
            if not path.is_file():
                raise CheckpointError(f"{self.path}: shard file {rel} is missing")
            expected = self.index["files"].get(rel)
            if expected is not None and path.stat().st_size != expected:
                raise CheckpointError(f"{path}: {path.stat().st_size} bytes, the index says {expected} (truncated or replaced)")
            f = open(path, "rb")  # noqa: SIM115 (kept open for the reads to come; closed with the reader)
            try:
                n = int.from_bytes(f.read(8), "little")
                if n > path.stat().st_size - 8:  # a damaged size must not become a huge read
                    raise ValueError(f"header size {n} exceeds the file")
                header = json.loads(f.read(n))
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except ValueError as e:  # JSON, UTF-8 and our own checks
                f.close()
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            entry = self._open[rel] = (f, 8 + n, header)
            if hasattr(os, "posix_fadvise"):  # a rank mostly reads its files front to back: a larger read-ahead
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return entry

    def _read_ahead(self, rel: str, f: Any, at: int) -> None:
        """Ask the kernel for the next ``_AHEAD`` bytes after ``at`` (each byte once): on a cold
        cache the disk reads them while this piece is checked and copied."""
        if not hasattr(os, "posix_fadvise"):
            return
        begin = max(at, self._advised.get(rel, 0))
        if begin < at + _AHEAD // 2:
            os.posix_fadvise(f.fileno(), begin, at + _AHEAD - begin, os.POSIX_FADV_WILLNEED)
            self._advised[rel] = at + _AHEAD

    def read_piece(self, p: Mapping[str, Any], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """A whole piece, read with plain reads (into ``out`` when given) and CRC-checked."""
        f, start, header = self._file(p["file"])
        info = header.get(p["key"])
        if not isinstance(info, dict) or info.get("shape") != list(p["shape"]):
            raise CheckpointError(f"{self.path / p['file']}: no piece {p['key']!r} of shape {p['shape']}, which "
                                  f"{INDEX} lists (one of the two files was changed)")
        if out is None:
            out = torch.empty(tuple(p["shape"]), dtype=dtype)
        view = tensor_bytes(out)
        with reading(self.path / p["file"], CheckpointError, f"header entry {p['key']!r}"):
            begin, end = (int(x) for x in info["data_offsets"])
            f.seek(start + begin)
        self._read_ahead(p["file"], f, start + end)
        if end - begin != len(view) or f.readinto(view) != len(view):
            raise CheckpointError(f"{self.path / p['file']}: piece {p['key']!r} is truncated")
        if CHECKSUMS[self.checksum](view) != p[self.checksum]:
            raise CheckpointError(f"{self.path / p['file']}: checksum mismatch in {p['key']!r} against {INDEX} "
                                  "(the file is corrupted or was changed)")
        return out

    def close(self) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int], *, what: str = "",
             into: torch.Tensor | None = None) -> torch.Tensor:
        """The box ``[offset, offset + shape)`` of global tensor ``name`` (read into ``into``, a
        contiguous tensor of that shape, when given)."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in its {INDEX}{what}")
        out = into
        filled = 0
        for p in t["pieces"]:
            lo = [max(a, b) for a, b in zip(offset, p["offset"])]
            hi = [min(a + s, b + q) for a, s, b, q in zip(offset, shape, p["offset"], p["shape"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            src = tuple(slice(lo_ - po, h - po) for lo_, h, po in zip(lo, hi, p["offset"]))
            dst = tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, offset))
            dtype = getattr(torch, t["dtype"])
            if list(p["offset"]) == list(offset) and list(p["shape"]) == list(shape):
                return self.read_piece(p, dtype, out=into)  # exactly this piece: read straight into the result
            # Otherwise the whole piece is read (its CRC-32 covers all of it) and the box's part used.
            piece = self.read_piece(p, dtype)
            if out is None:
                out = torch.empty(tuple(shape), dtype=dtype)
            part = piece[src]
            out[dst] = part
            filled += part.numel()
        if out is None:
            out = torch.empty(tuple(shape), dtype=getattr(torch, t["dtype"]))
        if filled != out.numel():
            raise CheckpointError(f"{self.path}: {name!r} box {list(offset)}+{list(shape)} is not fully covered by the pieces {INDEX} lists")
        return out

    def read_local(self, name: str, local_shape: Sequence[int], shard: TPShard | Split | None, *, what: str = "",
                   into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece of ``name`` for a tensor of ``local_shape`` split as ``shard`` says;
        read straight into ``into`` (the destination, no copy) when it is a contiguous tensor of
        that shape and the checkpoint's dtype. Returns ``into`` or a new tensor."""
        shape, regs = regions(local_shape, shard)
        if name in self.tensors and self.shape(name) != shape:
            raise CheckpointError(f"{self.path}: {name!r} has shape {list(self.shape(name))} in the checkpoint "
                                  f"({INDEX}), the model needs {list(shape)}{what}")
        if into is not None and not (into.is_contiguous() and into.device.type == "cpu" and not into.requires_grad
                                     and tuple(into.shape) == tuple(local_shape)
                                     and name in self.tensors and str(into.dtype) == f"torch.{self.tensors[name]['dtype']}"):
            into = None
        if len(regs) == 1:
            return self.read(name, regs[0][1], tuple(local_shape), what=what, into=into)
        # Several regions (a gated [gate; up] shard): each is a contiguous block of rows, read in place.
        out = into if into is not None else torch.empty(tuple(local_shape),
                                                        dtype=getattr(torch, self.tensors[name]["dtype"]))
        for sl, offset in regs:
            view = out[sl]
            part = self.read(name, offset, view.shape, what=what, into=view)
            if part is not view:
                view.copy_(part)
        return out

    def full(self, name: str) -> torch.Tensor:
        return self.read(name, (0,) * len(self.shape(name)), self.shape(name))

    def names(self) -> Iterator[str]:
        return iter(self.tensors)

    def rng(self, rank: int) -> rng_mod.RNGState:
        """Rank ``rank``'s random states (rank 0's when the checkpoint had fewer ranks)."""
        from zoo.checkpoint.tensorio import load_file

        with reading(self.path / INDEX, CheckpointError, "random states"):
            entry = self.index["rng"].get(str(rank)) or self.index["rng"]["0"]
            return rng_mod.from_saved(load_file(self.path / relative_name(entry["file"])), entry["other"])

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Entry", "Saver", "ShardedCheckpoint", "finalize", "snapshot", "write_rank"]
