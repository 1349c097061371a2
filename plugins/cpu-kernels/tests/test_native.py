"""`zoo_cpu_kernels.native`: zoo's C kernels (transposition, tanh-GELU, attention's softmax) against torch's own
operations and float64, how the library is built and cached, and the paths that use them: a bf16
weight gradient from a dense operand (`Gemm.mm`), the blocked attention's scale inside its
softmax (`test_attention.py` runs its float64 matrix with them too)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import torch
from zoo_cpu_kernels import gemm, native

from zoo.testing import threads


@pytest.fixture
def on(monkeypatch):
    """The library built for the test."""
    monkeypatch.delenv("ZOO_BACKENDS", raising=False)
    if not native.available():
        pytest.fail(f"zoo_cpu_kernels.native did not build here: {native.status()}")
    yield


def _vectorized() -> bool:
    lib = native._library()
    return lib is not None and bool(lib.zoo_avx512())


needs_avx512 = pytest.mark.skipif(not _vectorized(), reason="native.c's GELU and softmax are AVX-512 code")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("src,dst", list(native._KINDS))
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (16, 16), (32, 64), (37, 53), (2, 40, 33), (5, 8, 16)])
def test_transposition_is_torchs_bit_for_bit(on, src, dst, shape):
    """Every kind (two- and four-byte copies, bf16 <-> float32) for whole tiles and edges, 2-D and
    batched, with NaN and infinities: the bits of ``a.transpose(-1, -2).to(dst)``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 50
    flat = x.view(-1)
    flat[:: 7] = float("nan")
    flat[3:: 11] = float("inf")
    flat[5:: 13] = -float("inf")
    a = x.to(src)
    got = native.transposed(a, dst)
    assert got.dtype == dst and got.shape == (*shape[:-2], shape[-1], shape[-2]) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(a.transpose(-1, -2).to(dst).contiguous()))


def test_transposition_reads_and_writes_strided_views(on):
    """A source whose rows are longer than its columns (a slice of a wider matrix, a batch of slices)
    and an ``out`` that is a view into a larger tensor: only the view's elements are written."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 70, 90, generator=g).bfloat16()
    a = wide[:, 3:60, 10:51]  # rows of 90, batch stride 70 x 90
    big = torch.zeros(4, 50, 80, dtype=torch.float32)
    out = big[:, 2:43, 5:62]
    native.transpose_into(a, out)
    assert torch.equal(out, a.transpose(1, 2).float())
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[:, 2:43, 5:62] = False
    assert (big[outside] == 0).all()


def test_transposition_without_the_library_is_torchs_copy(monkeypatch):
    """Not built, `transposed` is torch's copy, and autograd still records it."""
    monkeypatch.setattr(native, "_library", lambda: None)
    a = torch.randn(40, 30, requires_grad=True)
    out = native.transposed(a)
    assert torch.equal(out, a.t()) and out.grad_fn is not None


def test_the_library_is_built_once_into_the_cache_with_the_umask(tmp_path, monkeypatch):
    """First use compiles native.c into $ZOO_CACHE/native (mode from the umask, the name keyed by
    the source, compiler and CPU); a second process's first use loads it without compiling."""
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path))
    monkeypatch.delenv("ZOO_BACKENDS", raising=False)
    native._library.cache_clear()
    old = os.umask(0o027)
    try:
        assert "built with" in native.describe()
    finally:
        os.umask(old)
    (lib,) = list((tmp_path / "native").iterdir())
    assert lib.name.startswith("zoo-native-") and lib.suffix == ".so"
    assert stat.S_IMODE(lib.stat().st_mode) == 0o750
    native._library.cache_clear()
    real = subprocess.run

    def no_compiler(cmd, *a, **kw):  # `cc --version` answers; a compilation would fail the test
        assert "--version" in cmd, cmd
        return real(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "run", no_compiler)
    try:
        assert native.available()
    finally:
        native._library.cache_clear()


def test_a_cache_it_cannot_write_gets_a_private_copy(tmp_path, monkeypatch):
    """$ZOO_CACHE not creatable (here: under a file): the library is built in a temporary directory
    of the process's own, and works."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.delenv("ZOO_BACKENDS", raising=False)
    native._library.cache_clear()
    try:
        assert native.available(), native.status()
        a = torch.randn(40, 70).bfloat16()
        assert torch.equal(native.transposed(a), a.t())
    finally:
        native._library.cache_clear()


def test_a_compiler_that_fails_leaves_torchs_paths(tmp_path, monkeypatch):
    """A broken compiler: one line saying why, `available` False, and every caller computes as before."""
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.delenv("ZOO_BACKENDS", raising=False)
    native._library.cache_clear()
    try:
        line = native.describe()
        assert "unavailable" in line and "false" in line and not native.available()
        a = torch.randn(300, 50).bfloat16()
        assert torch.equal(native.transposed(a), a.t())
        assert native.softmax(a, 1.0) is None and not native.gelu_ok(a)
        g, x = torch.randn(512, 300).bfloat16(), torch.randn(512, 200).bfloat16()
        chosen = gemm.Gemm(native=True)
        assert torch.equal(chosen.mm_or_torch(g.t(), x), torch.mm(g.t(), x))
    finally:
        native._library.cache_clear()


def test_switched_off_by_zoo_backends(monkeypatch):
    from _cpu_helpers import cpu_kernels

    monkeypatch.setenv("ZOO_BACKENDS", "-native")
    k = cpu_kernels(cpu_fused="auto")
    assert any("off (ZOO_BACKENDS switches native off)" in line for line in k.report())
    assert not k.selections["cpu"].impls["mm"].__self__.native


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_and_its_derivative_match_float64(on, dtype):
    """Within two roundings of the output's type of float64's GELU, element by element (and at zero,
    both saturated ends, tiny inputs, an input whose exponential overflows, NaN); the derivative as
    close to float64's as torch's own kernel is."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(70, 97, generator=gen) * 3).to(dtype)  # (a tail of 6,790 % 16 elements)
    x[0, :6] = torch.tensor([0.0, -12.0, 12.0, 1e-30, -1e4, float("nan")])
    g = torch.randn(70, 97, generator=gen).to(dtype)
    assert native.gelu_ok(x) and native.gelu_ok(g, x)
    y = native.gelu_tanh(x)
    want = torch.nn.functional.gelu(x.double(), approximate="tanh")
    assert y.dtype == dtype and y[0, 4] == 0 and torch.isnan(y[0, 5]) and y[0, 2] == 12
    fin = torch.isfinite(want)
    assert ((y.double() - want).abs() <= 2 * torch.finfo(dtype).eps * (want.abs() + 1))[fin].all()
    got = native.gelu_tanh_backward(g, x)
    ref = torch.ops.aten.gelu_backward(g.double(), x.double(), approximate="tanh")
    eager = torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    assert got.dtype == dtype and torch.isnan(got[0, 5]) and got[0, 4] == 0

    def rel(a):
        return float((a.double() - ref)[fin].norm() / ref[fin].norm())

    assert rel(got) <= max(1.5 * rel(eager), 1e-6)


@needs_avx512
def test_gelu_bits_depend_on_the_element_alone(on):
    """An element's result is the same wherever it sits (a chunk's edge, a tail) and on any thread
    count: a recomputed activation equals the forward's bit for bit."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50_001, generator=gen).bfloat16()
    g = torch.randn(50_001, generator=gen).bfloat16()
    with threads(2):
        y, d = native.gelu_tanh(x), native.gelu_tanh_backward(g, x)
    with threads(1):
        y1, d1 = native.gelu_tanh(x[7:].contiguous()), native.gelu_tanh_backward(g[7:].contiguous(), x[7:].contiguous())
    assert torch.equal(_bits(y[7:]), _bits(y1)) and torch.equal(_bits(d[7:]), _bits(d1))


@needs_avx512
@pytest.mark.parametrize("n", [5, 16, 256, 300])
def test_softmax_and_its_backward_match_float64(on, n):
    """``softmax(scale x)`` over rows with masked (-inf) keys, each probability within a bf16 rounding
    of float64's; an all-masked row is NaN, as torch's; the backward ``scale p (dp - sum(p dp))``
    within a bf16 rounding of the float64 formula on the same p."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 17, n, generator=gen) * 4).bfloat16()
    x[0, 1, : n // 2] = float("-inf")
    x[1, 2] = float("-inf")
    scale = 0.125 if n != 300 else 0.0883883  # a power of two and 1 / sqrt(128)
    p = native.softmax(x, scale)
    want = torch.softmax(x.double() * scale, -1)
    assert torch.isnan(p[1, 2]).all() and torch.isnan(torch.softmax(x[1, 2].float(), -1)).all()
    ok = ~torch.isnan(want)
    assert ((p.double() - want).abs() <= 2 ** -8 * want + 1e-6)[ok].all()
    assert (p[0, 1, : n // 2] == 0).all()
    dp = torch.randn(3, 17, n, generator=gen).bfloat16()
    ds = native.softmax_backward(dp, p, scale)
    pd, dpd = p.double(), dp.double()
    ref = scale * pd * (dpd - (pd * dpd).nan_to_num().sum(-1, keepdim=True))
    tol = 2 ** -8 * ref.abs() + 2e-2 * scale * pd
    assert ((ds.double() - ref).abs() <= tol)[ok].all()


@needs_avx512
def test_softmax_refuses_what_it_does_not_take(on):
    assert native.softmax(torch.randn(4, 8), 1.0) is None  # float32: torch's
    assert native.softmax(torch.randn(8, 4).bfloat16().t(), 1.0) is None  # not contiguous
    assert native.softmax(torch.randn(1, 16385).bfloat16(), 1.0) is None and not native.softmax_ok(16385)


@pytest.mark.parametrize("out_features,in_features", [(1536, 384), (384, 1536), (600, 600)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bf16_weight_gradient_from_a_dense_operand(on, monkeypatch, out_features, in_features, dtype):
    """`Gemm.mm(g.t(), x, out)` on a CPU with AMX: the smaller operand transposed dense first (g's,
    or x's with the product transposed back into ``out``), the same bf16 product as torch's in
    place (within a bf16 rounding of float64's, as torch's), widened into a float32 ``out``."""
    monkeypatch.setattr(gemm, "has_amx", lambda: True)
    calls = []
    real = native.transposed
    monkeypatch.setattr(native, "transposed", lambda a, dt=None: calls.append(a.shape) or real(a, dt))
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(512, out_features, generator=gen).bfloat16()
    x = torch.randn(512, in_features, generator=gen).bfloat16()
    out = torch.empty(out_features, in_features, dtype=dtype)
    chosen = gemm.Gemm(native=True)
    got = chosen.mm(g.t(), x, out)
    assert got is out and calls == [(512, min(out_features, in_features))]
    want = g.double().t() @ x.double()
    theirs = torch.mm(g.t(), x).double()
    bound = 2 ** -8 * want.abs() + 1e-3
    assert ((got.double() - want).abs() <= bound).all() and ((theirs - want).abs() <= bound).all()
    calls.clear()
    small = g[:, :384], x[:, :384]  # (75M multiply-adds: the copy would not pay) in place
    assert chosen.mm(small[0].t(), small[1]) is NotImplemented and not calls
    monkeypatch.setattr(gemm, "has_amx", lambda: False)  # elsewhere: torch's product in place
    assert chosen.mm(g.t(), x) is NotImplemented and not calls


def test_the_autocast_linear_takes_the_dense_operand_path(on, monkeypatch):
    """Inside a bf16 linear layer's backward (`zoo_cpu_kernels.gemm._AutocastLinear`): the weight
    gradient from the dense path equals the in-place one within a bf16 rounding, float32 as the weight."""
    import dataclasses

    from zoo.kernels import Kernels, Selection
    from zoo.nn.linear import Linear

    auto = gemm.configure("auto")[0]
    if not auto.autocast:
        pytest.skip("no oneDNN bf16 products on this machine")
    monkeypatch.setattr(gemm, "has_amx", lambda: True)
    calls = []
    real = native.transposed
    monkeypatch.setattr(native, "transposed", lambda a, dt=None: calls.append(a.shape) or real(a, dt))
    torch.manual_seed(0)
    lin = Linear(384, 1152)
    x = torch.randn(4, 256, 384)
    g = torch.randn(4, 256, 1152).bfloat16()
    grads = []
    for native_on in (True, False):
        chosen = dataclasses.replace(auto, native=native_on)
        lin.zero_grad()
        with Kernels("cpu", {"t": Selection({"linear": chosen.linear})}).use(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.backward(g)
        grads.append(lin.weight.grad.clone())
        assert calls == ([(1024, 384)] if native_on else []), calls  # (x, the smaller operand)
        calls.clear()
    assert grads[0].dtype == torch.float32
    want = g.double().reshape(-1, 1152).t() @ x.bfloat16().double().reshape(-1, 384)
    for got in grads:
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-3).all()
