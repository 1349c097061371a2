"""File writes that a crash cannot half-do and that keep the user's permissions.

`atomic_write_bytes` writes a temporary file beside the target, syncs it and renames it over the
target: a reader sees the old file or the new one, never half of one. `tempfile.mkstemp` creates
its file with mode 0600 whatever the umask, which would leave datasets, configs and checkpoints
written on a shared cluster unreadable by the rest of the team, so the file is given the mode a
plain ``open`` would have created (0644 under umask 022). `make_dir_like_user` does the same for
`tempfile.mkdtemp` directories (0700 -> 0755).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()


def umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else
    set-and-restored under a lock."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def user_mode(*, directory: bool = False) -> int:
    """The mode ``open`` (0666) or ``mkdir`` (0777) gives a new file or directory under the umask."""
    return (0o777 if directory else 0o666) & ~umask()


def make_dir_like_user(path: Path) -> Path:
    """Give a directory made by `tempfile.mkdtemp` (mode 0700) the mode ``mkdir`` would have given."""
    os.chmod(path, user_mode(directory=True))
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, user_mode())  # mkstemp's 0600 -> what the umask gives a plain file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
