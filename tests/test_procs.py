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


_WARM = """
import os, sys
from multiprocessing import forkserver
from zoo import procs
server = forkserver._forkserver
assert server._forkserver_pid is None  # a fresh process: no server yet
procs.warm()
pid = server._forkserver_pid
print(pid if pid is None else int(procs.alive(pid)))
procs.warm()
assert server._forkserver_pid == pid  # again: nothing new started
"""


def test_warm_starts_the_server_once_and_spawn_starts_none():
    """`warm` starts the forkserver ahead of the first child (the trainer calls it before building
    the model when the loader has workers), once; with ``ZOO_START_METHOD=spawn`` none. Each in a
    fresh process, where no earlier test has started one."""
    for method, want in (("forkserver", "1"), ("spawn", "None")):
        env = {**os.environ, "ZOO_START_METHOD": method}
        out = subprocess.run([sys.executable, "-c", _WARM], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [want], (method, out.stdout)
