"""zoo.procs: the preloaded forkserver children start from, and how a child tells its starter is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from zoo import procs


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_zombie_is_not_alive_nor_a_reaped_process():
    """A killed loader whose parent has not reaped it yet is a zombie: its workers must count it as
    gone (forked from the server, they are not re-parented when it dies)."""
    assert procs.alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _state(child.pid) != "Z" and time.monotonic() < deadline:  # exited, not yet reaped
        time.sleep(0.05)
    assert _state(child.pid) == "Z" and not procs.alive(child.pid)
    child.wait()
    assert not procs.alive(child.pid)


def test_warm_starts_the_server_once(monkeypatch):
    """`warm` starts the forkserver ahead of the first child (the trainer calls it before building
    the model when the loader has workers); again, it starts nothing new."""
    from multiprocessing import forkserver

    monkeypatch.setenv("ZOO_START_METHOD", "forkserver")
    procs.warm()
    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None and procs.alive(pid)
    procs.warm()
    assert forkserver._forkserver._forkserver_pid == pid
