"""What users debug a run with: per-phase timers with a straggler warning, a profiler window and
a memory snapshot (``logging.timers``, ``logging.profile``, ``logging.memory_snapshot``).

The timers are laps: `Instruments.lap` charges the wall time since the previous lap to a phase,
so the phases of a logging interval always add up to its wall time (nothing is unaccounted), and
the cost is one clock read per phase. Host time: on a GPU, work the host has queued but the
device has not finished shows up in the phase that waits for it (the gradient norm's read at the
optimizer, the loss check) -- where the step actually waits.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from zoo.config.sections import parse_window

# data: waiting for the step's batches; forward_backward: all micro-batches (the pipeline
# schedule on a pipeline stage); grad_sync: the gradient reductions backward did not hide;
# optimizer: clipping, the update, ZeRO's gathers; checkpoint: saves and waiting for an async
# save in flight; eval: validation and previews; other: loss checks, logging.
PHASES = ("data", "forward_backward", "grad_sync", "optimizer", "checkpoint", "eval", "other")
STREAK = 2  # logging intervals a rank must be slow in a row before it is named


class Instruments:
    """One rank's timers, profiler window and memory snapshot."""

    def __init__(self, logging: Any, *, rank: int, world_size: int, device: torch.device | str, stage: int,
                 run_dir: Path, is_main: bool) -> None:
        self.enabled = logging.timers
        self.factor = logging.straggler_factor
        self.rank, self.world, self.device, self.stage = rank, world_size, device, stage
        self.cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        self.is_main, self.run_dir = is_main, run_dir
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.ready = 0.0  # the interval's sum of wall-clock times at which this rank's batches were ready
        self.last = time.perf_counter()
        self.streak: dict[int, int] = {}
        self.window = parse_window(logging.profile, key="logging.profile")
        self.snapshot_step = logging.memory_snapshot or None
        self.prof: Any = None
        self.step_range: Any = None
        if self.snapshot_step is not None and torch.cuda.is_available() and str(device).startswith("cuda"):
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    # ------------------------------------------------------------------------------ timers

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        if self.enabled and self.cuda:
            # A GPU runs a phase's kernels after the host has moved on: without waiting for them,
            # backward's tail is charged to whichever later phase reads a value first (the
            # optimizer's norm check).
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.sums[phase] += now - self.last
        self.last = now
        if phase == "data":
            self.ready += time.time()

    def interval(self, steps: int) -> dict[str, float]:
        """Every rank at a logging step (a collective when several): each phase's mean ms per step
        over the interval -- the mean over ranks, and with several ranks the min and max -- for
        the metrics line; warns when one rank is persistently slower. Starts the next interval."""
        if not self.enabled:
            return {}
        mine = torch.tensor([self.sums[p] for p in PHASES] + [float(self.stage), self.ready], dtype=torch.float64)
        self.sums, self.ready = dict.fromkeys(PHASES, 0.0), 0.0
        if self.world > 1:
            from zoo.parallel.comm import all_gather

            table = all_gather(mine[None].to(self.device), torch.distributed.group.WORLD, dim=0).cpu()  # (ranks, 8)
        else:
            table = mine[None]
        ms = table[:, :len(PHASES)] * 1e3 / max(steps, 1)  # (ranks, phases)
        record: dict[str, float] = {}
        for i, p in enumerate(PHASES):
            record[f"time_{p}_ms"] = float(ms[:, i].mean())
            if self.world > 1:
                record[f"time_{p}_ms_min"], record[f"time_{p}_ms_max"] = float(ms[:, i].min()), float(ms[:, i].max())
        stages = table[:, len(PHASES)].long()
        if int(stages.max()) > 0:  # per pipeline stage: its slowest rank's forward and backward
            fb = ms[:, PHASES.index("forward_backward")]
            for s in range(int(stages.max()) + 1):
                record[f"time_forward_backward_stage{s}_ms"] = float(fb[stages == s].max())
        if self.world > 1:
            # How late each rank's batches were ready, on average, after the first rank's: the
            # others wait that long for it in the step's first collective (wall clocks: one host's,
            # or NTP-synchronised ones, whose skew is far below a step).
            late = (table[:, len(PHASES) + 1] - table[:, len(PHASES) + 1].min()) * 1e3 / max(steps, 1)
            record["time_ready_late_ms_max"] = float(late.max())
            if self.factor > 0:
                self._stragglers(late, ms)
        return record

    def _stragglers(self, late: torch.Tensor, ms: torch.Tensor) -> None:
        step = float(ms.sum(1).median())
        for r, lag in enumerate(late.tolist()):
            slow = lag > (self.factor - 1) * step
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            if slow and self.is_main and self.streak[r] % (5 * STREAK) == STREAK:
                print(f"zoo: straggler: rank {r} starts its steps {lag:.0f} ms after the first rank (a step takes "
                      f"{step:.0f} ms; its data wait {float(ms[r, 0]):.0f} ms against a median of "
                      f"{statistics.median(ms[:, 0].tolist()):.0f} ms), for {self.streak[r]} logging intervals in a row "
                      f"(logging.straggler_factor={self.factor:g}: late by more than {self.factor - 1:g} of a step)",
                      flush=True)

    @staticmethod
    def detail(record: dict[str, Any]) -> str:
        """The compact form for the log line: ``data 3 fb 120 sync 4 opt 20 ms`` (ms per step)."""
        short = {"data": "data", "forward_backward": "fb", "grad_sync": "sync", "optimizer": "opt",
                 "checkpoint": "ckpt", "eval": "eval"}
        parts = [f"{s} {record[f'time_{p}_ms']:.0f}" for p, s in short.items()
                 if f"time_{p}_ms" in record and (record[f"time_{p}_ms"] >= 0.5 or p in ("data", "forward_backward"))]
        return " ".join(parts) + " ms" if parts else ""

    # ------------------------------------------------------------------ profiler and memory

    def step_begin(self, step: int) -> None:
        """Before step ``step``'s data is fetched."""
        if self.window is not None and step == self.window[0]:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if str(self.device).startswith("cuda"):
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True, profile_memory=True)
            self.prof.__enter__()
        if self.prof is not None:
            self.step_range = torch.profiler.record_function(f"zoo step {step}")
            self.step_range.__enter__()

    def step_end(self, step: int) -> None:
        """After step ``step``'s update."""
        if self.prof is not None:
            self.step_range.__exit__(None, None, None)
            if step == self.window[1]:
                self.prof.__exit__(None, None, None)
                path = self.run_dir / "profile" / f"rank_{self.rank}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                self.prof.export_chrome_trace(str(path))
                self.prof = None
                print(f"rank {self.rank}: profiler trace of steps {self.window[0]}-{self.window[1]} in {path} "
                      "(open in https://ui.perfetto.dev or chrome://tracing)", flush=True)
        if step == self.snapshot_step:
            self._memory(step)

    def _memory(self, step: int) -> None:
        out = self.run_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        if str(self.device).startswith("cuda") and torch.cuda.is_available():
            path = out / f"memory_rank_{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"rank {self.rank}: allocator history at step {step} in {path} (drop it on "
                  f"https://pytorch.org/memory_viz); peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
                  "allocated", flush=True)
            return
        # CPU: no allocator history; the process's peak and current resident memory
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
        current = math.nan
        with contextlib.suppress(OSError, ValueError, IndexError):
            current = int(Path(f"/proc/{os.getpid()}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        print(f"rank {self.rank}: memory at step {step}: peak RSS {peak / 2**30:.2f} GiB, now {current / 2**30:.2f} GiB "
              "(CPU: no allocator history; on CUDA this writes the allocator's)", flush=True)

    def close(self) -> None:
        if self.prof is not None:  # the run ended inside the window
            self.prof.__exit__(None, None, None)
            self.prof = None


__all__ = ["PHASES", "Instruments"]
