"""The compiled CPU elementwise kernels (`zoo_cpu_kernels.fused`) against float64 references of the same
formulas and against torch's eager kernels: adaLN's layer norm forward and backward, tanh-GELU's
derivative; a recomputed output bitwise the forward's; a compiler failure falls back to eager,
said once; tiny tensors and ``cpu_fused=eager`` never compile."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from _cpu_helpers import cpu_kernels
from zoo_cpu_kernels import fused

from zoo.nn.linear import Linear


def _eager():
    """The provider's kernels with the compiled ones off (``train.cpu_fused=eager``)."""
    return cpu_kernels(cpu_fused="eager", cpu_gemm="blas").use()


@pytest.fixture
def on(monkeypatch):
    """Compiled kernels for every size (the tests' tensors are small), torch's products; zoo's C
    kernels off (tested on their own)."""
    monkeypatch.setenv("ZOO_BACKENDS", "-native")  # (tests/conftest.py switches inductor off elsewhere)
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(fused, "_BROKEN", {})
    with cpu_kernels(cpu_fused="auto", cpu_gemm="blas").use() as k:
        yield k


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp(min=1e-30))


def _reference_ln(x, shift, scale, eps):
    """LayerNorm (no affine) modulated, in float64 through autograd."""
    x, shift, scale = (t.double().detach().requires_grad_(True) for t in (x, shift, scale))
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * (1 + scale) + shift
    return y, (x, shift, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_modulated_layer_norm_forward_and_backward_match_float64(on, dtype, per_token):
    from zoo.nn import modulated_layer_norm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, 48, generator=gen) * 2 + 0.5).to(dtype).requires_grad_(True)
    mshape = (3, 40, 48) if per_token else (3, 1, 48)
    shift = (torch.randn(mshape, generator=gen) * 0.3).to(dtype).requires_grad_(True)
    scale = (torch.randn(mshape, generator=gen) * 0.3).to(dtype).requires_grad_(True)
    g = torch.randn(3, 40, 48, generator=gen).to(dtype)
    y = modulated_layer_norm(x, shift, scale, 1e-6)
    assert y.dtype == dtype
    y.backward(g)
    ref, leaves = _reference_ln(x, shift, scale, 1e-6)
    ref.backward(g.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(y, ref) <= tol
    for got, want in zip((x.grad, shift.grad, scale.grad), leaves):
        assert got.dtype == dtype and got.shape == want.shape
        assert _rel(got, want.grad) <= tol * 10


@pytest.mark.parametrize("compiled", [True, False])
def test_under_autocast_the_modulated_norm_writes_the_low_precision_its_linear_reads(on, compiled):
    """Under bf16 autocast the adaLN norm of a float32 residual stream returns bf16 (its own pass
    rounds it), and what a linear layer then computes is bitwise what it computed from the float32
    output it used to cast itself: output, and gradients of x, shift, scale and the linear's
    weights, with and without elementwise recomputation, compiled kernels and eager."""
    from zoo.nn import modulated_layer_norm, recompute

    stack = contextlib.ExitStack()
    if not compiled:
        stack.enter_context(_eager())
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 24, 32, generator=gen) * 2
    mod0 = torch.randn(2, 1, 64, generator=gen) * 0.3
    lin = Linear(32, 48)
    g = torch.randn(2, 24, 48, generator=gen).bfloat16()
    results = {}
    for mode in ("none", "elementwise"):
        for widen in (False, True):
            x, mod = x0.clone().requires_grad_(True), mod0.clone().requires_grad_(True)
            lin.zero_grad()
            with recompute.scope(mode), torch.autocast("cpu", dtype=torch.bfloat16):
                shift, scale = mod.chunk(2, -1)
                if widen:  # the former float32 output, cast by the linear
                    with torch.autocast("cpu", enabled=False):
                        y = modulated_layer_norm(x, shift, scale, 1e-6)
                    assert y.dtype == torch.float32
                else:
                    y = modulated_layer_norm(x, shift, scale, 1e-6)
                    assert y.dtype == torch.bfloat16
                out = lin(y)
            out.backward(g)
            results[mode, widen] = [out.detach(), x.grad, mod.grad, lin.weight.grad, lin.bias.grad]
    stack.close()
    want = results["none", True]
    assert want[1].dtype == torch.float32 and want[0].dtype == torch.bfloat16
    for key, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_its_derivative_match_float64(on, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 96, generator=gen) * 3).to(dtype)
    # zero, both saturated ends, a subnormal-ish input, one whose e^-2u overflows to inf
    x[0, :5] = torch.tensor([0.0, -12.0, 12.0, 1e-30, -1e4])
    g = torch.randn(64, 96, generator=gen).to(dtype)
    y = fused.gelu_tanh(x, None)  # (no fallback: the compiler must not fail here)
    want_y = torch.nn.functional.gelu(x.double(), approximate="tanh")
    assert y.dtype == dtype and torch.isfinite(y).all() and y[0, 4] == 0
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(y, want_y) <= tol
    # element by element within two roundings of the output's type (absolute below 1: the float64
    # reference's 1 + tanh(u) itself cancels to 0 at x < -6, where GELU is ~1e-16)
    assert ((y.double() - want_y).abs() <= 2 * torch.finfo(dtype).eps * (want_y.abs() + 1)).all()
    got = fused.gelu_tanh_backward(g, x)
    want = torch.ops.aten.gelu_backward(g.double(), x.double(), approximate="tanh")
    eager = torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(got, want) <= tol and _rel(eager, want) <= tol


def test_tanh_gelu_takes_the_compiled_kernel_where_onednns_is_not_the_faster(on, monkeypatch):
    """`Gemm.gelu_tanh`: oneDNN's kernel on an AVX-512 CPU without AMX where `configure` chose it,
    on a CPU with AMX zoo's C kernel (where built with its AVX-512 GELU) or else the compiled one,
    the compiled one where oneDNN's is not chosen, torch's inside autograd; a compiler failure falls
    back to oneDNN's or torch's (not back into the compiled kernel)."""
    from zoo_cpu_kernels import gemm, native

    x = torch.randn(64, 96)
    calls: list[str] = []
    monkeypatch.setattr(gemm, "_gelu_tanh", lambda t: calls.append("onednn") or torch.zeros_like(t))
    with monkeypatch.context() as mp:
        mp.setattr(fused, "gelu_tanh", lambda t, _unfused: calls.append("compiled") or torch.ones_like(t))
        mp.setattr(native, "gelu_tanh", lambda t: calls.append("native") or torch.ones_like(t))
        vector = native.gelu_ok(x)  # (built with AVX-512 here)
        for amx, eltwise, own, want in ((False, (torch.float32,), True, "onednn"),
                                        (True, (torch.float32,), True, "native" if vector else "compiled"),
                                        (True, (torch.float32,), False, "compiled"), (False, (), True, "compiled")):
            mp.setattr(gemm, "has_amx", lambda a=amx: a)
            chosen = gemm.Gemm(eltwise=eltwise, fused=True, native=own)
            calls.clear()
            chosen.gelu_tanh(x)
            assert calls == [want], (amx, eltwise, own, calls)
        xg = x.clone().requires_grad_(True)
        assert chosen.gelu_tanh(xg) is NotImplemented  # autograd: torch's own (the reference)
        assert calls == [want]

    def broken(*_a):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused, "_compiled", lambda *_a: broken)
    chosen = gemm.Gemm(fused=True)
    with pytest.warns(RuntimeWarning, match="compiling gelu_tanh failed"):
        got = chosen.gelu_tanh(x)
    assert torch.equal(got, torch.nn.functional.gelu(x, approximate="tanh"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from then on torch's, without a second warning
        assert torch.equal(chosen.gelu_tanh(x), got)


@pytest.mark.parametrize("family", ["dit", "llama"])
def test_a_recomputed_norm_and_activation_are_the_forwards_bits(on, family):
    """Under elementwise recomputation a DiT block's saved adaLN and GELU outputs (LLaMA's RMS norm
    and SwiGLU outputs) are recomputed in backward: with the compiled kernels the gradients equal
    those of a run that keeps them."""
    from zoo.nn import recompute
    from zoo.testing.conformance import build_tiny

    model, cfg = build_tiny(family)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    from zoo.testing.conformance import _parts, _seq_length

    fam, *_, loss_fn, example = _parts(family, "tiny")
    batch = example(cfg, batch_size=2, seq_length=_seq_length(fam, "tiny"), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("none", "elementwise"):
        model.zero_grad(set_to_none=True)
        with recompute.scope(mode), torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = loss_fn(model, batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert fused._compiled.cache_info().currsize >= 2  # the compiled kernels did run
    for n, g in grads[0].items():
        assert torch.equal(grads[1][n], g), n


def test_a_compiler_failure_falls_back_to_eager_and_says_so_once(on, monkeypatch):
    def broken(name, fn, variant):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(fused, "_compiled", broken)
    x, g = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match="compiling gelu_tanh_backward failed.*no C\\+\\+ compiler"):
        got = fused.gelu_tanh_backward(g, x)
    assert torch.equal(got, torch.ops.aten.gelu_backward(g, x, approximate="tanh"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not again
        fused.gelu_tanh_backward(g, x)
    assert "gelu_tanh_backward" in fused.describe(True, "")  # named in what `zoo version` prints


def test_a_profiler_trace_names_each_compiled_kernel(on):
    """Inside a profiler window a compiled kernel's call is the range ``zoo_cpu_kernels.fused.<name>`` (inductor's
    own event is named by a hash of its graph)."""
    x, g = torch.randn(64, 96), torch.randn(64, 96)
    want = fused.gelu_tanh_backward(g, x)  # (compiled here, outside the window)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = fused.gelu_tanh_backward(g, x)
    assert torch.equal(got, want)
    names = [e.name for e in prof.events()]
    assert names.count("zoo_cpu_kernels.fused.gelu_tanh_backward") == 1, sorted(set(names))
    assert not any(n.startswith("zoo_cpu_kernels.fused.") and n != "zoo_cpu_kernels.fused.gelu_tanh_backward" for n in names)


def test_tiny_tensors_and_off_never_compile(monkeypatch):
    monkeypatch.delenv("ZOO_BACKENDS", raising=False)
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 1 << 18)

    def said(k, text):
        return any(text in line for line in k.report() if "elementwise" in line)

    k = cpu_kernels(cpu_fused="auto")
    assert not k.fuses(torch.zeros(4, 8)) and k.fuses(torch.zeros(512, 512))
    assert not k.fuses(torch.zeros(512, 512, dtype=torch.float64))
    off = cpu_kernels(cpu_fused="eager")
    assert said(off, "off") and not off.fuses(torch.zeros(512, 512))
    for spec in ("-inductor", "off", "-apex,-inductor"):  # ZOO_BACKENDS, as for the optional backends
        monkeypatch.setenv("ZOO_BACKENDS", spec)
        k = cpu_kernels(cpu_fused="auto")
        assert said(k, "ZOO_BACKENDS") and not k.fuses(torch.zeros(512, 512))
    monkeypatch.setenv("ZOO_BACKENDS", "-apex")
    k = cpu_kernels(cpu_fused="auto")
    assert said(k, "inductor's") and k.fuses(torch.zeros(512, 512))


def test_an_input_error_is_raised_and_the_compiler_not_blamed(on):
    with pytest.raises(RuntimeError):
        fused.gelu_tanh_backward(torch.randn(8, 16), torch.randn(8, 17))  # mismatched shapes
    assert "gelu_tanh_backward" not in fused._BROKEN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_transpose_is_an_exact_copy(on, dtype):
    a = torch.randn(300, 517).to(dtype)
    got = fused.transpose(a)
    assert got.is_contiguous() and torch.equal(got, a.t())


def test_a_kernel_is_only_called_with_the_inputs_it_was_built_for(on, monkeypatch):
    """Kernels are keyed by their inputs' signature, not by their order of arrival: a signature
    table started afresh (as a test may) never hands a kernel built for one size the inputs of
    another (keyed by order, that was an inductor assertion and then torch's kernel for good)."""
    a, b = torch.randn(56, 40), torch.randn(72, 48)
    monkeypatch.setattr(fused, "_seen", {})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="zoo_cpu_kernels.fused")
        assert torch.equal(fused.transpose(a), a.t())
        monkeypatch.setattr(fused, "_seen", {})
        assert torch.equal(fused.transpose(b), b.t())
    assert not fused._BROKEN


def test_a_torch_without_standalone_compile_gets_torch_compiles_kernel_for_the_sizes(on, monkeypatch):
    """zoo-core takes torch >= 2.4; ``torch._inductor.standalone_compile`` came later. Without it a
    kernel for one signature is ``torch.compile``'s for those sizes: the norm within float32
    rounding of float64 (its eps constant kept), the transpose an exact copy, and the same bits
    as the standalone kernels."""
    from torch import _inductor as inductor

    x = torch.randn(4, 16, 48)
    shift, scale = torch.randn(4, 1, 48), torch.randn(4, 1, 48)
    want = fused.modulated_ln(x, shift, scale, 1e-3, torch.float32)
    monkeypatch.delattr(inductor, "standalone_compile")
    monkeypatch.setattr(fused, "_seen", {})
    fused._compiled.cache_clear()
    before = fused.built
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="zoo_cpu_kernels.fused")
        got = fused.modulated_ln(x, shift, scale, 1e-3, torch.float32)
        a = torch.randn(40, 24)
        assert torch.equal(fused.transpose(a), a.t())
    assert fused.built - before == 2 and not fused._BROKEN
    ref, _ = _reference_ln(x, shift, scale, 1e-3)
    assert _rel(got[0], ref) <= 1e-6
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    fused._compiled.cache_clear()  # the next tests build their kernels with standalone_compile again


def test_each_of_a_kernels_first_sizes_gets_a_kernel_of_its_own_then_one_for_any_size(on, monkeypatch):
    """A float32 step transposes one weight-gradient operand per weight shape: each of the first
    `_SIGNATURES` sizes is compiled on its own (dynamo would compile the second size of one function
    for any size, and every later one would take that slower kernel), later sizes share one kernel
    for any size, and a size seen before compiles nothing. Every result stays an exact copy."""
    monkeypatch.setattr(fused, "_seen", {})
    monkeypatch.setattr(fused, "built", 0)
    torch._dynamo.reset()
    fused._compiled.cache_clear()
    torch._dynamo.utils.counters.clear()
    shapes = [(40 + 8 * i, 24 + 8 * i) for i in range(fused._SIGNATURES + 2)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="zoo_cpu_kernels.fused")
        for shape in shapes + shapes[:2] + shapes[-1:]:  # then sizes seen before
            a = torch.randn(*shape)
            got = fused.transpose(a)
            assert got.is_contiguous() and torch.equal(got, a.t())
    assert [fused._variant("transpose", fused._signature([torch.empty(s)])) for s in shapes] == \
        [*range(fused._SIGNATURES), -1, -1]
    # one kernel per size of its own (no dynamo), one dynamo graph for the rest; no recompilation
    assert fused.built == fused._SIGNATURES
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert fused._compiled.cache_info().currsize == fused._SIGNATURES + 1
    assert not fused._BROKEN


@pytest.mark.parametrize("rows", [48, 50])
def test_row_block_sums_add_up_to_the_column_sums(rows):
    """`zoo_mamba.ssm_fused.row_block_sums`: partial sums over blocks of rows whose sum is the column
    sum (float64 reference), one block where the rows are not a multiple of the block."""
    from zoo_mamba import ssm_fused

    block = ssm_fused._SUM_ROWS
    v = torch.randn(rows, 3, 5, generator=torch.Generator().manual_seed(9))
    parts = ssm_fused.row_block_sums(v)
    assert parts.shape == ((rows // block, 3, 5) if rows % block == 0 else (1, 3, 5))
    torch.testing.assert_close(parts.sum(0).double(), v.double().sum(0), rtol=1e-6, atol=1e-6)
    if rows % block == 0:  # each block is the sum of its own rows
        torch.testing.assert_close(parts[1], v[block:2 * block].sum(0))


def test_float32_weight_gradients_are_bitwise_the_same_with_the_compiled_transposes(on):
    """The oneDNN linear (`zoo_cpu_kernels.gemm`): its weight gradient's transposed operands copied
    by the compiled kernel or by torch give the same bits (a transposition is exact)."""
    from zoo_cpu_kernels import gemm

    if not gemm._onednn_works():
        pytest.skip("no oneDNN matmul in this torch build")
    x = torch.randn(4, 96, 64, requires_grad=True)
    w = torch.randn(80, 64, requires_grad=True)
    g = torch.randn(4, 96, 80)
    grads = []
    for enabled in (False, True):
        chosen = gemm.configure("onednn", fused_on=enabled)[0]
        x.grad = w.grad = None
        chosen.linear(x, w).backward(g)
        grads.append((x.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert fused._compiled.cache_info().currsize >= 1
    ref = torch.einsum("bto,bti->oi", g.double(), x.detach().double())
    assert _rel(grads[1][1], ref) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_swiglu_match_float64(on, dtype):
    from zoo.nn import gated_activation, rms_norm

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 50, 64, generator=gen) * 3).to(dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).requires_grad_(True)
    g = torch.randn(6, 50, 64, generator=gen).to(dtype)
    y = rms_norm(x, w, 1e-5)
    y.backward(g)
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    yd = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))
    yd.backward(g.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(y, yd) <= tol and _rel(x.grad, xd.grad) <= 10 * tol and _rel(w.grad, wd.grad) <= 10 * tol

    gu = torch.randn(6, 50, 96, generator=gen).to(dtype).requires_grad_(True)
    h = gated_activation(gu, "silu")
    h.backward(g[..., :48])
    gud = gu.detach().double().requires_grad_(True)
    gate, up = gud.chunk(2, -1)
    hd = torch.nn.functional.silu(gate) * up
    hd.backward(g[..., :48].double())
    assert _rel(h, hd) <= tol and _rel(gu.grad, gud.grad) <= 10 * tol


def test_one_kernel_per_dtype_whatever_grad_mode_autocast_or_view(on, monkeypatch):
    """Training, sampling (no grad) and bf16 autocast call the adaLN norm with the same shapes but
    different grad modes, requires_grad flags, autocast states and chunk offsets (shift and scale
    are views into one modulation tensor): each used to compile a variant, and a DiT run that
    trained and sampled reached dynamo's recompile limit and fell back to eager with a warning."""
    from zoo.nn import modulated_layer_norm

    monkeypatch.setattr(fused, "_seen", {})
    torch._dynamo.reset()
    fused._compiled.cache_clear()
    before = fused.built
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="zoo_cpu_kernels.fused")
        for dtype in (torch.float32, torch.bfloat16):
            for grad in (True, False):
                for autocast in (False, True):
                    for first in range(0, 5):  # shift, scale = chunks (first, first + 1) of six
                        x = torch.randn(4, 16, 48, dtype=dtype, requires_grad=grad)
                        mod = torch.randn(4, 1, 6 * 48, dtype=dtype, requires_grad=grad).chunk(6, -1)
                        with torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=autocast):
                            y = modulated_layer_norm(x, mod[first], mod[first + 1], 1e-6)
                        # each view read at its own offset (a kernel is built for the first one it meets)
                        want = torch.nn.functional.layer_norm(x.double(), (48,), eps=1e-6) * (
                            1 + mod[first + 1].double()) + mod[first].double()
                        assert _rel(y.double(), want) <= (2e-2 if y.dtype == torch.bfloat16 else 1e-5)
                        if grad:
                            y.sum().backward()
    assert not fused._BROKEN
    graphs = fused.built - before
    # forward and backward, each once per (input, output) dtypes: float32, bf16, and float32 under
    # autocast (bf16 out, a bf16 gradient in)
    assert 0 < graphs <= 6, graphs


@pytest.mark.parametrize("softcap", [None, 40.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_cross_entropy_matches_float64_where_probabilities_underflow(on, dtype, softcap):
    """The LM loss through the compiled softmax-gradient kernel: loss and both gradients against
    float64 autograd of the same (rounded) inputs, each row's logits spread over > 200 so that
    some labels' probabilities underflow in float32. With Gemma 2's soft cap the kernel caps the
    logits (cap tanh(x / cap)) and takes the gradient back through it."""
    from zoo.nn import linear_cross_entropy

    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(96, 32, generator=gen) * 6).to(dtype).requires_grad_(True)
    w = (torch.randn(500, 32, generator=gen) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 500, (96,), generator=gen)
    mask = torch.rand(96, generator=gen) > 0.2
    loss = linear_cross_entropy(h, w, labels, mask, chunk=40, softcap=softcap)
    loss.backward()
    hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    logits = hd @ wd.t()
    spread = logits.detach().amax(1) - logits.detach().amin(1)
    assert float(spread.min()) > 200  # exp(-104) is float32's smallest subnormal
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * mask).sum() / mask.sum()
    ref.backward()
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: the logits' and gradients' rounding
    assert abs(loss.item() - ref.item()) <= tol * ref.item()
    assert _rel(h.grad, hd.grad) <= 10 * tol and _rel(w.grad, wd.grad) <= 10 * tol
    assert "cross_entropy_grad" not in fused._BROKEN and "capped_cross_entropy_grad" not in fused._BROKEN
    assert softcap is None or "capped_cross_entropy_grad" in fused._seen  # (the compiled kernel ran)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,t", [(True, 37), (False, 37), (True, 40)])
def test_mamba_causal_convolution_with_silu_matches_float64(on, dtype, bias, t):
    """`zoo_mamba.ssm.causal_conv1d(silu=True)` through the compiled kernels (`zoo_mamba.ssm_fused.ConvSiLU`)
    against torch's grouped conv1d in float64, on a strided view of a wider projection as the mixers
    pass it, forward and every gradient; 2 x 40 rows take the weight's sums by blocks of rows."""
    from zoo_mamba import ssm, ssm_fused

    gen = torch.Generator().manual_seed(5)
    proj = (torch.randn(2, t, 40, generator=gen)).to(dtype).requires_grad_(True)
    x = proj[..., 8:32]  # (B, T, C) with row stride 40
    w = (0.5 * torch.randn(24, 1, 4, generator=gen)).to(dtype).requires_grad_(True)  # (bf16 parameters)
    b = (0.1 * torch.randn(24, generator=gen)).to(dtype).requires_grad_(True) if bias else None
    g = torch.randn(2, t, 24, generator=gen).to(dtype)
    calls = []
    orig = ssm_fused.ConvSiLU.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssm_fused.ConvSiLU, "apply", lambda *a: calls.append(1) or orig(*a))
        y, nxt = ssm.causal_conv1d(x, w, b, silu=True)
    assert calls and y.dtype == dtype and y.shape == x.shape
    y.backward(g)
    xd = x.detach().double().requires_grad_(True)
    wd, bd = w.detach().double().requires_grad_(True), None if b is None else b.detach().double().requires_grad_(True)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.nn.functional.pad(xd.transpose(1, 2), (3, 0)), wd, bd, groups=24)).transpose(1, 2)
    ref.backward(g.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(y, ref) <= tol and _rel(proj.grad[..., 8:32], xd.grad) <= 10 * tol
    assert proj.grad[..., :8].abs().sum() == 0 and _rel(w.grad, wd.grad) <= 10 * tol
    if bias:
        assert _rel(b.grad, bd.grad) <= 10 * tol
    assert torch.equal(nxt, x.detach()[:, -3:].transpose(1, 2))  # the decoding state: the last K-1 inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,t", [(1, 29), (2, 29), (2, 32)])
def test_mamba2_skip_gate_and_grouped_norm_match_float64(on, dtype, groups, t):
    """`zoo_mamba.ssm_fused.SkipGatedRMSNorm`: ``weight * RMSNorm((y + D x) * silu(z))`` per group against
    the formula in float64 through autograd, with x and z strided views as the mixer passes them
    (2 x 32 rows: D's and the weight's gradients summed by blocks of rows)."""
    from zoo_mamba.ssm_fused import SkipGatedRMSNorm

    gen = torch.Generator().manual_seed(6)
    h, p = 4, 8
    y = torch.randn(2, t, h, p, generator=gen).requires_grad_(True)  # the scan's float32 output
    proj = (2 * torch.randn(2, t, 3 * h * p, generator=gen)).to(dtype).requires_grad_(True)
    z, x = proj[..., :h * p], proj[..., h * p:2 * h * p].unflatten(-1, (h, p))
    d = (1 + 0.3 * torch.randn(h, generator=gen)).requires_grad_(True)
    w = (1 + 0.2 * torch.randn(h * p, generator=gen)).requires_grad_(True)
    g = torch.randn(2, t, h * p, generator=gen)
    out = SkipGatedRMSNorm.apply(y, x, d, z, w, groups, 1e-5)
    assert out.dtype == torch.float32 and out.shape == (2, t, h * p)
    out.backward(g)
    yd, pd, dd, wd = (t.detach().double().requires_grad_(True) for t in (y, proj, d, w))
    v = ((yd + pd[..., h * p:2 * h * p].unflatten(-1, (h, p)) * dd[:, None]).flatten(-2)
         * torch.nn.functional.silu(pd[..., :h * p])).unflatten(-1, (groups, -1))
    ref = wd * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2)
    ref.backward(g.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(out, ref) <= tol
    for got, want in ((y.grad, yd.grad), (proj.grad, pd.grad), (d.grad, dd.grad), (w.grad, wd.grad)):
        assert got.shape == want.shape and _rel(got, want) <= 10 * tol


def test_mamba2_mixer_with_the_compiled_kernels_follows_the_eager_one(on, monkeypatch):
    """The wiring: a Mamba-2 mixer (2 groups, bias on the convolution) computes the same outputs
    and parameter gradients with the compiled kernels on (its convolution, gate and SSD's elementwise passes
    compiled) as with torch's eager kernels."""
    from zoo_mamba.ssm import Mamba2Mixer

    from zoo.spec import SSMSpec

    torch.manual_seed(0)
    mixer = Mamba2Mixer(SSMSpec(kind="mamba2", gated_norm=True), hidden=32, heads=4, head_dim=16, groups=2, state=8,
                        conv=4, chunk=16, eps=1e-5, dt_limit=(0.0, float("inf")), layer=0)
    u = torch.randn(2, 40, 32)
    names, run = [], fused.run
    monkeypatch.setattr(fused, "run", lambda name, *v: names.append(name) or run(name, *v))
    runs = []
    for enabled in (False, True):
        with (contextlib.nullcontext() if enabled else _eager()):
            mixer.zero_grad()
            out = mixer(u)
            out.square().sum().backward()
        runs.append((out.detach(), {n: q.grad.clone() for n, q in mixer.named_parameters()}))
    assert set(names) == {"conv_silu_keep", "conv_silu_grad_kept", "conv_backward", "gated_rms_norm",
                          "gated_rms_norm_backward", "ssd_inputs", "ssd_output", "ssd_output_grads", "ssd_input_grads",
                          "ssd_decay_grad"}
    assert _rel(runs[1][0], runs[0][0]) <= 1e-6
    for name, grad in runs[0][1].items():
        assert _rel(runs[1][1][name], grad) <= 1e-5, name


@pytest.mark.parametrize("form", ["mixed", "every chunk by decay matrices"])
def test_mamba2_scan_with_the_compiled_passes_matches_the_float64_recurrence(on, monkeypatch, form):
    """`zoo_mamba.ssd.SSD` with its elementwise passes compiled (`_inputs`, `_output`, their gradients
    and the chunks' decay gradient): outputs, last state and the gradients of x, dt, A, B, C and the
    entering state against autograd through the step-by-step recurrence in float64; two groups, a
    length the chunk does not divide, and one chunk that forgets too much for the factored form (it
    takes the decay matrices, scales 0 and 1 in the compiled passes) beside factored ones, or every
    chunk by decay matrices (the passes without the factored form's parts)."""
    from zoo_mamba import ssd, ssm

    def recurrence(x, dt, a, b, c, h):
        r = x.shape[2] // b.shape[2]
        b, c = b.repeat_interleave(r, 2), c.repeat_interleave(r, 2)
        ys = []
        for t in range(x.shape[1]):
            h = torch.exp(dt[:, t] * a)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None]
            ys.append((h * c[:, t, :, None, :]).sum(-1))
        return torch.stack(ys, 1), h

    names, run = [], fused.run
    monkeypatch.setattr(fused, "run", lambda name, *v: names.append(name) or run(name, *v))
    wide, within = [], ssd._within_by_matrices
    monkeypatch.setattr(ssd, "_within_by_matrices", lambda x, *v: wide.append(x.shape[0]) or within(x, *v))
    if form != "mixed":
        monkeypatch.setattr(ssd, "MAX_SPAN", -1.0)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 45, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b, c = (torch.randn(2, 45, 2, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    a = (-torch.rand(4, generator=g, dtype=torch.float64) * 4 - 0.5).requires_grad_()
    h0 = torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    dt = torch.rand(2, 45, 4, generator=g, dtype=torch.float64)
    dt[0, :16] = 10.0  # the first sequence's first chunk spans e^-80..e^-720 a head: decay matrices
    dt.requires_grad_()
    inputs = (x, dt, a, b, c, h0)
    ref_y, ref_h = recurrence(*inputs)
    y, h = ssm.ssd_scan(*inputs[:-1], state=h0, chunk=16)
    assert set(names) == {"ssd_inputs", "ssd_output"}
    assert _rel(y, ref_y) <= 1e-6 and _rel(h, ref_h) <= 1e-6
    wy, wh = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (ref_y, ref_h))
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), inputs)
    want = torch.autograd.grad((ref_y * wy).sum() + (ref_h * wh).sum(), inputs)
    assert set(names) == {"ssd_inputs", "ssd_output", "ssd_output_grads", "ssd_input_grads", "ssd_decay_grad"}
    assert wide == ([1, 1] if form == "mixed" else [6, 6])  # by decay matrices, forward and backward
    # A's gradient sums dt-weighted terms of every position, which cancel: in float32 it is good to
    # ~5e-5 here with torch's eager kernels too (the compiled passes change the rounding, not that)
    for name, gv, wv in zip(["x", "dt", "A", "B", "C", "h0"], got, want):
        assert _rel(gv, wv) <= (1e-4 if name == "A" else 1e-5), name


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_gated_residual_is_computed_in_float32_and_rounded_once(on, compiled, dtype, per_token):
    """adaLN-Zero's ``x + gate * y`` on a float32 stream with gate and y in ``dtype`` (gate a chunk
    of the adaLN output, per sample or per token): the output is the float64 value of the same
    inputs within float32 rounding (a bf16 ``gate * y`` rounded before the sum is ~1e-3 off), the
    gradients within one rounding to their dtype; compiled and torch's eager path alike."""
    from zoo.nn import gated_residual

    stack = contextlib.ExitStack()
    if not compiled:
        stack.enter_context(_eager())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 48, generator=gen).requires_grad_(True)
    mod = torch.randn(3, 40 if per_token else 1, 3 * 48, generator=gen).to(dtype).requires_grad_(True)
    y = torch.randn(3, 40, 48, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(3, 40, 48, generator=gen)
    out = gated_residual(x, mod.chunk(3, -1)[1], y)
    assert out.dtype == torch.float32 and type(out.grad_fn).__name__ == "_GatedResidualFnBackward"
    out.backward(g)
    x64, mod64, y64 = (t.detach().double().requires_grad_(True) for t in (x, mod, y))
    ref = x64 + mod64.chunk(3, -1)[1] * y64
    ref.backward(g.double())
    assert _rel(out, ref) <= 1e-7
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    for got, want in ((x.grad, x64.grad), (mod.grad, mod64.grad), (y.grad, y64.grad)):
        assert got.dtype == (torch.float32 if got is x.grad else dtype)
        assert _rel(got, want) <= tol
    assert torch.equal(x.grad, g)  # the stream's gradient passes through untouched
    small = [t.detach()[:, :3, :5].clone().requires_grad_(True) for t in (x64, mod64, y64)]
    assert torch.autograd.gradcheck(gated_residual, small)
    stack.close()
