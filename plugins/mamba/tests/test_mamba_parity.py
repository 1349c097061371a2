"""Mamba-1, Mamba-2 and NemotronH against Hugging Face (tiny random configs, fp32): logits, round
trips of the weights, the original mamba_ssm key names; the chunked scans against the recurrence
written out step by step; cached decoding against the full forward; bad patterns and configs."""

from __future__ import annotations

import math

import pytest
import torch
from zoo_mamba import convert
from zoo_mamba.model import build
from zoo_mamba.plugin import SPECS, MambaConfig
from zoo_mamba.ssm import causal_conv1d, selective_scan, ssd_scan

from zoo.checkpoint.mapping import MappingError, from_external, to_external

VOCAB = 64


def _hf(kind: str, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, layer_norm_epsilon=1e-5)
    if kind == "mamba":
        model = tf.MambaForCausalLM(tf.MambaConfig(num_hidden_layers=2, state_size=8, **common, **over))
    elif kind == "mamba2":
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(num_hidden_layers=2, state_size=8, num_heads=8, head_dim=8,
                                                     n_groups=2, chunk_size=8, **common, **over))
    else:
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{
            "layers_block_type": ["linear_attention", "mlp", "full_attention", "moe", "linear_attention"],
            "ssm_state_size": 8, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "chunk_size": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "moe_shared_expert_intermediate_size": 24, "max_position_embeddings": 64, **common, **over}))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D")) or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # off their init values, so a swapped tensor shows
            else:
                torch.nn.init.normal_(p, std=0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


def _ours(hf, state=None):
    cfg = convert.from_hf_config(hf.config.to_dict())
    sd = hf.state_dict() if state is None else state
    ours = from_external(convert.import_table(cfg, list(sd)), sd, cfg)
    model = build(cfg, SPECS[cfg.layer_spec]).eval()
    model.load_state_dict(ours, strict=True)
    return model, cfg, ours


# Nemotron-3-Nano's router: routed_scaling_factor 2.5; and group-limited routing (DeepSeek-V3's)
GROUPED = {"n_routed_experts": 8, "n_group": 4, "topk_group": 1, "routed_scaling_factor": 2.5}


@pytest.mark.parametrize(("kind", "over"), [("mamba", {}), ("mamba2", {}), ("nemotron_h", {}), ("nemotron_h", GROUPED)],
                         ids=["mamba", "mamba2", "nemotron_h", "nemotron_h-grouped-scaled"])
def test_logits_match_hugging_face_and_weights_round_trip_bitwise(kind, over):
    hf = _hf(kind, **over)
    ours, cfg, state = _ours(hf)
    x = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))  # 21: not a multiple of chunk 8
    with torch.no_grad():
        ref = hf(x).logits
        assert (ours(x) - ref).abs().max().item() <= 1e-5
    sd = hf.state_dict()
    back = to_external(convert.table(cfg, "fused"), state, cfg)
    if kind != "nemotron_h":  # transformers holds NemotronH as model.* (accepted on import; written as backbone.*)
        assert back.keys() - {"lm_head.weight"} == sd.keys() - {"lm_head.weight"}
        assert all(torch.equal(back[k], sd[k]) for k in back)
    hf_config = convert.to_hf_config(cfg)
    again = convert.from_hf_config(hf_config)
    assert again == cfg


def test_nemotron_h_hub_layout_reads_and_writes_bitwise(tmp_path):
    hf = _hf("nemotron_h")
    _, cfg, state = _ours(hf)
    hf.save_pretrained(tmp_path / "hub")
    from safetensors.torch import load_file

    hub = load_file(tmp_path / "hub" / "model.safetensors")
    assert "backbone.layers.3.mixer.experts.2.up_proj.weight" in hub  # as released: per expert, backbone.*
    _, _, from_hub = _ours(hf, hub)
    assert all(torch.equal(from_hub[k], state[k]) for k in state)
    exported = to_external(convert.table(cfg), state, cfg)
    assert exported.keys() == hub.keys() and all(torch.equal(exported[k], hub[k]) for k in hub)
    mixed = {**hub, "backbone.layers.3.mixer.experts.up_proj": torch.zeros(4, 16, 32)}
    with pytest.raises(MappingError, match="mixes expert layouts"):
        convert.import_table(cfg, list(mixed))


def test_mamba_ssm_original_key_names_are_read():
    hf = _hf("mamba")
    _, _, state = _ours(hf)
    original = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in hf.state_dict().items()}
    assert "backbone.embedding.weight" in original
    _, _, again = _ours(hf, original)
    assert all(torch.equal(again[k], state[k]) for k in state)


def _recurrence_mamba1(x, dt, a, b, c, h=None):
    h = torch.zeros(x.shape[0], x.shape[2], a.shape[1], dtype=torch.float64) if h is None else h
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * a) * h + (dt[:, t] * x[:, t])[..., None] * b[:, t, None, :]
        ys.append((h * c[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def _recurrence_mamba2(x, dt, a, b, c, h):
    r = x.shape[2] // b.shape[2]
    b, c = b.repeat_interleave(r, 2), c.repeat_interleave(r, 2)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t] * a)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append((h * c[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("length", [1, 37, 64])
def test_chunked_scans_equal_the_sequential_recurrence(length):
    g = torch.Generator().manual_seed(length)

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    x, b, c = rnd(2, length, 6), rnd(2, length, 5), rnd(2, length, 5)
    dt = torch.rand(2, length, 6, generator=g, dtype=torch.float64)
    a = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 4
    ref_y, ref_h = _recurrence_mamba1(x, dt, a, b, c)
    x2, b2, c2 = rnd(2, length, 4, 3), rnd(2, length, 2, 5), rnd(2, length, 2, 5)
    dt2 = torch.rand(2, length, 4, generator=g, dtype=torch.float64)
    a2, h0 = -torch.rand(4, generator=g, dtype=torch.float64) * 4, rnd(2, 4, 3, 5)
    ref2_y, ref2_h = _recurrence_mamba2(x2, dt2, a2, b2, c2, h0)
    for chunk in (4, 16, 64):  # lengths 37 and 1 are not multiples of any of them
        y, h = selective_scan(x, dt, a, b, c, chunk=chunk)
        assert (y - ref_y).abs().max() <= 1e-5 * ref_y.abs().max() and (h - ref_h).abs().max() <= 1e-5 * ref_h.abs().max()
        y, h = ssd_scan(x2, dt2, a2, b2, c2, state=h0, chunk=chunk)
        assert (y - ref2_y).abs().max() <= 1e-5 * ref2_y.abs().max()
        assert (h - ref2_h).abs().max() <= 1e-5 * ref2_h.abs().max()


def test_ssd_state_passing_over_many_chunks_equals_the_recurrence():
    """19 chunks (the last one padded) pass their states on one after another (`zoo_mamba.ssd.pass_states`),
    forward and in reverse for backward: the recurrence's outputs, last state and gradients."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 75, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b, c = (torch.randn(2, 75, 2, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dt = torch.rand(2, 75, 4, generator=g, dtype=torch.float64)
    a, h0 = -torch.rand(4, generator=g, dtype=torch.float64) * 4, torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64)
    ref_y, ref_h = _recurrence_mamba2(x, dt, a, b, c, h0)
    y, h = ssd_scan(x, dt, a, b, c, state=h0, chunk=4)  # 19 chunks, the last one padded
    # (the scan computes in float32)
    assert (y - ref_y).abs().max() <= 1e-6 * ref_y.abs().max() and (h - ref_h).abs().max() <= 1e-6 * ref_h.abs().max()
    got = torch.autograd.grad((y * ref_y.detach()).sum() + h.sum(), (x, b, c))
    want = torch.autograd.grad((ref_y * ref_y.detach()).sum() + ref_h.sum(), (x, b, c))
    for gv, wv in zip(got, want):
        assert (gv - wv).norm() <= 1e-6 * wv.norm()



def _assert_gradients_match(scan, recurrence, inputs, chunk, g, tol=1e-5):
    """The scan's gradients of (x, dt, A, B, C, entering state) from both outputs (y and the last
    state, weighted at random) against autograd through the float64 recurrence."""
    ref_y, ref_h = recurrence(*inputs)
    wy, wh = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (ref_y, ref_h))
    want = torch.autograd.grad((ref_y * wy).sum() + (ref_h * wh).sum(), inputs)
    y, h = scan(*inputs[:-1], state=inputs[-1], chunk=chunk)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), inputs)
    for name, gv, wv in zip(["x", "dt", "A", "B", "C", "h0"], got, want):
        assert (gv - wv).norm() <= tol * wv.norm(), name
    return wy


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_selective_scan_backward_equals_the_recurrences_gradients(chunk):
    """Mamba-1's hand-written backward against autograd through the step-by-step recurrence in
    float64, over a length no chunk size divides (the last chunk shorter)."""
    g = torch.Generator().manual_seed(chunk)
    x, b, c = (torch.randn(2, 37, n, generator=g, dtype=torch.float64, requires_grad=True) for n in (6, 5, 5))
    dt = torch.rand(2, 37, 6, generator=g, dtype=torch.float64).requires_grad_()
    a = (-torch.rand(6, 5, generator=g, dtype=torch.float64) * 4).requires_grad_()
    h0 = torch.randn(2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    wy = _assert_gradients_match(selective_scan, _recurrence_mamba1, (x, dt, a, b, c, h0), chunk, g)
    # only y used (the last state's gradient absent), as in training
    got = torch.autograd.grad((selective_scan(x, dt, a, b, c, chunk=chunk)[0] * wy).sum(), (x, dt, a))
    want = torch.autograd.grad((_recurrence_mamba1(x, dt, a, b, c)[0] * wy).sum(), (x, dt, a))
    assert all((gv - wv).norm() <= 1e-5 * wv.norm() for gv, wv in zip(got, want))


@pytest.mark.parametrize("with_state,bias,t", [(False, True, 11), (True, False, 11), (False, True, 2), (True, True, 1)])
def test_causal_conv_equals_torchs_padded_grouped_convolution(with_state, bias, t):
    """zoo's shifted multiply-adds against torch's depthwise conv1d over the left-padded (or
    state-prefixed) input in float64: output, next state and the gradients of x, weight and bias;
    also for sequences shorter than the kernel's history and a decoding step."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, t, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    state = torch.randn(2, 6, 3, generator=g, dtype=torch.float64) if with_state else None
    y, nxt = causal_conv1d(x, w, b, state)
    before = state if with_state else torch.zeros(2, 6, 3, dtype=torch.float64)
    xp = torch.cat([before, x.transpose(1, 2)], dim=-1)
    ref = torch.nn.functional.conv1d(xp, w, b, groups=6).transpose(1, 2)
    assert torch.allclose(y, ref, atol=1e-12) and torch.equal(nxt, xp[:, :, -3:])
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    params = [x, w] + ([b] if bias else [])
    for got, want in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(ref, params, gy)):
        assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("form", ["factored", "decay matrices", "accelerator"])
@pytest.mark.parametrize("chunk,groups", [(4, 1), (16, 2), (64, 4)])
def test_ssd_backward_equals_the_recurrences_gradients(chunk, groups, form, monkeypatch):
    """The SSD (`zoo_mamba.ssd`) in each form of its within-chunk part, factored, by decay matrices
    (per-head products) and as on an accelerator (every chunk by decay matrices, chosen without
    reading the spans, heads in one batched product), and its hand-written backward against
    autograd through the step-by-step recurrence in float64: the gradients of x, dt, A, B, C and
    the entering state, from both outputs (y and the last state), over a length no chunk size
    divides (the last chunk padded)."""
    from zoo_mamba import ssd

    monkeypatch.setattr(ssd, "MAX_SPAN", float("inf") if form != "decay matrices" else -1.0)
    rows = []
    if form == "accelerator":  # every chunk by decay matrices although no span exceeds MAX_SPAN
        within = ssd._within_by_matrices
        monkeypatch.setattr(ssd, "_within_by_matrices", lambda x, *v: rows.append(x.shape[0]) or within(x, *v))
        monkeypatch.setattr(ssd, "_launch_bound", lambda x: True)
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(2, 37, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b, c = (torch.randn(2, 37, groups, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dt = torch.rand(2, 37, 4, generator=g, dtype=torch.float64).requires_grad_()
    a = (-torch.rand(4, generator=g, dtype=torch.float64) * 4).requires_grad_()
    h0 = torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    _assert_gradients_match(ssd_scan, _recurrence_mamba2, (x, dt, a, b, c, h0), chunk, g)
    if form == "accelerator":
        assert rows == [2 * -(-37 // min(chunk, 37))] * 2  # all of the batch's chunks, forward and backward


def test_a_chunk_that_forgets_too_much_takes_the_decay_matrices(monkeypatch):
    """With dt A of -40 a step, a chunk of 16 spans e^-600: the factored form's scales e^(+-300)
    leave float32's range (alone, its output is not finite there), so that chunk takes the decay
    matrices while the next, with ordinary decays, stays factored; outputs and gradients still equal
    the recurrence's."""
    from zoo_mamba import ssd

    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 32, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b, c = (torch.randn(1, 32, 1, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    a = torch.tensor([-4.0, -0.5], dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    dt = torch.rand(1, 32, 2, generator=g, dtype=torch.float64)
    dt[:, :16] = 10.0  # the first chunk forgets
    dt.requires_grad_()
    wide = []
    within = ssd._within_by_matrices
    monkeypatch.setattr(ssd, "_within_by_matrices", lambda x, *v: wide.append(x.shape[0]) or within(x, *v))
    # (A's gradient sums dt-weighted terms of a chunk spanning e^-600 in float32: 2.2e-5 of its norm
    # off on an Intel Xeon with MKL's AVX-512 kernels, under 1e-5 on AMD hosts)
    _assert_gradients_match(ssd_scan, _recurrence_mamba2, (x, dt, a, b, c, h0), 16, g, tol=5e-5)
    assert wide == [1, 1]  # one chunk by decay matrices, forward and backward
    monkeypatch.setattr(ssd, "MAX_SPAN", float("inf"))
    assert not torch.isfinite(ssd_scan(x, dt, a, b, c, state=h0, chunk=16)[0]).all()


@pytest.mark.parametrize(("flavor", "groups"), [("mamba_tiny", None), ("mamba2_tiny", None), ("mamba2_tiny", 1),
                                               ("hybrid_moe_tiny", None)])
def test_cached_decoding_equals_the_full_forward(flavor, groups):
    import dataclasses

    from zoo_mamba import plugin

    torch.manual_seed(0)
    cfg = getattr(plugin, flavor)()
    if groups is not None:  # (the tiny flavor has 2 groups; one group, as the benchmark's, shares B and C over all heads)
        cfg = dataclasses.replace(cfg, ssm_groups=groups)
    model = build(cfg, SPECS[cfg.layer_spec]).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 45))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 45)
        steps = [model(tokens[:, :40], cache=cache)]  # a prompt longer than a chunk, then one token at a time
        steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(40, 45)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("over", "message"), [
    ({"pattern": "M-X*"}, r"unknown symbol\(s\) 'X'"),
    ({"pattern": "M-M"}, "has 3 layers, num_layers=4"),
    ({"pattern": "M-M-|"}, "every pipeline stage"),
])
def test_bad_patterns_fail_with_one_clear_line(over, message):
    with pytest.raises(ValueError, match=message):
        MambaConfig(vocab_size=64, hidden_size=32, num_layers=4, ffn_hidden_size=64, num_heads=2, num_kv_heads=2, **over)


def test_unsupported_hugging_face_configs_are_refused():
    from zoo.checkpoint.fields import check_config
    from zoo.errors import UsageError

    mamba1 = convert.to_hf_config(MambaConfig(vocab_size=64, hidden_size=32, num_layers=2, layer_spec="mamba1"))
    check_config(convert.FIELDS, mamba1)
    mamba1.use_bias = True
    with pytest.raises(UsageError, match=r"MambaConfig.use_bias=True changes the computation"):
        check_config(convert.FIELDS, mamba1)
    with pytest.raises(UsageError, match="num_heads"):  # (transformers' own validation)
        convert.from_hf_config({**convert.to_hf_config(MambaConfig(vocab_size=64, hidden_size=32, num_layers=2,
                                                                   ssm_head_dim=16)).to_dict(), "num_heads": 3})
    assert math.isinf(convert.from_hf_config(convert.to_hf_config(MambaConfig(vocab_size=64, hidden_size=32,
                                                                              num_layers=2, ssm_head_dim=16))).dt_max)
    grouped = _hf("nemotron_h", **GROUPED).config.to_dict()
    with pytest.raises(UsageError, match="num_experts_per_tok=4, topk_group=1: Hugging Face scores a group by its top 2"):
        convert.from_hf_config({**grouped, "num_experts_per_tok": 4})


def test_the_scans_compute_in_float32_under_bf16_autocast():
    """Autocast would run the scans' products in bf16 (and Mamba-2's hand-written backward then met
    mixed dtypes): under it both scans give their float32 results bit for bit, decoding steps
    included, and backward runs."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 70, 4, 3, generator=g, requires_grad=True)
    b, c = torch.randn(1, 70, 2, 5, generator=g), torch.randn(1, 70, 2, 5, generator=g)
    dt, a = torch.rand(1, 70, 4, generator=g), -torch.rand(4, generator=g)
    x1, b1, c1 = torch.randn(1, 70, 6, generator=g, requires_grad=True), torch.randn(1, 70, 5), torch.randn(1, 70, 5)
    dt1, a1 = torch.rand(1, 70, 6, generator=g), -torch.rand(6, 5, generator=g)
    want = ssd_scan(x, dt, a, b, c, chunk=16)[0], selective_scan(x1, dt1, a1, b1, c1, chunk=16)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ssd_scan(x, dt, a, b, c, chunk=16)[0], selective_scan(x1, dt1, a1, b1, c1, chunk=16)[0]
        (got[0].sum() + got[1].sum()).backward()
    assert all(torch.equal(u, v) for u, v in zip(got, want)) and x.grad is not None and x1.grad is not None
    h0, s0 = torch.randn(1, 4, 3, 5, generator=g), torch.randn(1, 6, 5, generator=g)  # one decoding step each
    want = ssd_scan(x[:, :1], dt[:, :1], a, b[:, :1], c[:, :1], state=h0), selective_scan(
        x1[:, :1], dt1[:, :1], a1, b1[:, :1], c1[:, :1], state=s0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ssd_scan(x[:, :1], dt[:, :1], a, b[:, :1], c[:, :1], state=h0), selective_scan(
            x1[:, :1], dt1[:, :1], a1, b1[:, :1], c1[:, :1], state=s0)
    assert all(torch.equal(u, v) for pair in zip(got, want) for u, v in zip(*pair))
