"""The blocked CPU attention (zoo_cpu_kernels.attention) against float64 scaled_dot_product_attention:
outputs and all three gradients, for every mask it takes, with blocks small enough that each
call is cut into several (query blocks, matrix chunks within and across batch rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zoo_cpu_kernels import attention as ops

from zoo.nn import attention


@pytest.fixture(autouse=True)
def _cpu_kernels():
    """`zoo.nn.attention` with the CPU kernels a run selects (uncompiled elementwise kernels)."""
    from _cpu_helpers import cpu_kernels

    with cpu_kernels(cpu_fused="eager").use():
        yield


def _reference(q, k, v, *, causal, offset=0, segment_ids=None, window=None, softcap=None):
    """float64 SDPA with the masks spelled out: key j visible to query i when j <= offset + i
    (causal), offset + i - j < window (a sliding window) and both lie in the same packed sample.
    With ``softcap`` the attention is written out, scores ``cap tanh(q k^T / (sqrt(hd) cap))``."""
    mask = _mask(q.shape[2], k.shape[2], causal=causal, offset=offset, segment_ids=segment_ids, window=window)
    if softcap is not None:
        g = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _mask(t, s, *, causal, offset, segment_ids, window):
    mask = torch.ones(t, s, dtype=torch.bool)
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=offset)
    if window is not None:
        mask &= offset + torch.arange(t)[:, None] - torch.arange(s)[None, :] < window
    mask = mask[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return mask


def _inputs(b, h, kv, t, s, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q and k as (B, T, H, hd) memory seen as (B, H, T, hd), the layout the attention layers pass
    q = torch.randn(b, t, h, hd, generator=g).transpose(1, 2)
    k = torch.randn(b, s, kv, hd, generator=g).transpose(1, 2)
    v = torch.randn(b, kv, s, hd, generator=g)
    return q, k, v, torch.randn(b, h, t, hd, generator=g)


def _run(fn, q, k, v, grad, dtype):
    xs = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out = fn(*xs)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [x.grad.double() for x in xs]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


CASES = {
    # name: (b, h, kv, t, s, hd, causal, offset, packed, sliding window)
    "causal-gqa": (2, 8, 2, 40, 40, 16, True, 0, False, None),
    "full-mha": (2, 4, 4, 33, 33, 8, False, 0, False, None),
    "cross-lengths": (2, 4, 2, 12, 20, 8, False, 0, False, None),
    "causal-offset": (1, 6, 3, 9, 25, 8, True, 16, False, None),
    "packed-causal": (2, 4, 1, 30, 30, 8, True, 0, True, None),
    "packed-full": (3, 2, 2, 21, 21, 8, False, 0, True, None),
    "causal-window": (2, 8, 2, 40, 40, 16, True, 0, False, 7),
    "offset-window": (1, 6, 3, 9, 25, 8, True, 16, False, 5),
    "packed-window": (2, 4, 1, 30, 30, 8, True, 0, True, 6),
}


@pytest.fixture(params=["torch", "native"], ids=["torch-softmax", "native-softmax"])
def softmax_kernel(request, monkeypatch):
    """bf16 blocks' softmax: torch's with the scale in the products, or zoo's C kernel's with the
    scale inside it (on a CPU with AMX); yields the native kernel's calls and whether it is on."""
    from zoo_cpu_kernels import native

    calls: list[int] = []
    if request.param == "native":
        if not native.softmax_ok(256):
            pytest.skip(f"native.c's softmax is AVX-512 code ({native.status()})")
        monkeypatch.setattr(ops, "has_amx", lambda: True)
        real = native.softmax
        monkeypatch.setattr(native, "softmax", lambda x, s: calls.append(1) or real(x, s))
    yield calls, request.param == "native"


@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept-probs"])
@pytest.mark.parametrize("blocks", [None, (8, 400), (4, 60)], ids=["default", "few-rows", "tiny"])
@pytest.mark.parametrize("case", list(CASES))
def test_blocked_attention_matches_float64(case, blocks, keep, softmax_kernel, monkeypatch):
    # ``keep``: backward reads the probabilities the forward kept instead of recomputing them
    monkeypatch.setattr(ops, "_keeps_probs", lambda *shape: keep)
    if blocks is not None:  # many blocks; bf16 through the long keys' sizes (of their own)
        monkeypatch.setattr(ops, "_LONG_KEYS", 1)
        for prefix in ("", "_LONG"):
            monkeypatch.setattr(ops, f"{prefix}_BLOCK_ROWS", blocks[0])
            monkeypatch.setattr(ops, f"{prefix}_BLOCK_ELEMENTS", blocks[1])
        monkeypatch.setattr(ops, "_AMX_BLOCK_ELEMENTS", blocks[1])  # (bf16's on a CPU with AMX)
    b, h, kv, t, s, hd, causal, offset, packed, window = CASES[case]
    q, k, v, grad = _inputs(b, h, kv, t, s, hd)
    seg = _packed(b, t) if packed else None  # samples of uneven lengths packed along the sequence

    def reference(q, k, v):
        return _reference(q, k, v, causal=causal, offset=offset, segment_ids=seg, window=window)

    ref = _run(reference, q, k, v, grad, torch.float64)

    def ours(q, k, v):
        return ops.blocked_attention(q, k, v, causal=causal, offset=offset, segment_ids=seg, window=window,
                                     use_native=softmax_kernel[1])

    for got, want in zip(_run(ours, q, k, v, grad, torch.float32), ref):
        assert _rel(got, want) < 2e-6
    # bf16: the errors of torch's own bf16 kernel on the same inputs, within a factor
    torch_bf16 = _run(reference, q, k, v, grad, torch.bfloat16)
    for got, theirs, want in zip(_run(ours, q, k, v, grad, torch.bfloat16), torch_bf16, ref):
        assert _rel(got, want) < max(2.5 * _rel(theirs, want), 4e-3)
    assert bool(softmax_kernel[0]) == softmax_kernel[1]  # (the native kernel ran exactly where it is on)


def _packed(b, t):
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate((7, 1, t - 12, 4))])[None].repeat(b, 1)
    seg[-1] = torch.arange(t) // 5
    return seg


@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept-probs"])
@pytest.mark.parametrize("case", list(CASES))
def test_soft_capped_scores_on_every_path(case, keep, monkeypatch):
    """Gemma 2's attention logit soft-capping (scores -> cap tanh(scores / cap) before the masks):
    the blocked path (many tiny blocks) and the written-out path (`_capped_attention`, a GPU's and a
    decoding step's) against float64 with the cap spelled out, outputs and gradients; a cap of 2 on
    scores of size ~4 changes the attention, so a path that drops it (or its slope in backward) fails.
    ``keep``: backward reads the probabilities and the cap's slope the forward kept."""
    monkeypatch.setattr(ops, "_keeps_probs", lambda *shape: keep)
    monkeypatch.setattr(ops, "_LONG_KEYS", 1)
    for prefix in ("", "_LONG"):
        monkeypatch.setattr(ops, f"{prefix}_BLOCK_ROWS", 4)
        monkeypatch.setattr(ops, f"{prefix}_BLOCK_ELEMENTS", 60)
    monkeypatch.setattr(ops, "_AMX_BLOCK_ELEMENTS", 60)
    b, h, kv, t, s, hd, causal, offset, packed, window = CASES[case]
    q, k, v, grad = _inputs(b, h, kv, t, s, hd)
    q = q * 2  # scores of a few units, where a cap of 2 bends them
    seg = _packed(b, t) if packed else None
    cap = 2.0

    def reference(q, k, v):
        return _reference(q, k, v, causal=causal, offset=offset, segment_ids=seg, window=window, softcap=cap)

    def ours(q, k, v):
        return attention(q, k, v, causal=causal, offset=offset, segment_ids=seg, window=window, softcap=cap)

    ref = _run(reference, q, k, v, grad, torch.float64)
    uncapped = _reference(q.double(), k.double(), v.double(), causal=causal, offset=offset, segment_ids=seg,
                          window=window)
    assert _rel(uncapped, ref[0]) > 0.05
    assert ops.blocked_supported(q, k, causal=causal, segment_ids=seg, kv_segment_ids=None, softcap=cap)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        for got, want in zip(_run(ours, q, k, v, grad, dtype), ref, strict=True):
            assert _rel(got, want) < tol
    blocked_bf16 = _run(ours, q, k, v, grad, torch.bfloat16)
    with monkeypatch.context() as m:  # the scores written out
        m.setattr(ops, "blocked_supported", lambda *a, **kw: False)
        for got, want in zip(_run(ours, q, k, v, grad, torch.float32), ref, strict=True):
            assert _rel(got, want) < 2e-6
        written_bf16 = _run(ours, q, k, v, grad, torch.bfloat16)
    # bf16: the blocked path rounds the capped scores to bf16 (as it does uncapped ones); the
    # written-out path keeps them in float32
    for got, theirs, want in zip(blocked_bf16, written_bf16, ref, strict=True):
        assert _rel(got, want) < max(4 * _rel(theirs, want), 1e-2)


def test_soft_capped_decoding_and_kept_positions():
    """A decoding step (one query, a cache before it) and a few kept query positions take the
    written-out path with the cap; a cap must be positive."""
    q, k, v, _ = _inputs(2, 4, 2, 24, 24, 8)
    q = q * 2
    ref = _reference(q.double(), k.double(), v.double(), causal=True, window=6, softcap=2.0)
    for n in (5, 1):
        got = attention(q[:, :, -n:], k, v, causal=True, offset=24 - n, window=6, softcap=2.0)
        assert _rel(got.double(), ref[:, :, -n:]) < 1e-6
    at = torch.tensor([[3, 11, 23], [0, 7, 20]])
    pick = at[:, None, :, None].expand(-1, 4, -1, 8)
    got = attention(q.gather(2, pick), k, v, causal=True, window=6, q_positions=at, softcap=2.0)
    assert _rel(got.double(), ref.gather(2, pick)) < 1e-6
    # packed cross-attention (text keys of other samples): a query whose sample has no key gets zeros,
    # as torch's kernel gives it uncapped, and finite gradients
    seg, kseg = torch.tensor([[0, 0, 1, 1]] * 2), torch.tensor([[0, 0, 2, 2]] * 2)
    xs = [x[:, :, :4].detach().requires_grad_(True) for x in (q, k, v)]
    out = attention(*xs, causal=False, segment_ids=seg, kv_segment_ids=kseg, softcap=2.0)
    assert torch.equal(out[:, :, 2:], torch.zeros_like(out[:, :, 2:]))
    ref = _reference(*(x[:, :, :2].double() for x in xs), causal=False, softcap=2.0)
    assert _rel(out[:, :, :2].double(), ref) < 1e-6
    out.sum().backward()
    assert all(x.grad.isfinite().all() for x in xs)
    with pytest.raises(ValueError, match="positive cap"):
        attention(q, k, v, causal=True, softcap=0.0)


def test_kept_probabilities_give_the_recomputed_gradients_bitwise(monkeypatch):
    """A short sequence (DiT's case) keeps the forward's probabilities; backward then gives bitwise
    the gradients of recomputing them, and keeps them only when a backward can follow."""
    q, k, v, grad = _inputs(2, 6, 6, 16, 16, 8)
    def keeps(b, h, kv, t, hd, causal, dtype=torch.bfloat16):
        return ops._keeps_probs(ops._Plan(b, h, kv, t, t, causal, 0, None, q), hd, dtype)

    # DiT-S/2's 256 tokens and a bf16 causal LLaMA layer's 512 (8/2 heads of 64) keep them; 2,048,
    # a non-causal 1,024 or that LLaMA layer in float32 do not (the probabilities would outgrow the
    # q, k, v and output kept anyway, twice them in bf16)
    assert keeps(8, 6, 6, 256, 64, False) and keeps(4, 8, 2, 512, 64, True)
    assert keeps(8, 6, 6, 256, 64, False, torch.float32) and not keeps(4, 8, 2, 512, 64, True, torch.float32)
    assert not keeps(4, 8, 2, 2048, 64, True) and not keeps(2, 16, 16, 1024, 64, False)
    runs = {}
    for keep in (True, False):
        monkeypatch.setattr(ops, "_keeps_probs", lambda *shape, keep=keep: keep)
        runs[keep] = _run(lambda q, k, v: ops.blocked_attention(q, k, v, causal=False), q, k, v, grad, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True))
    monkeypatch.setattr(ops, "_keeps_probs", lambda *shape: True)
    qb = q.bfloat16().requires_grad_(True)
    out = ops.blocked_attention(qb, k.bfloat16(), v.bfloat16(), causal=False)
    assert len(out.grad_fn.saved_tensors) > 3  # q, k, v and the probabilities
    with torch.no_grad():
        assert ops.blocked_attention(qb, k.bfloat16(), v.bfloat16(), causal=False).grad_fn is None


def test_output_is_laid_out_for_the_output_projection():
    q, k, v, _ = _inputs(2, 4, 2, 10, 10, 8)
    out = ops.blocked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert out.shape == (2, 4, 10, 8) and out.transpose(1, 2).is_contiguous()


def test_attention_dispatch(monkeypatch):
    """bf16 (or autocast to it) on a CPU takes the blocked path, and so does fp32 causal attention
    with grouped KV heads; other fp32 attention and decoding steps torch's kernel; both give the same
    attention."""
    calls = []
    real = ops.blocked_attention
    monkeypatch.setattr(ops, "blocked_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, _ = _inputs(1, 4, 2, 16, 16, 8)
    ref = _reference(q.double(), k.double(), v.double(), causal=True)
    attention(q, k, v, causal=False)  # fp32, not causal
    attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True)  # fp32, one KV head a head
    assert not calls
    out32 = attention(q, k, v, causal=True)  # fp32, causal, grouped
    assert calls == [1]
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac = attention(q, k, v, causal=True)
    assert calls == [1] and out_ac.dtype == torch.bfloat16
    out16 = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert calls == [1, 1]
    attention(q[:, :, -1:].bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, offset=15)  # one query: torch's
    assert calls == [1, 1]
    assert _rel(out32.double(), ref) < 1e-6
    assert _rel(out_ac.double(), ref) < 1e-2 and _rel(out16.double(), ref) < 1e-2


@pytest.mark.parametrize("window", [1, 6, 40])
def test_sliding_window_on_every_path(window, monkeypatch):
    """`attention` with a window, through each way it is computed (the blocked path, torch's kernel
    with a mask, a decoding step against a KV cache, a few kept query positions, packed samples):
    the float64 reference with the window spelled out. A window of 40 covers the whole sequence."""
    q, k, v, _ = _inputs(2, 4, 2, 24, 24, 8)
    qd, kd, vd = q.double(), k.double(), v.double()
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # one KV head a head
    ref = _reference(qd, kd, vd, causal=True, window=window)
    assert ops.blocked_supported(q, kr, causal=True, segment_ids=None, kv_segment_ids=None, window=window)
    assert _rel(attention(q, kr, vr, causal=True, window=window).double(), ref) < 1e-6
    assert _rel(attention(q, k, v, causal=True, window=window).double(), ref) < 1e-6
    with monkeypatch.context() as m:  # torch's kernel with the window as a mask (a GPU's path)
        m.setattr(ops, "blocked_supported", lambda *a, **kw: False)
        assert _rel(attention(q, k, v, causal=True, window=window).double(), ref) < 1e-6
    assert _rel(attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, window=window).double(), ref) < 1e-2
    # decoding: the last 5 queries against a cache of 19 earlier positions, and one query alone
    for n in (5, 1):
        got = attention(q[:, :, -n:], k, v, causal=True, offset=24 - n, window=window)
        assert _rel(got.double(), ref[:, :, -n:]) < 1e-6
    at = torch.tensor([[3, 11, 23], [0, 7, 20]])
    got = attention(q.gather(2, at[:, None, :, None].expand(-1, 4, -1, 8)), k, v, causal=True, window=window,
                    q_positions=at)
    assert _rel(got.double(), ref.gather(2, at[:, None, :, None].expand(-1, 4, -1, 8))) < 1e-6
    seg = (torch.arange(24) // 9)[None].repeat(2, 1)
    ref_packed = _reference(qd, kd, vd, causal=True, window=window, segment_ids=seg)
    assert _rel(attention(q, kr, vr, causal=True, window=window, segment_ids=seg).double(), ref_packed) < 1e-6
    assert _rel(attention(q, k, v, causal=True, window=window, segment_ids=seg).double(), ref_packed) < 1e-6
    with pytest.raises(ValueError, match="sliding-window attention is causal"):
        attention(q, k, v, causal=False, window=window)


def test_packed_cross_attention_keeps_torch_kernel():
    """Packed text keys can leave a query none to attend to: that case stays on torch's kernel."""
    q, k, v, _ = _inputs(1, 2, 2, 6, 6, 8)
    seg = torch.tensor([[0, 0, 1, 1, 2, 2]])
    assert not ops.blocked_supported(q.bfloat16(), k.bfloat16(), causal=False, segment_ids=seg,
                                     kv_segment_ids=seg.clone())
    assert ops.blocked_supported(q.bfloat16(), k.bfloat16(), causal=False, segment_ids=seg, kv_segment_ids=seg)


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_long_keys_on_an_amx_cpu_take_torchs_kernel(monkeypatch, amx):
    """On a CPU with AMX torch's kernel computes bf16/fp16 attention with it and is the faster one
    from 1,024 keys on: the blocked path stops there (and only there); the attention is the same
    either way."""
    monkeypatch.setattr(ops, "has_amx", lambda: amx)
    calls = []
    real = ops.blocked_attention
    monkeypatch.setattr(ops, "blocked_attention", lambda *a, **kw: calls.append(kw["causal"]) or real(*a, **kw))
    for keys in (ops._AMX_TORCH_KEYS - 1, ops._AMX_TORCH_KEYS):
        q, k, v, _ = _inputs(1, 2, 1, 4, keys, 8)
        ref = _reference(q.double(), k.double(), v.double(), causal=False)
        for dtype in (torch.bfloat16, torch.float16):
            calls.clear()
            out = attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=False)
            assert calls == ([False] if keys < ops._AMX_TORCH_KEYS or not amx else [])
            assert _rel(out.double(), ref) < 1e-2
        calls.clear()
        attention(q, k, v, causal=True, offset=keys - 4)  # fp32 causal, grouped: blocked whatever the CPU
        assert calls == [True]
