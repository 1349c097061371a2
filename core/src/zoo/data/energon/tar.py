"""Tar shards as Energon reads them: members grouped into samples, the `.tar.idx` sample index,
and one sample read back from its byte range.

Parsed from the 512-byte headers directly (ustar, GNU long names, pax records) rather than
through `tarfile`: indexing reads only the headers (one ``pread`` per member, the data is
skipped), and a sample's range ``[idx[i], idx[i+1])`` is parsed from one buffer. Offsets are the
ones `tarfile` reports (a member's first header, extension headers included), so the index is
byte-identical to ``energon prepare``'s. Unlike `tarfile`, a shard cut short (a member's data
running past the end of the file, or no end-of-archive blocks) is an error, not a silent end.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoo.errors import ZooError

BLOCK = 512
# Energon's grouping rules (flavors/webdataset/config.py): names starting with a __meta__ component
# are skipped; the key is the directory plus the base name up to its first dot, the part the rest.
SKIP_META = re.compile(r"__[^/]*__($|/)")
SPLIT_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_REGULAR = (b"0", b"\0", b"7", b"S")
_GNU = (b"L", b"K", b"S")


class TarFormatError(ZooError, ValueError):
    """A shard that is not a readable tar (the message names the file and the byte offset)."""


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    offset: int  # of its first header (a pax or GNU long-name header when it has one)
    data: int  # offset of its data
    size: int
    regular: bool


def _octal(field: bytes, where: str) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for sizes over 8 GiB
        return int.from_bytes(field[1:], "big") if field[0] == 0x80 else -1
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"{where}: not a tar header (size field {field!r})") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes, where: str) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] not in (b"\0", b""):
        space = data.find(b" ", pos)
        if space < 0:
            raise TarFormatError(f"{where}: malformed pax record")
        length = int(data[pos:space])
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def iter_members(read, file_size: int, *, start: int = 0, end: int | None = None, where: str) -> Iterator[Member]:
    """Members whose first header lies in ``[start, end)`` (``end`` None: to the end-of-archive
    blocks). ``read(offset, n) -> bytes``. The iteration's ``StopIteration.value`` is the offset
    where it stopped (the end-of-archive blocks for a whole shard)."""
    pos = start
    limit = file_size if end is None else end
    pending_name: str | None = None
    pending_pax: dict[str, str] = {}
    first = None  # offset of the first extension header of the member being assembled
    while pos < limit:
        header = read(pos, BLOCK)
        if len(header) < BLOCK:
            raise TarFormatError(f"{where}: truncated at byte {pos} (a header is cut short; the file is {file_size} bytes)")
        if header == b"\0" * BLOCK:
            if end is None:
                return pos
            raise TarFormatError(f"{where}: end-of-archive blocks at byte {pos}, inside an indexed sample range")
        chksum = _octal(header[148:156], where)
        if chksum != sum(header[:148]) + 256 + sum(header[156:]):
            raise TarFormatError(f"{where}: bad header checksum at byte {pos} (not a tar, or corrupt)")
        kind = header[156:157]
        size = _octal(header[124:136], where)
        data = pos + BLOCK
        nxt = data + -(-size // BLOCK) * BLOCK
        if data + size > file_size:
            raise TarFormatError(f"{where}: truncated: the member at byte {pos} needs {size} bytes of data, "
                                 f"the file ends at {file_size}")
        if first is None:
            first = pos
        if kind in (b"L", b"x"):
            payload = read(data, size)
            if kind == b"L":
                pending_name = payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            else:
                pending_pax.update(_pax(payload, where))
            pos = nxt
            continue
        if kind in (b"K", b"g"):  # a long link name or a global pax header: nothing for a sample
            if kind == b"g":
                first = None
            pos = nxt
            continue
        name = _text(header[0:100])
        prefix = _text(header[345:500]) if header[257:262] == b"ustar" else ""
        if prefix and kind not in _GNU:
            name = prefix + "/" + name
        if pending_name is not None:
            name = pending_name
        if "path" in pending_pax:
            name = pending_pax["path"]
        if "size" in pending_pax:
            size = int(pending_pax["size"])
            nxt = data + -(-size // BLOCK) * BLOCK
        regular = kind in _REGULAR and not (kind == b"\0" and name.endswith("/"))
        yield Member(name, first, data, size, regular)
        pending_name, pending_pax, first = None, {}, None
        pos = nxt
    if end is None:
        raise TarFormatError(f"{where}: truncated: no end-of-archive blocks (the file ends at byte {file_size})")
    return pos


def split_name(name: str) -> tuple[str, str] | None:
    """(key, part) of a member name as Energon groups it; None for members that are no part."""
    if SKIP_META.match(name):
        return None
    m = SPLIT_NAME.match(name)
    return (m.group(1), m.group(2)) if m else None


@dataclass
class ShardIndex:
    offsets: np.ndarray  # uint64, count + 1 entries
    keys: list[str]
    parts: set[str]

    @property
    def count(self) -> int:
        return len(self.keys)


def index_shard(path: str | os.PathLike[str], *, where: str | None = None, max_parts: int = 64) -> ShardIndex:
    """Sample offsets (plus the end offset), keys and part names of one shard, as ``energon
    prepare`` computes them. A key whose parts are not adjacent (the same key twice in a shard)
    is an error."""
    where = where or str(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise TarFormatError(f"{where}: empty file")

        def read(off: int, n: int) -> bytes:
            return os.pread(fd, n, off)

        offsets: list[int] = []
        keys: list[str] = []
        seen: set[str] = set()
        parts: set[str] = set()
        last = None
        it = iter_members(read, size, where=where)
        while True:
            try:
                m = next(it)
            except StopIteration as stop:
                end = stop.value
                break
            if not m.regular:
                continue
            kp = split_name(m.name)
            if kp is None:
                continue
            key, part = kp
            if len(parts) < max_parts:
                parts.add(part)
            if key != last:
                if key in seen:
                    raise TarFormatError(f"{where}: key {key!r} appears twice (its parts are not adjacent); "
                                         "the parts of a sample must be consecutive members")
                seen.add(key)
                offsets.append(m.offset)
                keys.append(key)
                last = key
    finally:
        os.close(fd)
    offsets.append(end)
    return ShardIndex(np.asarray(offsets, dtype=np.uint64), keys, parts)


def idx_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".idx")


def read_idx(data: bytes, *, where: str) -> np.ndarray:
    """A `.tar.idx` file's offsets: native-order uint64, count + 1 entries, non-decreasing."""
    if len(data) % 8 or len(data) < 8:
        raise TarFormatError(f"{where}: {len(data)} bytes is not a .tar.idx (a whole number of uint64, at least one)")
    idx = np.frombuffer(data, dtype=np.uint64)
    if len(idx) > 1 and bool(np.any(idx[1:] < idx[:-1])):
        raise TarFormatError(f"{where}: offsets are not increasing (a .tar.idx of another byte order or file?)")
    return idx


def parse_sample(buf: bytes, base: int, *, where: str) -> tuple[str, dict[str, bytes]]:
    """The key and parts of the one sample whose byte range starts at ``base`` and is ``buf``."""
    def read(off: int, n: int) -> bytes:
        return buf[off - base:off - base + n]

    key = None
    parts: dict[str, bytes] = {}
    for m in iter_members(read, base + len(buf), start=base, end=base + len(buf), where=where):
        if not m.regular:
            continue
        kp = split_name(m.name)
        if kp is None:
            continue
        if key is None:
            key = kp[0]
        elif kp[0] != key:
            raise TarFormatError(f"{where}: byte range at {base} holds samples {key!r} and {kp[0]!r}: "
                                 "the .tar.idx does not match this tar (rerun zoo prepare webdataset)")
        parts[kp[1]] = buf[m.data - base:m.data - base + m.size]
    if key is None:
        raise TarFormatError(f"{where}: no sample at byte {base}: the .tar.idx does not match this tar")
    return key, parts


__all__ = ["Member", "ShardIndex", "TarFormatError", "idx_path", "index_shard", "iter_members", "parse_sample",
           "read_idx", "split_name"]
