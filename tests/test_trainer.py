"""The trainer applies what a family declares, under every layout: a family defined here (not a
plugin: `_trainer_family`) with an auxiliary loss, ``max`` and ``sum`` metrics, images as its
throughput unit, frozen parameters, a learning-rate multiplier, an EMA of the weights and a preview
trains under dp2, tp2 and pp2 (its conditioning vector carried across the stage boundary) on gloo
exactly as one process does, and resumes from another layout's checkpoint with its EMA and frozen
state resharded. References are independent: a plain PyTorch computation of the first step, the
EMA formula, and the single-process run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _trainer_family import AUX_WEIGHT, DATASET, FAMILY, SIDE, CondConfig, build, sample

from zoo.testing import run_distributed

COMMON = ["train.steps=6", "train.micro_batch_size=2", "train.global_batch_size=8", "logging.interval=1",
          "train.eval_interval=3", "train.eval_steps=2", "train.ema=0.9", "train.freeze=[embed.*]",
          "optimizer.lr_mult={cond_embed.*: 0.5}", "optimizer.lr=3e-3", "optimizer.eps=1e-6", "schedule.warmup_steps=0",
          "checkpoint.interval=3", "logging.progress=false", "train.seed=5"]
COMPARED = ("loss", "aux_l2", "max_abs_err", "samples", "grad_norm", "val_loss", "val_aux_l2")


def _fit(run_dir: str, world: int, overrides: list[str]) -> None:
    from zoo.config import resolve
    from zoo.parallel.layout import plan
    from zoo.training.trainer import Trainer

    run = resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=FAMILY.flavors["tiny"](),
                  recipe=[("recipe of cond", FAMILY.recipe)], overrides=overrides)
    Trainer(FAMILY, run, plan(run, world_size=world, family=FAMILY), run_dir=Path(run_dir), dataset=DATASET).fit()


def _train(run_dir: Path, world: int, *extra: str) -> list[dict]:
    run_distributed(_fit, world, str(run_dir), world, [*COMMON, *extra], timeout=240)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _close(got: list[dict], ref: list[dict], rel: float = 1e-5, *, validation: bool = True) -> None:
    """Equal curves; ``validation=False`` when data-parallel ranks each evaluate their own
    ``eval_steps`` micro-batches (so more samples than one process)."""
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        for key in COMPARED:
            if key in b and (validation or not key.startswith("val_")):
                assert abs(a[key] - b[key]) <= rel * abs(b[key]) + 1e-7, (key, a["step"], a[key], b[key])


def _same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Every tensor within 1e-5 relative norm (float32 sums in another order differ in the last
    bits, and Adam's normalisation carries that into the next steps, element by element)."""
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        a, b = got[name].double(), t.double()
        assert float((a - b).norm() / b.norm().clamp(min=1e-30)) <= 1e-5, name


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from zoo.checkpoint.sharded import ShardedCheckpoint

    with ShardedCheckpoint(ckpt) as ck:
        return {name: ck.full(name) for name in ck.names()}


def _initial() -> torch.nn.Module:
    torch.manual_seed(5)  # the trainer seeds with train.seed, then builds
    return build(CondConfig(), FAMILY.specs["cond"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trainer")
    out = {"root": root}
    for name, world, layout in (("one", 1, ()), ("dp2", 2, ()), ("tp2", 2, ("parallel.tp=2",)),
                                ("pp2", 2, ("parallel.pp=2",))):
        out[name] = _train(root / name, world, *layout)
    return out


def test_first_step_matches_an_independent_computation(runs):
    """Step 1's logged loss is the main objective (MSE) alone, the auxiliary term is logged beside
    it and included in what is backpropagated (the gradient norm says so), and frozen parameters
    get no gradient."""
    model = _initial()
    rows = [sample(5, "train", g) for g in range(8)]
    x, label = torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    target = torch.stack([r[2] for r in rows])
    mse, aux = 0.0, 0.0
    for i in range(0, 8, 2):  # four micro-batches of two, averaged
        pred = model(x[i:i + 2], label[i:i + 2])
        m, a = (pred - target[i:i + 2]).pow(2).mean() / 4, AUX_WEIGHT * pred.pow(2).mean() / 4
        (m + a).backward()
        mse, aux = mse + m.detach(), aux + a.detach()
    trainable = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in trainable))
    first = runs["one"][0]
    assert first["loss"] == pytest.approx(float(mse), rel=1e-6) and first["aux_l2"] == pytest.approx(float(aux), rel=1e-6)
    assert first["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert first["samples"] == 8.0
    assert "images_per_s" in first and "tokens_per_s" not in first and first["mfu"] > 0
    # the achieved model FLOP/s per rank: 6 FLOPs per linear weight per row of an image, times
    # the images a second; MFU its share of one peak measured once per run
    per_image = 6.0 * SIDE * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    for r in runs["one"]:
        assert r["flops_per_s"] == pytest.approx(per_image * r["images_per_s"], rel=1e-6)
    peaks = {r["flops_per_s"] / r["mfu"] for r in runs["one"]}
    assert max(peaks) == pytest.approx(min(peaks), rel=1e-9)


def test_validation_follows_its_own_interval_between_logging_steps(runs, tmp_path):
    """train.eval_interval=3 under logging.interval=4: validation at steps 3 and 6 (each with a
    record of its own), not only where both intervals meet; the same values as the run logging
    every step, whose training it does not disturb."""
    records = _train(tmp_path / "run", 1, "logging.interval=4")
    assert [r["step"] for r in records] == [3, 4, 6]
    assert [("val_loss" in r) for r in records] == [True, False, True]
    every = {r["step"]: r for r in runs["one"]}
    for r in records:
        for key in ("loss", "val_loss", "grad_norm"):
            assert r.get(key) == every[r["step"]].get(key), (r["step"], key)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_layouts_train_like_one_process(runs, layout):
    _close(runs[layout], runs["one"], validation=layout != "dp2")
    _same(_tensors(runs["root"] / layout / "checkpoints" / "step_00000006"),
          _tensors(runs["root"] / "one" / "checkpoints" / "step_00000006"))


def test_frozen_parameters_keep_their_values_and_have_no_optimizer_state(runs):
    initial = _initial().embed.weight.detach()
    for layout in ("one", "dp2", "tp2", "pp2"):
        tensors = _tensors(runs["root"] / layout / "checkpoints" / "step_00000006")
        assert torch.equal(tensors["embed.weight"], initial), layout
        assert not [n for n in tensors if n.startswith("embed.") and "::" in n or n.startswith("ema/embed.")], layout
        assert "cond_embed.weight::exp_avg" in tensors and "ema/cond_embed.weight" in tensors


def test_preview_and_tensorboard(runs):
    from PIL import Image

    one = runs["root"] / "one"
    assert sorted(p.name for p in (one / "samples").iterdir()) == ["step_00000003.png", "step_00000006.png"]
    with Image.open(one / "samples" / "step_00000006.png") as img:
        # targets then predictions of the micro-batch (2 each), 8x8 tiles with 2-pixel gaps, one row
        assert img.format == "PNG" and img.mode == "RGB" and img.size == (4 * 10 + 2, 10 + 2)
        pixels = torch.from_numpy(np.array(img)).int()
    with Image.open(runs["root"] / "tp2" / "samples" / "step_00000006.png") as img:  # drawn by both TP ranks together
        assert (torch.from_numpy(np.array(img)).int() - pixels).abs().max() <= 1
    assert list((one / "tensorboard").glob("events.out.tfevents.*"))
    assert not (runs["root"] / "pp2" / "samples").exists()  # previews need pp=1


def test_resume_across_layouts_reshards_ema_and_frozen_state(runs, tmp_path):
    def resume(src: str, name: str, world: int, *layout: str) -> tuple[list[dict], dict]:
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(runs["root"] / src / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000003")
        records = _train(run, world, *layout)
        return records, _tensors(run / "checkpoints" / "step_00000006")

    same, same_t = resume("dp2", "dp2-again", 2)
    assert [r["loss"] for r in same] == [r["loss"] for r in runs["dp2"][3:]]  # the same layout: bitwise
    dp2_final = _tensors(runs["root"] / "dp2" / "checkpoints" / "step_00000006")
    assert all(torch.equal(same_t[k], dp2_final[k]) for k in dp2_final)
    other, other_t = resume("dp2", "dp2-to-tp2", 2, "parallel.tp=2")
    _close(other, runs["one"][3:])
    _same(other_t, _tensors(runs["root"] / "one" / "checkpoints" / "step_00000006"))


def test_a_restart_within_the_same_second_still_hides_the_earlier_runs_tensorboard_points(tmp_path):
    """TensorBoard orders event files by name (start second, host, pid): an earlier run's file from
    the second this run starts in, with a pid that sorts later, would be read after the purge and
    its points shown. The log starts its file in a later second."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from zoo.training.metrics import MetricsLog

    tb = tmp_path / "tensorboard"
    with SummaryWriter(str(tb)) as old:
        for step in range(1, 4):
            old.add_scalar("loss", 9.0, step)
    (old_file,) = tb.iterdir()
    # named as a writer started in the coming second by a process whose pid sorts after any other
    host = old_file.name.split(".")[4:-2]
    old_file.rename(tb / ".".join(["events", "out", "tfevents", str(int(time.time()) + 1), *host, "999999999", "0"]))
    log = MetricsLog(tmp_path, resume_step=0, tensorboard=True)
    log.log({"step": 1, "loss": 0.5})
    log.close(plot=None, title="", log_scale=False)
    seen = EventAccumulator(str(tb))
    seen.Reload()
    assert [(e.step, e.value) for e in seen.Scalars("loss")] == [(1, 0.5)]


def test_a_fresh_run_refuses_a_run_directory_holding_another_runs_checkpoints(runs, tmp_path):
    """checkpoint.dir elsewhere and nothing there to resume: the run would start fresh and rewrite the
    run directory's metrics and config, which describe the checkpoints still in it. Refused, one
    line naming the directory, nothing written; its own checkpoint root empty, the same directory
    trains (a run that died before its first checkpoint restarts there)."""
    from zoo.errors import ConfigError

    one = runs["root"] / "one"
    before = {p: p.read_bytes() for p in (one / "metrics.jsonl", one / "config.yaml")}
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match=rf"{one} holds another run .*use another --run-dir"):
        _fit(str(one), 1, [*COMMON, f"checkpoint.dir={elsewhere}"])
    assert {p: p.read_bytes() for p in before} == before and not elsewhere.exists()
    # A run that died before its first checkpoint: metrics and TensorBoard (as TensorBoard's own
    # reader shows them) hold only the new run's points
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    fresh = tmp_path / "died-early"
    (fresh / "checkpoints").mkdir(parents=True)
    (fresh / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    with SummaryWriter(str(fresh / "tensorboard")) as old:
        for step in range(1, 6):
            old.add_scalar("loss", 9.0, step)
    records = _train(fresh, 1, "train.steps=3", "checkpoint.interval=0")
    assert [r["step"] for r in records] == [1, 2, 3] and 9.0 not in [r["loss"] for r in records]
    seen = EventAccumulator(str(fresh / "tensorboard"))
    seen.Reload()
    assert [(e.step, e.value) for e in seen.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in records]


def test_lr_multiplier_and_ema_follow_their_formulas(tmp_path):
    """One step: the cond_embed update with multiplier 0.5 is half the update without it (Adam's
    step and decoupled weight decay both scale with the learning rate), and the EMA is
    ``0.9 * initial + 0.1 * updated``; torch's per-tensor AdamW loop gives the default fused
    kernel's update."""
    init = _initial().state_dict()
    final = {}
    for name, extra in (("half", ()), ("whole", ("optimizer.lr_mult={}",)),
                        ("loop", ("optimizer.implementation=for-loop",))):
        _train(tmp_path / name, 1, "train.steps=1", "train.eval_interval=0", *extra)
        final[name] = _tensors(tmp_path / name / "checkpoints" / "step_00000001")
    _same(final["loop"], final["half"])  # the default fused kernel, as the per-tensor loop
    key = "cond_embed.weight"
    torch.testing.assert_close(final["half"][key] - init[key], 0.5 * (final["whole"][key] - init[key]), rtol=1e-4, atol=1e-8)
    for name, t in init.items():
        if not name.startswith("embed."):
            torch.testing.assert_close(final["half"][f"ema/{name}"], torch.lerp(t, final["half"][name], 0.1))


@pytest.mark.parametrize("power", [0.0, 0.75])
def test_ema_ramp_follows_diffusers_ema_model_and_resumes(tmp_path, power):
    """train.ema_ramp: diffusers' EMAModel (its default decay ramp, or with train.ema_power its
    use_ema_warmup, capped at train.ema) stepped over the same weights gives the same average;
    resumed from step 2, the ramp continues where it was (its update count is saved)."""
    from diffusers.training_utils import EMAModel

    from zoo.config import resolve
    from zoo.errors import ConfigError

    ramp = ("train.steps=3", "checkpoint.interval=1", "train.eval_interval=0", "train.ema_ramp=true", "train.ema=0.95",
            f"train.ema_power={power}")
    _train(tmp_path / "run", 1, *ramp)
    model = _initial()
    trained = {n: p for n, p in model.named_parameters() if not n.startswith("embed.")}
    ema = EMAModel(list(trained.values()), decay=0.95, use_ema_warmup=power > 0, power=power or 2 / 3)
    for step in (1, 2, 3):
        saved = _tensors(tmp_path / "run" / "checkpoints" / f"step_{step:08d}")
        with torch.no_grad():
            for n, p in trained.items():
                p.copy_(saved[n])
        ema.step(list(trained.values()))
    for (n, _), expected in zip(trained.items(), ema.shadow_params):
        torch.testing.assert_close(saved[f"ema/{n}"], expected, msg=n)
    again = tmp_path / "again" / "checkpoints"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_00000002", again / "step_00000002")
    _train(tmp_path / "again", 1, *ramp)
    _same(_tensors(again / "step_00000003"), saved)
    with pytest.raises(ConfigError, match="train: ema_ramp=true ramps .* set ema"):
        resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=FAMILY.flavors["tiny"](),
                recipe=[("recipe of cond", FAMILY.recipe)], overrides=["train.ema_ramp=true", "train.ema=0"])
    with pytest.raises(ConfigError, match="ema_power=0.5 shapes ema_ramp's warmup"):
        resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=FAMILY.flavors["tiny"](),
                recipe=[("recipe of cond", FAMILY.recipe)], overrides=["train.ema=0.9", "train.ema_power=0.5"])


def _fit_and_probe(run_dir: str, overrides: list[str], flushed: bool) -> None:
    _fit(run_dir, 1, overrides)
    tiny = torch.tensor([1e-40]) * 1.0  # a subnormal float32: kept, or flushed to zero
    assert (tiny.item() == 0.0) == flushed, tiny


@pytest.mark.parametrize("flush", [True, False])
def test_flush_denormal_sets_the_processs_float_mode(tmp_path, flush):
    run_distributed(_fit_and_probe, 1, str(tmp_path), [*COMMON, "train.steps=1", "train.eval_interval=0",
                                                         f"train.flush_denormal={str(flush).lower()}"], flush, timeout=240)


def test_fp16_loss_scale_skips_the_same_steps_in_every_layout(tmp_path):
    """fp16 with a loss scale too large at first: one process skips the steps whose gradients
    overflow and halves the scale, then doubles it after two clean steps (the policy, checked from
    the logged norms); tp2 and fsdp2 (both refused before: torch's GradScaler decided per rank)
    and dp2 with ZeRO-1 skip the same steps with the same scale and follow the same curve, and pp2
    resuming fsdp2's checkpoint continues it, scale and skips included. The EMA moves only on steps
    that updated."""
    import math

    fp16 = ("train.precision=fp16", "train.initial_loss_scale=3e6", "train.loss_scale_window=2", "train.steps=7")
    ref = _train(tmp_path / "one", 1, *fp16)
    scale, clean, expected = 3e6, 0, []
    for r in ref:
        if math.isfinite(r["grad_norm"]):
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
        else:
            scale, clean = scale / 2, 0
        expected.append(scale)
    assert [r["loss_scale"] for r in ref] == expected
    skipped = [r["skipped_steps"] for r in ref]
    assert skipped[-1] == sum(not math.isfinite(r["grad_norm"]) for r in ref)
    assert 0 < skipped[-1] < len(ref) and max(expected) > min(expected) * 2  # both ways taken
    from zoo.training.metrics import log_fields

    shown = log_fields(ref[-1], FAMILY)  # the console line, as Megatron's shows scale and skips
    assert shown["loss scale"] == f"{expected[-1]:g}" and shown["skipped"] == str(skipped[-1])

    def same_scales(got: list[dict], ref: list[dict]) -> None:
        assert [(r["loss_scale"], math.isfinite(r["grad_norm"])) for r in got] == \
               [(r["loss_scale"], math.isfinite(r["grad_norm"])) for r in ref]
        for a, b in zip(got, ref):  # fp16 partial sums rounded per rank: within fp16's precision
            assert abs(a["loss"] - b["loss"]) <= 1e-3 * b["loss"], (a["step"], a["loss"], b["loss"])

    for name, world, layout in (("tp2", 2, ("parallel.tp=2",)), ("fsdp2", 2, ("parallel.fsdp=2",)),
                                ("dp2-zero", 2, ("parallel.zero=1",))):
        got = _train(tmp_path / name, world, *fp16, *layout)
        same_scales(got, ref)
        assert [r["skipped_steps"] for r in got] == skipped, name
    # pp2 takes over fsdp2's step-3 checkpoint (scale and clean-step count resharded with it)
    cont = tmp_path / "fsdp2-to-pp2"
    (cont / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "fsdp2" / "checkpoints" / "step_00000003", cont / "checkpoints" / "step_00000003")
    pp2 = _train(cont, 2, *fp16, "parallel.pp=2")
    same_scales(pp2, ref[3:])
    assert [r["skipped_steps"] for r in pp2] == skipped[3:]  # (the count resumed with the checkpoint)
    from zoo.checkpoint.inspect import describe

    assert describe(tmp_path / "one" / "checkpoints" / "step_00000007")[1].endswith(f", skipped steps {skipped[-1]}")
    # At this scale steps 1-4 overflow, 5 and 6 update (doubling the scale) and 7 overflows again:
    # step 7 leaves the weights and their EMA as step 6 left them (an EMA step there would move the
    # average towards the weights it already differs from), with and without ZeRO
    assert [math.isfinite(r["grad_norm"]) for r in ref] == [False] * 4 + [True] * 2 + [False]
    for run in ("one", "dp2-zero"):
        six, seven = (_tensors(tmp_path / run / "checkpoints" / f"step_0000000{k}") for k in (6, 7))
        assert six.keys() == seven.keys() and all(torch.equal(six[k], seven[k]) for k in six), run
        assert any(not torch.equal(six[k], six[k[4:]]) for k in six if k.startswith("ema/")), run  # EMA != weights


def test_a_grad_scaler_state_from_before_resumes_into_the_loss_scale():
    """Runs without a distributed optimizer saved torch GradScaler's state; it loads."""
    from zoo.training.loss_scale import DynamicLossScale

    old = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    state = old.state_dict()
    state["_growth_tracker"] = 5
    scale = DynamicLossScale(2.0**16, 7)
    scale.load_state_dict(state)
    assert (scale.scale_value, scale.clean_steps) == (1024.0, 5)
    scale.update(found_inf=False)
    scale.update(found_inf=False)
    assert (scale.scale_value, scale.clean_steps) == (2048.0, 0)  # torch's policy: the 7th clean step doubles


BF16 = ("train.steps=3", "checkpoint.interval=1", "train.precision=bf16", "train.param_dtype=bf16", "optimizer.lr=3e-2")


@pytest.fixture(scope="module")
def bf16_one(tmp_path_factory) -> Path:
    """One process training with bf16 parameters (fp32 masters), a checkpoint every step."""
    run = tmp_path_factory.mktemp("bf16") / "one"
    _train(run, 1, *BF16)
    return run


def _resume(src: Path, run: Path, world: int, *extra: str) -> list[dict]:
    shutil.copytree(src / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    return _train(run, world, *BF16, *extra)


def test_ema_under_bf16_parameters_averages_the_fp32_masters(bf16_one, tmp_path):
    """train.param_dtype=bf16 keeps fp32 masters in the distributed optimizer; the EMA follows
    them (the formula over the saved masters to float32 rounding; the bf16 parameters' rounding,
    ~1e-3 of each step's weight, would show), and two data-parallel ranks, each averaging its
    shard and gathering it for the preview, save what one process does, also resumed from it."""
    _train(tmp_path / "dp2", 2, *BF16)
    saved = [_tensors(bf16_one / "checkpoints" / f"step_{s:08d}") for s in (1, 2, 3)]
    init = {n: t.to(torch.bfloat16).float() for n, t in _initial().state_dict().items()}  # the masters at step 0
    trained = [n for n in init if not n.startswith("embed.")]
    assert len(trained) >= 4
    for name in trained:
        ema = init[name]
        for ck in saved:
            ema = torch.lerp(ema, ck[f"{name}::master"], 0.1)
        torch.testing.assert_close(saved[-1][f"ema/{name}"], ema, rtol=1e-6, atol=1e-7)
    assert (tmp_path / "dp2" / "samples" / "step_00000003.png").exists()
    _same(_tensors(tmp_path / "dp2" / "checkpoints" / "step_00000003"), saved[-1])
    # resumed on two ranks from one process's step 2: each rank reads its shard of the average
    _resume(bf16_one, tmp_path / "again", 2)
    _same(_tensors(tmp_path / "again" / "checkpoints" / "step_00000003"), saved[-1])


def test_a_bf16_parameter_checkpoint_resumes_float32_parameters_from_its_masters(bf16_one, tmp_path):
    """Resumed with train.param_dtype=fp32 and no learning rate (step 3 keeps what was loaded):
    the parameters are step 2's exact fp32 masters, not their bf16 roundings; under ZeRO-1 on two
    ranks they are gathered from the masters before step 3's forward (with the bf16 values the
    layer norms' weights moved the loss by ~1e-4)."""
    step2 = _tensors(bf16_one / "checkpoints" / "step_00000002")
    plain = _resume(bf16_one, tmp_path / "plain", 1, "train.param_dtype=fp32", "optimizer.lr=0")
    got = _tensors(tmp_path / "plain" / "checkpoints" / "step_00000003")
    for name, t in got.items():
        if "::" not in name and not name.startswith(("ema/", "embed.")):
            assert t.dtype == torch.float32 and torch.equal(t, step2[f"{name}::master"]), name
    zero = _resume(bf16_one, tmp_path / "zero", 2, "train.param_dtype=fp32", "optimizer.lr=0", "parallel.zero=1")
    assert zero[-1]["loss"] == pytest.approx(plain[-1]["loss"], rel=1e-6)


def test_a_float32_checkpoint_resumed_with_bf16_parameters_takes_its_weights_as_the_masters(tmp_path):
    """The other way: a float32-parameter run's step 2 resumed with train.param_dtype=bf16 and no
    learning rate; the masters saved at step 3 are the float32 weights, not their bf16 roundings;
    the same where `checkpoint.load` starts a run from it."""
    _train(tmp_path / "fp32", 1, "train.steps=2", "checkpoint.interval=2", "train.precision=bf16")
    weights = _tensors(tmp_path / "fp32" / "checkpoints" / "step_00000002")
    _resume(tmp_path / "fp32", tmp_path / "bf16", 1, "optimizer.lr=0")
    got = _tensors(tmp_path / "bf16" / "checkpoints" / "step_00000003")
    masters = [n for n in got if n.endswith("::master")]
    assert len(masters) >= 4
    for key in masters:
        assert torch.equal(got[key], weights[key.removesuffix("::master")]), key
    # and as checkpoint.load's starting point (its moving average, by default), on two ranks
    _train(tmp_path / "start", 2, *BF16, "train.steps=1", "optimizer.lr=0",
           f"checkpoint.load={tmp_path / 'fp32' / 'checkpoints' / 'step_00000002'}")
    got = _tensors(tmp_path / "start" / "checkpoints" / "step_00000001")
    for key in masters:
        assert torch.equal(got[key], weights["ema/" + key.removesuffix("::master")]), key
