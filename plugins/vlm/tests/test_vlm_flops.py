"""MFU's numerator for CLIP and LLaVA: the FLOPs a micro-batch's samples need, against what
torch.utils.flop_counter counts for the forward and backward zoo runs. Their work depends on
the data (a text cut at its end token, the last layer and head at answer positions), so the
count is per batch (`Throughput.flops_of_batch`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from zoo.config import RunConfig, TrainConfig
from zoo.family import resolve
from zoo.registry import get_registry
from zoo.training import metrics


def _setup(name: str, seq: int):
    fam = get_registry().get(name).family
    cfg = fam.flavors["tiny"]()
    model = resolve(fam.build, owner="test")(cfg, fam.spec_for(cfg))
    batch = resolve(fam.example_batch, owner="test")(cfg, batch_size=3, seq_length=seq,
                                                       generator=torch.Generator().manual_seed(0))
    run = RunConfig(family=name, flavor="tiny", model=cfg, train=TrainConfig(seq_length=seq))
    return fam, cfg, model, batch, run


def _declared(fam, model, run, batch, monkeypatch, *, attention: bool) -> float:
    """The declared FLOPs; without ``attention`` the PaLM scores-and-values term is left out
    (CPU's fused attention kernel has no FLOP formula in the counter)."""
    if not attention:
        of = metrics.LayerFlops.of.__func__
        monkeypatch.setattr(metrics.LayerFlops, "of",
                            classmethod(lambda cls, layer: dataclasses.replace(of(cls, layer), width=0)))
    return metrics.work_of(fam.throughput, model, run, owner="test")(batch)[1]


def _counted(fam, model, batch, monkeypatch) -> tuple[float, set[str]]:
    # Outside a run the operations are zoo.kernels' references: torch's attention kernel (the
    # declared PaLM term is a convention, not what a blocked CPU path computes) and aten's products,
    # which the counter has formulas for.
    with FlopCounterMode(display=False) as counter:
        loss = resolve(fam.loss, owner="test")(model, batch)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
    return counter.get_total_flops(), {str(k) for k in counter.get_flop_counts()["Global"]}


@pytest.mark.parametrize("name,seq", [("clip", 16), ("llava", 64)])
def test_declared_flops_match_torchs_flop_counter(name, seq, monkeypatch):
    fam, cfg, model, batch, run = _setup(name, seq)
    if name == "clip":  # every text ends at the same position: no padding computed that is not needed
        tokens = batch["tokens"]
        tokens[tokens == cfg.eos_token_id] = cfg.eos_token_id + 1
        tokens[:, 9] = cfg.eos_token_id
    else:  # the loss reads well under 3/4 of the positions, so zoo runs the last layer and head there alone
        assert batch["loss_mask"].mean() < 0.75
    counted, ops = _counted(fam, model, batch, monkeypatch)
    declared = _declared(fam, model, run, batch, monkeypatch, attention=any("attention" in op for op in ops))
    # the patch embedding's input needs no gradient, so the counter has 4 of its 6 per weight there
    tower = model.vision
    declared -= 2.0 * tower.patch.weight.numel() * tower.cfg.num_patches * batch["images"].shape[0]
    assert abs(declared - counted) <= 0.005 * counted, (declared, counted, ops)


def test_clip_counts_each_text_to_its_own_end(monkeypatch):
    """A batch whose texts are shorter declares less; padding zoo computes for the longest text of a
    batch is not counted for the shorter ones."""
    fam, cfg, model, batch, run = _setup("clip", 16)
    tokens = batch["tokens"]
    tokens[tokens == cfg.eos_token_id] = cfg.eos_token_id + 1
    work = metrics.work_of(fam.throughput, model, run, owner="test")
    flops = []
    for ends in ([12, 12, 12], [3, 12, 12], [3, 3, 3]):
        t = tokens.clone()
        t[torch.arange(3), torch.tensor(ends)] = cfg.eos_token_id
        flops.append(work({**batch, "tokens": t})[1])
    assert flops[0] > flops[1] > flops[2]
    lf = [metrics.LayerFlops.of(layer) for layer in model.text.layers]
    text = [sum(f(n) for f in lf[:-1]) + lf[-1](n, kept=1) for n in (13, 4)]
    assert flops[0] - flops[1] == pytest.approx(text[0] - text[1])


def test_llava_head_counts_only_the_answer_positions():
    fam, cfg, model, batch, run = _setup("llava", 64)
    work = metrics.work_of(fam.throughput, model, run, owner="test")
    fewer = batch["loss_mask"].clone()
    fewer[0, -10:] = 0
    lf = metrics.LayerFlops.of(model.layers[-1])
    drop = work(batch)[1] - work({**batch, "loss_mask": fewer})[1]
    assert drop == pytest.approx(10 * (6.0 * (lf.rest + model.head.weight.numel()) + 12.0 * lf.width * 64))
