"""One of four ranks is SIGKILLed mid-run: every other rank exits non-zero, well within the
collective timeout, with one `zoo: error:` line naming the lost rank, and nothing is left running.

The ranks are started the way each node's launcher starts them on a multi-node job (one rank per
"node", the rendezvous store hosted outside them, as torchrun's agent hosts it), so no launcher sees
the death and tears the job down for them: what the survivors print is zoo's own diagnosis.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["--model", "mixer", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "train.eval_interval=0", "logging.interval=1", "checkpoint.interval=0", "train.steps=100000"]
TIMEOUT_S = 120  # parallel.timeout_s: the survivors must not need it


def test_a_killed_rank_is_named_by_every_survivor_and_nothing_hangs(tmp_path: Path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world, victim = 4, 2
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "OMP_NUM_THREADS": "1"}
        env.pop("ZOO_PLUGINS", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "zoo", "train", *ARGS, "--run-dir", str(tmp_path / "run"),
             f"parallel.timeout_s={TIMEOUT_S}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline, "training did not start"
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.1)
        procs[victim].kill()
        killed_at = time.monotonic()
        outs = {}
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=TIMEOUT_S)
            outs[rank] = (p.returncode, err, time.monotonic() - killed_at)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (rc, err, took) in outs.items():
        if rank == victim:
            continue
        assert rc != 0, f"rank {rank} exited 0"
        lines = [x for x in err.splitlines() if x.startswith("zoo: error:")]
        assert len(lines) == 1, err[-3000:]
        assert re.search(rf"rank {rank}: lost contact with the job: rank {victim} is gone", lines[0]), lines[0]
        assert took < TIMEOUT_S / 2, f"rank {rank} needed {took:.0f} s"
    # Nothing left: every process of the job has exited (the loader runs in-process here).
    assert all(p.poll() is not None for p in procs)
