"""Bucketed, overlapped data-parallel gradients: equal to one process on the whole batch, with
gradient accumulation, and issuing no more all-reduces than buckets."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zoo.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _dp_rank(accum: int, bucket_size: int) -> dict:
    import torch.distributed as dist

    from zoo.parallel.data_parallel import GradBuckets

    model = _model()
    buckets = GradBuckets(model, dist.group.WORLD, bucket_size=bucket_size)
    x, y = _data()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine_x, mine_y = x.chunk(world)[rank], y.chunk(world)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):  # three optimizer steps
        buckets.zero_grad()
        for m, (xm, ym) in enumerate(zip(mine_x.chunk(accum), mine_y.chunk(accum))):
            ctx = buckets.no_sync() if m < accum - 1 else torch.enable_grad()
            with ctx:
                loss = F.mse_loss(model(xm), ym) / accum
                loss.backward()
        buckets.finish()
        opt.step()
        losses.append(loss.item())
    return {"params": [p.detach().clone() for p in model.parameters()], "launched": buckets.launched,
            "buckets": len(buckets.buckets)}


def _single() -> list[torch.Tensor]:
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("accum", "bucket_size"), [(1, 10**9), (2, 300), (4, 1)])
def test_dp_equals_single_process(accum, bucket_size):
    ref = _single()
    n_params = sum(p.numel() for p in _model().parameters())
    for got in run_distributed(_dp_rank, 2, accum, bucket_size, timeout=120):
        for a, b in zip(got["params"], ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # One reduction per bucket per step, never more; never during accumulation micro-batches.
        assert got["launched"] == 3 * got["buckets"]
        assert got["buckets"] <= math.ceil(n_params / bucket_size) if bucket_size > 1 else got["buckets"] == 6


def _decay_rule(p: torch.Tensor) -> dict:
    """The plain optimizer's groups in the reference: weight decay 0.1 on matrices only."""
    from zoo.training.optim import ParamRules

    return ParamRules(0.1).options("", p)


def _zero_rank(zero: bool) -> dict:
    import torch.distributed as dist

    from zoo.parallel.data_parallel import GradBuckets
    from zoo.parallel.zero import DistributedOptimizer

    model = _model()
    buckets = GradBuckets(model, dist.group.WORLD, bucket_size=500, shard=True)
    opt = DistributedOptimizer(buckets, lambda groups: torch.optim.AdamW(groups, lr=0.01), group_of=_decay_rule)
    x, y = _data()
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        buckets.finish()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": [p.detach().clone() for p in model.parameters()], "state_bytes": opt.state_bytes(),
            "padded": sum(b.buffer.numel() for b in buckets.buckets), "state": opt.full_state(names)}


def test_zero1_equals_single_process_and_shards_state():
    torch.manual_seed(0)
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01)
    x, y = _data()
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    n = sum(p.numel() for p in model.parameters())
    unsharded = 3 * 4 * n  # fp32 master + exp_avg + exp_avg_sq
    names = {id(p): n for n, p in model.named_parameters()}
    for got in run_distributed(_zero_rank, 2, True, timeout=120):
        for a, b in zip(got["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        # The sharded Adam state, gathered, is the plain optimizer's state.
        for p in model.parameters():
            for field in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][f"{names[id(p)]}::{field}"], opt.state[p][field],
                                           rtol=1e-5, atol=1e-7)
        # 1/DP of the unsharded state, up to the padding of each bucket to a multiple of DP.
        assert abs(got["state_bytes"] - unsharded / 2) <= 3 * 4 * (got["padded"] - n)


def _zero_bf16_rank() -> dict:
    import torch.distributed as dist

    from zoo.parallel.data_parallel import GradBuckets
    from zoo.parallel.zero import DistributedOptimizer

    model = _model().to(torch.bfloat16)  # bf16 parameters and gradients
    buckets = GradBuckets(model, dist.group.WORLD, bucket_size=500, shard=True)
    opt = DistributedOptimizer(buckets, lambda groups: torch.optim.AdamW(groups, lr=0.01), group_of=_decay_rule)
    x, y = _data()
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        F.mse_loss(model(x.chunk(world)[rank].bfloat16()).float(), y.chunk(world)[rank]).backward()
        buckets.finish()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": [p.detach().clone() for p in model.parameters()], "state_bytes": opt.state_bytes(),
            "padded": sum(b.buffer.numel() for b in buckets.buckets), "state": opt.full_state(names),
            "dtypes": {b.buffer.dtype for b in buckets.buckets}}


def test_zero1_with_bf16_parameters_keeps_fp32_masters():
    # Reference: one process, bf16 model, the textbook mixed-precision optimizer (fp32 copies
    # updated by AdamW from the bf16 gradients, written back rounded to bf16).
    model = _model().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    decay = [m for m, p in zip(masters, model.parameters()) if p.dim() >= 2]
    rest = [m for m, p in zip(masters, model.parameters()) if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01)
    x, y = _data()
    for _ in range(3):
        model.zero_grad()
        F.mse_loss(model(x.bfloat16()).float(), y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    n = sum(p.numel() for p in model.parameters())
    names = {id(p): name for name, p in model.named_parameters()}
    for got in run_distributed(_zero_bf16_rank, 2, timeout=120):
        assert got["dtypes"] == {torch.bfloat16}  # gradients stay in the parameters' dtype
        for a, b in zip(got["params"], model.parameters()):
            assert a.dtype == torch.bfloat16
            # Two half-batch gradients averaged in bf16 versus one whole-batch gradient: bf16 rounding.
            torch.testing.assert_close(a.float(), b.detach().float(), rtol=2e-2, atol=2e-2)
        for m, p in zip(masters, model.parameters()):  # the fp32 masters are kept and saved
            master = got["state"][f"{names[id(p)]}::master"]
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, m.detach(), rtol=2e-2, atol=2e-2)
            assert not torch.equal(master, master.bfloat16().float())  # more precise than the parameters
        # Master + two moments in fp32 per parameter, 1/DP of them per rank (Megatron's 12/d bytes).
        assert abs(got["state_bytes"] - 12 * n / 2) <= 12 * (got["padded"] - n)


def _overflow_rank() -> dict:
    import torch.distributed as dist

    from zoo.parallel.data_parallel import GradBuckets
    from zoo.parallel.zero import DistributedOptimizer
    from zoo.training.loss_scale import DynamicLossScale

    model = _model().to(torch.float16)
    buckets = GradBuckets(model, dist.group.WORLD, bucket_size=500, shard=True)
    opt = DistributedOptimizer(buckets, lambda groups: torch.optim.AdamW(groups, lr=0.01), group_of=_decay_rule)
    scale = DynamicLossScale(init_scale=1024.0, growth_interval=2)
    x, y = _data()
    rank = dist.get_rank()
    before = [p.detach().clone() for p in model.parameters()]
    norms = []
    for step in range(4):
        loss = F.mse_loss(model(x.chunk(2)[rank].half()).float(), y.chunk(2)[rank])
        hook = None
        if step == 1 and rank == 1:  # one rank, one element, during backward: an fp16 overflow
            first = next(model.parameters())
            hook = first.register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([0]), float("inf")).view_as(g))
        scale.scale(loss).backward()
        if hook is not None:
            hook.remove()
        buckets.finish()
        norms.append(opt.step(loss_scale=scale))
        if step == 1:
            after_skip = [p.detach().clone() for p in model.parameters()]
        if step == 0:
            after_first = [p.detach().clone() for p in model.parameters()]
    return {"norms": norms, "scale": scale.state_dict(), "first": after_first, "skip": after_skip, "before": before}


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    a, b = run_distributed(_overflow_rank, 2, timeout=120)
    for r in (a, b):
        assert math.isinf(r["norms"][1]) and all(math.isfinite(n) for n in (r["norms"][0], *r["norms"][2:]))
        assert all(torch.equal(p, q) for p, q in zip(r["skip"], r["first"]))  # the step was skipped
        assert not all(torch.equal(p, q) for p, q in zip(r["first"], r["before"]))  # the others were not
        # 1024 -> halved on the overflow -> two clean steps double it back.
        assert r["scale"] == {"scale": 1024.0, "clean_steps": 0, "growth_interval": 2}
    assert all(torch.equal(p, q) for p, q in zip(a["skip"], b["skip"]))  # the ranks still agree


def test_bf16_parameters_accumulate_their_gradients_in_float32():
    """`train.grad_dtype=fp32`, the default with bf16 parameters (Megatron's ``main_grad``): eight
    micro-batches' bf16 gradients add up in a float32 bucket to the float64 sum of the same
    gradients within float32 rounding, where adding them in bf16 is off by a percent. ``.grad``
    stays None (each gradient is added in and dropped); `grad_of` reads the bucket."""
    import contextlib
    import copy

    from zoo.parallel.data_parallel import GradBuckets, grad_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(torch.bfloat16)
    alone = copy.deepcopy(model)
    xs = [torch.randn(16, 64).bfloat16() for _ in range(8)]
    each = []  # every micro-batch's own bf16 gradients, from a model without buckets
    for x in xs:
        alone.zero_grad(set_to_none=True)
        alone(x).square().sum().backward()
        each.append([p.grad.clone() for p in alone.parameters()])
    buckets = GradBuckets(model, None, shard=True, grad_dtype=torch.float32)
    for i, x in enumerate(xs):
        with buckets.no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
            model(x).square().sum().backward()
            assert all(p.grad is None for p in model.parameters())
    buckets.finish()
    worst_bf16 = 0.0
    for j, p in enumerate(model.parameters()):
        main = grad_of(p)
        assert main is p.main_grad and main.dtype == torch.float32 and p.grad is None
        exact = sum(g[j].double() for g in each)
        assert (main.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
        summed = each[0][j].clone()
        for g in each[1:]:
            summed += g[j]
        worst_bf16 = max(worst_bf16, float((summed.double() - exact).abs().max() / exact.abs().max()))
    assert worst_bf16 > 1e-3, worst_bf16  # (what the float32 buckets are for)
    buckets.zero_grad()
    assert all(float(grad_of(p).abs().sum()) == 0 for p in model.parameters())
