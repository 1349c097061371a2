"""Child processes started from a server that has imported torch once: data-loader workers
(`zoo.data.energon.loader`) and the ranks of `zoo.testing.run_distributed`.

A spawned child spends ~3 s of CPU importing torch before it does anything; a rank with 8 loader
workers on a node of 8 ranks pays that 64 times at every start. multiprocessing's forkserver
imports the modules in `PRELOAD` once, in a fresh process that has done nothing else (no caller
threads, no torch state: the reason plain fork is not used), and forks each child from it. Such a
child inherits the server's environment, umask and output descriptors from when the server
started, not its caller's now: `callers()` packs the caller's (environment, umask, stdout and
stderr as descriptors handed over at launch) and the child applies them first with `adopt`, so
it starts as a spawned child of its caller would. ``ZOO_START_METHOD=spawn`` (or a platform
without forkserver) spawns every child afresh.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Any

from zoo import io as zoo_io

# torch, its compiler front end (every optimizer imports it), its distributed package
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp"]


def context() -> Any:
    """The multiprocessing context children are started from: forkserver preloaded with `PRELOAD`
    (one server per process, started at the first child), or spawn."""
    if os.environ.get("ZOO_START_METHOD", "forkserver") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm() -> None:
    """Start the forkserver now, where a process knows it will start children later (a training
    run with loader workers): the server imports `PRELOAD` meanwhile, on another core, instead of
    while the first child waits (4 s of imports on a 2-core VM, against ~2 s for spawned workers
    importing torch side by side)."""
    ctx = context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class _CallersFd:
    """One of the caller's file descriptors, handed to the child as it is started (pickled while
    the child is being launched, when multiprocessing can pass descriptors: `DupFd`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()  # type: ignore[no-any-return]


def callers(env: dict[str, str] | None = None) -> tuple[dict[str, str], tuple[Any, Any], int]:
    """What a child of this process should start with: the environment (``env`` on top), stdout and
    stderr, the umask. Pass it to the child's target, which calls `adopt` with it first."""
    return {**os.environ, **(env or {})}, (_CallersFd(1), _CallersFd(2)), zoo_io.umask()


def adopt(packed: tuple[dict[str, str], tuple[Any, Any], int]) -> None:
    """In the child: take the caller's environment, output and umask (`callers`)."""
    environ, stdio, umask = packed
    os.environ.clear()
    os.environ.update(environ)
    os.umask(umask)
    for fd, target in zip(stdio, (1, 2), strict=True):
        if fd != target:  # (a spawned child gets the caller's under their own numbers)
            os.dup2(fd, target)
            os.close(fd)
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # torch read it in the server
        sys.modules["torch"].set_num_threads(int(threads))


def alive(pid: int) -> bool:
    """Whether process ``pid`` is still running. A zombie is not: a killed loader whose parent has
    not reaped it yet (one that reads its output to the end first) is dead, and its forkserver
    children, unlike spawned ones, are not re-parented when it dies."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the number is taken at all
        pass
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # (PermissionError: someone else's took the number)
        return False
    return True
