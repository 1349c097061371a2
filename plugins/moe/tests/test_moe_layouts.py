"""Expert parallelism equals one process (gloo, fp32): EP alone, with DP + ZeRO-1, TP + sequence
parallelism, PP, CP, FSDP, expert tensor parallelism, 4-process combinations, both dispatchers (all-to-all, all-gather), the
step's metrics (each layer's load) included; idle experts never hang a collective; a run that
starts from a Hugging Face Mixtral resumes across EP sizes on the same curve; bad layouts fail
with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.testing import assert_same_training, run_distributed


def _train(layout: dict, family: str, zero: bool, force: tuple[int, ...] | None = None, pattern: str = "") -> dict:
    from zoo.nn.moe import Router
    from zoo.testing import train_layout

    Router.force = force
    # A pattern with dense layers ("T"): their MLP as wide as an expert's, one layer per symbol.
    model = {"pattern": pattern, "dense_ffn_hidden_size": 96} if pattern else None
    layers = len(pattern.replace("|", "")) if pattern else 2
    return train_layout(layout, family, layers, zero, steps=2, micro=4, seq_length=16, model=model)


_REFS: dict = {}


def _reference(family: str, force: tuple[int, ...] | None = None, pattern: str = "") -> dict:
    if (family, force, pattern) not in _REFS:
        try:
            _REFS[(family, force, pattern)] = _train({}, family, False, force, pattern)
        finally:
            from zoo.nn.moe import Router

            Router.force = None
    return _REFS[(family, force, pattern)]


LAYOUTS = [
    # (ep2 alone: test_idle_experts_train_under_ep2_without_hanging)
    (4, {"ep": 2}, "qwen2-moe", True),  # EP x DP with ZeRO-1 (experts' state over their EDP ranks)
    (2, {"ep": 2, "tp": 2, "sequence_parallel": True}, "qwen2-moe", False),  # EP over the TP ranks; shared expert TP-split
    (4, {"ep": 2, "pp": 2}, "mixtral", False),  # routing statistics carried across the stage boundary
    (4, {"ep": 4, "tp": 2, "sequence_parallel": True}, "mixtral", True),  # EP spans TP and DP ranks, ZeRO-1
    (4, {"ep": 2, "cp": 2}, "mixtral", True),  # EP x CP: each layer's statistics summed over the sequence's parts
    # Megatron's allgather dispatcher, as it is used with TP: every EP rank sees every token
    (2, {"ep": 2, "tp": 2, "sequence_parallel": True, "ep_dispatcher": "allgather"}, "qwen2-moe", False),
    # FSDP x EP with ep = dp: no rank replicates an expert and FSDP leaves them whole, the shared
    # expert and router FSDP units of their own (sharded experts: the FSDP test from Hugging Face below)
    (2, {"fsdp": 2, "ep": 2}, "qwen2-moe", False),
    # HSDP x EP: dense units sharded over 2 ranks and replicated twice, each expert sharded over its
    # 2 expert-data-parallel ranks
    (4, {"fsdp": 2, "ep": 2}, "mixtral", False),
    # Expert tensor parallelism (Megatron's ETP): each expert's MLP split over the TP ranks, its
    # experts over ep2; tokens gathered over ETP and the partial outputs summed back
    (4, {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 2}, "qwen2-moe", True),
    (4, {"tp": 2, "sequence_parallel": True, "etp": 2, "pp": 2}, "mixtral", False),  # ETP x PP: a grid per stage
    (4, {"tp": 2, "sequence_parallel": True, "ep": 2}, "qwen3-moe", True),  # per-head q/k norms under TP, ZeRO-1
]


@pytest.mark.parametrize(("world", "layout", "family", "zero"), LAYOUTS,
                         ids=[f"{f}-w{w}-" + "-".join(f"{k}{v}" if v is not True else k for k, v in lay.items())
                              + ("-zero" if z else "") for w, lay, f, z in LAYOUTS])
def test_expert_parallel_layouts_equal_one_process(world, layout, family, zero):
    ref = _reference(family)
    for got in run_distributed(_train, world, layout, family, zero, timeout=240):
        assert_same_training(got, ref)
        # The step's metrics too: balancing terms, and each layer's load reduced element-wise.
        assert sorted(got["metrics"]) == sorted(ref["metrics"])
        assert {"expert_load/0", "expert_load/1"} <= set(ref["metrics"]) and "expert_load/2" not in ref["metrics"]
        assert ref["metrics"]["expert_load"] == max(ref["metrics"]["expert_load/0"], ref["metrics"]["expert_load/1"])
        for k, v in ref["metrics"].items():
            assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_dense_and_moe_layers_mixed_under_tp_sp_ep_and_pp_cut_by_the_pattern_equal_one_process():
    """Megatron's --moe-layer-freq as a pattern: the dense layers' MLPs split by TP and SP like
    LLaMA's, the stages cut where the pattern's "|" says, each MoE layer's statistics row (its
    count among the MoE layers) carried across the cut."""
    ref = _reference("qwen2-moe", pattern="TE|ET")
    assert {"expert_load/0", "expert_load/1"} <= set(ref["metrics"]) and "expert_load/2" not in ref["metrics"]
    assert any(".mlp.fc." in k for k in ref["grads"]) and any(".moe.gate_up" in k for k in ref["grads"])
    layout = {"tp": 2, "sequence_parallel": True, "ep": 2, "pp": 2}
    for got in run_distributed(_train, 4, layout, "qwen2-moe", False, None, "TE|ET", timeout=240):
        assert_same_training(got, ref)
        assert got["pp_sent"] > 0
        # Each stage holds one dense layer, its MLP split over the TP ranks ([gate; up] 2 x 96 wide).
        assert [s for n, s in got["shapes"].items() if n.endswith("mlp.fc.weight")] == [(96, 128)]
        for k, v in ref["metrics"].items():
            assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def _train_sequence_balanced(layout: dict) -> dict:
    from zoo.testing import train_layout

    return train_layout(layout, "mixtral", 2, False, steps=2, micro=4, seq_length=16,
                        model={"aux_loss_convention": "sequence"})


@pytest.mark.parametrize(("world", "layout"), [(2, {"tp": 2, "sequence_parallel": True, "ep": 2}),
                                               (4, {"cp": 2, "ep": 2, "zero": 1})], ids=["tp2-sp-ep2", "cp2-ep2-zero"])
def test_sequence_aux_loss_over_sequence_shards_equals_one_process(world, layout):
    """Megatron's seq_aux_loss where each rank holds part of every sequence (sequence parallel,
    context parallel): each sequence's routing counted whole, each rank's probabilities its own,
    the same loss, gradients and metrics as one process."""
    ref = _train_sequence_balanced({})
    assert ref["metrics"]["aux_loss"] > 0
    for got in run_distributed(_train_sequence_balanced, world, layout, timeout=240):
        assert_same_training(got, ref)
        for k, v in ref["metrics"].items():
            assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_idle_experts_train_under_ep2_without_hanging(dispatcher):
    # Every token goes to experts 0 and 1, both on EP rank 0: rank 1's experts see no token at all.
    ref = _reference("mixtral", (0, 1))
    got = run_distributed(_train, 2, {"ep": 2, "ep_dispatcher": dispatcher}, "mixtral", False, (0, 1), timeout=120)
    for g in got:
        assert_same_training(g, ref)
        assert g["grads"]["layers.0.moe.down"][4:].abs().sum() == 0  # idle experts: zero gradient, not none
        assert g["grads"]["layers.0.moe.down"][:2].abs().sum() > 0


def test_bad_layouts_fail_with_one_clear_line():
    from zoo.errors import ConfigError
    from zoo.registry import get_registry
    from zoo.testing import layout_for

    fam = get_registry().get("mixtral").family
    with pytest.raises(ConfigError, match="ep=3 does not divide model.num_experts=8"):
        layout_for(fam, 3, ep=3)
    with pytest.raises(ConfigError, match="tp=2 with a mixture of experts needs parallel.sequence_parallel=true"):
        layout_for(fam, 2, tp=2)
    with pytest.raises(ConfigError, match="etp=3 does not divide the experts' hidden width 256 \\(model.ffn_hidden_size\\)"):
        layout_for(fam, 3, etp=3)
    with pytest.raises(ConfigError, match="etp=2 runs with ep_dispatcher=alltoall only"):
        layout_for(fam, 2, etp=2, ep_dispatcher="allgather")
    with pytest.raises(ConfigError, match="etp=2 needs tp before ep in parallel.order"):
        layout_for(fam, 4, etp=2, ep=2, order="ep-tp-cp-dp-pp")


def _zoo(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``zoo ARGS`` in a process of its own, or on NPROC ranks as torchrun starts them (forked from
    a server that imported torch once: `zoo.testing.run_zoo_ranks`)."""
    if nproc > 1:
        from zoo.testing import run_zoo_ranks

        return run_zoo_ranks(nproc, *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=600, env=env)


def _run(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--model", "mixtral", "--run-dir", str(run_dir), "train.seq_length=32", "train.micro_batch_size=4",
            "train.global_batch_size=8", "train.steps=4", "checkpoint.interval=2", "logging.interval=1",
            "train.eval_interval=0", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", *extra]


def _curve(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def from_hf(tmp_path_factory) -> tuple[str, list[float]]:
    """A Hugging Face Mixtral directory (the Hub's per-expert layout) and one process's curve from it."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    from zoo_moe.plugin import mixtral_tiny

    tmp = tmp_path_factory.mktemp("from_hf")
    c = mixtral_tiny()
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, num_local_experts=c.num_experts,
        num_experts_per_tok=c.top_k, max_position_embeddings=c.max_seq_length, rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps)).save_pretrained(tmp / "hf")
    load = f"checkpoint.load=hf:{tmp / 'hf'}"
    one = _zoo(1, *_run(tmp / "one", load))
    assert one.returncode == 0, one.stdout + one.stderr
    return load, _curve(tmp / "one")


def _resumed_in_one_process(tmp_path: Path, src: Path) -> list[float]:
    import shutil

    run = tmp_path / "resumed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    out = _zoo(1, *_run(run))
    assert out.returncode == 0 and "resuming from" in out.stdout, out.stdout + out.stderr
    return _curve(run)


def test_training_from_hugging_face_under_ep2_resumes_at_ep1_on_the_same_curve(tmp_path, from_hf):
    load, one = from_hf
    # Each EP rank reads only its four experts of the HF files; ZeRO-1 shards their optimizer state.
    ep2 = _zoo(2, *_run(tmp_path / "ep2", load, "parallel.ep=2", "parallel.zero=1"))
    assert ep2.returncode == 0, ep2.stdout + ep2.stderr
    assert _close(_curve(tmp_path / "ep2"), one)
    index = json.loads((tmp_path / "ep2" / "checkpoints" / "step_00000002" / "index.json").read_text())
    assert len(index["tensors"]["layers.1.moe.gate_up"]["pieces"]) == 2  # one piece per EP rank
    # The ep2 checkpoint continued by one process: the uninterrupted curve.
    assert _close(_resumed_in_one_process(tmp_path, tmp_path / "ep2"), one[2:])


def test_fsdp_with_expert_tensor_parallelism_from_hugging_face_resumes_in_one_process(tmp_path, from_hf):
    """fsdp2 x cp2 with etp2 on 4 ranks: each expert's MLP split over 2 expert-tensor-parallel ranks
    (gate and up by rows, down by columns), each such piece FSDP-sharded over its 2
    expert-data-parallel ranks (the data x context ranks that hold the same piece), loaded from the
    HF files piece by piece and written as pieces of a checkpoint that one process continues."""
    load, one = from_hf
    out = _zoo(4, *_run(tmp_path / "fsdp", load, "parallel.fsdp=2", "parallel.cp=2", "parallel.etp=2"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "experts: etp=2 x ep=1 x dp=2" in out.stdout
    assert _close(_curve(tmp_path / "fsdp"), one)
    index = json.loads((tmp_path / "fsdp" / "checkpoints" / "step_00000002" / "index.json").read_text())
    gate_up = index["tensors"]["layers.1.moe.gate_up"]
    e, f2, _ = gate_up["shape"]
    # 8 experts: 2 FSDP pieces of rows x 2 ETP pieces of each of the gate and up halves
    assert sorted(tuple(p["offset"][:2]) for p in gate_up["pieces"]) == sorted(
        (r, h * f2 // 2 + t * f2 // 4) for r in (0, e // 2) for h in (0, 1) for t in (0, 1))
    assert _close(_resumed_in_one_process(tmp_path, tmp_path / "fsdp"), one[2:])


def test_fsdp_with_whole_experts_trains_on_the_same_curve(tmp_path, from_hf):
    """fsdp2 x ep2 through `zoo train`: FSDP shards the dense parameters (DTensors) and leaves each
    rank's experts whole (plain tensors, ep = dp); the trainer's fused AdamW takes them in groups
    of one kind (mixed, it failed: "got mixed torch.Tensor and DTensor")."""
    load, one = from_hf
    out = _zoo(2, *_run(tmp_path / "fsdp_ep", load, "parallel.fsdp=2", "parallel.ep=2"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert _close(_curve(tmp_path / "fsdp_ep"), one)
