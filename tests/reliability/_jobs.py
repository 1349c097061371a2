"""Launching and killing whole `torchrun` jobs for the reliability tests.

A job is torchrun's agent plus its workers plus their data-loader workers. torchrun starts each
worker in a session of its own, so killing the agent's process group leaves the workers running:
`kill_job` finds every descendant through /proc, stops them all (none can start another or react),
then SIGKILLs them together, as a lost node or an OOM-killed job would die.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENTRY = Path(__file__).with_name("_trial_entry.py")  # `zoo` with the trials' fault points


def llama_args(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    """A short LLaMA run on the embedded corpus (no TensorBoard, plot or progress bar)."""
    return ["train", "--model", "llama", "--run-dir", str(run_dir), f"data.cache_dir={cache}",
            "train.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=16", "model.num_layers=4",
            "optimizer.grad_clip=0.5", "logging.interval=1", "train.eval_interval=0", "logging.progress=false",
            "logging.tensorboard=false", "logging.plot=false", "parallel.timeout_s=120", *extra]


def env(**extra: str) -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    out.pop("ZOO_PLUGINS", None)
    return out


def torchrun_cmd(*launcher: str, script: Path = ENTRY) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, str(script)]


def start(cmd: list[str], environ: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (read from /proc: no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_job(proc: subprocess.Popen[str]) -> list[int]:
    """SIGKILL the launcher and everything it started, all at once; returns the pids killed."""
    pids = descendants(proc.pid)
    for p in pids:
        with _gone():
            os.kill(p, signal.SIGSTOP)
    pids = descendants(proc.pid)  # anything started before the stop took
    for p in pids:
        with _gone():
            os.kill(p, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


class _gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *_):
        return kind is ProcessLookupError


def wait_for(predicate, proc: subprocess.Popen[str], what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{out[-3000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.02)


def lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def curve(run_dir: Path) -> list[float]:
    """The training losses a run logged, in order."""
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
