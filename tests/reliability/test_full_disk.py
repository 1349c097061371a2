"""A save that cannot be written (a file-size limit here, which fails writes with EFBIG as a full
disk fails them with ENOSPC) is one clear error naming the checkpoint directory; the previous
checkpoint stays complete, `latest` stays on it and the partial directory goes. With
``checkpoint.on_save_error=continue`` training goes on, and an async save's failure is reported at
the next step."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = ["--model", "mixer", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "train.eval_interval=0", "logging.interval=1"]
LIMIT = 512 * 1024  # below the model's checkpoint file (1.3 MB), above every other file the run writes


def _zoo(run_dir: Path, *extra: str, limit: int | None = None) -> subprocess.CompletedProcess:
    def cap() -> None:  # in the child: writes past the limit fail with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    # The cap also stops torch's compiler from writing the fused CPU kernels (zoo.fused falls back
    # to eager and says so in a line of its own): off, so the checkpoint's error is the only line.
    extra = (*extra, "train.cpu_fused=eager") if limit else extra
    return subprocess.run([sys.executable, "-m", "zoo", "train", *ARGS, "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=300, preexec_fn=cap if limit else None)


def _complete(ckpt: Path) -> None:
    from zoo.checkpoint.sharded import ShardedCheckpoint

    with ShardedCheckpoint(ckpt) as ck:  # every tensor reads back against its checksum
        assert all(ck.full(name).numel() for name in ck.names())


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("full_disk") / "base"
    out = _zoo(run, "train.steps=2")
    assert out.returncode == 0, out.stderr
    return run


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_cannot_be_written_stops_with_the_directory_named(saved_at_2, tmp_path, async_save):
    import shutil

    from zoo.checkpoint.state import resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(saved_at_2, run)
    out = _zoo(run, "train.steps=4", f"checkpoint.async_save={str(async_save).lower()}", limit=LIMIT)
    assert out.returncode == 1, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, out.stderr
    ckpts = run / "checkpoints"
    assert lines[0].startswith(f"zoo: error: could not write checkpoint {ckpts / 'step_00000004'}: ")
    assert "File too large" in lines[0] and f"the newest complete one is still {ckpts / 'step_00000002'}" in lines[0]
    assert resolve_checkpoint(run) == ckpts / "step_00000002"
    _complete(ckpts / "step_00000002")
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith(".")) == []  # no partial directory left


def test_on_save_error_continue_trains_on_and_reports_an_async_failure_at_the_next_step(saved_at_2, tmp_path):
    import json
    import shutil

    from zoo.checkpoint.state import resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(saved_at_2, run)
    out = _zoo(run, "train.steps=5", "checkpoint.interval=1", "checkpoint.async_save=true",
               "checkpoint.on_save_error=continue", limit=LIMIT)
    assert out.returncode == 0, out.stderr
    warnings = [x for x in out.stderr.splitlines() if x.startswith("zoo: warning: could not write checkpoint")]
    # Saves at steps 3, 4 and 5 fail: the first two reported at the following step, the last before the end.
    assert [w.split("step_")[1][:8] for w in warnings] == ["00000003", "00000004", "00000005"], out.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-3:] == [3, 4, 5]
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_00000002"
    _complete(run / "checkpoints" / "step_00000002")


def _fit_capped(run_dir: str, capped_rank: int) -> None:
    import torch.distributed as dist
    from _trainer_family import DATASET, FAMILY, CondConfig

    from zoo.config import resolve
    from zoo.parallel.layout import plan
    from zoo.training.trainer import Trainer

    if dist.get_rank() == capped_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    run = resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=FAMILY.flavors["tiny"](),
                  recipe=[("recipe of cond", FAMILY.recipe)],
                  overrides=["train.steps=2", "train.micro_batch_size=2", "parallel.tp=2", "train.eval_interval=0",
                             "logging.progress=false", "logging.tensorboard=false", "train.preview=false",
                             "parallel.timeout_s=120"])
    from zoo.checkpoint.tensorio import CheckpointError

    try:
        Trainer(FAMILY, run, plan(run, world_size=2, family=FAMILY), run_dir=Path(run_dir), dataset=DATASET).fit()
    except CheckpointError as e:
        return str(e)
    return None


def test_a_rank_that_cannot_write_its_part_fails_the_save_at_once_on_rank_0(tmp_path):
    import time

    from zoo.testing import run_distributed

    t = time.monotonic()
    errors = run_distributed(_fit_capped, 2, str(tmp_path), 1, timeout=200)
    # Rank 0 learns of rank 1's failure from its marker instead of waiting out parallel.timeout_s.
    assert time.monotonic() - t < 100
    dst = tmp_path / "checkpoints" / "step_00000002"
    assert errors[1].startswith(f"could not write checkpoint {dst}: [Errno 27] File too large"), errors
    assert errors[0].startswith(f"could not write checkpoint {dst}: rank 1 could not write its part: "
                                "[Errno 27] File too large"), errors
    assert not list((tmp_path / "checkpoints").glob(".step_*"))
