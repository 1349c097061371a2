"""Megatron's batch-size ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``; here
``train.rampup_batch_size=[START, INCREMENT, SAMPLES]``): the global batch starts at START samples
and grows by INCREMENT each time another SAMPLES / ((global - START) / INCREMENT) samples have been
consumed, ``train.global_batch_size`` from SAMPLES on (megatron-core's
``RampupBatchsizeNumMicroBatchesCalculator``). A step's batch follows from the samples consumed
before it alone, so a resumed run continues the ramp where it was, at any layout whose micro-batch
x data-parallel size divides every size on it (checked when the layout is planned); a data-parallel
rank takes its share of each step's batch, so one process and many read the same samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def batch_size_at(train: Any, consumed: int, final: int) -> int:
    """The global batch of the step that starts after ``consumed`` samples (``final`` without a ramp)."""
    if not train.rampup_batch_size:
        return final
    start, increment, samples = train.rampup_batch_size
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def sizes(train: Any, final: int) -> list[int]:
    """Every global batch size a run takes, ramp first."""
    if not train.rampup_batch_size:
        return [final]
    start, increment, _ = train.rampup_batch_size
    return list(range(start, final + 1, increment))


def samples_for(train: Any, steps: int, final: int) -> int:
    """Samples ``steps`` optimizer steps consume from the start of the run."""
    if not train.rampup_batch_size:
        return steps * final
    consumed, samples = 0, train.rampup_batch_size[2]
    for done in range(steps):
        if consumed > samples:  # past the ramp: whole batches
            return consumed + (steps - done) * final
        consumed += batch_size_at(train, consumed, final)
    return consumed


def step(train: Any, consumed: int, layout: Any) -> tuple[int, int]:
    """The global batch of the step after ``consumed`` samples and its micro-batches per DP rank."""
    size = batch_size_at(train, consumed, layout.global_batch_size)
    return size, size // (layout.global_batch_size // layout.grad_accum)


# The datasets whose order zoo computes from the global sample index, so that each step's batch can
# grow: Megatron indexed data and the built-in corpus (an Energon loader's position is its own).
def rank_micro_batches(train: Any, *, split: str, consumed: int, dp_rank: int, dp_size: int, final: int
                       ) -> Iterator[list[int]]:
    """The global sample indices of each of data-parallel rank ``dp_rank``'s micro-batches, from
    ``consumed`` samples on: its share of every global batch (``final`` samples; in training the
    ramp's size at the samples consumed before the step). What datasets read by global sample
    index (a `DatasetSpec` with ``indexed=True``) hand out, so that any layout and any resume sees
    the same samples."""
    mbs, g = train.micro_batch_size, consumed
    while True:
        gbs = batch_size_at(train, g, final) if split == "train" else final
        per_rank = gbs // dp_size
        mine = g + dp_rank * per_rank
        for m in range(per_rank // mbs):
            yield [mine + m * mbs + j for j in range(mbs)]
        g += gbs


def check_run(run: Any, dataset: Any) -> None:
    """Refuse a ramp where it cannot run: a dataset (a `DatasetSpec`) not read by global sample
    index, CUDA graphs."""
    from zoo.errors import ConfigError

    if not run.train.rampup_batch_size:
        return
    if not dataset.indexed:
        raise ConfigError(f"train.rampup_batch_size with dataset {dataset.name!r}: a growing batch needs data read "
                          "by global sample index (such as megatron, python-docs, sft)")
    if run.train.cuda_graph:
        raise ConfigError("train.rampup_batch_size with train.cuda_graph=true: a growing number of micro-batches "
                          "a step is not captured; ramp eagerly")


def check(train: Any, *, final: int, per_step: int, pp: int, vpp: int) -> None:
    """Every size on the ramp in whole micro-batches of every data-parallel rank (``per_step`` =
    micro-batch x dp), a multiple of pp of them under an interleaved pipeline."""
    from zoo.errors import ConfigError

    for size in sizes(train, final)[:-1]:
        if size % per_step:
            raise ConfigError(f"train: rampup_batch_size={train.rampup_batch_size} reaches a global batch of {size}, "
                              f"not a multiple of micro_batch_size*dp = {per_step}")
        if vpp > 1 and (size // per_step) % pp:
            n = size // per_step
            raise ConfigError(f"train: rampup_batch_size={train.rampup_batch_size} reaches {n} micro-batch"
                              f"{'es' if n != 1 else ''} a step, which interleaved 1F1B (vpp={vpp}) needs a multiple "
                              f"of pp={pp}")


__all__ = ["batch_size_at", "check", "check_run", "samples_for", "sizes", "step"]
