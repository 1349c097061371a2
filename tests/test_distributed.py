"""Process start-up and the multi-process test harness (gloo on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from zoo.errors import UsageError
from zoo.parallel import distributed
from zoo.testing import DistributedTestError, run_distributed


def _all_reduce_rank(scale: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() * scale)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.parametrize("world", [2, 4])
def test_all_ranks_run_and_return_their_results(world):
    results = run_distributed(_all_reduce_rank, world, 3, timeout=90)
    expected = 3 * world * (world - 1) / 2  # sum of 3*r over ranks
    assert results == [(r, world, expected) for r in range(world)]


def _what_a_rank_inherits(path: str) -> tuple[str | None, int, int]:
    import torch.distributed as dist

    for fd, name in ((1, "stdout"), (2, "stderr")):  # (one write a line: the ranks' lines do not interleave)
        os.write(fd, f"rank {dist.get_rank()} to {name}\n".encode())
    with open(f"{path}.{dist.get_rank()}", "w"):
        pass
    return os.environ.get("ZOO_TEST_INHERITED"), os.stat(f"{path}.{dist.get_rank()}").st_mode & 0o777, os.getppid()


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_get_the_callers_environment_umask_and_output(tmp_path, monkeypatch, capfd, start):
    """Ranks forked from the preloaded server see what a spawned child of the caller would: the
    caller's environment now (not the server's when it started), its umask and its file
    descriptors (output a test captures)."""
    monkeypatch.setenv("ZOO_START_METHOD", start)
    for value, mask in (("a", 0o027), ("b", 0o002)):  # (the second call reuses the server started by the first)
        monkeypatch.setenv("ZOO_TEST_INHERITED", value)
        old = os.umask(mask)
        try:
            got = run_distributed(_what_a_rank_inherits, 2, str(tmp_path / value), timeout=90)
        finally:
            os.umask(old)
        assert [g[:2] for g in got] == [(value, 0o666 & ~mask)] * 2
        assert all((g[2] == os.getpid()) == (start == "spawn") for g in got)  # forkserver: the server's children
        out, err = capfd.readouterr()
        for text, name in ((out, "stdout"), (err, "stderr")):
            assert sorted(line for line in text.split("\n") if line.startswith("rank")) == \
                [f"rank 0 to {name}", f"rank 1 to {name}"]


def _fail_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone


def test_failing_rank_is_reported_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_fail_on_rank_one, 2, timeout=60, collective_timeout=20)
    text = str(e.value)
    assert text.startswith("rank 1 of 2 failed")
    assert "ValueError: boom on purpose" in text and "_fail_on_rank_one" in text
    assert time.monotonic() - start < 45  # did not wait for the full timeout


def _hang_on_rank_zero() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def test_hung_collective_fails_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_hang_on_rank_zero, 2, timeout=20, collective_timeout=4)
    assert time.monotonic() - start < 40
    assert "rank 0 of 2 failed" in str(e.value) or "did not finish" in str(e.value)


def _died() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)  # a crash that reports nothing
    time.sleep(60)


def test_rank_that_dies_silently_is_reported():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed.*exit code 7"):
        run_distributed(_died, 2, timeout=30)


def test_world_size_one_creates_no_group(monkeypatch):
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with distributed.session(device="cpu") as env:
        assert (env.rank, env.world_size, env.backend, env.device) == (0, 1, None, "cpu")
        assert not dist.is_initialized()


def test_launch_environment_errors_are_clear(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(UsageError, match="MASTER_ADDR is not set; launch with torchrun"):
        distributed.init(device="cpu")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(UsageError, match="RANK=5 is outside WORLD_SIZE=2"):
        distributed.init(device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(UsageError, match="WORLD_SIZE='two' is not an integer"):
        distributed.init(device="cpu")


def test_zoo_train_under_torchrun_data_parallel_equals_one_process(tmp_path):
    """`torchrun -m zoo train` joins the job from the environment; DP=2 with micro-batch 8 follows
    the same loss curve as one process with micro-batch 16 (the same global batches)."""
    import json

    common = ["train", "--model", "mixer", "train.steps=4", "logging.interval=1", "train.eval_interval=0",
              "parallel.timeout_s=60", "parallel.bucket_size=20000", "logging.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_PLUGINS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "zoo",
           *common, "--run-dir", str(tmp_path / "dp"), "train.micro_batch_size=8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("trained mixer") == 1  # rank 0 reports, once
    one = subprocess.run([sys.executable, "-m", "zoo", *common, "--run-dir", str(tmp_path / "one"),
                          "train.micro_batch_size=16"], capture_output=True, text=True, timeout=240, env=env)
    assert one.returncode == 0, one.stderr

    def losses(d):
        return [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]

    dp, single = losses(tmp_path / "dp"), losses(tmp_path / "one")
    assert len(dp) == 4  # written once, by rank 0
    for a, b in zip(dp, single):
        assert abs(a - b) <= 1e-5 * abs(b), (dp, single)
    # The suite's stand-in for torchrun (`run_zoo_ranks`: ranks forked from a server that imported
    # torch once) is the same job to the bit, with its output and exit status.
    from zoo.testing import run_zoo_ranks

    forked = run_zoo_ranks(2, *common, "--run-dir", str(tmp_path / "forked"), "train.micro_batch_size=8")
    assert forked.returncode == 0, forked.stdout + forked.stderr
    assert forked.stdout.count("trained mixer") == 1 and losses(tmp_path / "forked") == dp
    bad = run_zoo_ranks(2, *common, "--run-dir", str(tmp_path / "bad"), "train.micro_batch_sise=8")
    assert bad.returncode == 2 and "train.micro_batch_size" in bad.stderr, bad.stderr


def _misplaced_collective() -> str:
    import torch
    import torch.distributed as dist

    from zoo.parallel.distributed import CollectiveDeviceError

    dist.all_reduce(torch.ones(3))  # a CPU tensor on gloo: served
    try:
        dist.all_reduce(torch.empty(3, device="meta"))
    except CollectiveDeviceError as e:
        return str(e)
    return "not caught"


def test_collectives_reject_tensors_on_a_device_their_backend_does_not_serve():
    """Every distributed test runs with the check on; here a meta tensor handed to a gloo group is
    caught at the call, naming it; and NCCL (which no test here can start) serves CUDA tensors only,
    so the host-side bookkeeping a CPU tensor would be fails the same way there."""
    from zoo.parallel.distributed import CollectiveDeviceError, check_tensors, pick_backend, served_devices

    messages = run_distributed(_misplaced_collective, 2, timeout=60)
    assert all("torch.distributed.all_reduce: a meta tensor (3,) float32 on a gloo process group" in m for m in messages)
    assert served_devices("nccl") == {"cuda"} and served_devices("gloo") == {"cpu"}
    assert served_devices(pick_backend("auto", "cuda:0")) == {"cpu", "cuda"}  # cpu:gloo,cuda:nccl
    with pytest.raises(CollectiveDeviceError, match="a cpu tensor .* on a nccl process group"):
        check_tensors("all_reduce", [torch.zeros(2)], "nccl")
