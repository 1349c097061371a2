"""Every parallel layout equals one process (gloo, float32): GPT-2 (tied embeddings, learned
positions, biases) and LLaMA (grouped-query attention, SwiGLU) trained for several optimizer
steps through `zoo.parallel.engine.Parallel`, the same path `zoo train` takes; then the loss and
every gradient, gathered to full shape under its single-process name, are compared."""

from __future__ import annotations

import pytest

from zoo.testing import assert_same_training, run_distributed

STEPS, MICRO, SEQ = 3, 4, 16


def _train(layout: dict, family: str, layers: int, zero: bool, steps: int = STEPS) -> dict:
    from zoo.testing import train_layout

    return train_layout(layout, family, layers, zero, steps=steps, micro=MICRO, seq_length=SEQ)


_REFS: dict = {}


def _reference(family: str, layers: int) -> dict:
    if (family, layers) not in _REFS:
        _REFS[(family, layers)] = _train({}, family, layers, False)
    return _REFS[(family, layers)]


LAYOUTS = [
    # (world, layout, family, layers, zero)
    (2, {"pp": 2, "pp_schedule": "gpipe"}, "llama", 2, False),
    (2, {"pp": 2, "vpp": 2}, "gpt2", 4, False),  # interleaved 1F1B, tied embeddings across stages
    (2, {"pp": 2, "pp_layers": [1, 3]}, "llama", 4, False),  # uneven stages
    (2, {"cp": 2}, "llama", 2, False),
    (2, {"tp": 2, "sequence_parallel": True}, "gpt2", 2, False),
    (4, {"tp": 2, "pp": 2}, "gpt2", 2, False),
    (4, {"pp": 2}, "llama", 2, True),  # PP x DP with ZeRO-1
    (4, {"cp": 2, "tp": 2, "sequence_parallel": True}, "gpt2", 2, False),
    (4, {"cp": 2}, "llama", 2, True),  # CP x DP with ZeRO-1 (sharded over the data x context group)
    (4, {"tp": 2, "pp": 2, "vpp": 2, "sequence_parallel": True}, "llama", 4, False),
    # FSDP (torch's fully_shard over the data-parallel ranks), alone, with TP and PP, and hybrid (HSDP).
    (2, {"fsdp": 2}, "llama", 2, False),
    (4, {"fsdp": 2, "tp": 2, "sequence_parallel": True}, "gpt2", 2, False),
    (4, {"fsdp": 2, "pp": 2}, "gpt2", 2, False),  # tied embeddings across stages, FSDP-sharded on both
    (4, {"fsdp": 2}, "llama", 2, False),  # HSDP: dp4 as 2 replicas of 2 sharding ranks
    # Qwen3's per-head q/k norms: whole on every TP rank, their gradients summed over its heads' ranks
    (2, {"tp": 2}, "qwen3", 2, False),
    (4, {"tp": 2, "cp": 2, "sequence_parallel": True}, "qwen3", 2, False),
    # (fsdp2 x cp2: test_dist_checkpoint's FSDP test, whose 6-step curve it follows)
]


def _ids():
    out = []
    for world, layout, family, _, zero in LAYOUTS:
        name = "-".join(f"{k}{v}" if not isinstance(v, bool) else k for k, v in layout.items() if k != "pp_layers")
        out.append(f"{family}-w{world}-{name}{'-uneven' if 'pp_layers' in layout else ''}{'-zero' if zero else ''}")
    return out


@pytest.mark.parametrize(("world", "layout", "family", "layers", "zero"), LAYOUTS, ids=_ids())
def test_layout_equals_one_process(world, layout, family, layers, zero):
    ref = _reference(family, layers)
    for got in run_distributed(_train, world, layout, family, layers, zero, timeout=240):
        assert_same_training(got, ref)


def _train_with(layout: dict, family: str, model: dict) -> dict:
    from zoo.testing import train_layout

    return train_layout(layout, family, 2, False, steps=STEPS, micro=MICRO, seq_length=SEQ, model=model)


@pytest.mark.parametrize(("world", "layout", "family", "model", "rtol"), [
    # a window of 5 over 16 positions: at cp2 the ring's 4-position chunks lie partly inside it and
    # wholly outside it (skipped)
    (4, {"tp": 2, "cp": 2, "sequence_parallel": True}, "mistral", {"sliding_window": 5}, 1e-5),
    (2, {"tp": 2}, "qwen2", {}, 1e-5),  # q/k/v biases split with their columns, o without one
    # Gemma 3: sandwich norms on sequence shards, per-head q/k norms, two RoPE tables (the ring's
    # chunks rotated by their own positions), the window on layer 0 only; scaled embeddings on stage 0.
    # Tensor- and context-parallel sums leave every family's gradients a few 1e-6 from one process
    # after one step (LLaMA's 4e-6 at tp2); Gemma's q/k-norm gradients, behind two more norms, 7-9.5e-6,
    # and three Adam steps carry that to 1.4e-5 (tp2, tp2 x cp2) and 1.6e-5 (cp2).
    (4, {"tp": 2, "cp": 2, "sequence_parallel": True}, "gemma3", {"sliding_window": 5}, 3e-5),
    (2, {"pp": 2}, "gemma3", {"sliding_window": 5}, 1e-5),
    # Gemma 2: soft-capped scores in the ring's blocks and logits in the vocabulary-parallel loss,
    # caps set near the tiny model's score and logit sizes (~0.05, ~0.2) so that they bend them
    # (a ring or a loss without its cap fails by 1e-3 on the losses); measured 7.4e-6 from one process
    (4, {"tp": 2, "cp": 2, "sequence_parallel": True}, "gemma2",
     {"sliding_window": 5, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.25}, 1.5e-5),
], ids=["mistral-window5-w4-tp2-cp2-sp", "qwen2-w2-tp2", "gemma3-window5-w4-tp2-cp2-sp", "gemma3-window5-w2-pp2",
        "gemma2-caps-w4-tp2-cp2-sp"])
def test_windows_and_qkv_biases_equal_one_process(world, layout, family, model, rtol):
    ref = _train_with({}, family, model)
    for got in run_distributed(_train_with, world, layout, family, model, timeout=240):
        assert_same_training(got, ref, rtol=rtol)


@pytest.mark.slow
def test_eight_processes_tp_pp_dp_with_sequence_parallel_and_zero():
    layout = {"tp": 2, "pp": 2, "vpp": 2, "sequence_parallel": True}
    ref = _reference("llama", 4)
    for got in run_distributed(_train, 8, layout, "llama", 4, True, timeout=600):
        assert_same_training(got, ref)


def _val_curve(run_dir) -> list[float]:
    import json

    return [r["val_loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r]


def test_zoo_train_curves_match_one_process_and_resume_across_layouts(tmp_path, corpus_cache):
    """`zoo train` on 4 ranks as torchrun starts them: TP x PP (interleaved) with sequence
    parallelism, and CP x PP with ZeRO-1, each follow the single-process curve for 12 steps; each resumes the other's step-6
    checkpoint and continues the same curve."""
    import shutil

    from _gpt_helpers import curve as _curve
    from _gpt_helpers import ranks, small_run, zoo

    # (3 validation micro-batches: not a multiple of pp, which interleaved training needs and evaluation does not)
    args = ("train.steps=12", "checkpoint.interval=6", "optimizer.grad_clip=0.5", "train.global_batch_size=16",
            "train.micro_batch_size=4", "model.num_layers=4", "train.eval_interval=6", "train.eval_steps=3")
    one = zoo(*small_run(tmp_path / "one", corpus_cache, *args))
    assert one.returncode == 0, one.stderr
    ref = _curve(tmp_path / "one")
    ref_val = _val_curve(tmp_path / "one")
    assert len(ref_val) == 2
    layouts = {"a": ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.sequence_parallel=true"],
               "b": ["parallel.cp=2", "parallel.pp=2", "parallel.zero=1"]}
    for name, layout in layouts.items():
        out = ranks(4, *small_run(tmp_path / name, corpus_cache, *args, *layout))
        assert out.returncode == 0, out.stdout + out.stderr
        got = _curve(tmp_path / name)
        assert len(got) == 12
        for a, b in zip(got, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got, ref)
        for a, b in zip(_val_curve(tmp_path / name), ref_val, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, ref_val)
    for src, dst in (("a", "b"), ("b", "a")):
        cont = tmp_path / f"{src}-then-{dst}"
        (cont / "checkpoints").mkdir(parents=True)
        shutil.copytree(tmp_path / src / "checkpoints" / "step_00000006", cont / "checkpoints" / "step_00000006")
        out = ranks(4, *small_run(cont, corpus_cache, *args, *layouts[dst]))
        assert out.returncode == 0, out.stdout + out.stderr
        got = _curve(cont)
        assert len(got) == 6
        for a, b in zip(got, ref[6:]):
            assert abs(a - b) <= 1e-5 * abs(b), (src, dst, got, ref[6:])


def test_a_rank_that_raises_stops_every_rank_with_its_error(tmp_path, corpus_cache):
    """Rank 1 (the last pipeline stage) raises in its 7th loss call; rank 0 is then waiting for
    its gradients. The job must end promptly with rank 1's error, not hang."""
    import os
    import time

    from _gpt_helpers import small_run, torchrun

    from zoo.testing.plugins import fake_distribution

    root = tmp_path / "site"
    fake_distribution(root, "zoo-flaky", "1.0", plugins={"flaky": "flaky_plugin"}, files={
        "flaky_plugin.py": """
            import dataclasses
            from zoo import hookimpl
            import zoo_gpt.plugin as gpt  # a module, not its hook: pluggy would see a second hook

            @hookimpl
            def zoo_families():
                llama = next(f for f in gpt.zoo_families() if f.name == "llama")
                return [dataclasses.replace(llama, name="flaky", aliases=(), loss="flaky_loss:loss")]
        """,
        "flaky_loss.py": """
            import os
            from zoo_gpt.model import loss as gpt_loss

            calls = 0

            def loss(model, batch):
                global calls
                calls += 1
                if os.environ.get("RANK") == "1" and calls == 7:
                    raise RuntimeError("injected failure on rank 1")
                return gpt_loss(model, batch)
        """,
    })
    args = small_run(tmp_path / "run", corpus_cache, "train.steps=10", "parallel.pp=2", "parallel.timeout_s=60")
    args[args.index("llama")] = "flaky"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    try:
        start = time.monotonic()
        out = torchrun(2, *args)
        elapsed = time.monotonic() - start
    finally:
        os.environ["PYTHONPATH"] = os.environ["PYTHONPATH"].split(os.pathsep, 1)[1]
    assert out.returncode != 0
    assert "injected failure on rank 1" in out.stdout + out.stderr
    assert elapsed < 120, f"the job took {elapsed:.0f} s to stop"  # far below any hang, not a timing claim


_FP32_STORAGE: dict = {}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_parameters_with_fp32_masters_train_and_resume_exactly(tmp_path, corpus_cache, dtype, capsys):
    import functools
    import shutil

    from _gpt_helpers import curve as _curve
    from _gpt_helpers import small_run

    from zoo.testing import run_zoo

    zoo = functools.partial(run_zoo, capsys)  # in this process: six runs, no interpreter starts

    # No parallel.zero needed: low-precision parameters bring the fp32-master optimizer with them.
    args = ("train.steps=6", "checkpoint.interval=3", f"train.precision={dtype}", f"train.param_dtype={dtype}")
    full = zoo(*small_run(tmp_path / "full", corpus_cache, *args))
    assert full.returncode == 0, full.stderr
    if "fp32" not in _FP32_STORAGE:  # the same reference for both types: bf16 autocast, fp32 storage
        ref = zoo(*small_run(tmp_path / "fp32", corpus_cache, "train.steps=6", "train.precision=bf16"))
        assert ref.returncode == 0, ref.stderr
        _FP32_STORAGE["fp32"] = _curve(tmp_path / "fp32")
    got, fp32 = _curve(tmp_path / "full"), _FP32_STORAGE["fp32"]
    assert all(abs(a - b) < 5e-3 * b for a, b in zip(got, fp32))  # low-precision storage, same training
    cont = tmp_path / "cont"
    (cont / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000003", cont / "checkpoints" / "step_00000003")
    out = zoo(*small_run(cont, corpus_cache, *args))
    assert out.returncode == 0, out.stderr
    assert _curve(cont) == got[3:]  # bitwise: the fp32 masters were saved, not re-read from bf16
    if dtype == "bf16":  # (the checks are the same for both)
        zero = zoo(*small_run(tmp_path / "zero", corpus_cache, *args, "parallel.zero=1", "train.steps=3"))
        assert zero.returncode == 0 and _curve(tmp_path / "zero") == got[:3]  # the same optimizer, asked for
        bad = zoo(*small_run(tmp_path / "bad", corpus_cache, f"train.param_dtype={dtype}"))
        assert bad.returncode == 2 and f"needs train.precision={dtype}" in bad.stderr
        # float32 gradients (train.grad_dtype's default) reduce-scattered over dp2, the bf16 parameters
        # gathered in bf16: bit for bit one process accumulating the same two micro-batches
        from _gpt_helpers import ranks

        batch = ("train.steps=3", "train.global_batch_size=16", "train.micro_batch_size=8")
        from zoo.testing import threads

        with threads(1):  # as each torchrun rank has (oneDNN's AMX bf16 products split sums by threads)
            acc = zoo(*small_run(tmp_path / "acc", corpus_cache, *args, *batch))
        dp2 = ranks(2, *small_run(tmp_path / "dp2", corpus_cache, *args, *batch))
        assert acc.returncode == 0 and dp2.returncode == 0, acc.stderr + dp2.stderr
        assert _curve(tmp_path / "dp2") == _curve(tmp_path / "acc")
        narrow = zoo(*small_run(tmp_path / "narrow", corpus_cache, *args, "train.grad_dtype=bf16", "train.steps=3"))
        assert narrow.returncode == 0, narrow.stderr  # bf16 buckets (what train.cuda_graph needs): the same run
        assert all(abs(a - b) < 5e-3 * b for a, b in zip(_curve(tmp_path / "narrow"), got))
        bad = zoo(*small_run(tmp_path / "bad", corpus_cache, *args, "train.grad_dtype=fp16"))
        assert bad.returncode == 2 and "gradients are kept in float32 or in the parameters' own type" in bad.stderr
