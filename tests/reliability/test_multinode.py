"""Two `torchrun` launchers on 127.0.0.1 act as two nodes (c10d rendezvous, two ranks each):
tp2 x dp2 follows the single-process curve, and with `--max-restarts` a rank SIGKILLed mid-run makes
torchrun restart the whole group, which resumes from the newest checkpoint by itself and ends on
the uninterrupted run's curve, bit for bit.

The rendezvous store is hosted by the test (``is_host=false`` on both launchers), as a cluster's
rendezvous endpoint outlives any one node: no port has to be picked and hoped free.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _jobs import curve, env, kill_job, llama_args, start, torchrun_cmd

from zoo.testing import run_zoo

ARGS = ("train.steps=6", "checkpoint.interval=2")


def _two_nodes(run_dir: Path, cache: Path, *, restarts: int, **environ: str) -> list[tuple[int, str, str]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "zoo-test",
                "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false",
                "--max-restarts", str(restarts), "--monitor-interval", "0.2"]
    nodes = [start(torchrun_cmd(*launcher) + llama_args(run_dir, cache, *ARGS, "parallel.tp=2"), env(**environ))
             for _ in range(2)]
    results, started = [], time.monotonic()
    for node in nodes:
        try:
            out, err = node.communicate(timeout=300)
        except Exception:
            kill_job(node)
            raise
        results.append((node.returncode, out, err))
    print(f"two nodes, --max-restarts {restarts}: {time.monotonic() - started:.1f} s from launch to the end")
    return results


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, corpus_cache) -> tuple[Path, list[tuple[int, str, str]]]:
    run = tmp_path_factory.mktemp("two-nodes") / "run"
    return run, _two_nodes(run, corpus_cache, restarts=0)


def test_two_launchers_train_tp2_dp2_like_one_process(two_node_run, tmp_path, corpus_cache, capsys):
    run, results = two_node_run
    for rc, out, err in results:
        assert rc == 0, out[-2000:] + err[-4000:]
    assert sum(out.count("trained llama") for _, out, _ in results) == 1  # global rank 0 reports, once
    assert sum(out.count("training llama (tiny") for _, out, _ in results) == 1  # and says what starts, once
    one = run_zoo(capsys, *llama_args(tmp_path / "one", corpus_cache, *ARGS))
    assert one.returncode == 0, one.stderr
    got, ref = curve(run), curve(tmp_path / "one")
    assert len(got) == len(ref) == 6
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (got, ref)


def test_max_restarts_brings_a_killed_rank_back_and_the_run_continues_its_curve(two_node_run, tmp_path, corpus_cache):
    """Rank 3 (on the second node) SIGKILLs itself once step 3 is logged, on the first attempt
    only: both agents restart their workers, which rendezvous afresh and resume from step 2."""
    reference, results = two_node_run
    assert all(rc == 0 for rc, _, _ in results)
    run = tmp_path / "run"
    results = _two_nodes(run, corpus_cache, restarts=1, ZOO_TRIAL_DIE=f"3:3:{run / 'metrics.jsonl'}")
    for rc, out, err in results:
        assert rc == 0, out[-2000:] + err[-4000:]
    stdout = "".join(out for _, out, _ in results)
    stderr = "".join(err for _, _, err in results)
    assert "exitcode: -9" in stderr  # the kill happened and was seen by torchrun
    assert f"resuming from {run / 'checkpoints' / 'step_00000002'}" in stdout
    assert curve(run) == curve(reference)  # bitwise: the same layout on the same data


def _check_checkpoint_dirs(base: str) -> tuple[str, str]:
    """A shared directory, then one that each "node" (ranks 0-1, ranks 2-3) sees as its own."""
    import torch.distributed as dist

    from zoo.errors import UsageError
    from zoo.training.run_control import run_token

    out = []
    for path in (Path(base) / "shared", Path(base) / f"node{dist.get_rank() // 2}"):
        try:
            run_token(dist.get_world_size(), shared=path)
            dist.barrier()  # rank 0 removes its probe after the others looked
            out.append("ok" if not list(path.glob(".zoo-shared-*")) else "probe left behind")
        except UsageError as e:
            out.append(str(e))
    return out[0], out[1]


def test_a_checkpoint_directory_that_is_not_shared_fails_on_every_rank_at_start(tmp_path):
    """Four ranks as two nodes of two: when each node's ranks see their own directory (a node-local
    disk), every rank fails before training with one error naming the ranks that cannot see rank
    0's files; a shared directory passes and is left clean."""
    from zoo.testing import run_distributed

    results = run_distributed(_check_checkpoint_dirs, 4, str(tmp_path), timeout=90)
    for rank, (shared, local) in enumerate(results):
        assert shared == "ok"
        # each rank names the directory as it sees it
        assert local.startswith(f"checkpoint directory {tmp_path / f'node{rank // 2}'} is not shared by every rank: "
                                "rank 2 ("), local
        assert "rank 3 (" in local and "rank 1 (" not in local and "docs/launch.md" in local
