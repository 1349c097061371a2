"""Packing: a row holding several samples of different sizes computes, for each of them, exactly
what the sample alone computes (attention kept inside samples, per-sample conditioning, per-sample
loss average), and the task encoder's inputs are checked with one-line errors."""

from __future__ import annotations

import pytest
import torch
from zoo_dit.data import DiTTaskEncoder, collate
from zoo_dit.diffusion import loss
from zoo_dit.model import DiT, patchify
from zoo_dit.plugin import DIT, DIT_VIDEO, dit_tiny, video_tiny


def _sample(cfg, c, t, h, w, gen, *, label=None, text_len=0):
    latent = torch.randn(c, t, h, w, generator=gen)
    toks, pos = patchify(latent, cfg.patch_t, cfg.patch_size, cfg.patch_size)
    m = {"latents": toks, "positions": pos, "noise": torch.randn(toks.shape, generator=gen),
         "sigma": float(torch.rand((), generator=gen) * 3 + 0.1), "grid": tuple(int(g) for g in pos.max(0).values + 1)}
    if label is not None:
        m["label"] = label
    if text_len:
        m["text"] = torch.randn(text_len, cfg.text_dim, generator=gen)
    return m


@pytest.mark.parametrize("video", [False, True])
def test_a_packed_row_computes_what_each_sample_computes_alone(video):
    cfg = video_tiny() if video else dit_tiny()
    torch.manual_seed(0)
    model = DiT(cfg, DIT_VIDEO if video else DIT)
    with torch.no_grad():  # every weight nonzero, so masks and conditioning matter
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    gen = torch.Generator().manual_seed(3)
    if video:
        a = _sample(cfg, 1, 2, 8, 8, gen, text_len=3)
        b = _sample(cfg, 1, 4, 4, 8, gen, text_len=5)
    else:
        a = _sample(cfg, 1, 1, 8, 8, gen, label=3)
        b = _sample(cfg, 1, 1, 4, 8, gen, label=10)  # the null class
    packed = collate([[a, b]], cfg)
    assert packed["segment_ids"].tolist()[0] == [0] * len(a["latents"]) + [1] * len(b["latents"])
    alone = [collate([[m]], cfg) for m in (a, b)]
    kw = lambda bt: dict(positions=bt["positions"], labels=bt.get("labels"), segment_ids=bt.get("segment_ids"),  # noqa: E731
                         context=bt.get("context"), context_segment_ids=bt.get("context_segment_ids"))
    with torch.no_grad():
        out = model(packed["latents"], noise_level=packed["sigma"].log() / 4, **kw(packed))[0]
        outs = [model(x["latents"], noise_level=x["sigma"].log() / 4, **kw(x))[0] for x in alone]
    assert torch.allclose(out, torch.cat(outs), atol=1e-5)
    lp = loss(model, packed)[0]
    la, lb = (loss(model, x)[0] for x in alone)
    assert torch.allclose(lp, (la + lb) / 2, atol=1e-6)  # per-sample average
    # A padded row beside it changes nothing (padding is masked from attention and the loss).
    two = collate([[a, b], [a]], cfg)
    assert torch.allclose(loss(model, two)[0], (la + lb + la) / 3, atol=1e-6)


def test_first_fit_decreasing_fills_rows_and_skips_oversized_samples():
    cfg = dit_tiny()
    te = DiTTaskEncoder(cfg, seq_length=20, packing=True)
    sizes = [16, 4, 8, 12, 4]
    samples = [{"latents": torch.zeros(n, 4), "i": i} for i, n in enumerate(sizes)]
    rows = te.select_samples_to_pack(samples)
    assert [[s["i"] for s in r] for r in rows] == [[0, 1], [3, 2], [4]]
    assert all(sum(len(s["latents"]) for s in r) <= 20 for r in rows)


def test_task_encoder_errors_name_the_sample():
    from zoo.data.energon.samples import ImageClassificationSample

    te = DiTTaskEncoder(dit_tiny(), seq_length=64, packing=False)
    img = torch.rand(3, 7, 8)
    s = ImageClassificationSample(__key__="k7", __restore_key__=("s", 0, 0, 0), __subflavors__=None, __sources__=(),
                                  image=img, label=1)
    with pytest.raises(ValueError, match=r"sample k7: a 7x8 latent is not divisible by patch_size=2"):
        te.encode_sample(s)
    s = ImageClassificationSample(__key__="k1", __restore_key__=("s", 0, 0, 0), __subflavors__=None, __sources__=(),
                                  image=torch.rand(3, 8, 8), label=None)
    with pytest.raises(ValueError, match=r"sample k1: the model is class-conditional .* has no class"):
        te.encode_sample(s)
    vte = DiTTaskEncoder(video_tiny(), seq_length=64, packing=False)
    with pytest.raises(ValueError, match=r"sample v1: the model is text-conditioned .* no text embeddings"):
        vte.encode_sample({"__key__": "v1", "npy": torch.zeros(1, 2, 8, 8)})


@pytest.mark.parametrize("video", [False, True])
def test_declared_flops_match_torchs_flop_counter_per_sample_and_add_up_when_packed(video):
    """MFU's numerator: one sample's declared FLOPs equal what torch.utils.flop_counter counts for
    its forward and backward (adaLN and the timestep MLP once per sample, cross-attention K/V over
    its own caption); a packed row declares the sum of its samples alone (no padding, no attention
    across samples counted)."""
    import types

    from torch.utils.flop_counter import FlopCounterMode
    from zoo_dit.diffusion import flops_of_batch

    cfg = video_tiny() if video else dit_tiny()
    g = torch.Generator().manual_seed(0)
    model = DiT(cfg, DIT_VIDEO if video else DIT)
    flops = flops_of_batch(model, types.SimpleNamespace(model=cfg))
    sizes = [(2, 4, 6, 5), (1, 2, 4, 3)] if video else [(1, 8, 8, 0), (1, 4, 6, 0)]
    samples = [_sample(cfg, cfg.in_channels, t * cfg.patch_t, h * cfg.patch_size, w * cfg.patch_size, g,
                       label=None if video else 3, text_len=n) for t, h, w, n in sizes]
    alone = []
    for m in samples:
        batch = collate([[m]], cfg)
        with FlopCounterMode(display=False) as counter:
            loss(model, batch)[0].backward()
        declared, counted = flops(batch), counter.get_total_flops()
        if not any("attention" in str(op) for op in counter.get_flop_counts()["Global"]):
            # CPU's fused attention kernel has no FLOP formula: take PaLM's 12 L h t (t + text) out
            t, text = len(m["latents"]), len(m.get("text", ()))
            declared -= 12.0 * cfg.num_layers * cfg.hidden_size * t * (t + text)
        assert abs(declared - counted) <= 0.01 * counted, (declared, counted)
        alone.append(flops(batch))
    packed = collate([samples, samples[::-1]], cfg, multiple_of=64)
    assert flops(packed) == pytest.approx(2 * sum(alone))


def test_patchify_places_each_value_by_the_documented_order_for_a_batch_and_back():
    """patchify over a batch of video latents against its definition, value by value: token
    ``(t, h, w)`` in raster order, features ``(pt, ph, pw, C)``; unpatchify inverts it."""
    from zoo_dit.model import unpatchify

    lat = torch.randn(2, 3, 4, 6, 4, generator=torch.Generator().manual_seed(0))  # (N, C, T, H, W)
    pt, ph, pw = 2, 3, 2
    toks, pos = patchify(lat, pt, ph, pw)
    gt, gh, gw = 2, 2, 2
    assert toks.shape == (2, gt * gh * gw, pt * ph * pw * 3)
    for n in range(2):
        for tok, (ti, hi, wi) in enumerate(pos.tolist()):
            assert tok == (ti * gh + hi) * gw + wi
            for a in range(pt):
                for b in range(ph):
                    for c in range(pw):
                        for ch in range(3):
                            feat = ((a * ph + b) * pw + c) * 3 + ch
                            assert toks[n, tok, feat] == lat[n, ch, ti * pt + a, hi * ph + b, wi * pw + c]
    assert torch.equal(unpatchify(toks, (gt, gh, gw), pt, ph, pw), lat)
    assert torch.equal(patchify(lat[1], pt, ph, pw)[0], toks[1])  # one sample as before
