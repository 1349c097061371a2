"""What every rank of a run must agree on outside the step itself: a token naming this run's
partial checkpoint directories, and preemption (SIGTERM asks for a save at the end of the step)."""

from __future__ import annotations

import signal
import threading
from typing import Any


def run_token(world_size: int) -> str:
    """A token every rank agrees on (rank 0's), unique to this run."""
    import secrets

    token = [secrets.token_hex(4)]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)
    return token[0]


class Preemption:
    """SIGTERM (a scheduler preempting the job) asks for a save at the end of the current step."""

    def __init__(self, enabled: bool) -> None:
        self.requested = False
        self.watching = enabled and threading.current_thread() is threading.main_thread()
        self._previous: Any = None
        if self.watching:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self.watching:
            signal.signal(signal.SIGTERM, self._previous)
            self.watching = False


__all__ = ["Preemption", "run_token"]
