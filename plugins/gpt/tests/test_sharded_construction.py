"""Models built shard by shard: each rank builds the model on the meta device and materialises only
its own parameters (its pipeline stages, its tensor-parallel pieces, its FSDP shards), which must be bitwise the
single-process model's, random stream included."""

from __future__ import annotations

import pytest
import torch

from zoo.testing import run_distributed


def _build(family: str, layers: int, layout: dict) -> dict:
    import torch.distributed as dist

    from zoo.family import resolve
    from zoo.parallel.engine import Parallel
    from zoo.parallel.materialize import record_build
    from zoo.registry import get_registry
    from zoo.testing import layout_for

    fam = get_registry().get(family).family
    cfg = fam.flavors["tiny"]()
    cfg.num_layers = layers
    torch.manual_seed(7)
    meta, record = record_build(resolve(fam.build, owner="test"), cfg, fam.spec_for(cfg))
    world = dist.get_world_size() if dist.is_initialized() else 1
    par = Parallel(meta, fam, layout_for(fam, world, model=cfg, **layout), rank=dist.get_rank() if world > 1 else 0,
                   init=record)
    from zoo.parallel.sharding import local as local_data

    local = {n: local_data(p).numel() for n, p in par.model.named_parameters()}  # (an FSDP parameter's shard)
    full = par.full_state(dict(par.model.named_parameters()))
    full.update({n: b.clone() for n, b in par.model.named_buffers()})  # buffers are whole on every rank
    return {"full": full, "rng": torch.get_rng_state(), "local": sum(local.values()),
            "meta": sum(1 for p in par.model.parameters() if p.is_meta),
            "placed": all(par.placements.of(p) is not None for p in par.model.parameters())}


def _reference(family: str, layers: int) -> tuple[dict, torch.Tensor, int]:
    from zoo.family import resolve
    from zoo.registry import get_registry

    fam = get_registry().get(family).family
    cfg = fam.flavors["tiny"]()
    cfg.num_layers = layers
    torch.manual_seed(7)
    model = resolve(fam.build, owner="test")(cfg, fam.spec_for(cfg))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return state, torch.get_rng_state(), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("world", "family", "layers", "layout"), [
    (1, "gpt2", 2, {}),
    (2, "gpt2", 4, {"pp": 2, "vpp": 2}),  # tied embeddings across the first and last stage
    (4, "llama", 2, {"tp": 2, "pp": 2}),  # gated MLP and GQA pieces
    (2, "gpt2", 2, {"fsdp": 2}),  # FSDP's own shards (tied embedding and head in one unit)
], ids=["one-process", "gpt2-pp2-vpp2", "llama-tp2-pp2", "gpt2-fsdp2"])
def test_each_rank_materialises_exactly_its_part_of_the_single_process_model(world, family, layers, layout):
    ref, rng, total = _reference(family, layers)
    results = run_distributed(_build, world, family, layers, layout, timeout=180)
    for got in results:
        assert got["meta"] == 0 and got["placed"]  # every parameter real and described by its placement
        assert got["full"].keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(got["full"][name], t.detach()), name
        assert torch.equal(got["rng"], rng)  # the stream continues where a full build leaves it
    if world > 1:  # and no rank holds more than its part
        assert max(r["local"] for r in results) < total
        assert sum(r["local"] for r in results) < total * 1.5


def test_a_tensor_made_from_data_is_refused_for_recording_not_left_uninitialised():
    """``torch.tensor(2.66)`` under the meta device takes no dispatched operation: replaying the
    record would leave the parameter as uninitialised memory (a CLIP temperature of -4e30 once
    did), so recording refuses and the trainer builds that model in full."""
    import pytest
    import torch
    from torch import nn

    from zoo.parallel.materialize import DeferredInitError, record_build

    def from_data() -> nn.Module:
        m = nn.Module()
        m.scale = nn.Parameter(torch.tensor(2.66))
        return m

    with pytest.raises(DeferredInitError, match=r"scale \(\) was made from data"):
        record_build(from_data)
    model, record = record_build(lambda: nn.ParameterDict({"scale": nn.Parameter(torch.full((), 2.66))}))
    assert record.ops
