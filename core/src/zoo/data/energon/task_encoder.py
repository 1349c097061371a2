"""Task encoders: the user code that turns dataset samples into training batches, with
Energon's hooks and names (``cookers``, ``encode_sample``, ``select_samples_to_pack`` /
``pack_selected_samples``, ``batch``, ``batch_group_criterion``, ``encode_batch``).

A hook marked ``@stateless(restore_seeds=True)`` runs with torch, NumPy and ``random`` seeded
from the run seed and the sample's restore key, so a sample rebuilt after a restore (from a
buffer saved by key) is augmented exactly as it was the first time, whatever worker builds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zoo.data.energon.samples import Sample


class SkipSample(Exception):  # noqa: N818 (Energon's name)
    """Raised by a hook to drop the sample it was given."""


def stateless(fn: Callable[..., Any] | None = None, *, restore_seeds: bool = False,
              failure_tolerance: int | None = None) -> Any:
    """Mark a hook as a pure function of its input (so its outputs can be rebuilt by key);
    ``restore_seeds`` reseeds the global RNGs per sample around each call. ``failure_tolerance``
    is accepted for Energon's signature; zoo stops at the first failing sample, naming it."""
    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__zoo_stateless__ = True  # type: ignore[attr-defined]
        f.__zoo_restore_seeds__ = restore_seeds  # type: ignore[attr-defined]
        return f
    return mark(fn) if fn is not None else mark


@dataclass(frozen=True)
class Cooker:
    """Turns a crude dict into a sample; used for datasets whose subflavors contain every
    ``has_subflavors`` entry (the first match wins)."""

    cook: Callable[..., Any]
    has_subflavors: dict[str, Any] | None = None

    def matches(self, subflavors: dict[str, Any] | None) -> bool:
        have = subflavors or {}
        return all(have.get(k) == v for k, v in (self.has_subflavors or {}).items())


def cooker(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
    """Energon's ``@cooker`` decorator; zoo's cookers need no options."""
    return fn if fn is not None else (lambda f: f)


def _collate(items: list[Any]) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        if all(t.shape == first.shape for t in items):
            return torch.stack(items)
        shape = [max(t.shape[d] for t in items) for d in range(first.dim())]  # pad-stack, as Energon
        out = first.new_zeros((len(items), *shape))
        for i, t in enumerate(items):
            out[(i, *[slice(0, n) for n in t.shape])] = t
        return out
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return torch.tensor(items)
    return list(items)


def default_batch(samples: list[Any]) -> Any:
    """Dataclass samples -> dict of stacked tensors (padded when shapes differ) and lists;
    dicts likewise; anything else a list."""
    first = samples[0]
    if dataclasses.is_dataclass(first):
        keys = [f.name for f in dataclasses.fields(first)]
        return {k: _collate([getattr(s, k) for s in samples]) for k in keys}
    if isinstance(first, dict):
        return {k: _collate([s[k] for s in samples]) for k in first}
    return _collate(samples)


class TaskEncoder:
    """Override what your task needs; the defaults pass samples through and pad-stack batches."""

    cookers: Sequence[Cooker] = ()
    decoder: bool = True  # crude parts decoded (True) or left as bytes (False)

    def cook_crude_sample(self, sample: dict[str, Any], subflavors: dict[str, Any] | None, where: str) -> Any:
        for c in self.cookers:
            if c.matches(subflavors):
                return c.cook(sample)
        raise ValueError(f"{where}: a crude (CrudeWebdataset) dataset needs a Cooker in the task encoder's cookers "
                         f"matching its subflavors {subflavors or {}}")

    def encode_sample(self, sample: Any) -> Any:
        return sample

    def select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        raise NotImplementedError("packing_buffer_size is set: override select_samples_to_pack and pack_selected_samples")

    def postencode_sample(self, sample: Any) -> Any:
        return sample

    def pack_selected_samples(self, samples: list[Any]) -> Any:
        raise NotImplementedError("packing_buffer_size is set: override select_samples_to_pack and pack_selected_samples")

    def batch_group_criterion(self, sample: Any) -> tuple[Any, int | None]:
        raise NotImplementedError

    def batch(self, samples: list[Any]) -> Any:
        return default_batch(samples)

    def encode_batch(self, batch: Any) -> Any:
        return batch

    def overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(TaskEncoder, name)


class DefaultTaskEncoder(TaskEncoder):
    """Samples pass through and batch to dicts (Energon's default)."""


def key_seed(seed: int, key: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr((seed, key)).encode(), digest_size=8).digest(), "little") >> 1


def pure(fn: Callable[..., Any]) -> bool:
    """Marked ``@stateless`` without ``restore_seeds``: a function of its input alone, which draws
    from no global random stream."""
    target = getattr(fn, "__func__", fn)
    return getattr(target, "__zoo_stateless__", False) and not getattr(target, "__zoo_restore_seeds__", False)


class Reseeder:
    """Runs hooks, those marked ``restore_seeds`` reseeded from (seed, key), and gives the
    caller's torch, NumPy and ``random`` states back at `restore`. A hook that is not marked
    ``@stateless`` runs after a restore, on the caller's streams, as if no reseeded hook had run
    before it (a `pure` one needs no streams).

    The caller's states are saved at the first reseeded call after a restore rather than around
    each call: around every call they cost a quarter of a small image's encoding (NumPy's Mersenne
    Twister state alone is 2.5 KB). The pipeline restores before any other code of the user's runs (a
    cooker, a sample loader, an unmarked hook) and before a batch leaves it."""

    def __init__(self) -> None:
        self.saved: tuple[torch.Tensor, Any, Any] | None = None

    def call(self, fn: Callable[..., Any], arg: Any, *, seed: int, key: Any) -> Any:
        if not getattr(getattr(fn, "__func__", fn), "__zoo_restore_seeds__", False):
            if not pure(fn):
                self.restore()
            return fn(arg)
        if self.saved is None:
            self.saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        s = key_seed(seed, key)
        # The CPU generator only (what is saved and restored here): torch.manual_seed also queues a
        # reseed of every accelerator's generators, each capturing a stack trace, and those it
        # would have left reseeded by the data.
        torch.default_generator.manual_seed(s)
        np.random.seed(s % (1 << 32))
        random.seed(s)
        out = fn(arg)
        if hasattr(out, "__next__"):  # a generator runs lazily: drain it under the seed
            out = list(out)
        return out

    def restore(self) -> None:
        if self.saved is not None:
            (t, n, r), self.saved = self.saved, None
            torch.set_rng_state(t)
            np.random.set_state(n)
            random.setstate(r)


def call_hook(fn: Callable[..., Any], arg: Any, *, seed: int, key: Any) -> Any:
    """``fn(arg)``; reseeded from (seed, key) when marked ``restore_seeds`` (the caller's RNG
    states are put back afterwards)."""
    seeds = Reseeder()
    try:
        return seeds.call(fn, arg, seed=seed, key=key)
    finally:
        seeds.restore()


__all__ = ["Cooker", "DefaultTaskEncoder", "Reseeder", "Sample", "SkipSample", "TaskEncoder", "call_hook", "cooker",
           "default_batch", "pure", "stateless"]
