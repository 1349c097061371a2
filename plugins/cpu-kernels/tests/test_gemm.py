"""`zoo.gemm`: float32 CPU products through oneDNN, against float64 and torch's own F.linear."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _cpu_helpers import gemm_kernels
from zoo_cpu_kernels import gemm

from zoo import kernels
from zoo.nn.linear import Linear
from zoo.testing import threads


@pytest.fixture
def onednn():
    """oneDNN's products for the test, whatever this machine's "auto" chose."""
    with gemm_kernels("onednn") as chosen:
        yield chosen


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("bias,shape,frozen,out", [(True, (3, 5, 24), False, 40), (False, (7, 24), False, 40),
                                                  (True, (6, 24), True, 40), (True, (96, 24), False, 40),
                                                  (True, (96, 24), False, 16)])
def test_linear_and_its_gradients_are_float32_products(onednn, bias, shape, frozen, out):
    """Output and every gradient within float32 rounding of the float64 product (as close as torch's
    own kernel is), the weight frozen or not, wider or narrower than its input (the weight gradient
    copies the smaller operand); the module keeps nn.Linear's type and state dict."""
    torch.manual_seed(0)
    lin = Linear(24, out, bias=bias)
    ref_lin = torch.nn.Linear(24, out, bias=bias).double()
    ref_lin.load_state_dict(lin.state_dict())
    keys = list(lin.state_dict())
    assert isinstance(lin, torch.nn.Linear) and list(lin.state_dict()) == keys
    lin.weight.requires_grad_(not frozen)
    x = torch.randn(*shape, requires_grad=True)
    xd = x.detach().double().requires_grad_(True)
    g = torch.randn(*shape[:-1], out)
    y, yd = lin(x), ref_lin(xd)
    assert type(y.grad_fn).__name__ == "_LinearBackward"
    y.backward(g)
    yd.backward(g.double())
    torch_y = F.linear(x.detach(), lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
    assert _rel(y.detach(), yd.detach()) < max(4 * _rel(torch_y, yd.detach()), 1e-6)
    assert _rel(x.grad, xd.grad) < 1e-6
    if frozen:
        assert lin.weight.grad is None
    else:
        assert _rel(lin.weight.grad, ref_lin.weight.grad) < 1e-6
    if bias:
        assert _rel(lin.bias.grad, ref_lin.bias.grad) < 1e-6


@pytest.mark.parametrize("a_layout", ["dense", "transposed", "column slice"])
@pytest.mark.parametrize("b_layout", ["dense", "transposed", "column slice"])
@pytest.mark.parametrize("m,k,n", [(48, 300, 20), (20, 300, 48)])  # a weight gradient's shapes, either side smaller
def test_mm_of_every_operand_layout_is_the_float64_product(onednn, a_layout, b_layout, m, k, n):
    """Whichever operand `_product` copies into a dense one (or neither), the values are the
    float64 product's to float32 rounding and the result is a dense matrix."""
    torch.manual_seed(0)

    def laid_out(rows: int, cols: int, layout: str) -> torch.Tensor:
        if layout == "transposed":
            return torch.randn(cols, rows).t()
        if layout == "column slice":  # neither dense nor the transpose of a dense matrix
            return torch.randn(rows, cols + 3)[:, 2:cols + 2]
        return torch.randn(rows, cols)

    a, b = laid_out(m, k, a_layout), laid_out(k, n, b_layout)
    got = onednn.mm(a, b)
    assert got.shape == (m, n) and got.is_contiguous()
    assert _rel(got, a.double() @ b.double()) < 1e-6


def test_mm_writes_into_out_and_reads_transposed_operands(onednn):
    torch.manual_seed(0)
    a, b = torch.randn(40, 17), torch.randn(33, 17)
    out = torch.empty(30, 33)
    got = onednn.mm(a[5:35], b.t(), out)  # a row slice, a transposed view
    assert got.data_ptr() == out.data_ptr()
    assert _rel(out, a[5:35].double() @ b.double().t()) < 1e-6


def test_other_dtypes_and_blas_keep_torchs_own_product(onednn):
    torch.manual_seed(0)
    lin, plain = Linear(16, 8), torch.nn.Linear(16, 8)
    plain.load_state_dict(lin.state_dict())
    x = torch.randn(4, 16, requires_grad=True)
    assert type(lin(x).grad_fn).__name__ == "_LinearBackward"  # float32 on the CPU: oneDNN's
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(lin(x), plain(x))  # fp16 autocast: torch's own
    lin64, plain64 = Linear(16, 8).double(), torch.nn.Linear(16, 8).double()
    plain64.load_state_dict(lin64.state_dict())
    x64 = x.detach().double()
    assert torch.equal(lin64(x64), plain64(x64))  # float64: torch's own
    with gemm_kernels("blas"):
        y = lin(x)
        assert torch.equal(y, plain(x)) and type(y.grad_fn).__name__ == "AddmmBackward0"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert type(lin(x).grad_fn).__name__ == "AddmmBackward0"  # "blas": autocast's own linear


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_autocast_linear_is_autocasts_values_keeping_the_float32_weight(onednn, bias):
    """Under bf16 autocast: the output bitwise autocast's own, the gradients within bf16 rounding
    of autocast's (the same bf16 products; the bias gradient summed in float32 either way), and what
    backward keeps is the input's bf16 copy and the float32 weight itself, no bf16 copy of it."""
    if not onednn.autocast:
        pytest.skip("no oneDNN bf16 products on this machine")
    torch.manual_seed(0)
    lin, plain = Linear(48, 40, bias=bias), torch.nn.Linear(48, 40, bias=bias)
    plain.load_state_dict(lin.state_dict())
    x = torch.randn(3, 20, 48)
    g = torch.randn(3, 20, 40).bfloat16()
    outs, grads = [], []
    for m in (lin, plain):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        outs.append(y)
        y.backward(g)
        grads.append([xi.grad, *(p.grad for p in m.parameters())])
    assert type(outs[0].grad_fn).__name__ == "_AutocastLinearBackward" and outs[0].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x.requires_grad_(True))
    kept = y.grad_fn.saved_tensors
    assert any(t is lin.weight or t.data_ptr() == lin.weight.data_ptr() for t in kept)
    assert all(t.dtype == torch.float32 or t.shape != lin.weight.shape for t in kept)  # no bf16 weight copy


@pytest.mark.parametrize("rows", [8, 32, 33])
def test_bf16_autocast_linear_over_a_few_rows_computes_in_float32(onednn, rows):
    """A linear over at most 32 rows under bf16 autocast (a DiT's per-image adaLN, a decoding step)
    computes its product and gradients in float32 from the float32 weight (no bf16 copy of it to
    make three times a step): the output is the float64 product rounded once to bf16, the gradients
    within float32 rounding; over 33 rows it is autocast's bf16 product again."""
    if not onednn.autocast:
        pytest.skip("no oneDNN bf16 products on this machine")
    torch.manual_seed(0)
    lin = Linear(48, 96)
    x = torch.randn(rows, 48, requires_grad=True)
    g = torch.randn(rows, 96).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.backward(g)
    w64, b64 = lin.weight.detach().double().requires_grad_(True), lin.bias.detach().double().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    ref = F.linear(x64, w64, b64)
    ref.backward(g.double())
    few = rows <= 32
    assert (type(y.grad_fn).__name__ == "_AutocastLinearBackward") != few
    assert _rel(y.detach(), ref.detach()) <= 2 ** -8  # at most the output's own bf16 rounding
    tol = 1e-6 if few else 1e-2  # float32 products, or bf16 ones (2^-8 relative per operand)
    for got, want in ((x.grad, x64.grad), (lin.weight.grad, w64.grad), (lin.bias.grad, b64.grad)):
        assert got.dtype == torch.float32 and _rel(got, want) <= tol
    if not few:
        assert _rel(lin.weight.grad, w64.grad) > 1e-5  # (the bf16 products are measurably coarser)


def test_auto_follows_the_machine_not_a_timing():
    """"auto" is decided from the CPU (MKL on a non-Intel x86 takes its generic path, which leaves
    AVX-512 unused), so every rank and every resumed run of a machine computes with the same
    products; "blas" is torch's."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert gemm.has_avx512() == bool(re.search(r"^flags\s*:.*\bavx512f\b", info, re.M))
    auto, line = gemm.configure("auto")
    chosen = gemm.blas_is_generic() and gemm.has_avx512() and gemm._onednn_works()
    assert chosen == auto.onednn
    assert ("products: oneDNN" in line) == auto.onednn
    # oneDNN's GELU only where its AVX-512 kernel runs, and in bf16 only where oneDNN has bf16
    assert bool(auto.eltwise) == (gemm.has_avx512() and gemm._eltwise_works(torch.float32))
    assert (torch.bfloat16 in auto.eltwise) <= auto.autocast
    blas, line = gemm.configure("blas")
    assert "BLAS" in line and not blas.onednn and not blas.eltwise and not blas.autocast
    out = subprocess.run([sys.executable, "-m", "zoo", "version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    assert ("float32 CPU products: oneDNN" in out.stdout) == chosen


def test_gelu_on_a_cpu_without_bf16_products_is_torchs():
    """Where oneDNN has no bf16 inner product (a CPU without AVX-512 bf16 instructions), a bf16
    tanh-GELU is torch's kernel even when oneDNN was asked for: its post-op would raise."""
    with gemm_kernels("onednn" if gemm._onednn_works() else "auto") as chosen:
        x = torch.randn(64, 32).bfloat16()
        if not gemm.bf16_is_native():
            assert torch.bfloat16 not in chosen.eltwise
        y = kernels.active().call("gelu_tanh", x)
        torch.testing.assert_close(y.float(), F.gelu(x.float(), approximate="tanh"), rtol=1e-2, atol=1e-2)


def test_a_trained_step_matches_torchs_product_and_recomputation_stays_exact():
    """A LLaMA block stack's loss and gradients with oneDNN's products against torch's (float32
    rounding apart), and under elementwise recomputation bitwise the same as without it."""
    from zoo.nn import recompute
    from zoo_gpt.convert import from_hf_config
    from zoo_gpt.model import build
    from zoo_gpt.plugin import SPECS

    cfg = from_hf_config({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "max_position_embeddings": 32})
    torch.manual_seed(0)
    model = build(cfg, SPECS[cfg.layer_spec])
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))

    def run(mode: str) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with recompute.scope(mode):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    ref = run("none")  # torch's products: the references
    with gemm_kernels("onednn") as chosen:
        assert chosen.onednn or not gemm._onednn_works()
        fast, fast_rc = run("none"), run("elementwise")
    assert all(torch.equal(a, b) for a, b in zip(fast, fast_rc, strict=True))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_tanh_gelu_through_onednn_is_torchs_formula_and_reproducible():
    """oneDNN's tanh-GELU (the post-op of an identity product) against float64: as close as torch's
    own kernel in float32 and bf16; the same bits for a slice as for the whole tensor and on one
    thread (a recomputed copy is exact); torch's kernel where autograd records, for a strided
    tensor, and under "blas"."""
    def gelu(x):
        return kernels.active().call("gelu_tanh", x)

    with gemm_kernels("onednn" if gemm._onednn_works() else "auto") as chosen:
        if not chosen.eltwise:
            pytest.skip("this torch build has no oneDNN tanh-GELU post-op")
        torch.manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
            if dtype not in chosen.eltwise:  # bf16: only where oneDNN computes bf16 (AVX-512 bf16)
                continue
            x = (torch.randn(300, 96) * 4).to(dtype)
            ref = F.gelu(x.double(), approximate="tanh")
            y = gelu(x)
            assert y.dtype == dtype and y.shape == x.shape and y._base is None
            own = (F.gelu(x, approximate="tanh").double() - ref).abs().max().item()
            assert (y.double() - ref).abs().max().item() <= max(2 * own, tol)
            assert not torch.equal(y, F.gelu(x, approximate="tanh")) or dtype == torch.bfloat16  # oneDNN's, not torch's
            assert torch.equal(gelu(x[100:107].contiguous()), y[100:107])
            with threads(1):
                assert torch.equal(gelu(x), y)
        x = torch.randn(32, 16, requires_grad=True)
        assert type(gelu(x).grad_fn).__name__ == "GeluBackward0"  # autograd: torch's op
        xt = torch.randn(16, 32).t()
        assert torch.equal(gelu(xt), F.gelu(xt, approximate="tanh"))  # strided: torch's
    with gemm_kernels("blas") as chosen:
        assert not chosen.eltwise
        xd = torch.randn(32, 16)
        assert torch.equal(gelu(xd), F.gelu(xd, approximate="tanh"))


def test_bf16_on_a_cpu_without_bf16_instructions_gets_a_note_and_a_quick_peak(monkeypatch):
    """A bf16 run where the CPU has no bf16 instructions says so once (fp32 named as the fast
    choice), and MFU's peak for such a slow dtype is two 256^3 products, not a dozen or more
    1024^3 ones (a minute of start-up at torch's fallback rate); a fast dtype is measured in full."""
    from zoo_cpu_kernels import PROVIDER

    from zoo.training import metrics

    def note(precision):
        return " ".join(PROVIDER.select({"cpu_malloc": "system", "cpu_fused": "eager", "precision": precision}).notes)

    # the machine's own word, independent of oneDNN's check: no AVX-512 at all (an AVX2-only CPU)
    # means no bf16 products, AVX-512 BF16 or AMX means bf16 in hardware (AVX-512 alone: emulated)
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    if flags and "avx512f" not in flags and platform.machine() == "x86_64":
        assert "fp32 is the fast choice" in note("bf16")
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert note("bf16") == ""
    monkeypatch.setattr(gemm, "bf16_is_native", lambda: False)
    assert "fp32 is the fast choice" in note("bf16")
    assert note("fp32") == ""

    calls: list[int] = []

    def slow_mm(a, b, out=None):  # 40 ms a 256^3 product: ~0.8 GFLOP/s, a 1024^3 one would take 2.6 s
        calls.append(a.shape[0])
        if a.dtype == torch.float16:
            import time
            time.sleep(0.04)
        return NotImplemented  # (torch's product then)

    monkeypatch.setattr(metrics, "_PEAK", {})
    with kernels.Kernels("cpu", {"slow": kernels.Selection({"mm": slow_mm})}).use():
        slow = metrics.measured_peak_flops("cpu", torch.float16)
        assert calls == [256, 256] and slow <= 2 * 256**3 / 0.04
        calls.clear()
        metrics.measured_peak_flops("cpu", torch.float32)
    assert calls[:2] == [256, 256] and set(calls[2:]) == {1024} and len(calls) >= 2 + 12  # and >= 0.25 s of them
