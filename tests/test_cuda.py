"""The CUDA path against the CPU path, for every installed family: run where a GPU is (the lent
GPU machine, a user's workstation), skipped elsewhere. Every CPU path these compare with is tested
on its own in the rest of the suite; these show that the same code on a GPU computes the same
function (float32 with TF32 off: the last bits differ with the kernels, not more), that bf16
autocast on a GPU stays near float32, and that the trainer's curve on a GPU is the CPU's."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from zoo.testing.conformance import installed_families

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _loss_and_grads(model, loss_fn, batch, autocast=None):
    torch.manual_seed(1)  # a loss that draws noise draws the same on both runs of one device
    dev = next(model.parameters()).device.type
    with torch.autocast(dev, dtype=autocast, enabled=autocast is not None):
        loss, _ = loss_fn(model, batch)
    loss.backward()
    return loss.detach().double().cpu(), {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()
                                          if p.grad is not None}


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name", installed_families())
def test_a_family_computes_the_same_loss_and_gradients_on_cuda(name):
    from zoo.testing.conformance import _parts, _seq_length

    fam, cfg, spec, build, loss_fn, example = _parts(name, "tiny")
    torch.manual_seed(0)
    cpu_model = build(cfg, spec)
    batch = example(cfg, batch_size=2, seq_length=_seq_length(fam, "tiny"), generator=torch.Generator().manual_seed(0))
    gpu_model = copy.deepcopy(cpu_model).cuda()
    ref_loss, ref = _loss_and_grads(cpu_model, loss_fn, batch)
    loss, grads = _loss_and_grads(gpu_model, loss_fn, _to(batch, "cuda"))
    assert abs(float(loss - ref_loss)) <= 1e-5 * max(abs(float(ref_loss)), 1.0), (float(loss), float(ref_loss))
    assert grads.keys() == ref.keys()
    for n, g in ref.items():
        err = float((grads[n] - g).norm() / g.norm().clamp(min=1e-12))
        assert err <= 1e-4, f"{name}: {n}: gradient differs on CUDA by {err:.2e} (relative)"

    # bf16 autocast on the GPU: the same loss to bf16's precision, the same gradient directions.
    gpu_model.zero_grad(set_to_none=True)
    loss16, grads16 = _loss_and_grads(gpu_model, loss_fn, _to(batch, "cuda"), autocast=torch.bfloat16)
    assert abs(float(loss16 - ref_loss)) <= 3e-2 * max(abs(float(ref_loss)), 1.0), (float(loss16), float(ref_loss))
    cos = [float(torch.nn.functional.cosine_similarity(grads16[n].flatten(), g.flatten(), dim=0))
           for n, g in ref.items() if g.norm() > 1e-6 * max(x.norm() for x in ref.values())]
    assert min(cos) > 0.95, f"{name}: a bf16 gradient points elsewhere than float32's (cosine {min(cos):.3f})"


@pytest.mark.parametrize("name", installed_families())
def test_cached_decoding_on_cuda_equals_the_cpu_full_forward(name):
    """A prompt longer than Mamba-2's chunk, then one token at a time from the recurrent or KV cache
    on the GPU (the SSD's one-token step, the conv state, the attention cache), gives the logits of
    the uncached forward on the CPU."""
    from zoo.testing.conformance import build_tiny

    model, cfg = build_tiny(name)
    if not hasattr(model, "new_cache"):
        pytest.skip(f"{name} has no decoding cache")
    tokens = torch.randint(0, cfg.vocab_size, (2, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.eval()(tokens)
        gpu = copy.deepcopy(model).cuda()
        cache = gpu.new_cache(2, 45)
        steps = [gpu(tokens[:, :40].cuda(), cache=cache)]
        steps += [gpu(tokens[:, i:i + 1].cuda(), cache=cache) for i in range(40, 45)]
    got = torch.cat(steps, 1).cpu()
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-4 * max(float(ref.abs().max()), 1.0), name


@pytest.mark.parametrize("model, ask", [
    ("llama", ["--prompt", "The with statement", "--temperature", "0.9", "--top-p", "0.95", "--max-new-tokens", "24"]),
    ("mamba2", ["--prompt", "The with statement", "--temperature", "0.9", "--max-new-tokens", "24"]),
    ("dit", ["--class", "7", "3", "--num-steps", "4", "--guidance", "1.5", "--output", "OUT.png"]),
])
def test_zoo_generate_on_cuda_draws_what_the_cpu_draws(capsys, tmp_path, model, ask):
    """`zoo generate --device cuda` from a checkpoint trained on the CPU: the same --seed gives the
    CPU's text (tokens drawn on the host from the GPU's probabilities) and the CPU's image grid."""
    import numpy as np
    from PIL import Image

    from zoo.testing import run_zoo

    run = tmp_path / "run"
    out = run_zoo(capsys, "train", "--model", model, "--run-dir", str(run), "train.steps=4", "train.device=cpu",
                  "train.eval_interval=0", "logging.progress=false")
    assert out.returncode == 0, out.stderr[-3000:]
    said = {}
    for device in ("cpu", "cuda"):
        args = [str(tmp_path / f"{device}.png") if a == "OUT.png" else a for a in ask]
        got = run_zoo(capsys, "generate", "--checkpoint", str(run), "--device", device, "--seed", "3", *args)
        assert got.returncode == 0, got.stderr[-3000:]
        said[device] = got.stdout
    if model == "dit":
        a, b = (np.asarray(Image.open(tmp_path / f"{d}.png"), dtype=np.int16) for d in ("cpu", "cuda"))
        assert a.shape == b.shape and int(np.abs(a - b).max()) <= 1
    else:
        assert said["cuda"] == said["cpu"] and said["cpu"].startswith("The with statement"), said


def test_clip_and_llava_answer_on_cuda_as_on_the_cpu():
    """CLIP's zero-shot probabilities and LLaVA's sampled answer with the model on the GPU and the
    images and texts handed over on the CPU (as `zoo generate --device cuda` reads them)."""
    from zoo_vlm.generate import generate_answer, zero_shot

    from zoo.testing.conformance import build_tiny

    clip, ccfg = build_tiny("clip")
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(3, ccfg.num_channels, ccfg.image_size, ccfg.image_size, generator=gen)
    texts = torch.randint(1, ccfg.vocab_size, (4, ccfg.max_seq_length), generator=gen)
    texts[:, 5:] = ccfg.eos_token_id  # (CLIP pools each text at its end token)
    ref = zero_shot(clip, images, texts)
    got = zero_shot(copy.deepcopy(clip).cuda(), images, texts)
    assert got.device.type == "cpu" and torch.allclose(got, ref, atol=1e-5)

    llava, lcfg = build_tiny("llava")
    image = torch.randn(1, lcfg.num_channels, lcfg.image_size, lcfg.image_size, generator=gen)
    prompt = [5, lcfg.image_token_id, 7, 9, 11]
    kw = dict(max_new_tokens=12, eos_id=-1, temperature=0.9, seed=4)
    assert generate_answer(copy.deepcopy(llava).cuda(), lcfg, image, prompt, **kw) == \
        generate_answer(llava, lcfg, image, prompt, **kw)


def test_the_trainer_on_cuda_follows_the_cpu_run(tmp_path):
    """The whole trainer (data to the device, autocast off, clipping, AdamW, EMA, frozen
    parameters, validation, checkpoints) on CUDA gives the CPU run's curve, step by step."""
    import json

    from test_trainer import COMMON, _fit

    curves = {}
    for device in ("cpu", "cuda"):
        _fit(str(tmp_path / device), 1, [*COMMON, f"train.device={device}"])
        curves[device] = [json.loads(x) for x in (tmp_path / device / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curves["cuda"]] == [r["step"] for r in curves["cpu"]]
    for a, b in zip(curves["cuda"], curves["cpu"]):
        for key in ("loss", "aux_l2", "grad_norm", "val_loss"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-4 * abs(b[key]) + 1e-6, (key, a["step"], a[key], b[key])


def test_dit_samples_and_previews_on_cuda_as_on_the_cpu():
    """DiT's sampler on a GPU driven by a CPU generator (churn draws fresh noise each step) gives
    the CPU's samples, and the trainer's preview, handed a generator on the GPU, draws its grid."""
    from zoo_dit.diffusion import preview, sample

    from zoo.testing.conformance import build_tiny

    model, cfg = build_tiny("dit")
    torch.manual_seed(3)
    with torch.no_grad():  # adaLN-Zero starts at zero: give the blocks something to compute
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    kw = dict(labels=[1, 7], num_steps=4, guidance=1.5, churn=2.0)
    ref = sample(model, cfg, generator=torch.Generator().manual_seed(5), **kw)
    got = sample(copy.deepcopy(model).cuda(), cfg, generator=torch.Generator().manual_seed(5), **kw)
    assert got.device.type == "cpu" and got.shape == ref.shape
    assert float((got - ref).norm() / ref.norm()) <= 1e-4
    art = preview(model.cuda(), cfg, {}, generator=torch.Generator("cuda").manual_seed(0))
    assert art.kind == "image"


def test_the_phase_timers_charge_gpu_work_to_the_phase_that_launched_it(tmp_path):
    """Kernels launched in forward_backward and waited for by the optimizer's first host read are
    forward_backward's time (without a device sync at the lap, the optimizer got it)."""
    from types import SimpleNamespace

    from zoo.training.instruments import Instruments

    log = SimpleNamespace(timers=True, straggler_factor=1.5, profile="", memory_snapshot=0)
    inst = Instruments(log, rank=0, world_size=1, device="cuda:0", stage=0, run_dir=tmp_path, is_main=True)
    a = torch.randn(4096, 4096, device="cuda")
    inst.lap("other")
    for _ in range(30):
        a = torch.tanh(a @ a)  # ~0.1 s of GPU work, launched in microseconds
    inst.lap("forward_backward")
    float(a.sum())  # the optimizer's first read of a device value
    inst.lap("optimizer")
    assert inst.sums["forward_backward"] > 5 * inst.sums["optimizer"], inst.sums


def _curve(run_dir):
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_curve(graphed, eager, what):
    assert [r["step"] for r in graphed] == [r["step"] for r in eager]
    for a, b in zip(graphed, eager):
        for key in ("loss", "aux_l2", "grad_norm", "val_loss"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]) + 1e-7, (what, key, a["step"], a[key], b[key])


def _same_final_checkpoint(run_dir, ref_dir, step: int = 6):
    """Weights, EMA and optimizer state of the two runs' checkpoints of ``step`` agree."""
    from test_trainer import _tensors

    final, ref = (_tensors(d / "checkpoints" / f"step_{step:08d}") for d in (run_dir, ref_dir))
    assert final.keys() == ref.keys()
    for k, v in ref.items():
        same = torch.allclose(final[k], v, rtol=1e-5, atol=1e-7) if v.is_floating_point() else torch.equal(final[k], v)
        assert same, k


def _resume_copy(run_dir, step: int, into):
    """A new run directory holding only ``run_dir``'s checkpoint of ``step`` (a run to resume)."""
    import shutil

    name = f"step_{step:08d}"
    (into / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / name, into / "checkpoints" / name)
    return into


@pytest.mark.parametrize("extra", [(), ("optimizer.implementation=foreach",),
                                   ("train.precision=bf16", "train.param_dtype=bf16"), ("train.precision=fp16",),
                                   ("train.precision=fp16", "train.param_dtype=fp16")],
                         ids=["fused", "foreach", "bf16-params", "fp16", "fp16-params"])
def test_a_cuda_run_resumed_from_its_checkpoint_continues_its_curve(tmp_path, extra):
    """Resuming on a GPU puts the optimizer state where each kernel reads it (fused AdamW reads
    its step count on the device; the distributed optimizer of bf16 parameters keeps its state beside
    its float32 masters; fp16's loss scale, torch's GradScaler or the distributed optimizer's, comes
    back too): the resumed run's curve and final weights and EMA are the uninterrupted run's."""
    from test_trainer import COMMON, _fit

    overrides = [*COMMON, "train.device=cuda", *extra]
    _fit(str(tmp_path / "whole"), 1, overrides)
    resumed = _resume_copy(tmp_path / "whole", 3, tmp_path / "resumed")
    _fit(str(resumed), 1, overrides)
    _same_curve(_curve(resumed), _curve(tmp_path / "whole")[3:], "resumed")
    _same_final_checkpoint(resumed, tmp_path / "whole")


def test_cuda_graphs_replay_the_trainers_eager_steps_and_resume_exactly(tmp_path):
    """train.cuda_graph=true on the trainer's own family (four micro-batches a step accumulated into
    the same gradients, frozen parameters, a learning-rate multiplier, EMA, validation, checkpoints):
    the micro-batches after the warm-up are replayed from one graph, the curve is the eager run's, and
    a graphed run resumed from the step-3 checkpoint continues the uninterrupted one (weights and EMA)."""
    from _trainer_family import DATASET, FAMILY, CondConfig
    from test_trainer import COMMON

    from zoo.config import resolve
    from zoo.parallel.cuda_graphs import WARMUP
    from zoo.parallel.layout import plan
    from zoo.training.trainer import Trainer

    def fit(graph: str, run_dir):
        run = resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=FAMILY.flavors["tiny"](),
                      recipe=[("recipe of cond", FAMILY.recipe)],
                      overrides=[*COMMON, "train.device=cuda", f"train.cuda_graph={graph}"])
        trainer = Trainer(FAMILY, run, plan(run, world_size=1, family=FAMILY), run_dir=run_dir, dataset=DATASET)
        trainer.fit()
        return _curve(run_dir), trainer.par.graphs

    eager, _ = fit("false", tmp_path / "eager")
    graphed, graphs = fit("true", tmp_path / "graphed")
    assert graphs.off is None and len(graphs.graphs) == 1, (graphs.off, len(graphs.graphs))
    assert graphs.replays == 6 * 4 - WARMUP  # 6 steps of 4 micro-batches: all but the warm-ups replayed
    _same_curve(graphed, eager, "cond")

    resumed = _resume_copy(tmp_path / "graphed", 3, tmp_path / "resumed")
    again, graphs = fit("true", resumed)
    assert graphs.off is None and graphs.replays == 3 * 4 - WARMUP, (graphs.off, graphs.replays)
    _same_curve(again, graphed[3:], "cond resumed")
    _same_final_checkpoint(resumed, tmp_path / "graphed")


@pytest.mark.parametrize("model, extra", [("llama", ()), ("mamba2", ()), ("dit", ()),
                                          ("llama", ("train.precision=bf16", "train.param_dtype=bf16",
                                                     "train.grad_dtype=bf16"))],
                         ids=["llama", "mamba2", "dit", "llama-bf16-params"])
def test_cuda_graphs_train_a_familys_eager_curve_under_zoo_train(capsys, tmp_path, model, extra):
    """`zoo train --model M train.cuda_graph=true` captures the family's step (no fallback to eager)
    and trains the eager run's curve; with bf16 parameters and gradients the gradients are views
    into the distributed optimizer's buckets, which the graph accumulates into."""
    from zoo.parallel.cuda_graphs import WARMUP
    from zoo.testing import run_zoo

    curves = {}
    for graph in ("false", "true"):
        out = run_zoo(capsys, "train", "--model", model, "--run-dir", str(tmp_path / graph), "train.steps=6",
                      "train.device=cuda", f"train.cuda_graph={graph}", "train.eval_interval=0", "logging.interval=1",
                      "logging.progress=false", "checkpoint.interval=0", *extra)
        assert out.returncode == 0, out.stderr[-3000:]
        said = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith("train.cuda_graph:")]
        if graph == "true":  # replayed (after the warm-ups), never eager for good, no shape left eager
            assert len(said) == 1, out.stdout[-3000:]
            m = re.fullmatch(r"train.cuda_graph: (\d+) of (\d+) micro-batches replayed from (\d+) graph\(s\)", said[0])
            assert m, said
            replays, calls, graphs = map(int, m.groups())
            assert graphs >= 1 and replays == calls - WARMUP * graphs > 0, said
        else:
            assert not said, said
        curves[graph] = _curve(tmp_path / graph)
    _same_curve(curves["true"], curves["false"], model)
