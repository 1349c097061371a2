"""Memory-lean primitives against the plain PyTorch formulas they replace: values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo.nn import gated_activation, linear_cross_entropy, rms_norm


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    out.backward(torch.randn_like(out, generator=None) if out.dim() else None)
    return out.detach(), [x.grad for x in xs]


def test_rms_norm_matches_formula():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 16), torch.randn(16)

    def ref(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    torch.manual_seed(1)
    out_a, (gx_a, gw_a) = _grads(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    torch.manual_seed(1)
    out_b, (gx_b, gw_b) = _grads(ref, x, w)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(gx_a, gx_b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw_a, gw_b, atol=1e-6, rtol=1e-5)


def test_swiglu_matches_formula():
    torch.manual_seed(0)
    gu = torch.randn(4, 7, 24)
    torch.manual_seed(1)
    out_a, (g_a,) = _grads(lambda t: gated_activation(t, "silu"), gu)
    torch.manual_seed(1)
    out_b, (g_b,) = _grads(lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1], gu)
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    torch.testing.assert_close(g_a, g_b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk,dropped,block", [(7, 0.1, None), (64, 0.3, None), (1000, 0.3, None), (7, 0.9, None),
                                                 (1000, 0.3, 40 * 3)])
def test_linear_cross_entropy_matches_full_logits(chunk, dropped, block, monkeypatch):
    # A mask dropping most rows takes the kept-rows path (the head runs on them only). ``block``:
    # the cap on a chunk's logits (elements), which here sets 3 rows a chunk instead of ``chunk``.
    import zoo.nn.loss

    if block is not None:
        monkeypatch.setattr(zoo.nn.loss, "_LOGITS_BLOCK", block)
    torch.manual_seed(0)
    h, w = torch.randn(50, 16), torch.randn(40, 16) * 0.3
    labels = torch.randint(0, 40, (50,))
    mask = torch.rand(50) > dropped

    def ours(h, w):
        return linear_cross_entropy(h, w, labels, mask, chunk=chunk)

    def ref(h, w):
        ce = F.cross_entropy((h @ w.t()).float(), labels, reduction="none")
        return (ce * mask).sum() / mask.sum()

    la, (gh_a, gw_a) = _grads(ours, h, w)
    lb, (gh_b, gw_b) = _grads(ref, h, w)
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gh_a, gh_b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw_a, gw_b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_cross_entropy_with_soft_capped_logits(dtype):
    """Gemma 2's final logit soft-capping, logits -> cap tanh(logits / cap): loss and gradients equal
    float64 cross entropy of the capped logits (to the dtype's precision), with and without a
    backward to follow; a cap of 3 on logits of ~10 changes the loss, so a dropped cap or slope fails."""
    torch.manual_seed(0)
    h, w = torch.randn(50, 16), torch.randn(40, 16) * 2.5
    labels, mask = torch.randint(0, 40, (50,)), torch.rand(50) > 0.2

    def ref(h, w):
        logits = 3.0 * torch.tanh((h @ w.t()) / 3.0)
        return (F.cross_entropy(logits, labels, reduction="none") * mask).sum() / mask.sum()

    lb, (gh_b, gw_b) = _grads(ref, h.double(), w.double())
    plain = (F.cross_entropy(h.double() @ w.double().t(), labels, reduction="none") * mask).sum() / mask.sum()
    assert abs(plain.item() - lb.item()) > 0.5
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    hd, wd = h.to(dtype), w.to(dtype)
    la, (gh_a, gw_a) = _grads(lambda h, w: linear_cross_entropy(h, w, labels, mask, chunk=7, softcap=3.0), hd, wd)
    assert abs(la.item() - lb.item()) / lb.item() < tol
    for got, want in ((gh_a, gh_b), (gw_a, gw_b)):
        assert float((got.double() - want).norm() / want.norm()) < tol
    with torch.no_grad():  # (evaluation: no gradients formed)
        assert abs(linear_cross_entropy(hd, wd, labels, mask, softcap=3.0).item() - lb.item()) / lb.item() < tol


def test_linear_cross_entropy_is_exact_where_the_labels_probability_underflows():
    """Logits spread over ~1,400 (a label's softmax probability is 0 in float32): the loss, read off
    the softmax at each row's largest logit, still matches float64 cross entropy, and so do the
    gradients; bf16 logits give the float64 loss of the rounded logits."""
    torch.manual_seed(0)
    h, w = torch.randn(300, 32) * 8, torch.randn(1000, 32) * 3
    labels = torch.randint(0, 1000, (300,))
    logits = h.double() @ w.double().t()
    assert float(logits.max() - logits.min()) > 1000
    la, (gh_a, gw_a) = _grads(lambda h, w: linear_cross_entropy(h, w, labels, chunk=64), h, w)
    lb, (gh_b, gw_b) = _grads(lambda h, w: F.cross_entropy(h @ w.t(), labels), h.double(), w.double())
    assert abs(la.item() - lb.item()) / lb.item() < 1e-6
    assert float((gh_a - gh_b).norm() / gh_b.norm()) < 1e-5 and float((gw_a - gw_b).norm() / gw_b.norm()) < 1e-5
    hb, wb = h.bfloat16(), w.bfloat16()
    exact = F.cross_entropy((hb @ wb.t()).double(), labels)  # the rounded logits' own loss
    with torch.no_grad():
        assert abs(linear_cross_entropy(hb, wb, labels).item() - exact.item()) / exact.item() < 1e-6


@pytest.mark.parametrize("scale", [2.0**10, 2.0**16])
def test_linear_cross_entropy_in_fp16_under_a_loss_scale_keeps_its_gradients(scale):
    """fp16 under autocast with a loss scale: the gradients, unscaled, match float64's to fp16's
    precision (3e-4 here). The fused loss forms them before the scale reaches them: formed as
    (softmax - one_hot) / tokens they were at fp16's smallest subnormal (1e-4 / 2,048 tokens; 2.4%
    off at 2^10), and a scale above fp16's largest number (torch's initial 2^16) became inf when
    cast to fp16 (every gradient NaN)."""
    torch.manual_seed(0)
    n, v, d = 2048, 8192, 32
    h, w = torch.randn(n, d), torch.randn(v, d) * 0.05
    labels = torch.randint(0, v, (n,))
    hh = h.half().requires_grad_(True)
    ww = w.clone().requires_grad_(True)  # an fp32 parameter, its product in fp16 as autocast does
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(hh, ww, labels)
    (loss * scale).backward()
    h64, w64 = hh.detach().double().requires_grad_(True), w.double().requires_grad_(True)
    F.cross_entropy(h64 @ w64.t(), labels).backward()
    assert torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all()
    for got, ref in ((hh.grad.double() / scale, h64.grad), (ww.grad.double() / scale, w64.grad)):
        assert float((got - ref).norm() / ref.norm()) < 2e-3


def test_linear_cross_entropy_of_a_fully_masked_batch_is_zero_with_zero_gradients():
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 5, (6,)), torch.zeros(6, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_linear_cross_entropy_scales_with_upstream_gradient_and_autocast():
    torch.manual_seed(0)
    h = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(12, 8, requires_grad=True)
    labels = torch.randint(0, 12, (20,))
    (linear_cross_entropy(h, w, labels, chunk=6) * 3.0).backward()
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (F.cross_entropy(h2 @ w2.t(), labels) * 3.0).backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-6, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = linear_cross_entropy(h, w, labels)
    assert abs(low.item() - F.cross_entropy(h @ w.t(), labels).item()) < 0.05
    with torch.no_grad():  # evaluation forms no gradients and still gives the loss
        assert torch.allclose(linear_cross_entropy(h, w, labels), F.cross_entropy(h @ w.t(), labels), atol=1e-6)


def test_linear_cross_entropy_refuses_a_second_backward_instead_of_scaling_twice():
    # The saved weight gradient is scaled in place; a retained graph must not reuse it silently
    # (autograd's version counter on the saved tensor refuses it).
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 5, (6,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_the_textbook_formula_bit_for_bit(dtype):
    """The fused rotary (no concatenation, saves only the tables) against x*cos + rotate_half(x)*sin
    through autograd, forward and backward, bit for bit; and a float64 gradcheck."""
    from zoo.nn import _rotate_half, apply_rotary

    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 8, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(2, 16, 8), torch.randn(2, 16, 8)  # per-sample tables (packed documents)
    y = apply_rotary(x, cos, sin)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = x_ref * cos[:, None].to(dtype) + _rotate_half(x_ref) * sin[:, None].to(dtype)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert torch.equal(y, ref) and torch.equal(x.grad, x_ref.grad)
    x64 = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos[0, :5].double(), sin[0, :5].double()), (x64,))


@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_elementwise_recompute_is_exact_and_frees_outputs(precision):
    """Under `zoo.recompute.scope("elementwise")` the linear layers after a norm and after SwiGLU
    keep recipes instead of the outputs (one per norm and one per MLP), the outputs are freed
    after forward, and every gradient is bitwise the one without recomputation."""
    import weakref

    from zoo.nn import recompute

    torch.manual_seed(0)
    d, f = 16, 24
    w_norm = torch.nn.Parameter(torch.rand(d) + 0.5)
    fc, proj = torch.nn.Linear(d, 2 * f), torch.nn.Linear(f, d)
    x0 = torch.randn(3, 7, d)
    kept: dict[str, weakref.ref] = {}

    def block(x):
        h = rms_norm(x, w_norm, 1e-6)
        a = gated_activation(fc(h), "silu")
        kept["norm"], kept["act"] = weakref.ref(h), weakref.ref(a)
        return x + proj(a)

    grads, recipes = {}, {}
    for mode in ("none", "elementwise"):
        for p in (w_norm, *fc.parameters(), *proj.parameters()):
            p.grad = None
        made = []
        original = recompute._Recipe.__init__

        def counting(self, *a, original=original, made=made):
            made.append(1)
            original(self, *a)

        recompute._Recipe.__init__ = counting
        try:
            with torch.autocast("cpu", dtype=precision, enabled=precision is not None), recompute.scope(mode):
                out = block(block(x0))
        finally:
            recompute._Recipe.__init__ = original
        if mode == "elementwise" and precision is None:
            assert kept["norm"]() is None and kept["act"]() is None  # nothing holds them any more
        out.float().square().sum().backward()
        grads[mode] = [p.grad.clone() for p in (w_norm, *fc.parameters(), *proj.parameters())]
        recipes[mode] = len(made)
    assert recipes == {"none": 0, "elementwise": 4}  # two blocks x (norm output, SwiGLU output)
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["elementwise"]))


@pytest.mark.parametrize("per_token", [False, True])
def test_modulated_layer_norm_matches_formula_gradcheck_and_recomputes(per_token):
    """DiT's adaLN ``LN(x) (1 + scale) + shift``: values and gradients of x, shift and scale (broadcast
    per sample or given per token) against the plain formula, a float64 gradcheck, and under
    elementwise recomputation the next linear keeps a recipe and gradients stay bitwise equal."""
    from zoo.nn import activation, modulated_layer_norm, recompute

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    shape = (2, 5, 16) if per_token else (2, 1, 16)
    shift, scale = torch.randn(shape), torch.randn(shape)

    def ref(x, sh, sc):
        return F.layer_norm(x, (16,), eps=1e-6) * (1 + sc) + sh

    torch.manual_seed(1)
    out_a, grads_a = _grads(lambda *t: modulated_layer_norm(*t, 1e-6), x, shift, scale)
    torch.manual_seed(1)
    out_b, grads_b = _grads(ref, x, shift, scale)
    assert torch.allclose(out_a, out_b, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads_a, grads_b))
    args = [t.double().requires_grad_(True) for t in (x[:, :3, :6], shift[:, :3 if per_token else 1, :6],
                                                        scale[:, :3 if per_token else 1, :6])]
    assert torch.autograd.gradcheck(lambda *t: modulated_layer_norm(*t, 1e-6), args)
    xg = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: activation(t, "gelu_tanh"), (xg,))

    lin, fc = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    grads = {}
    for mode in ("none", "elementwise"):
        for p in (*lin.parameters(), *fc.parameters()):
            p.grad = None
        with recompute.scope(mode):
            out = fc(activation(lin(modulated_layer_norm(x, shift, scale, 1e-6)), "gelu_tanh"))
        out.square().sum().backward()
        grads[mode] = [p.grad.clone() for p in (*lin.parameters(), *fc.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["elementwise"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_tables_keep_float32_frequencies_when_the_model_is_cast(dtype):
    """A model cast to bf16/fp16 (`train.param_dtype`, `zoo generate --dtype`) keeps RoPE's
    inverse frequencies in float32: its cos/sin tables equal the formula's in float64 to float32
    accuracy out to 8,192 positions (bf16 frequencies put them off by up to ~2 there), and equal
    the uncast module's bit for bit. Llama 3.1's scaled frequencies included."""
    from zoo.nn import Rotary

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    for theta, scale in ((10000.0, None), (500000.0, scaling)):
        rope = Rotary(128, theta, scale)
        pos = torch.arange(8192)
        ref = rope(pos)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), rope).to(dtype)
        assert model[0].weight.dtype == dtype and rope.inv_freq.dtype == torch.float32
        cos, sin = rope(pos)
        assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
        if scale is None:  # the paper's frequencies, in float64
            inv = theta ** -(torch.arange(0, 128, 2, dtype=torch.float64) / 128)
            angle = pos.double()[:, None] * torch.cat([inv, inv])
            assert (cos.double() - angle.cos()).abs().max() < 2e-3
            assert (sin.double() - angle.sin()).abs().max() < 2e-3


@pytest.mark.parametrize("causal,gqa,packed", [(False, False, False), (True, True, False), (True, False, True)])
def test_a_last_layer_computing_only_kept_positions_equals_the_full_layer_there(causal, gqa, packed):
    """`run_layers(..., keep=)`: the last layer computes K of T positions; outputs and every
    gradient equal the full stack's at those positions (causal and document masks included)."""
    from zoo.nn import Rotary
    from zoo.nn.layers import TransformerLayer, run_layers, take_positions
    from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, NormSpec

    torch.manual_seed(0)
    spec = BlockSpec(norm=NormSpec(kind="layernorm"), mixer=AttentionSpec(causal=causal, bias=True, positions="rope"),
                     ffn=MLPSpec(activation="gelu", gated=False, bias=True))
    layers = torch.nn.ModuleList(TransformerLayer(spec, hidden=16, heads=4, kv_heads=2 if gqa else 4, head_dim=4,
                                                  ffn_hidden=32, eps=1e-5, layer=i) for i in range(2))
    x = torch.randn(3, 10, 16, requires_grad=True)
    rope = Rotary(4, 10000.0, None)(torch.arange(10))
    segments = torch.tensor([[0] * 4 + [1] * 6, [0] * 10, [0] * 7 + [1] * 3]) if packed else None
    keep = torch.tensor([[0, 5, 9], [2, 3, 4], [9, 1, 6]])
    w = torch.randn(3, 3, 16)

    def grads(out):
        (out * w).sum().backward()
        g = [x.grad.clone(), *(p.grad.clone() for p in layers.parameters())]
        x.grad = None
        layers.zero_grad(set_to_none=True)
        return out.detach(), g

    out_k, g_k = grads(run_layers(layers, x, rope, None, segments, keep=keep))
    out_f, g_f = grads(take_positions(run_layers(layers, x, rope, None, segments), keep))
    torch.testing.assert_close(out_k, out_f, atol=1e-6, rtol=1e-5)
    for a, b in zip(g_k, g_f, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "relu", "quick_gelu", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_gradient_is_autograds(name, dtype):
    """`activation` keeps only its input and differentiates with autograd's own kernel: bitwise the
    plain function's gradient (zeros included, for relu)."""
    from zoo.nn import ACTIVATIONS, activation

    torch.manual_seed(0)
    x = torch.randn(5, 64).to(dtype)
    x[0, :4] = 0.0
    g = torch.randn(5, 64).to(dtype)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    activation(a, name).backward(g)
    ACTIVATIONS[name](b).backward(g)
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("name,own", [("gelu_tanh", False), ("gelu_tanh", True), ("quick_gelu", False)])
def test_plain_mlp_recomputes_its_activation(name, own):
    """The ungated MLP (GPT-2, CLIP): under elementwise recomputation the output projection keeps a
    recipe for the activation's output instead of the output itself (one activation-sized tensor
    less per layer), and the gradients are bitwise those without recomputation (also with a
    tanh-GELU of a run's own kernels, `zoo.kernels`, whose bits differ from torch's)."""
    import contextlib
    import weakref

    from zoo.kernels import Kernels, Selection

    def gelu(x):  # the tanh formula written out (not torch's kernel: other bits)
        if x.requires_grad and torch.is_grad_enabled():
            return NotImplemented
        return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))

    scope = Kernels("cpu", {"own": Selection({"gelu_tanh": gelu})}).use() if own else contextlib.nullcontext()
    from zoo.nn import recompute
    from zoo.nn.layers import MLP
    from zoo.spec import MLPSpec

    torch.manual_seed(0)
    mlp = MLP(MLPSpec(activation=name, gated=False, bias=True), hidden=16, ffn_hidden=48)
    x = torch.randn(3, 7, 16, requires_grad=True)
    kept: list[weakref.ref] = []
    hook = mlp.proj.register_forward_pre_hook(lambda _m, args: kept.append(weakref.ref(args[0])))
    grads = {}
    with scope:
        for mode in ("none", "elementwise"):
            x.grad = None
            mlp.zero_grad(set_to_none=True)
            with recompute.scope(mode):
                out = mlp(x)
            assert (kept[-1]() is None) == (mode == "elementwise")  # freed: only a recipe refers to it
            out.square().sum().backward()
            grads[mode] = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
        if own:
            assert not torch.equal(out, mlp.proj(torch.nn.functional.gelu(mlp.fc(x), approximate="tanh")))
    hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["elementwise"], strict=True))
