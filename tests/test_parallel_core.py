"""The parallel core's first pieces on gloo: the process grid against its layout formula, and
tensor-parallel layers and vocab-parallel cross entropy against the single-process computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo.parallel.grid import ProcessGrid
from zoo.testing import run_distributed


def test_grid_layout_formula():
    # 16 ranks, tp=2 cp=1 dp=4 pp=2 in tp-cp-dp-pp order: rank = tp + 2*dp + 8*pp.
    g = ProcessGrid({"tp": 2, "cp": 1, "dp": 4, "pp": 2}, ["tp", "cp", "dp", "pp"], rank=11, world_size=16,
                    create_groups=False)
    assert g.coords() == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    assert g.ranks_of(["tp"]) == [10, 11]  # neighbours
    assert g.ranks_of(["dp"]) == [9, 11, 13, 15]
    assert g.ranks_of(["pp"]) == [3, 11]
    assert g.ranks_of(["tp", "dp"]) == [8, 9, 10, 11, 12, 13, 14, 15]
    assert g.size("tp", "dp") == 8 and g.index("dp") == 1
    with pytest.raises(KeyError, match="no axis 'ep'"):
        g.group("ep")
    with pytest.raises(ValueError, match="holds 8 ranks, the world has 6"):
        ProcessGrid({"tp": 2, "dp": 4}, ["tp", "dp"], rank=0, world_size=6)


def _grid_groups() -> dict:
    import torch.distributed as dist

    g = ProcessGrid({"tp": 2, "dp": 2}, ["tp", "dp"], rank=dist.get_rank(), world_size=dist.get_world_size())
    out = {}
    for axes in (("tp",), ("dp",), ("tp", "dp")):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=g.group(*axes))
        out[axes] = t.item()
    return out


def test_grid_groups_reduce_over_the_right_ranks():
    results = run_distributed(_grid_groups, 4, timeout=120)
    for rank, r in enumerate(results):
        tp_peers = [rank - rank % 2, rank - rank % 2 + 1]
        dp_peers = [rank % 2, rank % 2 + 2]
        assert r[("tp",)] == sum(tp_peers) and r[("dp",)] == sum(dp_peers) and r[("tp", "dp")] == 6


def _tp_layers(seq_parallel: bool) -> dict:
    import torch.distributed as dist

    from zoo.parallel.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    group = dist.group.WORLD
    torch.manual_seed(0)  # same full tensors on every rank, as a single process would build them
    w1, b1, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)
    emb, head = torch.randn(12, 8), torch.randn(12, 8)
    ids = torch.randint(0, 12, (6, 2))  # (S, B)
    target = torch.randint(0, 12, (6, 2))
    e = VocabParallelEmbedding(12, 8, group=group)
    c = ColumnParallelLinear(8, 16, bias=True, group=group, sequence_parallel=seq_parallel)
    r = RowParallelLinear(16, 8, bias=True, group=group, sequence_parallel=seq_parallel)
    h = ColumnParallelLinear(8, 12, bias=False, group=group, sequence_parallel=seq_parallel)
    e.load_full(emb), c.load_full(w1, b1), r.load_full(w2, b2), h.load_full(head)
    x = e(ids)  # (S, B, D), replicated
    if seq_parallel:
        from zoo.parallel import comm

        x = comm.scatter_seq(x, group)
    y = r(torch.tanh(c(x)))  # sequence-sharded again under sequence parallelism
    loss = vocab_parallel_cross_entropy(h(y), target, group).mean()
    loss.backward()
    from zoo.parallel import comm
    from zoo.parallel.tensor_parallel import reduce_sequence_parallel_grads

    if seq_parallel:  # the row-parallel bias is added to this rank's sequence shard only
        reduce_sequence_parallel_grads([r.bias], group)
    full = {
        "loss": loss.item(),
        "c.weight": comm.all_gather(c.weight.grad, group, 0),
        "r.weight": comm.all_gather(r.weight.grad, group, 1),
        "r.bias": r.bias.grad.clone(),
        "emb": comm.all_gather(e.weight.grad, group, 0),
        "head": comm.all_gather(h.weight.grad, group, 0),
    }
    return full


def _reference() -> dict:
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)
    emb, head = torch.randn(12, 8), torch.randn(12, 8)
    ids = torch.randint(0, 12, (6, 2))
    target = torch.randint(0, 12, (6, 2))
    params = [p.requires_grad_(True) for p in (w1, b1, w2, b2, emb, head)]
    x = F.embedding(ids, params[4])
    y = F.linear(torch.tanh(F.linear(x, params[0], params[1])), params[2], params[3])
    loss = F.cross_entropy(F.linear(y, params[5]).flatten(0, 1), target.flatten())
    loss.backward()
    return {"loss": loss.item(), "c.weight": w1.grad, "r.weight": w2.grad, "r.bias": b2.grad, "emb": emb.grad,
            "head": head.grad}


@pytest.mark.parametrize("seq_parallel", [False, True])
def test_tensor_parallel_equals_single_process(seq_parallel):
    ref = _reference()
    for got in run_distributed(_tp_layers, 2, seq_parallel, timeout=120):
        assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
        for k in ("c.weight", "r.weight", "r.bias", "emb", "head"):
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def _rng_streams() -> dict:
    import torch.distributed as dist

    from zoo.parallel.random import TensorParallelRNG

    torch.manual_seed(5)  # the default stream: alike on all ranks
    rng = TensorParallelRNG(5, dist.get_rank())
    outside = torch.rand(4)
    with rng.fork():
        inside = torch.rand(4)
    after = torch.rand(4)
    saved = rng.state()
    with rng.fork():
        nxt = torch.rand(4)
    rng.load_state(saved)
    with rng.fork():
        again = torch.rand(4)
    return {"outside": outside, "inside": inside, "after": after, "next": nxt, "again": again}


def test_dropout_streams_differ_inside_tensor_parallel_regions_only():
    r0, r1 = run_distributed(_rng_streams, 2, timeout=60)
    torch.manual_seed(5)
    plain = torch.rand(8)
    for r in (r0, r1):  # the default stream is as if the fork never happened
        assert torch.equal(torch.cat([r["outside"], r["after"]]), plain)
        assert torch.equal(r["next"], r["again"])  # the stream's state restores exactly
        assert not torch.equal(r["inside"], r["next"])  # and it continues, not restarts
    assert not torch.equal(r0["inside"], r1["inside"])  # each TP rank its own masks


def _exchange_and_reduce_scatter() -> dict:
    import torch.distributed as dist

    from zoo.parallel import comm

    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(n, 6, 4 * n, dtype=torch.float64)  # rank r's input is full[r]
    x = full[r].clone().requires_grad_(True)
    # Expert-parallel style: split the last dim over ranks, gather along dim 0.
    y = comm.exchange(x, dist.group.WORLD, split_dim=1, concat_dim=0)
    weight = torch.arange(y.numel(), dtype=torch.float64).view_as(y) + r
    (y * weight).sum().backward()
    rs = comm.reduce_scatter(full[r] * (r + 1), dist.group.WORLD, dim=1)
    return {"y": y.detach(), "grad": x.grad, "rs": rs, "weight": weight}


def test_all_to_all_and_reduce_scatter_against_their_definitions():
    n = 3
    results = run_distributed(_exchange_and_reduce_scatter, n, timeout=60)
    torch.manual_seed(0)
    full = torch.randn(n, 6, 4 * n, dtype=torch.float64)
    for r, got in enumerate(results):
        # Rank r receives every rank's r-th slice of the last dim, stacked along dim 0.
        assert torch.equal(got["y"], torch.cat([full[j][:, 4 * r:4 * r + 4] for j in range(n)], dim=0))
        # Backward is the reverse exchange: rank r's input slice j got rank j's weight block r.
        expected = torch.cat([results[j]["weight"][6 * r:6 * r + 6] for j in range(n)], dim=1)
        assert torch.equal(got["grad"], expected)
        total = sum(full[j] * (j + 1) for j in range(n))
        assert torch.allclose(got["rs"], total[:, 4 * r:4 * r + 4])


def test_expert_grid_shares_pipeline_groups_and_embedding_group_positions():
    from zoo.parallel.grid import expert_grid

    # 16 ranks: dense tp2 cp2 dp2 pp2; experts etp1 ep4 (edp 2) beside it.
    for rank in range(16):
        dense = ProcessGrid({"tp": 2, "cp": 2, "dp": 2, "pp": 2}, ["tp", "cp", "dp", "pp"], rank=rank, world_size=16,
                            create_groups=False)
        experts = expert_grid(dense, etp=1, ep=4)
        assert experts.sizes == {"etp": 1, "ep": 4, "edp": 2, "pp": 2}
        assert experts.ranks_of(["pp"]) == dense.ranks_of(["pp"])  # the same pipeline stages
        assert experts.ranks_of(["ep"]) == [r for r in range(16) if r // 4 == rank // 4]  # neighbours first
    with pytest.raises(ValueError, match="not divisible by etp\\*ep\\*pp"):
        expert_grid(ProcessGrid({"tp": 2, "pp": 2}, ["tp", "pp"], rank=0, world_size=4, create_groups=False), etp=1, ep=3)


def _embedding_group() -> list[int] | None:
    import torch.distributed as dist

    g = ProcessGrid({"tp": 1, "dp": 1, "pp": 3}, ["tp", "dp", "pp"], rank=dist.get_rank(), world_size=3)
    group = g.group_at("pp", (0, -1))
    return None if group is None else dist.get_process_group_ranks(group)


def test_embedding_group_holds_first_and_last_stage():
    assert run_distributed(_embedding_group, 3, timeout=60) == [[0, 2], None, [0, 2]]
