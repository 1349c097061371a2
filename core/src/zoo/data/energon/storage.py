"""Where a dataset's files live: a local directory or an fsspec URL (``s3://``, ``gs://``,
``file://``, ...). Reads are byte ranges, so a remote shard is never downloaded whole: a sample
is one ranged GET through its `.tar.idx` offsets.

Energon reaches object storage through NVIDIA's Multi-Storage Client (``msc://`` URLs, its own
config file); fsspec is what the rest of the PyTorch ecosystem already configures (s3fs reads
the usual AWS variables and ``~/.aws``), so a user's existing credentials work unchanged.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from typing import Any


def is_url(path: str) -> bool:
    return "://" in str(path)


class Storage:
    """A dataset root: ``read(rel, start, end)``, ``size(rel)``, ``text(rel)``, ``exists(rel)``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root = str(root)
        self.url = is_url(root)
        self.fs: Any = None
        if self.url:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(root)
            self.root = self.root.rstrip("/")
            self.display = root.rstrip("/")
        else:
            self.root = os.path.abspath(root)
            self.display = self.root
        self._fds: dict[str, int] = {}

    def join(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.url else os.path.join(self.root, rel)

    def where(self, rel: str) -> str:
        return posixpath.join(self.display, rel) if self.url else os.path.join(self.root, rel)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.join(rel))) if self.url else os.path.exists(self.join(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.join(rel))) if self.url else os.path.getsize(self.join(rel))

    def text(self, rel: str) -> str:
        try:
            return self.bytes(rel).decode("utf-8")
        except UnicodeDecodeError as e:
            from zoo.errors import ZooError

            raise ZooError(f"{self.where(rel)}: not UTF-8 text ({e})") from None

    def bytes(self, rel: str) -> bytes:
        if self.url:
            return bytes(self.fs.cat_file(self.join(rel)))
        with open(self.join(rel), "rb") as f:
            return f.read()

    def read(self, rel: str, start: int, end: int) -> bytes:
        if self.url:
            return bytes(self.fs.cat_file(self.join(rel), start=start, end=end))
        fd = self._fds.get(rel)
        if fd is None:
            if len(self._fds) >= 64:  # thousands of shards must not exhaust the descriptor limit
                self.close()
            fd = self._fds[rel] = os.open(self.join(rel), os.O_RDONLY)
        return os.pread(fd, end - start, start)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict[str, Any]:  # workers reopen their own file descriptors
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


__all__ = ["Storage", "is_url"]
