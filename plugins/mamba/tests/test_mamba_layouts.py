"""Mamba layouts equal one process (gloo, fp32): Mamba-1 under TP (x_proj's all-reduce both ways),
Mamba-2 over 4 processes (TP + sequence parallelism + DP with ZeRO-1), a hybrid cut into pipeline
stages by its pattern's "|", the hybrid with an MoE layer under pp2 x ep2 (4 processes), Mamba-2
and the MoE hybrid under context parallelism; bad layouts fail with one clear line."""

from __future__ import annotations

import dataclasses

import pytest

from zoo.testing import assert_same_training, run_distributed

LAYERS = {"mamba": 4, "mamba2": 4, "hybrid": 6}  # the tiny flavors' depths (a pattern fixes the depth)


def _onednn_products() -> bool:
    """Whether a run's float32 products here are oneDNN's (zoo-cpu-kernels on a non-Intel x86)."""
    try:
        from zoo_cpu_kernels.gemm import onednn_is_faster
    except ImportError:
        return False
    return onednn_is_faster()


def _train(layout: dict, family: str, zero: bool, flavor: str = "tiny") -> dict:
    from zoo.testing import train_layout

    return train_layout(layout, family, LAYERS[family], zero, steps=1, micro=4, seq_length=16, flavor=flavor)


LAYOUTS = [
    (2, {"tp": 2}, "mamba", False, "tiny"),
    (4, {"tp": 2, "sequence_parallel": True}, "mamba2", True, "tiny"),  # tp2 x dp2, ZeRO-1
    (2, {"pp": 2}, "hybrid", False, "tiny"),  # stages from the pattern "M-M|*-M"
    # "M-M|*EM": the MoE layer's experts split over ep2 on the second of two pattern-cut stages
    # (its routing statistics carried across the cut), over 4 processes.
    (4, {"pp": 2, "ep": 2}, "hybrid", False, "moe-tiny"),
    # Context parallelism: the Mamba-2 mixers trade sequence shards for head shards (all-to-all),
    # the attention layer runs as ring attention, the MoE layer's statistics are summed over CP.
    (2, {"cp": 2}, "mamba2", False, "tiny"),
    (4, {"cp": 2, "ep": 2}, "hybrid", True, "moe-tiny"),  # cp2 x dp2 with ZeRO-1, experts over ep2
]


@pytest.mark.parametrize(("world", "layout", "family", "zero", "flavor"), LAYOUTS,
                         ids=[f"{f}-{fl}-w{w}-" + "-".join(f"{k}{v}" if v is not True else k for k, v in lay.items())
                              + ("-zero" if z else "") for w, lay, f, z, fl in LAYOUTS])
def test_mamba_layouts_equal_one_process(world, layout, family, zero, flavor):
    ref = _train({}, family, False, flavor)
    # A_log's gradient is a sum of many cancelling terms (every position, channel and state of its
    # head); TP's partial GEMMs, or data-parallel halves summed, round differently, which one AdamW
    # step carries to ~1.3e-5 (1.3e-6 on the first gradient). Pipeline stages agree to 1e-6 under
    # torch's BLAS; where float32 products go through oneDNN (`zoo.gemm`, non-Intel x86) a product's
    # rounding depends on its row count, and pipeline micro-batches change it: 2.7e-5 measured.
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    rtol = 3e-5 if layout.get("tp", 1) > 1 or dp > 1 or _onednn_products() else 1e-5
    for got in run_distributed(_train, world, layout, family, zero, flavor, timeout=240):
        assert_same_training(got, ref, rtol=rtol)
        assert sorted(got["metrics"]) == sorted(ref["metrics"])
        if flavor == "moe-tiny":  # the MoE layer's balancing terms and its load, reduced
            assert "expert_load/0" in ref["metrics"] and ref["metrics"]["aux_loss"] > 0
        for k, v in ref["metrics"].items():
            assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize(("family", "world", "parallel", "message"), [
    ("mamba", 2, {"cp": 2}, "family 'mamba' does not support context parallelism"),
    ("mamba2", 4, {"cp": 4}, r"tp\*cp = 1\*4 does not divide model.ssm_groups=2"),
    ("mamba2_whole_norm", 2, {"cp": 2}, r"tp\*cp = 1\*2 does not divide model.ssm_norm_groups=1"),
    ("mamba2_mamba1", 2, {"cp": 2}, "model.layer_spec='mamba1' does not support context parallelism"),
    ("mamba2", 4, {"tp": 4}, r"tp=4 does not divide model.ssm_groups=2"),
    ("mamba2_whole_norm", 2, {"tp": 2}, r"tp=2 does not divide model.ssm_norm_groups=1"),
    ("mamba", 4, {"tp": 4}, None),  # Mamba-1 splits channels, 256 of them: fine
    ("hybrid", 3, {"pp": 3}, r"model.pattern cuts 2 pipeline stages \('\|'\), parallel.pp\*vpp = 3\*1 = 3"),
])
def test_bad_layouts_fail_with_one_clear_line(family, world, parallel, message):
    from zoo.errors import ConfigError
    from zoo.registry import get_registry
    from zoo.testing import layout_for

    model = None
    if family.startswith("mamba2_"):  # another layer spec in the mamba2 family: the gated norm over the whole
        # inner width (no rank holds it whole), or Mamba-1's mixer (x_proj reads every channel of a position)
        family, spec = "mamba2", {"mamba2_mamba1": "mamba1"}.get(family, family)
        model = dataclasses.replace(get_registry().get("mamba2").family.flavors["tiny"](), layer_spec=spec)
    fam = get_registry().get(family).family
    if message is None:
        assert layout_for(fam, world, model=model, **parallel).tp == parallel["tp"]
        return
    with pytest.raises(ConfigError, match=message):
        layout_for(fam, world, model=model, **parallel)
