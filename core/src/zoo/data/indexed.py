"""Megatron's indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``), read and written byte for byte.

``.idx`` (little-endian): 9-byte magic ``MMIDIDX\\0\\0``, ``<Q`` version 1, ``<B`` dtype code,
``<Q`` sequence count S, ``<Q`` document count D; then int32 lengths[S], int64 byte pointers[S]
into ``.bin``, int64 document indices[D] (sequence index where each document ends, starting with
0), and for multimodal data int8 modes[S]. ``.bin`` is the tokens back to back.

Reading is memory-mapped and validated up front: every size the index implies is checked against
the files, so a truncated ``.bin`` or a foreign ``.idx`` fails when opened, naming the file and what
is wrong, instead of returning garbage later. Writing goes to temporary files; ``finalize`` renames
the ``.bin`` first and the ``.idx`` last, so a prefix whose ``.idx`` exists is complete.
"""

from __future__ import annotations

import operator
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import ZooError
from zoo.io import user_mode

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedDatasetError(ZooError):
    """An indexed dataset file is missing, truncated or not in the format."""


def best_dtype(vocab_size: int) -> type[np.generic]:
    """Megatron's choice: uint16 when the vocabulary fits comfortably, else int32."""
    return np.uint16 if vocab_size < 65_500 else np.int32


def _paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    p = str(prefix)
    for ext in (".bin", ".idx"):
        if p.endswith(ext):
            p = p[: -len(ext)]
    return Path(p + ".idx"), Path(p + ".bin")


def _copy_file(src: Any, dst: Any) -> None:
    """Append ``src`` to ``dst`` inside the kernel where possible (no bytes through Python)."""
    size, done = os.fstat(src.fileno()).st_size, 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < size:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except OSError:  # e.g. across filesystems: finish in user space
            pass
    if done < size:
        src.seek(done)
        shutil.copyfileobj(src, dst, length=1 << 20)
        dst.flush()


class IndexedDataset:
    """A read-only, memory-mapped Megatron indexed dataset."""

    def __init__(self, prefix: str | os.PathLike[str], *, multimodal: bool = False) -> None:
        self.idx_path, self.bin_path = _paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise IndexedDatasetError(f"{p}: file not found")
        idx_size = self.idx_path.stat().st_size
        if idx_size < HEADER.size:
            raise IndexedDatasetError(f"{self.idx_path}: {idx_size} bytes, shorter than the {HEADER.size}-byte header")
        with open(self.idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{self.idx_path}: wrong magic {magic!r} (expected {MAGIC!r}): not a Megatron .idx file")
        if version != VERSION:
            raise IndexedDatasetError(f"{self.idx_path}: format version {version}; only version {VERSION} exists")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{self.idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        self.dtype = np.dtype(DTYPES[code])
        expected = HEADER.size + n_seq * (4 + 8) + n_doc * 8 + (n_seq if multimodal else 0)
        if idx_size != expected:
            hint = " (multimodal modes present? pass multimodal=True)" if idx_size == expected + n_seq and not multimodal else ""
            raise IndexedDatasetError(
                f"{self.idx_path}: {idx_size} bytes, but {n_seq} sequences and {n_doc} document indices need {expected}{hint}"
            )
        mm = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = HEADER.size
        self.sequence_lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=off)
        off += 8 * n_doc
        self.sequence_modes = np.frombuffer(mm, dtype=np.int8, count=n_seq, offset=off) if multimodal else None
        bin_size = self.bin_path.stat().st_size
        self._check_tables(n_seq, n_doc)
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if bin_size != need:
            what = "truncated" if bin_size < need else "longer than its index"
            raise IndexedDatasetError(f"{self.bin_path}: {bin_size} bytes but the index describes {need}: {what}")
        self._bin = np.memmap(self.bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)
        # Random reads are a few attribute lookups and one frombuffer: a memoryview exports its
        # buffer faster than the memmap array does, and the length is kept as a Python int.
        self._view = memoryview(self._bin)
        self._len = n_seq

    def _check_tables(self, n_seq: int, n_doc: int) -> None:
        """Lengths non-negative, each sequence starting where the previous one ends (how Megatron
        and zoo write them; with the size check this keeps every read inside ``.bin``), document
        indices rising from 0 to the sequence count. Vectorised in chunks: a few ms per million
        sequences, and a bit flip anywhere in the tables is named here rather than read later."""
        lens, ptrs, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq:
            raise IndexedDatasetError(f"{self.idx_path}: document indices must run from 0 to the sequence count {n_seq}")
        if n_seq and ptrs[0] != 0:
            raise IndexedDatasetError(f"{self.idx_path}: the first sequence starts at byte {int(ptrs[0])}, not 0")
        size = self.dtype.itemsize
        chunk = 1 << 22
        for a in range(0, n_seq, chunk):
            b = min(a + chunk, n_seq)
            bad = np.flatnonzero(lens[a:b] < 0)
            if bad.size:
                i = a + int(bad[0])
                raise IndexedDatasetError(f"{self.idx_path}: sequence {i} has length {int(lens[i])}")
            if b > a + 1:
                step = ptrs[a + 1:b] - ptrs[a:b - 1]
                bad = np.flatnonzero(step != lens[a:b - 1].astype(np.int64) * size)
                if bad.size:
                    i = a + 1 + int(bad[0])
                    raise IndexedDatasetError(
                        f"{self.idx_path}: sequence {i} starts at byte {int(ptrs[i])}, but sequence {i - 1} "
                        f"(byte {int(ptrs[i - 1])}, {int(lens[i - 1])} tokens) ends at {int(ptrs[i - 1]) + int(lens[i - 1]) * size}")
            if b < n_seq and ptrs[b] - ptrs[b - 1] != int(lens[b - 1]) * size:
                raise IndexedDatasetError(f"{self.idx_path}: sequence {b} does not start where sequence {b - 1} ends")
        for a in range(0, n_doc - 1, chunk):
            b = min(a + chunk + 1, n_doc)
            bad = np.flatnonzero(np.diff(docs[a:b]) < 0)
            if bad.size:
                i = a + 1 + int(bad[0])
                raise IndexedDatasetError(f"{self.idx_path}: document index {i} ({int(docs[i])}) is below the one before it")

    def describe(self) -> str:
        tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        return (f"megatron indexed dataset {self.idx_path.with_suffix('')}: {self._len:,} sequences in "
                f"{len(self.document_indices) - 1:,} documents, {tokens:,} tokens of {self.dtype}, "
                f"{self.bin_path.stat().st_size / 1e6:,.1f} MB")

    def __len__(self) -> int:
        return self._len

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``i`` (a read-only view)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._view, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, key: int | slice) -> Any:
        if type(key) is int or isinstance(key, np.integer):  # the hot path: one sequence
            i = int(key)
            if i < 0:
                i += self._len
            if not 0 <= i < self._len:
                raise IndexError(f"sequence {key} out of range for {self._len} sequences")
            return np.frombuffer(self._view, dtype=self.dtype, count=int(self.sequence_lengths[i]),
                                 offset=int(self.sequence_pointers[i]))
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("indexed datasets support contiguous slices only")
            if start >= stop:
                return []
            lengths = self.sequence_lengths[start:stop]
            flat = np.frombuffer(self._view, dtype=self.dtype, count=int(lengths.sum()),
                                 offset=int(self.sequence_pointers[start]))
            return np.split(flat, np.cumsum(lengths)[:-1])
        return self[operator.index(key)]

    def __reduce__(self) -> tuple[Any, ...]:
        # Reopened, not copied, in another process (a memoryview does not pickle, and a copy of
        # the data would defeat the memory map).
        return (_reopen, (str(self.idx_path), self.sequence_modes is not None))


def _reopen(prefix: str, multimodal: bool) -> IndexedDataset:
    return IndexedDataset(prefix, multimodal=multimodal)


class IndexedDatasetWriter:
    """Builds ``<prefix>.bin/.idx``: add sequences and documents, merge other datasets, finalize.

    Usable as a context manager: leaving the block with an error removes the temporary files and
    leaves no ``.idx``, so nothing partial ever looks complete.
    """

    def __init__(self, prefix: str | os.PathLike[str], *, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.idx_path, self.bin_path = _paths(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise IndexedDatasetError(f"dtype {self.dtype} has no code in the format (supported: {sorted(map(str, CODES))})")
        self.multimodal = multimodal
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.bin_path.parent, prefix=f".{self.bin_path.name}.", suffix=".tmp")
        os.fchmod(fd, user_mode())  # mkstemp's 0600 -> what the umask gives a plain file (teammates read it)
        self._tmp_bin = Path(tmp)
        self._bin = os.fdopen(fd, "wb")
        self._lengths: list[np.ndarray] = []
        self._docs: list[np.ndarray] = [np.zeros(1, np.int64)]
        self._modes: list[np.ndarray] = []
        self._count = 0  # sequences so far
        self._closed = False

    def add_item(self, tokens: Sequence[int] | np.ndarray, mode: int = 0) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(np.array([arr.size], np.int32))
        if self.multimodal:
            self._modes.append(np.array([mode], np.int8))
        self._count += 1

    def end_document(self) -> None:
        self._docs.append(np.array([self._count], np.int64))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None,
                     modes: Sequence[int] | None = None) -> None:
        """One document, optionally split into sequences of ``lengths``."""
        arr = np.asarray(tokens, dtype=self.dtype)
        lens = np.asarray(lengths if lengths is not None else [arr.size], dtype=np.int32)
        if int(lens.sum()) != arr.size:
            raise IndexedDatasetError(f"sequence lengths sum to {int(lens.sum())}, the document has {arr.size} tokens")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(lens)
        if self.multimodal:
            self._modes.append(np.asarray(modes if modes is not None else [0] * len(lens), np.int8))
        self._count += len(lens)
        self.end_document()

    def add_documents(self, docs: Iterable[Sequence[int] | np.ndarray]) -> None:
        for d in docs:
            self.add_document(d)

    def merge(self, prefix: str | os.PathLike[str]) -> None:
        """Append another finalized dataset of the same dtype (its bytes are copied file to file)."""
        other = IndexedDataset(prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{other.idx_path}: dtype {other.dtype}, this dataset is {self.dtype}")
        self._bin.flush()
        with open(other.bin_path, "rb") as src:
            _copy_file(src, self._bin)
        self._lengths.append(np.array(other.sequence_lengths))
        if self.multimodal and other.sequence_modes is not None:
            self._modes.append(np.array(other.sequence_modes))
        self._docs.append(np.array(other.document_indices[1:]) + self._count)
        self._count += len(other)

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.concatenate(self._docs)
        fd, tmp_idx = tempfile.mkstemp(dir=self.idx_path.parent, prefix=f".{self.idx_path.name}.", suffix=".tmp")
        os.fchmod(fd, user_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODES[self.dtype], len(lengths), len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())
            if self.multimodal:
                modes = np.concatenate(self._modes) if self._modes else np.zeros(0, np.int8)
                f.write(modes.astype(np.int8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)  # last: an .idx marks a complete dataset
        self._closed = True

    def abort(self) -> None:
        if not self._closed:
            self._bin.close()
            self._tmp_bin.unlink(missing_ok=True)
            self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None and not self._closed:
            self.finalize()
        else:
            self.abort()
