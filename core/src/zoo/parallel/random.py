"""Random streams for dropout under tensor parallelism (Megatron's RNG tracker, on any device).

Outside tensor-parallel regions activations are replicated on every TP rank, so every rank must
draw the same dropout mask: the default generator, seeded alike on all ranks. Inside a region the
activations are shards (a slice of the heads, of the MLP width): with the same stream every shard
would get the same mask, correlated in a way one process never is. `TensorParallelRNG.fork()`
switches to a stream of this rank's own (seed ``seed + 2718 + tp_rank``, Megatron's offset) for
the duration of a block and back afterwards, each stream continuing where it stopped. Its state
is saved with checkpoints (`state` / `load_state`), so resume is exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_OFFSET = 2718


class TensorParallelRNG:
    def __init__(self, seed: int, tp_rank: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.seed = seed + _OFFSET + tp_rank
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(self.seed)
            self._state = self._get()

    def _devices(self) -> list[Any]:
        return [self.device] if self.device.type == "cuda" else []

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this rank's own stream inside the block; the default stream is untouched."""
        outside = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(outside)

    def state(self) -> torch.Tensor:
        return self._state.clone()

    def load_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()
