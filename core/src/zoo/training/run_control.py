"""What every rank of a run must agree on outside the step itself: where it resumes from, a token
naming this run's partial checkpoint directories, that the checkpoint directory is one for all of
them, and preemption (SIGTERM asks for a save at the end of the step)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from zoo.errors import ConfigError, UsageError


def resume_point(resume: str, ckpt_root: Path, run_dir: Path) -> Path | None:
    """The checkpoint a run continues from (``checkpoint.resume``: "auto", "none" or a path; checkpoints
    in ``ckpt_root``), or None for a fresh start; refuses a fresh start that would overwrite another
    run's records."""
    from zoo.checkpoint.state import complete_checkpoints, latest, resolve_checkpoint

    if resume not in ("auto", "none"):
        return resolve_checkpoint(resume)
    if resume == "none" and complete_checkpoints(ckpt_root):
        raise ConfigError(f"{ckpt_root} already holds checkpoints; continue with checkpoint.resume=auto "
                          "or use another --run-dir")
    found = latest(ckpt_root) if resume == "auto" else None
    # A fresh start rewrites the run directory's records (metrics, loss plot, config, samples). With
    # checkpoint.dir elsewhere, the run directory may hold another run, its checkpoints included:
    # its records would then no longer describe its checkpoints.
    own = run_dir / "checkpoints"
    if found is None and ckpt_root.resolve() != own.resolve() and complete_checkpoints(own):
        raise ConfigError(f"{run_dir} holds another run (checkpoints in {own}) whose metrics and config this run, "
                          f"starting fresh with checkpoint.dir={ckpt_root}, would overwrite; use another --run-dir")
    return found


def run_token(world_size: int, *, shared: Path | None = None) -> str:
    """A token every rank agrees on (rank 0's), unique to this run; with ``shared``, also checks
    that every rank sees that directory as the same one (`check_shared`)."""
    import secrets

    token = [secrets.token_hex(4)]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)
        if shared is not None:
            check_shared(shared, token[0])
    return token[0]


def check_shared(path: Path, token: str) -> None:
    """Every rank writes its part of a checkpoint into ``path`` and global rank 0 waits for all the
    parts there, so on several nodes it must be a shared filesystem: a node-local directory would
    only show up as rank 0 waiting out ``parallel.timeout_s`` at the first save. Rank 0 leaves a
    file, every rank looks for it, and all of them fail at once if any cannot see it."""
    import socket

    import torch.distributed as dist

    probe = path / f".zoo-shared-{token}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        probe.touch()
    dist.barrier()
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (probe.exists(), socket.gethostname()))
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (ok, host) in enumerate(seen) if not ok]
    if blind:
        who = ", ".join(f"rank {r} ({host})" for r, host in blind[:8]) + (" ..." if len(blind) > 8 else "")
        raise UsageError(f"checkpoint directory {path} is not shared by every rank: {who} cannot see the file rank 0 "
                         f"({seen[0][1]}) wrote there; every rank writes its part of a checkpoint into it, so put "
                         "the run directory (or checkpoint.dir) on a filesystem all nodes mount (docs/launch.md)")


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
