"""kill -9 under parallelism: a whole `torchrun` job (agent, ranks, loader workers) is SIGKILLed at
a seeded moment, then the same command runs again; it must resume from the newest complete
checkpoint (never a partial one) and end on the uninterrupted run's loss curve, bit for bit.

Jobs: LLaMA tp2 x pp2 with synchronous saves; LLaMA dp2 x pp2 with ZeRO-1 and asynchronous saves;
DiT dp2 reading the Energon digits with 2 loader workers per rank (the data position must survive).
Moments, alternating per trial: inside a save (rank and call chosen among every file write,
directory sync and completing rename the uninterrupted run made; for an async save the writer
thread stops there while training goes on), or mid-training (after a seeded number of logged
steps plus a seeded delay).

CI runs one trial per job; the full count is ``ZOO_KILL_TRIALS=10 pytest tests/reliability/test_kill_trials.py``
(``ZOO_KILL_SEED`` picks another set of moments). Each trial prints its moment and recovery time.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from _jobs import curve, env, kill_job, lines, llama_args, start, torchrun_cmd, wait_for

from zoo.checkpoint import ShardedCheckpoint
from zoo.checkpoint.model_dir import complete_checkpoints

TRIALS = int(os.environ.get("ZOO_KILL_TRIALS", "1"))
SEED = int(os.environ.get("ZOO_KILL_SEED", "0"))
STEPS = 8


def _dit_args(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "--model", "dit", "--run-dir", str(run_dir), f"data.cache_dir={cache}", "train.micro_batch_size=8",
            "data.num_workers=2", "logging.interval=1", "train.eval_interval=0", "logging.progress=false",
            "logging.tensorboard=false", "logging.plot=false", "parallel.timeout_s=120", *extra]


# name: (ranks, argument builder, layout, moments alternated trial by trial)
JOBS = {
    "llama-tp2-pp2": (4, llama_args, ["parallel.tp=2", "parallel.pp=2"], ("save", "step")),
    "llama-dp2-pp2-zero-async": (4, llama_args, ["parallel.pp=2", "parallel.zero=1", "checkpoint.async_save=true"],
                                 ("save", "step")),
    "dit-dp2-energon-2-workers": (2, _dit_args, [], ("step", "save")),
}


def _command(job: str, run_dir: Path, cache: Path) -> list[str]:
    ranks, build, layout, _ = JOBS[job]
    return torchrun_cmd("--standalone", "--nproc-per-node", str(ranks)) + build(
        run_dir, cache, f"train.steps={STEPS}", "checkpoint.interval=2", *layout)


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache) -> dict:
    """Each job run once uninterrupted (lazily), counting every rank's checkpoint-writing calls."""
    done: dict[str, tuple[list[float], dict[int, int]]] = {}

    def get(job: str, cache: Path) -> tuple[list[float], dict[int, int]]:
        if job not in done:
            root = tmp_path_factory.mktemp(job)
            counts = root / "counts"
            counts.mkdir()
            proc = start(_command(job, root / "run", cache), env(ZOO_TRIAL_COUNT=str(counts)))
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, out[-2000:] + err[-4000:]
            done[job] = (curve(root / "run"), {int(p.name[4:]): int(p.read_text()) for p in counts.iterdir()})
            assert len(done[job][0]) == STEPS
        return done[job]

    return get


def _check_checkpoints(root: Path) -> Path | None:
    """Every step directory is complete and readable, and `latest` names one of them (a kill
    between the completing rename and rewriting `latest` leaves it on the one before). Returns the
    newest, which a rerun must take."""
    steps = sorted(p for p in root.glob("step_*")) if root.is_dir() else []
    complete = [p for _, p in complete_checkpoints(root)]
    assert steps == complete, f"an incomplete checkpoint under a final name: {steps} vs {complete}"
    for path in complete:
        with ShardedCheckpoint(path) as ckpt:
            for name in ckpt.names():
                ckpt.full(name)  # every byte is there (checksummed pieces)
    if (root / "latest").exists():
        assert (root / "latest").read_text().strip() in {p.name for p in complete}
    return complete[-1] if complete else None


@pytest.mark.parametrize("trial", range(TRIALS))
@pytest.mark.parametrize("job", list(JOBS))
def test_kill_9_then_the_same_command_ends_on_the_uninterrupted_curve(job, trial, references, tmp_path, corpus_cache,
                                                                      tmp_path_factory):
    cache = corpus_cache if JOBS[job][1] is llama_args else tmp_path_factory.getbasetemp() / "dit-cache"
    reference, counts = references(job, cache)
    rng = random.Random(f"{job}/{SEED}/{trial}")
    moment = JOBS[job][3][trial % 2]
    run = tmp_path / "run"
    flag = tmp_path / "stopped-in-a-save"
    if moment == "save":
        rank = rng.randrange(len(counts))
        call = rng.randint(1, counts[rank])
        what = f"inside a save: rank {rank}, checkpoint call {call} of {counts[rank]}"
        proc = start(_command(job, run, cache), env(ZOO_TRIAL_HANG=f"{rank}:{call}:{flag}"))
        wait_for(flag.exists, proc, "the chosen checkpoint call")
    else:
        logged = rng.randint(1, STEPS - 2)
        what = f"mid-training: after {logged} logged steps"
        proc = start(_command(job, run, cache), env())
        wait_for(lambda: lines(run / "metrics.jsonl") >= logged, proc, f"{logged} logged steps")
    time.sleep(rng.uniform(0.0, 0.3))  # let the other ranks (or the training thread) move on a little
    assert proc.poll() is None, "the job ended before the kill"
    killed = kill_job(proc)
    assert len(killed) > JOBS[job][0], killed  # the agent, every rank (and loader workers)

    newest = _check_checkpoints(run / "checkpoints")
    started = time.monotonic()
    again = start(_command(job, run, cache), env())
    out, err = again.communicate(timeout=400)
    took = time.monotonic() - started
    assert again.returncode == 0, out[-2000:] + err[-4000:]
    if newest is not None:
        assert f"resuming from {newest}" in out
    print(f"{job} trial {trial} (seed {SEED}): killed {what}; resumed from "
          f"{newest.name if newest else 'the start'} in {took:.1f} s")
    assert curve(run) == reference
    _check_checkpoints(run / "checkpoints")
