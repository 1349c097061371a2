"""Ring attention against PyTorch's own causal attention over the whole sequence (float64, so
any difference is an error, not rounding): outputs and the gradients of q, k and v, for CP sizes
2 and 4, multi-head and grouped-query, packed samples, sliding windows and soft-capped scores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo.parallel.context import local_positions, split_batch
from zoo.testing import run_distributed


def _ring(h: int, kvh: int, mode: str, window: int | None, softcap: float | None = None) -> dict:
    import torch.distributed as dist

    from zoo.parallel.context import ring_attention

    torch.manual_seed(0)  # the same full tensors on every rank
    b, t, hd = 2, 24, 8
    q = torch.randn(b, h, t, hd, dtype=torch.float64) * (3 if softcap else 1)  # (scores the cap bends)
    k, v = torch.randn(b, kvh, t, hd, dtype=torch.float64), torch.randn(b, kvh, t, hd, dtype=torch.float64)
    dout = torch.randn(b, h, t, hd, dtype=torch.float64)
    causal = mode != "bidirectional"
    seg = None
    if mode != "causal":  # packed samples of uneven lengths, a padded tail (-1) in the first row
        seg = torch.tensor([[0] * 5 + [1] * 11 + [2] * 3 + [-1] * 5, [0] * 13 + [1] * 11])
    idx = local_positions(t, dist.get_world_size(), dist.get_rank())
    ql, kl, vl = (x.index_select(2, idx).clone().requires_grad_(True) for x in (q, k, v))
    out = ring_attention(ql, kl, vl, dist.group.WORLD, causal=causal,
                         segment_ids=None if seg is None else seg.index_select(1, idx), window=window,
                         softcap=softcap)
    (out * dout.index_select(2, idx)).sum().backward()
    qf, kf, vf = (x.clone().requires_grad_(True) for x in (q, k, v))
    mask = torch.ones(b, 1, t, t, dtype=torch.bool)
    if causal:
        mask &= torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:  # query i sees keys i - window + 1 .. i
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        mask &= i - j < window
    if seg is not None:
        mask &= seg[:, None, :, None] == seg[:, None, None, :]
    if softcap is None:
        ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=h != kvh)
    else:  # written out: cap tanh(q k^T / (sqrt(hd) cap)), then the masks
        kr, vr = kf.repeat_interleave(h // kvh, 1), vf.repeat_interleave(h // kvh, 1)
        scores = softcap * torch.tanh(qf @ kr.transpose(-1, -2) / hd ** 0.5 / softcap)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        ref = probs @ vr
    (ref * dout).sum().backward()
    pick = lambda x: x.index_select(2, idx)  # noqa: E731
    return {"out": (out - pick(ref)).abs().max().item(), "dq": (ql.grad - pick(qf.grad)).abs().max().item(),
            "dk": (kl.grad - pick(kf.grad)).abs().max().item(), "dv": (vl.grad - pick(vf.grad)).abs().max().item()}


@pytest.mark.parametrize(("cp", "heads", "kv_heads", "mode", "window", "softcap"), [
    (2, 4, 4, "causal", None, None), (2, 4, 2, "causal", None, None), (4, 4, 1, "causal", None, None),
    # a DiT's: every block computed; packed samples' ids travel with the keys (some blocks see none)
    (2, 4, 2, "bidirectional", None, None), (4, 4, 4, "causal-packed", None, None),
    # sliding windows (Mistral's): chunks of 6 / 3 positions, blocks partly inside the window of 5
    # and, at cp=4, blocks wholly outside it (skipped)
    (2, 4, 2, "causal", 5, None), (4, 4, 2, "causal-packed", 5, None),
    # Gemma 2's soft-capped scores, with its windows and with packed samples
    (2, 4, 2, "causal", 5, 2.0), (4, 4, 2, "bidirectional", None, 2.0)])
def test_ring_attention_equals_full_attention(cp, heads, kv_heads, mode, window, softcap):
    for errors in run_distributed(_ring, cp, heads, kv_heads, mode, window, softcap, timeout=120):
        assert max(errors.values()) < 1e-12, errors


def test_load_balanced_split_and_batch_positions():
    # 2*cp chunks; rank i holds chunks i and 2cp-1-i, so causal work is even across ranks.
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    work = [sum(int(p) + 1 for p in local_positions(16, 4, r)) for r in range(4)]
    assert len(set(work)) == 1
    batch = {"tokens": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 1, "meta": "x"}
    part = split_batch(batch, ("tokens", "labels", "position_ids"), cp=2, rank=1, seq_len=8,
                       positions_key="position_ids")
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]] * 2  # global positions for RoPE
    assert part["meta"] == "x"
    with pytest.raises(ValueError, match="does not split into 2\\*cp = 4 chunks"):
        local_positions(10, 2, 0)
