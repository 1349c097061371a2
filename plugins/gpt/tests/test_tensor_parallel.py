"""GPT-2 and LLaMA under tensor parallelism (tp=2, gloo), applied by the core from the plan it
derives from the model's layers (the families declare none): loss and every gradient (gathered to
full shape) equal the single-process model, also for a family run with another family's layer spec
(LLaMA's config with GPT-2's ungated MLP), which a plan written per family split wrongly."""

from __future__ import annotations

import pytest
import torch

from zoo.testing import run_distributed


def _full_grad(name: str, g: torch.Tensor, group, plan_style: str) -> torch.Tensor:
    from zoo.parallel import comm

    if plan_style == "row":
        return comm.all_gather(g, group, 1)
    if plan_style == "column_gated":
        parts = comm.all_gather(g, group, 0).chunk(comm._size(group) * 2)
        return torch.cat(parts[0::2] + parts[1::2])  # [g0;u0;g1;u1] -> [g0;g1;u0;u1]
    return comm.all_gather(g, group, 0)


def _style(name: str, plan: dict) -> str | None:
    from zoo.parallel.apply import _matches

    mod = name.rpartition(".")[0]
    return next((s for p, s in plan.items() if _matches(mod, p)), None)


def _run(family: str, tp: int, layer_spec: str | None = None) -> dict:
    import dataclasses

    import torch.distributed as dist

    from zoo.parallel.apply import apply_tensor_parallel, tensor_parallel_plan
    from zoo.registry import get_registry

    fam = get_registry().get(family).family
    from zoo.family import resolve

    cfg = fam.flavors["tiny"]()
    if layer_spec is not None:
        cfg = dataclasses.replace(cfg, layer_spec=layer_spec)
    build, example = resolve(fam.build, owner="t"), resolve(fam.example_batch, owner="t")
    torch.manual_seed(0)
    model = build(cfg, fam.spec_for(cfg))
    plan, local = tensor_parallel_plan(model, fam.tp_plan, fam.tp_local)
    batch = example(cfg, batch_size=2, seq_length=16, generator=torch.Generator().manual_seed(1))
    group = dist.group.WORLD if tp > 1 else None
    if tp > 1:
        full_rows = model.layers[0].attn.qkv.weight.shape[0]
        apply_tensor_parallel(model, plan, local, group)
        assert model.layers[0].attn.qkv.weight.shape[0] == full_rows // tp  # really sharded
        assert model.layers[0].attn.h == cfg.num_heads // tp
    loss = model(batch["tokens"], labels=batch["labels"])
    loss.backward()
    from zoo.parallel.apply import tensor_parallel_shards

    split = tensor_parallel_shards(model)  # what the layers say they split (a row layer's bias is whole)
    grads = {}
    for name, p in model.named_parameters():
        style = _style(name, plan) if tp > 1 else None
        if style is not None and name in split:
            grads[name] = _full_grad(name, p.grad, group, "column" if style in ("vocab_embedding", "vocab_head") else style)
        else:
            grads[name] = p.grad.clone()
    return {"loss": loss.item(), "grads": grads}


@pytest.mark.parametrize("family, layer_spec", [("llama", None), ("gpt2", None), ("llama", "gpt2")])
def test_tp2_equals_single_process(family, layer_spec):
    ref = _run(family, 1, layer_spec)
    for got in run_distributed(_run, 2, family, 2, layer_spec, timeout=180):
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        assert got["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def _losses(run_dir):
    import json

    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ZeRO-1 and the other layouts through `zoo train` are in test_parallel_layouts.py and
# test_dist_checkpoint.py.
@pytest.mark.parametrize(("nproc", "layout"), [
    (2, ["parallel.tp=2"]),
    (4, ["parallel.tp=2", "train.micro_batch_size=4"]),
])
def test_zoo_train_tp_matches_one_process_and_resumes_anywhere(tmp_path, corpus_cache, nproc, layout):
    from _gpt_helpers import ranks, small_run, zoo

    args = ("train.steps=6", "checkpoint.interval=3", "optimizer.grad_clip=0.5", "train.global_batch_size=8")
    one = zoo(*small_run(tmp_path / "one", corpus_cache, *args))
    assert one.returncode == 0, one.stderr
    par = ranks(nproc, *small_run(tmp_path / "par", corpus_cache, *args, *layout))
    assert par.returncode == 0, par.stdout + par.stderr
    for a, b in zip(_losses(tmp_path / "par"), _losses(tmp_path / "one")):
        assert abs(a - b) <= 2e-5 * abs(b), (_losses(tmp_path / "par"), _losses(tmp_path / "one"))
    # The checkpoint holds full tensors: a single process continues the TP run from step 3.
    import shutil

    cont = tmp_path / "cont"
    (cont / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "par" / "checkpoints" / "step_00000003", cont / "checkpoints" / "step_00000003")
    out = zoo(*small_run(cont, corpus_cache, *args))
    assert out.returncode == 0, out.stderr
    for a, b in zip(_losses(cont), _losses(tmp_path / "one")[3:]):
        assert abs(a - b) <= 2e-5 * abs(b)


def test_dry_run_shows_parameters_per_rank():
    from _gpt_helpers import zoo

    out = zoo("train", "--model", "llama", "--flavor", "3-8B", "--dry-run", "--world-size", "8", "parallel.tp=8")
    assert out.returncode == 0, out.stderr
    # Independent count: every matrix of Llama 3 8B is split eight ways except the norms (replicated).
    norms = 32 * 2 * 4096 + 4096
    expected = (8_030_261_248 - norms) // 8 + norms
    assert f"# parameters per tensor-parallel rank: {expected:,}" in out.stdout


def test_dry_run_shows_parameters_per_pipeline_stage():
    from _gpt_helpers import zoo

    out = zoo("train", "--model", "llama", "--flavor", "3-8B", "--dry-run", "--world-size", "16",
              "parallel.tp=2", "parallel.pp=4")
    assert out.returncode == 0, out.stderr
    # Independent arithmetic for Llama 3 8B: 8 layers per stage, matrices split over TP=2, norms whole.
    attn = 2 * 4096 * 4096 + 2 * 1024 * 4096
    mlp = 3 * 4096 * 14336
    layer = (attn + mlp) // 2 + 2 * 4096
    vocab = 128256 * 4096 // 2
    expected = [8 * layer + vocab, 8 * layer, 8 * layer, 8 * layer + vocab + 4096]
    for stage, n in enumerate(expected):
        assert f"# parameters per rank of pipeline stage {stage}: {n:,}" in out.stdout
    assert "world 16 = tp=2 x cp=1 x dp=2 x pp=4" in out.stdout
