"""A bad sample (NaN pixels) makes the step's gradient norm non-finite: the step is skipped on every
rank alike (no update, no optimizer state advanced), counted in the metrics and named with its
samples; too many in a row stop the run with one line naming the step and the data. Reference: the
same run on a stream that never had that global batch."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from _trainer_family import DATASET, FAMILY, CondConfig, data

from zoo import DatasetSpec
from zoo.errors import ZooError
from zoo.testing import run_distributed

COMMON = ["train.micro_batch_size=2", "train.global_batch_size=8", "logging.interval=1", "train.eval_interval=0",
          "optimizer.lr=3e-3", "schedule.warmup_steps=0", "schedule.decay=constant", "logging.progress=false",
          "train.seed=5", "train.preview=false", "logging.tensorboard=false"]


def _fit(run_dir: str, world: int, overrides: list[str], dataset: DatasetSpec) -> None:
    from zoo.config import resolve
    from zoo.parallel.layout import plan
    from zoo.training.trainer import Trainer

    run = resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=FAMILY.flavors["tiny"](),
                  recipe=[("recipe of cond", FAMILY.recipe)], overrides=overrides)
    Trainer(FAMILY, run, plan(run, world_size=world, family=FAMILY), run_dir=Path(run_dir), dataset=dataset).fit()


def _stream(**kw) -> DatasetSpec:
    return DatasetSpec(name="cond-data", description=DATASET.description, build=functools.partial(data, **kw),
                       modality="images")


def _tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    from zoo.checkpoint.sharded import ShardedCheckpoint
    from zoo.checkpoint.state import resolve_checkpoint

    with ShardedCheckpoint(resolve_checkpoint(run_dir)) as ck:
        return {name: ck.full(name) for name in ck.names()}


def test_a_nan_sample_skips_its_step_on_every_rank_as_if_its_batch_never_was(tmp_path, capfd):
    # dp2 with the distributed optimizer: sample 9 is in rank 0's half of step 2's batch (8..15).
    layout = ["parallel.zero=1"]
    run_distributed(_fit, 2, str(tmp_path / "nan"), 2, [*COMMON, *layout, "train.steps=5"], _stream(nan_at=(9,)),
                    timeout=240)
    err = capfd.readouterr().err
    assert "step 2 skipped" in err and "samples 8..15 of the train stream of dataset 'cond-data'" in err
    rows = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1, 1]
    run_distributed(_fit, 2, str(tmp_path / "ref"), 2, [*COMMON, *layout, "train.steps=4"], _stream(drop_batch=1),
                    timeout=240)
    ref_rows = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    # Steps 3..5 of the skipping run are steps 2..4 of the run without that batch.
    for a, b in zip(rows[2:], ref_rows[1:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a, b)
    got, ref = _tensors(tmp_path / "nan"), _tensors(tmp_path / "ref")
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.allclose(got[name].double(), t.double(), rtol=1e-6, atol=1e-9), name


def test_too_many_non_finite_steps_in_a_row_stop_naming_the_step_and_its_samples(tmp_path, capfd):
    # Batches 1 and 2 both bad, at most one skipped in a row: step 2 is skipped, step 3 stops the run.
    with pytest.raises(ZooError, match=r"step 3: gradient norm nan \(2 non-finite step\(s\) in a row, "
                                       r"train.skip_nonfinite=1\); its data: samples 16..23 of the train stream"):
        _fit(str(tmp_path / "run"), 1, [*COMMON, "train.steps=5", "train.skip_nonfinite=1"],
             _stream(nan_at=(9, 20)))
    assert "step 2 skipped" in capfd.readouterr().err
    # Stopped after that skip and resumed, the run still counts it: step 3 is the second in a row
    resumed = str(tmp_path / "resumed")
    _fit(resumed, 1, [*COMMON, "train.steps=2", "train.skip_nonfinite=1"], _stream(nan_at=(9, 20)))
    with pytest.raises(ZooError, match=r"step 3: gradient norm nan \(2 non-finite step\(s\) in a row"):
        _fit(resumed, 1, [*COMMON, "train.steps=5", "train.skip_nonfinite=1"], _stream(nan_at=(9, 20)))
    with pytest.raises(ZooError, match="step 2: gradient norm nan"):  # 0: the first one stops
        _fit(str(tmp_path / "first"), 1, [*COMMON, "train.steps=5", "train.skip_nonfinite=0"], _stream(nan_at=(9,)))
