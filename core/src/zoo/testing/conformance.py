"""The conformance suite: what every model family, first- or third-party, must do.

`check_family(name)` runs every check on the family's ``tiny`` flavor; zoo's own test suite
parametrizes it over every installed family, and a plugin author calls it from their tests::

    from zoo.testing.conformance import check_family
    def test_conforms():
        check_family("mixer")

The checks: the flavor builds from its config and named spec; it builds on the meta device with the
same parameter count (so dry runs are exact); a forward on the family's example batch gives a finite
scalar loss; backward reaches every trainable parameter with finite gradients; the same seed gives
bitwise the same loss and gradients; a few optimizer steps on one batch lower the loss (the model
can learn at all). And what the family declares for the trainer (`check_declarations`): every
declared metric is returned as a finite scalar and every auxiliary loss carries a gradient; the
throughput hooks count positive units and FLOPs; a preview returns a `zoo.media.Artifact`; a
pipeline spec's stages, run one after the other in one process, give the whole model's loss, with
exactly the tensors the spec carries crossing the boundary. And bf16 parameters (`check_low_precision`):
loaded as ``zoo generate --dtype bf16`` loads them, every parameter is bf16 and the loss under bf16
autocast is the float32 model's to bf16 accuracy.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["build_tiny", "check_declarations", "check_family", "check_low_precision", "installed_families"]


def installed_families() -> list[str]:
    from zoo.registry import get_registry

    return sorted(get_registry().families)


def _parts(name: str, flavor: str, registry: Any = None) -> tuple[Any, Any, Any, Any, Any, Any]:
    from zoo.family import resolve
    from zoo.registry import get_registry

    entry = (registry or get_registry()).get(name)
    fam, owner = entry.family, str(entry.plugin)
    cfg = fam.flavors[flavor]()
    assert isinstance(cfg, fam.config), f"{owner}: flavor {flavor!r} returned {type(cfg).__name__}, not {fam.config.__name__}"
    spec = fam.spec_for(cfg)
    build = resolve(fam.build, owner=owner)
    loss_fn = resolve(fam.loss, owner=owner)
    example = resolve(fam.example_batch, owner=owner)
    return fam, cfg, spec, build, loss_fn, example


def build_tiny(name: str, *, seed: int = 0, flavor: str = "tiny") -> tuple[Any, Any]:
    """Build the family's flavor with a fixed seed; returns ``(model, config)``."""
    import torch

    _, cfg, spec, build, _, _ = _parts(name, flavor)
    torch.manual_seed(seed)
    return build(cfg, spec), cfg


def _seq_length(fam: Any, flavor: str) -> int:
    recipe = {**fam.recipe, **fam.flavor_recipes.get(flavor, {})}
    return min(int(recipe.get("train.seq_length", 32)), 32)


def _run_once(name: str, flavor: str, seed: int, registry: Any) -> tuple[Any, float, dict[str, Any]]:
    """Build with ``seed`` and run one forward/backward on the batch of data seed 0."""
    import torch

    fam, cfg, spec, build, loss_fn, example = _parts(name, flavor, registry)
    torch.manual_seed(seed)
    model = build(cfg, spec)
    gen = torch.Generator().manual_seed(0)
    batch = example(cfg, batch_size=2, seq_length=_seq_length(fam, flavor), generator=gen)
    torch.manual_seed(1)  # the loss may draw noise (diffusion): the same noise for every build
    loss, metrics = loss_fn(model, batch)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0, f"{name}: loss must be a scalar tensor, got {loss!r}"
    assert isinstance(metrics, dict), f"{name}: loss must return (loss, metrics dict)"
    value = loss.item()
    assert math.isfinite(value), f"{name}: loss is {value} on the example batch"
    loss.backward()
    grads = {}
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"{name}: parameter {pname} received no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: gradient of {pname} is not finite"
        grads[pname] = p.grad.detach().clone()
    assert grads, f"{name}: the model has no trainable parameters"
    assert any(g.abs().sum() > 0 for g in grads.values()), f"{name}: every gradient is zero"
    return model, value, grads


def check_family(name: str, *, flavor: str = "tiny", registry: Any = None) -> None:
    """Run every conformance check on one family; raises AssertionError naming what failed.

    ``registry`` defaults to the installed plugins (`zoo.registry.get_registry`).
    """
    import torch

    fam, cfg, spec, build, loss_fn, example = _parts(name, flavor, registry)

    model, loss_a, grads_a = _run_once(name, flavor, 0, registry)
    n_params = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        meta_model = build(cfg, spec)
    n_meta = sum(p.numel() for p in meta_model.parameters())
    assert n_meta == n_params, f"{name}: {n_meta} parameters on the meta device, {n_params} on CPU"

    _, loss_b, grads_b = _run_once(name, flavor, 0, registry)
    assert loss_a == loss_b, f"{name}: same seed, different loss ({loss_a} vs {loss_b})"
    for pname in grads_a:
        assert torch.equal(grads_a[pname], grads_b[pname]), f"{name}: same seed, different gradient for {pname}"
    _, loss_c, grads_c = _run_once(name, flavor, 1, registry)
    # (A zero-initialised output layer, DiT's adaLN-Zero, gives every seed the same first loss; the
    # gradients still differ.)
    assert loss_c != loss_a or any(not torch.equal(grads_a[p], grads_c[p]) for p in grads_a), \
        f"{name}: the seed does not change the initialisation (same loss {loss_a} and gradients for seeds 0 and 1)"

    # A few steps on one batch must lower the loss: the smallest sign that the model learns.
    torch.manual_seed(0)
    model = build(cfg, spec)
    batch = example(cfg, batch_size=2, seq_length=_seq_length(fam, flavor), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def measure() -> float:
        torch.manual_seed(1)
        with torch.no_grad():
            return float(loss_fn(model, batch)[0])

    start = measure()
    for _ in range(10):
        torch.manual_seed(1)
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch)[0].backward()
        opt.step()
    end = measure()
    assert end < start, f"{name}: 10 AdamW steps on one batch did not lower the loss ({start:.4f} -> {end:.4f})"
    check_declarations(name, flavor=flavor, registry=registry)
    check_low_precision(name, flavor=flavor, registry=registry)


def check_low_precision(name: str, *, flavor: str = "tiny", registry: Any = None) -> None:
    """The model loaded with bf16 parameters, as ``zoo generate --dtype bf16`` loads a checkpoint
    (built under a bf16 default dtype, cast, the float32 values rounded in), holds every parameter in
    bf16, and under bf16 autocast gives the float32 model's loss on the example batch to within 2%
    (both under the same autocast: what differs is only the parameters' rounding)."""
    import torch

    from zoo.checkpoint.external import _materialize
    from zoo.registry import get_registry

    fam, cfg, spec, build, loss_fn, example = _parts(name, flavor, registry)
    torch.manual_seed(0)
    model = build(cfg, spec)
    low = _materialize((registry or get_registry()).get(name), cfg, model.state_dict(), device="cpu",
                       what=f"family {name!r}", dtype=torch.bfloat16)
    wide = [n for n, p in low.named_parameters() if p.is_floating_point() and p.dtype != torch.bfloat16]
    assert not wide, f"{name}: parameters {wide[:4]} are not bf16 after a bf16 load"
    batch = example(cfg, batch_size=2, seq_length=_seq_length(fam, flavor), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, low):
        torch.manual_seed(1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(float(loss_fn(m, batch)[0]))
    full, half = losses
    assert math.isfinite(half) and abs(half - full) <= 2e-2 * max(1.0, abs(full)), \
        f"{name}: loss {half} with bf16 parameters, {full} with float32 ones (both under bf16 autocast)"


def check_declarations(name: str, *, flavor: str = "tiny", registry: Any = None) -> None:
    """The checks of what a family declares for the trainer (metrics, throughput, preview, pipeline)."""
    import torch

    from zoo.config import RunConfig, TrainConfig
    from zoo.family import resolve

    fam, cfg, spec, build, loss_fn, example = _parts(name, flavor, registry)
    owner = f"family {name!r}"
    torch.manual_seed(0)
    model = build(cfg, spec)
    seq = _seq_length(fam, flavor)
    batch = example(cfg, batch_size=2, seq_length=seq, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    loss, metrics = loss_fn(model, batch)
    inactive = ({m.name for m in fam.metrics} - {m.name for m in fam.metrics_for(cfg)}) & set(metrics)
    assert not inactive, f"{name}: the loss returned {sorted(inactive)}, whose MetricSpec.when does not hold for this config"
    for m in fam.metrics_for(cfg):
        assert m.name in metrics, f"{name}: declared metric {m.name!r} is not in what the loss returns ({sorted(metrics)})"
        value = metrics[m.name]
        seen = torch.as_tensor(value).detach()
        shape_ok = seen.dim() == 1 if m.vector else seen.numel() == 1  # a vector metric: one value per element
        assert shape_ok and bool(torch.isfinite(seen).all()), f"{name}: metric {m.name!r} is {value!r}"
        if m.aux_loss:
            assert isinstance(value, torch.Tensor) and value.requires_grad, \
                f"{name}: auxiliary loss {m.name!r} must be a tensor with a gradient (the core backpropagates it)"
    tp = fam.throughput
    count = resolve(tp.count, owner=owner)(batch) if tp.count else None
    assert count is None or (isinstance(count, int) and count > 0), f"{name}: throughput count gave {count!r}"
    if tp.flops_per_unit or tp.flops_of_batch:
        from zoo.training.metrics import work_of

        run = RunConfig(family=name, flavor=flavor, model=cfg, train=TrainConfig(seq_length=seq))
        with torch.device("meta"):
            work = work_of(tp, build(cfg, spec), run, owner=owner)
        flops = work(batch)[1]
        assert math.isfinite(flops) and flops > 0, f"{name}: the declared FLOPs of the example batch are {flops}"
    if fam.preview:
        from zoo.media import Artifact

        with torch.no_grad():
            art = resolve(fam.preview, owner=owner)(model, cfg, batch, generator=torch.Generator().manual_seed(0))
        assert isinstance(art, Artifact), f"{name}: preview returned {type(art).__name__}, not a zoo.media.Artifact"
    if fam.pipeline is not None:
        _check_stages(name, fam, model, loss_fn, batch)


def _check_stages(name: str, fam: Any, model: Any, loss_fn: Any, batch: dict[str, Any]) -> None:
    """Two pipeline stages cut from one model, run one after the other, give the model's loss."""
    import torch

    from zoo.parallel.pipeline import build_stages

    spec = fam.pipeline
    if len(getattr(model, spec.layers)) < 2:
        return
    torch.manual_seed(1)
    with torch.no_grad():
        whole = loss_fn(model, batch)[0]
        first = build_stages(model, spec, pp=2, vpp=1, rank=0).chunks[0]
        last = build_stages(model, spec, pp=2, vpp=1, rank=1).chunks[0]
        torch.manual_seed(1)
        out, _ = loss_fn(first, dict(batch))
        keys = (spec.input_key, *spec.carries)
        sent = {spec.input_key: out} if isinstance(out, torch.Tensor) else out
        assert isinstance(sent, dict) and list(sent) == list(keys), \
            f"{name}: a first pipeline stage handed on {list(sent) if isinstance(sent, dict) else type(out).__name__}; " \
            f"its PipelineSpec carries {list(keys)}"
        torch.manual_seed(1)  # the same noise as the first stage drew (diffusion losses draw before the model)
        staged = loss_fn(last, {**batch, **sent})[0]
    assert torch.allclose(staged, whole, rtol=1e-5, atol=1e-6), \
        f"{name}: two pipeline stages give loss {float(staged)}, the whole model {float(whole)}"
