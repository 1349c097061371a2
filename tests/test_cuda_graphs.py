"""``train.cuda_graph`` where it cannot work: refused before anything is built, one line naming the
key and the reason. (What it does on a GPU, a graphed run's curve equal to the eager run's for the
trainer's own test family and for LLaMA, Mamba-2 and DiT under `zoo train`, is in test_cuda.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from zoo.errors import ConfigError
from zoo.parallel.cuda_graphs import check
from zoo.parallel.layout import Layout
from zoo.testing import run_zoo


def _layout(**over: int) -> Layout:
    sizes = {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, **over}
    world = sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"]
    return Layout(world_size=world, vpp=1, etp=sizes["tp"], expert_dp=1, grad_accum=1, global_batch_size=8, **sizes)


def test_zoo_train_on_a_cpu_refuses_cuda_graphs_in_one_line(capsys, tmp_path):
    out = run_zoo(capsys, "train", "--model", "llama", "--run-dir", str(tmp_path / "run"), "train.cuda_graph=true",
                  "train.device=cpu", "train.steps=1", "logging.progress=false")
    assert out.returncode != 0
    lines = [x for x in out.stderr.splitlines() if "cuda_graph" in x]
    assert len(lines) == 1 and "needs a CUDA device" in lines[0] and "'cpu'" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("over, named", [({"tp": 2}, "parallel.tp=2"), ({"dp": 2}, "parallel.dp=2"),
                                         ({"pp": 2, "cp": 2}, "parallel.cp=2, parallel.pp=2"), ({"ep": 2}, "parallel.ep=2")])
def test_layouts_a_replay_would_break_are_refused_by_name(over, named):
    with pytest.raises(ConfigError, match="train.cuda_graph=true captures one GPU's step; " + named):
        check(enabled=True, device="cuda:0", layout=_layout(**over), precision="bf16")


def test_fsdp_and_fp16_are_refused_and_one_gpu_is_not():
    fsdp = dataclasses.replace(_layout(), fsdp=2)
    with pytest.raises(ConfigError, match="parallel.fsdp is not supported"):
        check(enabled=True, device="cuda", layout=fsdp, precision="fp32")
    with pytest.raises(ConfigError, match="train.precision=fp16"):
        check(enabled=True, device="cuda", layout=_layout(), precision="fp16")
    for precision in ("fp32", "bf16"):
        check(enabled=True, device="cuda:0", layout=_layout(), precision=precision)
    check(enabled=False, device="cpu", layout=_layout(tp=2), precision="fp16")  # off: nothing to refuse
