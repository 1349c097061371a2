"""The reading stage of a worker's pipeline (`zoo.data.energon.pipeline`): each dataset's share of
the samples for one global worker (`worker_range`, within Energon's nested ``subset``), cut at
shard boundaries into slices of about ``max_samples_per_sequence`` and read a few slices at a
time in a shuffled order (`LeafReader`), with the seeded NumPy generators every stage uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zoo.data.energon.dataset import WebDataset


def seeded_rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words])))


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    return rng.bit_generator.state


def set_rng_state(rng: np.random.Generator, state: dict[str, Any]) -> None:
    rng.bit_generator.state = state


def resolve_subset(subset: tuple[tuple[Any, Any], ...], n: int, where: str) -> tuple[int, int]:
    """Energon's nested ``subset: {range: [a, b]}``: the inner range first, the outer scaled inside it."""
    def bound(v: Any, default: int, length: int) -> int:
        if v == "end" or v is None:
            return default
        try:
            if isinstance(v, str) and v.strip().endswith("%"):
                return int(round(float(v.strip()[:-1]) / 100 * length))
            if type(v) is not int:
                raise ValueError
            return v
        except (ValueError, OverflowError):
            from zoo.errors import ZooError

            raise ZooError(f"{where}: subset bound {v!r} is not an index, a percentage or 'end'") from None

    lo, hi = 0, n
    for a, b in subset:
        length = hi - lo
        new_lo, new_hi = lo + bound(a, 0, length), lo + bound(b, length, length)
        if not lo <= new_lo <= new_hi <= hi:
            from zoo.errors import ZooError

            raise ZooError(f"{where}: subset range [{a}, {b}] is outside the {length} samples it applies to")
        lo, hi = new_lo, new_hi
    return lo, hi


def worker_range(n: int, g: int, G: int, rotation: int) -> tuple[int, int]:
    """Global worker ``g``'s contiguous share of ``n`` samples: ``n // G`` each, the ``n % G``
    extra samples to the workers after ``rotation`` (so remainders of several datasets spread)."""
    base, extra = divmod(n, G)
    gets = [base + (1 if (w - rotation) % G < extra else 0) for w in range(G)]
    start = sum(gets[:g])
    return start, start + gets[g]


class LeafReader:
    """Sample indices of one dataset for one worker, slice by slice.

    ``shuffle_over_epochs`` (Energon's, training only): ``k >= 1`` shuffles the slices of k passes
    together (1: every sample once per epoch), ``-1`` draws slices with replacement (an epoch is
    then a round of as many draws as there are slices), ``None`` reads the slices in order, one at a
    time. `pass_id` names the occurrence of the sample `next` returned (a sample comes round again
    under a new one, so a hook seeded by it draws afresh)."""

    def __init__(self, ds: WebDataset, lo: int, hi: int, *, training: bool, msps: int | None, parallel: int,
                 limit: int | None, seed_words: tuple[int, ...], shuffle_over_epochs: int | None = 1) -> None:
        bounds = [b for b in ds._starts if lo < b < hi]  # shard boundaries inside the range
        pieces = list(zip([lo, *bounds], [*bounds, hi])) if hi > lo else []
        self.slices: list[tuple[int, int]] = []
        for a, b in pieces:
            k = round((b - a) / msps) if msps and (b - a) > 1.5 * msps else 1
            cuts = [a + (b - a) * i // k for i in range(k + 1)]
            self.slices += list(zip(cuts[:-1], cuts[1:]))
        self.n = hi - lo
        self.soe = shuffle_over_epochs if training else None
        self.training, self.parallel = training, parallel if self.soe is not None else 1
        self.limit = limit  # samples in all (None: epochs without end)
        self.seed_words = seed_words
        self.rng = seeded_rng(*seed_words, 1)
        self.epoch, self.next_slice, self.taken, self.pass_id = 0, 0, 0, 0
        self.active: list[list[int]] = []
        self.order = self._order()

    def _order(self) -> list[int]:
        """This epoch's slice order; sets `seen`: each entry's count of earlier ones of its slice."""
        n = len(self.slices)
        self.seen: list[int] | None = None  # (None: every slice comes once)
        if self.soe is None:
            return list(range(n))
        rng = seeded_rng(*self.seed_words, 2, self.epoch)
        if self.soe == 1:
            return rng.permutation(n).tolist()
        order = rng.integers(n, size=n) if self.soe == -1 else rng.permutation(np.tile(np.arange(n), self.soe))
        by_slice = np.argsort(order, kind="stable")  # each slice's entries together, in order of position
        first = np.searchsorted(order[by_slice], order[by_slice])  # where each entry's slice starts
        seen = np.empty(len(order), dtype=np.int64)
        seen[by_slice] = np.arange(len(order)) - first
        self.seen = seen.tolist()
        return order.tolist()

    def _passes(self) -> int:
        """Occurrences of a slice one epoch's order can hold."""
        return max(len(self.slices), 1) if self.soe == -1 else (self.soe or 1)

    def next(self) -> int:
        if self.limit is not None and self.taken >= self.limit:
            raise StopIteration
        while len(self.active) < self.parallel and self.next_slice < len(self.order):
            s = self.order[self.next_slice]
            # The pass: the epoch when each slice comes once per epoch (as it always was),
            # otherwise also which of this epoch's occurrences of the slice this is.
            seen = self.seen[self.next_slice] if self.seen is not None else 0
            self.active.append([s, self.slices[s][0], self.epoch * self._passes() + seen])
            self.next_slice += 1
        if not self.active:
            if not self.training or not self.slices:
                raise StopIteration
            self.epoch, self.next_slice = self.epoch + 1, 0
            self.order = self._order()
            return self.next()
        if len(self.active) == 1:
            k = 0
        else:
            # A slice is drawn in proportion to the samples it has left (plain Python: a dozen
            # slices per sample is cheaper without numpy's per-call overhead).
            left = [self.slices[e[0]][1] - e[1] for e in self.active]
            r = int(self.rng.integers(sum(left)))
            k = 0
            while r >= left[k]:
                r -= left[k]
                k += 1
        entry = self.active[k]
        idx = entry[1]
        self.pass_id = entry[2] if len(entry) > 2 else self.epoch  # (a state saved before passes were kept)
        entry[1] += 1
        if entry[1] >= self.slices[entry[0]][1]:
            self.active.pop(k)
        self.taken += 1
        return idx

    def state(self) -> dict[str, Any]:
        return {"rng": rng_state(self.rng), "epoch": self.epoch, "next": self.next_slice, "taken": self.taken,
                "active": [list(a) for a in self.active]}

    def restore(self, st: dict[str, Any]) -> None:
        set_rng_state(self.rng, st["rng"])
        self.epoch, self.next_slice, self.taken = st["epoch"], st["next"], st["taken"]
        self.active = [list(a) for a in st["active"]]
        self.order = self._order()


__all__ = ["LeafReader", "resolve_subset", "rng_state", "seeded_rng", "set_rng_state", "worker_range"]
