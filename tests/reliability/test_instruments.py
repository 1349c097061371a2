"""The instruments a slow or broken run is debugged with, on a 2-rank gloo job where rank 1's
data is made slow on purpose: per-phase timers that account for the step time, the straggler
warning naming rank 1, a profiler trace of exactly the requested steps, a memory line per rank;
then `zoo checkpoint inspect` on its checkpoints (--verify finds a flipped byte and names the
file, --diff of a checkpoint with itself is empty and with the next one is not)."""

from __future__ import annotations

import json
import shutil

import pytest
from _jobs import env, llama_args, start, torchrun_cmd

from zoo.testing import run_zoo

STEPS, EVERY, SLEEP = 8, 2, 0.25


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory, corpus_cache):
    run = tmp_path_factory.mktemp("instruments") / "run"
    args = llama_args(run, corpus_cache, f"train.steps={STEPS}", f"logging.interval={EVERY}", "model.num_layers=2",
                      "train.global_batch_size=8", "logging.profile=3:4", "logging.memory_snapshot=5",
                      "checkpoint.interval=4")
    job = start(torchrun_cmd("--nproc-per-node", "2") + args, env(ZOO_TRIAL_SLOW=f"1:{SLEEP}"))
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    return run, out


def test_phases_add_up_to_the_step_time_with_min_and_max_over_ranks(slow_job):
    run, _ = slow_job
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(EVERY, STEPS + 1, EVERY))
    for r in records[1:]:  # (the first interval also holds the start-up before the loop)
        # the trainer's own clock: tokens over tokens per second, per step
        step_ms = 8 * 64 * EVERY / r["tokens_per_s"] / EVERY * 1e3
        phases = sum(v for k, v in r.items() if k.startswith("time_") and k.endswith("_ms"))
        assert abs(phases - step_ms) <= 0.1 * step_ms, (phases, step_ms, r)
        # rank 1 waits for its data, rank 0 waits for rank 1's gradients
        assert r["time_data_ms_max"] >= SLEEP * 1e3 * 0.9 > r["time_data_ms_min"], r
        assert r["time_grad_sync_ms_max"] > r["time_grad_sync_ms_min"]


def test_the_straggler_warning_names_the_slow_rank(slow_job):
    _, out = slow_job
    warnings = [x for x in out.splitlines() if "straggler" in x]
    assert warnings and all(x.startswith("zoo: straggler: rank 1 ") for x in warnings), out
    assert "after the first rank" in warnings[0]


def test_profiler_trace_of_exactly_the_requested_steps(slow_job):
    run, out = slow_job
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank_{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert sorted(n for n in names if n.startswith("zoo step ")) == ["zoo step 3", "zoo step 4"]
        # forward's matmuls: torch's BLAS, or oneDNN's where `train.cpu_gemm=auto` chose it (zoo.gemm)
        assert "aten::mm" in names or "mkldnn::_linear_pointwise" in names
        assert any(n.startswith("autograd::engine::evaluate_function") for n in names)  # backward
    assert sum(f"rank {r}: memory at step 5: peak RSS" in out for r in (0, 1)) == 2, out


def test_checkpoint_inspect_verify_and_diff(slow_job, tmp_path, capsys):
    run, _ = slow_job
    ckpts = run / "checkpoints"
    res = run_zoo(capsys, "checkpoint", "inspect", str(ckpts / "step_00000004"))
    code, out = res.returncode, res.stdout
    assert code == 0 and "family llama" in out and "step 4" in out and "saved by 2 ranks under dp=2" in out
    assert "layers.1.mlp.fc.weight" in out and "exp_avg_sq" in out
    res = run_zoo(capsys, "checkpoint", "inspect", str(ckpts / "step_00000004"), "--verify")
    code, out = res.returncode, res.stdout
    assert code == 0 and "all 60 tensors intact" in out, out
    bad = tmp_path / "bad"
    shutil.copytree(ckpts / "step_00000004", bad)
    shard = bad / "shards" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    res = run_zoo(capsys, "checkpoint", "inspect", str(bad), "--verify")
    code, out = res.returncode, res.stdout
    assert code == 1 and "shards/rank00000.safetensors: " in out and "checksum mismatch" in out, out
    assert "1 problem(s)" in out
    res = run_zoo(capsys, "checkpoint", "inspect", str(ckpts / "step_00000004"), "--diff",
                           str(ckpts / "step_00000004"))
    code, out = res.returncode, res.stdout
    assert code == 0 and out.startswith("no differences"), out
    res = run_zoo(capsys, "checkpoint", "inspect", str(ckpts / "step_00000004"), "--diff",
                           str(ckpts / "step_00000008"))
    code, out = res.returncode, res.stdout
    assert code == 1 and "embed.weight: max abs difference" in out and "embed.weight::step: max abs difference 4" in out
