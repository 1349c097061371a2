"""`python -m zoo` with the fault points of the kill trials, chosen through the environment
(torchrun runs this file as each worker's script):

- ``ZOO_TRIAL_COUNT=DIR``: count this rank's calls to the checkpoint writer's steps (each file
  written, each directory sync, the completing rename) and leave ``DIR/rank<R>`` with the count.
- ``ZOO_TRIAL_HANG=RANK:N:FLAG``: at rank RANK's N-th such call, create FLAG and stop there for
  good; the test then kills the whole job, so the save is cut at exactly that point (in the
  training thread for a synchronous save, in the writer thread while training goes on for an
  asynchronous one).
- ``ZOO_TRIAL_DIE=RANK:LINES:METRICS``: on torchrun's first attempt only, rank RANK SIGKILLs
  itself once METRICS holds LINES lines (an elastic restart must then take over).
- ``ZOO_TRIAL_SLOW=RANK:SECONDS``: rank RANK sleeps SECONDS before each training batch (a slow
  data path on one rank: the straggler warning must name it).
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import zoo.checkpoint.sharded as sharded

RANK = int(os.environ.get("RANK", "0"))
calls = [0]


def _point(name):
    original = getattr(sharded, name)

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if hang is not None and hang[0] == RANK and hang[1] == calls[0]:
            Path(hang[2]).touch()
            threading.Event().wait()  # until the job is killed
        return original(*args, **kwargs)

    setattr(sharded, name, wrapped)


hang = None
if os.environ.get("ZOO_TRIAL_HANG"):
    r, n, flag = os.environ["ZOO_TRIAL_HANG"].split(":", 2)
    hang = (int(r), int(n), flag)
for name in ("write_safetensors", "atomic_write_text", "_fsync_dir", "complete_and_move"):
    _point(name)

if os.environ.get("ZOO_TRIAL_COUNT"):
    import atexit

    atexit.register(lambda: (Path(os.environ["ZOO_TRIAL_COUNT"]) / f"rank{RANK}").write_text(str(calls[0])))

if (__name__ == "__main__" and os.environ.get("ZOO_TRIAL_DIE")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
    r, at, metrics = os.environ["ZOO_TRIAL_DIE"].split(":", 2)
    if int(r) == RANK:
        def _die():
            while True:
                try:
                    if len(Path(metrics).read_text().splitlines()) >= int(at):
                        os.kill(os.getpid(), signal.SIGKILL)
                except OSError:
                    pass
                time.sleep(0.01)

        threading.Thread(target=_die, daemon=True).start()

if os.environ.get("ZOO_TRIAL_SLOW"):
    r, seconds = os.environ["ZOO_TRIAL_SLOW"].split(":")
    if int(r) == RANK:
        from zoo.training.trainer import Trainer

        data = Trainer.data

        def slow(self, split, start):
            for batch in data(self, split, start):
                if split == "train":
                    time.sleep(float(seconds))
                yield batch

        Trainer.data = slow

if __name__ == "__main__":  # (loader workers started by spawn import this file as __mp_main__)
    from zoo.cli import main

    sys.exit(main(sys.argv[1:]))
