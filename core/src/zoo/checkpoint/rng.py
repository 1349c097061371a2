"""The random-number states a checkpoint keeps per rank, so a resumed run draws what an
uninterrupted one would: torch (CPU and every CUDA device), Python's `random`, NumPy's global
generator, and any extra streams (this rank's tensor-parallel dropout stream)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class RNGState:
    tensors: dict[str, torch.Tensor]  # "torch", "cuda0".., and extra streams ("tp_stream")
    python: list[Any]
    numpy: list[Any]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        return {"python": self.python, "numpy": self.numpy}


def capture(extra: Mapping[str, torch.Tensor] | None = None) -> RNGState:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    tensors.update({k: v.clone() for k, v in (extra or {}).items()})
    py = random.getstate()
    np_state = np.random.get_state()
    return RNGState(tensors, [py[0], list(py[1]), py[2]], [np_state[0], np_state[1].tolist(), *np_state[2:]])


def from_saved(tensors: Mapping[str, torch.Tensor], other: Mapping[str, Any]) -> RNGState:
    """A state read back: ``tensors`` from the RNG file, ``other`` the Python and NumPy states."""
    own = {k: v for k, v in tensors.items() if k == "torch" or k.startswith("cuda")}
    extra = {k: v for k, v in tensors.items() if k not in own}
    state = RNGState(own, list(other["python"]), list(other["numpy"]), extra)
    # Tried on private generators now, so a damaged state fails while its file is being read
    # (the caller names it), not when the run's generators are set.
    v, internal, gauss = state.python
    random.Random().setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state.numpy
    np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.Generator().set_state(own["torch"])
    return state


def restore(state: RNGState) -> None:
    torch.set_rng_state(state.tensors["torch"])
    if torch.cuda.is_available():
        cuda = [state.tensors[k] for k in sorted(k for k in state.tensors if k.startswith("cuda"))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    v, internal, gauss = state.python
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state.numpy
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


__all__ = ["RNGState", "capture", "from_saved", "restore"]
