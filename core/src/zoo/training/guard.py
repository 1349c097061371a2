"""Non-finite losses and gradients (``train.skip_nonfinite``).

A step whose global gradient norm is not finite is skipped: no optimizer or EMA update, its
gradients dropped, the data stream moves on (the step still counts, as Megatron's skipped
iterations do). A non-finite loss makes non-finite gradients, and the norm is the same number on
every rank (summed over TP, PP and DP), so every rank decides alike without another collective.
More than ``limit`` skipped steps in a row stop the run with an error naming the step and the
samples of its global batch (for Energon data also each sample's dataset, shard and key, gathered
from every data-parallel rank); ``limit=0`` stops at the first. fp16 runs leave overflow to the
dynamic loss scale, which skips and lowers the scale instead.

Deciding costs one read of the gradient norm per step; the losses themselves are still read only at
log lines and saves (`check_losses`).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from zoo.errors import ZooError


class NonFiniteGuard:
    def __init__(self, limit: int, *, announce: bool, batch: int, stream: str, data: Any = None) -> None:
        if limit < 0:
            raise ZooError(f"train.skip_nonfinite={limit}: expected 0 (stop at the first) or more")
        self.limit, self.announce, self.batch, self.stream = limit, announce, batch, stream
        self.data = data  # a stateful dataset's `DataPosition`, which names the samples of the step
        self.in_a_row = 0
        self.skipped = 0  # over the run, logged as skipped_steps (both counts carried by checkpoints)
        self.unchecked: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, loss) not yet read

    def loss(self, step: int, lr: float, loss: torch.Tensor) -> None:
        self.unchecked.append((step, lr, loss.detach()))

    def skip(self, grad_norm: torch.Tensor, *, step: int, first_sample: int) -> bool:
        """Whether step ``step``, whose global batch starts at ``first_sample`` of the stream, must not update."""
        norm = float(grad_norm)
        if math.isfinite(norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.skipped += 1
        # Its loss is accounted for here, not again at the next log line.
        self.unchecked = [u for u in self.unchecked if u[0] != step]
        data = f"samples {first_sample}..{first_sample + self.batch - 1} of {self.stream}"
        if self.data is not None:  # a collective: every rank skips the same steps
            names = self.data.sources()
            if names:
                data += f" ({', '.join(names[:8])}{f' and {len(names) - 8} more' if len(names) > 8 else ''})"
        if self.in_a_row > self.limit:
            raise ZooError(f"step {step}: gradient norm {norm} ({self.in_a_row} non-finite step(s) in a row, "
                           f"train.skip_nonfinite={self.limit}); its data: {data}. Lower optimizer.lr, or look for a "
                           "bad sample there")
        if self.announce:
            print(f"zoo: warning: step {step} skipped: gradient norm {norm} ({self.in_a_row} in a row of at most "
                  f"{self.limit}); its data: {data}", file=sys.stderr, flush=True)
        return True

    def check_losses(self) -> None:
        """Fail on the first non-finite loss since the last check (one read of the device)."""
        if not self.unchecked:
            return
        losses = torch.stack([loss.float() for _, _, loss in self.unchecked]).cpu()
        bad = (~torch.isfinite(losses)).nonzero()
        if len(bad):
            step, lr, _ = self.unchecked[int(bad[0])]
            raise ZooError(f"loss is {float(losses[int(bad[0])])} at step {step} (lr {lr:.3g}); lower optimizer.lr "
                           "or check the data")
        self.unchecked.clear()
