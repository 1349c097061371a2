"""Tar members are data, never filesystem operations: a symlink or hard link member is not
followed (its target's bytes never enter a sample), and names with ``..`` or an absolute path
are only keys -- nothing is written or read outside the shard. Reference: `tarfile` builds the
shard; what the reader returns is compared with the members' own bytes."""

from __future__ import annotations

import io
import os
import tarfile

from zoo.data.energon.tar import index_shard, parse_sample


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", *, kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


def test_links_are_not_followed_and_odd_names_stay_keys(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not for samples")
    shard = tmp_path / "shard" / "000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "a.cls", b"3")
        _add(tar, "a.txt", kind=tarfile.SYMTYPE, link=str(secret))
        _add(tar, "a.json", kind=tarfile.LNKTYPE, link="secret.txt")
        _add(tar, "../../b.txt", b"up")
        _add(tar, "/abs/c.txt", b"abs")
    before = sorted(p for p in tmp_path.rglob("*"))
    idx = index_shard(shard)
    assert idx.keys == ["a", "../../b", "/abs/c"]
    data = shard.read_bytes()
    got = {}
    for i in range(idx.count):
        lo, hi = int(idx.offsets[i]), int(idx.offsets[i + 1])
        key, parts = parse_sample(data[lo:hi], lo, where=str(shard))
        got[key] = parts
    assert got == {"a": {"cls": b"3"}, "../../b": {"txt": b"up"}, "/abs/c": {"txt": b"abs"}}
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing created anywhere
    assert not os.path.exists("/abs/c.txt")
