"""`train.recompute=full`: every block of every stack (CLIP's two towers, LLaVA's vision tower and
language model, LLaMA's one) runs once in the forward and once again in backward, and the
gradients are those of the plain model (under the default elementwise recomputation)."""

from __future__ import annotations

import copy

import pytest
import torch

from zoo.family import resolve
from zoo.nn import recompute
from zoo.registry import get_registry


@pytest.mark.parametrize("name", ["clip", "llava", "llama"])
def test_full_recompute_covers_every_tower_and_keeps_the_gradients(name):
    fam = get_registry().get(name).family
    cfg = fam.flavors["tiny"]()
    torch.manual_seed(0)
    plain = resolve(fam.build, owner="test")(cfg, fam.spec_for(cfg))
    batch = resolve(fam.example_batch, owner="test")(cfg, batch_size=2, seq_length=32,
                                                       generator=torch.Generator().manual_seed(0))
    rec = copy.deepcopy(plain)
    recompute.apply(rec, "full")
    stacks = {n for n, m in rec.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith("layers")}
    assert len(stacks) == (1 if name == "llama" else 2), stacks  # CLIP's towers, LLaVA's vision tower and LM
    calls: dict[str, dict[int, int]] = {"plain": {}, "rec": {}}
    for key, model in (("plain", plain), ("rec", rec)):  # a block's first part runs again when it is recomputed
        for i, block in enumerate(recompute.blocks_of(model)):
            count = calls[key]
            next(block.children()).register_forward_hook(lambda *_, i=i, c=count: c.__setitem__(i, c.get(i, 0) + 1))
    loss = {}
    for key, model, mode in (("plain", plain, "elementwise"), ("rec", rec, "full")):
        with recompute.scope(mode):  # as the trainer runs a training forward
            out = resolve(fam.loss, owner="test")(model, batch)
        loss[key] = out[0] if isinstance(out, tuple) else out
        forward = dict(calls[key])
        loss[key].backward()
        # Once in the forward (reading a saved tensor inside a checkpointed block recomputed it
        # there: LLaMA's blocks ran 5 times), once more in backward when recomputed.
        assert set(forward.values()) == {1} and set(calls[key].values()) == {1 if key == "plain" else 2}
    # (LLaVA's last vision block never runs: the features are the penultimate layer's)
    assert len(calls["rec"]) == sum(len(rec.get_submodule(s)) for s in stacks) - (name == "llava")
    assert torch.equal(loss["plain"], loss["rec"])
    for (n, p), q in zip(plain.named_parameters(), rec.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.allclose(p.grad, q.grad, atol=1e-6)), n
