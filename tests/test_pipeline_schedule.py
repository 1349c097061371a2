"""Pipeline schedules and stage cutting, checked by simulation: every rank's action list is run
against the dependencies of a real pipeline (a stage's forward needs the previous stage's, its
backward the next stage's), with blocking receives and non-blocking sends as the core runs them."""

from __future__ import annotations

import pytest
from torch import nn

from zoo.family import PipelineSpec
from zoo.parallel.pipeline import build_stages, schedule, split_layers


def _simulate(kind: str, pp: int, vpp: int, m: int) -> dict[int, int]:
    """Run all ranks' schedules; returns each rank's peak number of micro-batches in flight.
    Fails on a deadlock (no rank can make progress) or a dependency violation."""
    plans = {r: schedule(kind, pp=pp, vpp=vpp, rank=r, micro_batches=m) for r in range(pp)}
    last = pp * vpp - 1
    done: set[tuple[str, int, int]] = set()  # (action, virtual stage, micro-batch)
    pos = dict.fromkeys(range(pp), 0)
    live = dict.fromkeys(range(pp), 0)
    peak = dict.fromkeys(range(pp), 0)
    while any(pos[r] < len(plans[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(plans[r]):
                continue
            action, chunk, mb = plans[r][pos[r]]
            s = chunk * pp + r
            if action == "F":
                ready = s == 0 or ("F", s - 1, mb) in done
            else:
                ready = ("F", s, mb) in done and (s == last or ("B", s + 1, mb) in done)
            if ready:
                done.add((action, s, mb))
                pos[r] += 1
                live[r] += 1 if action == "F" else -1
                peak[r] = max(peak[r], live[r])
                progressed = True
        assert progressed, f"deadlock: {kind} pp={pp} vpp={vpp} m={m} at {pos}"
    assert len(done) == (1 if kind == "forward" else 2) * pp * vpp * m
    return peak


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 1), (2, 1, 4), (3, 1, 5), (4, 1, 8), (4, 1, 2),
                                             (2, 2, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6), (2, 3, 4)])
def test_schedules_complete_without_deadlock(pp, vpp, m):
    for kind in ("1f1b", "gpipe"):
        peak = _simulate(kind, pp, vpp, m)
        if kind == "gpipe":
            assert all(v == m * vpp for v in peak.values())  # everything in flight at once
        elif vpp == 1:
            # 1F1B bounds the activations kept: pp - rank micro-batches (Narayanan et al. 2021).
            assert peak == {r: min(pp - r, m) for r in range(pp)}
        else:
            # Interleaved: warm-up 2 (pp - rank - 1) + (vpp - 1) pp chunks, plus the one in steady state.
            assert peak == {r: min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, m * vpp) for r in range(pp)}


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 2, 1), (2, 2, 3), (4, 2, 5), (3, 3, 4), (2, 1, 3)])
def test_forward_only_schedules_take_any_number_of_micro_batches(pp, vpp, m):
    """Evaluation (forwards only) runs eval_steps micro-batches whatever pp is, interleaved too:
    every stage's forward of every micro-batch once, in an order that never waits forever."""
    _simulate("forward", pp, vpp, m)


def test_schedule_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of pp=2"):
        schedule("1f1b", pp=2, vpp=2, rank=0, micro_batches=3)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("zero-bubble", pp=2, vpp=1, rank=0, micro_batches=2)


def test_split_layers_even_given_and_invalid():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(6, 2, [1, 5]) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match="summing to 6"):
        split_layers(6, 2, [2, 2])
    with pytest.raises(ValueError, match="3 pipeline stages for 2 layers"):
        split_layers(2, 3)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_stages_keep_global_names_and_mark_tied_weights():
    spec = PipelineSpec(layers="layers", first=("embed",), last=("head",))
    full, other = _Toy(), _Toy()  # each pipeline rank builds its own full model
    names = [n for n, _ in full.named_parameters()]
    first = build_stages(full, spec, pp=2, vpp=2, rank=0)
    last = build_stages(other, spec, pp=2, vpp=2, rank=1)
    # Virtual stages 0 and 2 on rank 0, 1 and 3 on rank 1: layer i is stage i.
    assert [n for n, _ in first.local.named_parameters()] == [
        "embed.weight", "layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    assert [n for n, _ in last.chunks[1].named_parameters()] == ["layers.3.weight", "layers.3.bias", "head.weight"]
    assert first.chunks[1].embed is None and last.chunks[0].head is None
    own = {n for s in (first, last) for n, _ in s.local.named_parameters() if n not in s.duplicates}
    assert own == set(names)  # every parameter has exactly one owner
    assert last.canonical["head.weight"] == "embed.weight" and first.tied == {"embed.weight"}
    assert last.tied == last.duplicates == {"head.weight"}
    assert first.aliases == {"head.weight": "embed.weight"}
    with pytest.raises(ValueError, match="no top-level attribute 'norm'"):
        build_stages(_Toy(), PipelineSpec(layers="layers", first=("embed",), last=("norm",)), pp=2, vpp=1, rank=0)
