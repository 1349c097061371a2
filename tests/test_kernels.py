"""The kernel seam (`zoo.kernels`): every operation's PyTorch reference against an independent
computation (autograd of the plain formula in float64, or the Hugging Face module), on random
shapes and values; a run's choice held in an object and scoped to the code it runs; providers found
through the ``zoo.kernels`` entry-point group, a broken one skipped by name."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from zoo import kernels
from zoo.kernels import OPS, REFERENCE, Kernels, Selection


def _draw(seed: int) -> tuple[torch.Generator, tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(v) for v in torch.randint(1, 9, (2,), generator=g)) + (int(torch.randint(2, 40, (1,), generator=g)),)
    return g, shape


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("seed", range(6))
def test_rms_norm_reference_is_hf_llamas_norm_and_its_gradient(seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g, shape = _draw(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    hf = LlamaRMSNorm(shape[-1], eps=1e-6).double()
    hf.weight.data.copy_(w)
    xr = x.clone().requires_grad_(True)
    want = hf(xr)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    want.backward(dy)
    y, rstd = OPS["rms_norm"](x, w, 1e-6)
    assert _rel(y, want) < 1e-6 and torch.equal(OPS["rms_norm_again"](x, w, 1e-6, rstd), y)
    gx, gw = OPS["rms_norm_backward"](dy, x, w, rstd)
    assert _rel(gx, xr.grad) < 1e-6 and _rel(gw, hf.weight.grad) < 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_elementwise_references_match_autograd_of_their_formulas(seed):
    g, shape = _draw(seed)
    d = shape[-1]

    def leaf(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True)

    gu, dy = leaf(*shape[:-1], 2 * d), torch.randn(*shape, generator=g, dtype=torch.float64)
    ref = F.silu(gu[..., :d]) * gu[..., d:]
    ref.backward(dy)
    assert torch.allclose(OPS["swiglu"](gu.detach()), ref) and torch.allclose(OPS["swiglu_backward"](dy, gu.detach()),
                                                                               gu.grad)
    per_token = seed % 2 == 0
    x, sh, sc = leaf(*shape), leaf(*shape[:-2], shape[-2] if per_token else 1, d), leaf(*shape[:-2], shape[-2] if per_token else 1, d)
    ln = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-6)
    want = ln * (1 + sc) + sh
    want.backward(dy)
    y, mean, rstd = OPS["modulated_ln"](x.detach(), sh.detach(), sc.detach(), 1e-6, torch.float64)
    assert _rel(y, want) < 1e-6
    assert torch.equal(OPS["modulated_ln_again"](x.detach(), sh.detach(), sc.detach(), mean, rstd, 1e-6, torch.float64), y)
    grads = OPS["modulated_ln_backward"](dy, x.detach(), sh.detach(), sc.detach(), mean, rstd)
    for got, leaf_ in zip(grads, (x, sh, sc), strict=True):
        assert got.shape == leaf_.shape and _rel(got, leaf_.grad) < 1e-6
    r, gate, v = leaf(*shape), leaf(*shape[:-2], 1, d), leaf(*shape)
    out = r + gate * v
    out.backward(dy)
    assert torch.allclose(OPS["gated_residual"](r.detach(), gate.detach(), v.detach()), out)
    dv, dgate = OPS["gated_residual_backward"](dy, gate.detach(), v.detach(), kernels.broadcast_dims(v, gate))
    assert _rel(dv, v.grad) < 1e-6 and _rel(dgate, gate.grad) < 1e-6
    a = leaf(*shape)
    act = F.gelu(a, approximate="tanh")
    act.backward(dy)
    assert torch.equal(OPS["gelu_tanh"](a.detach()), act.detach())
    assert _rel(OPS["gelu_tanh_backward"](dy, a.detach()), a.grad) < 1e-6


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("seed", range(4))
def test_cross_entropy_gradient_is_autograds_of_torchs_loss(seed, softcap):
    g = torch.Generator().manual_seed(seed)
    n, v = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(2, 70, (1,), generator=g))
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 5).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    scale = torch.rand(n, generator=g, dtype=torch.float64)
    capped = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    nll = F.cross_entropy(capped, labels, reduction="none")
    (nll * scale).sum().backward()
    got_nll, got_grad = OPS["cross_entropy_grad"](logits.detach(), labels, scale, softcap)
    assert _rel(got_nll, nll) < 1e-6 and _rel(got_grad, logits.grad) < 1e-6


def test_products_and_their_questions():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g), torch.randn(5, 3, generator=g)
    assert torch.equal(OPS["mm"](a, b), a @ b)
    out = torch.empty(7, 3, dtype=torch.float64)
    assert OPS["mm"](a.bfloat16(), b.bfloat16(), out) is out and torch.equal(out, (a.bfloat16() @ b.bfloat16()).double())
    w, bias = torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    assert torch.equal(OPS["linear"](a, w, bias), F.linear(a, w, bias))
    assert OPS["mm_keeps_shapes"](a.bfloat16()) and not OPS["mm_keeps_shapes"](a)
    assert OPS["attention"](a, a, a, True, 0, None, None, None, None) is NotImplemented  # attend's own SDPA


def test_an_implementation_declines_what_it_does_not_take_and_the_reference_runs():
    seen = []

    def only_wide(x, weight, eps):
        seen.append(x.shape[-1])
        return NotImplemented if x.shape[-1] < 16 else (torch.zeros_like(x), torch.ones(*x.shape[:-1], 1))

    k = Kernels("cpu", {"test": Selection({"rms_norm": only_wide}, lines=("test kernels",))})
    x = torch.randn(3, 8)
    assert torch.equal(k.call("rms_norm", x, torch.ones(8), 1e-6)[0], OPS["rms_norm"](x, torch.ones(8), 1e-6)[0])
    assert (k.call("rms_norm", torch.randn(2, 16), torch.ones(16), 1e-6)[0] == 0).all()
    assert seen == [8, 16] and k.report() == ["test kernels"] and "# kernels:\n#   test kernels\n" == k.comment()
    with pytest.raises(ValueError, match=r"unknown operation\(s\) \['rms_nrom'\]"):
        Kernels("cpu", {"typo": Selection({"rms_nrom": only_wide})})


def test_the_choice_is_scoped_to_the_code_it_runs_and_to_its_thread():
    from zoo.nn import rms_norm

    calls = []
    k = Kernels("cpu", {"t": Selection({"rms_norm": lambda *a: calls.append(1) or NotImplemented})})
    x, w = torch.randn(2, 4, requires_grad=True), torch.ones(4)
    assert kernels.active() is REFERENCE
    with k.use():
        assert kernels.active() is k
        y = rms_norm(x, w, 1e-6)
        other = []
        t = threading.Thread(target=lambda: other.append(kernels.active()))
        t.start()
        t.join()
        assert other == [REFERENCE]  # a thread of its own sees no run's choice
    assert kernels.active() is REFERENCE and calls == [1]
    y.sum().backward()  # the backward keeps the kernels its forward ran with (outside the scope now)
    with pytest.raises(RuntimeError), k.use():
        raise RuntimeError
    assert kernels.active() is REFERENCE  # restored after an error too


def _kernel_distribution(root, name, value, module_text):
    (root / "acme_kern.py").write_text(module_text)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[zoo.kernels]\n{value}\n")


def test_a_third_party_provider_is_found_by_its_entry_point_and_a_broken_one_skipped(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    _kernel_distribution(good, "acme_kern", "acme = acme_kern:PROVIDER", """
from zoo.kernels import Selection
class P:
    name, device = "acme-kernels", "cpu"
    def select(self, options):
        return Selection({"gelu_tanh": lambda x: x * 0}, lines=(f"acme gelu ({options['cpu_fused']})",))
PROVIDER = P()
""")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken_kern-0.1.dist-info").mkdir()
    (bad / "broken_kern-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-kern\nVersion: 0.1\n")
    (bad / "broken_kern-0.1.dist-info" / "entry_points.txt").write_text("[zoo.kernels]\nbroken = no_such_module:X\n")
    code = """
import warnings, torch
from zoo import kernels
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    k = kernels.select("cpu", {"cpu_fused": "auto"})
    print([str(x.message).split(": ")[0] for x in w])
print(k.report()[0])
with k.use():
    print(float(kernels.active().call("gelu_tanh", torch.ones(3)).sum()))
print(kernels.select("meta").report())
"""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(good), str(bad), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "kernel provider 'broken' (no_such_module:X) failed to load and is skipped" in lines[0]
    assert lines[1] == "acme gelu (auto)" and lines[2] == "0.0"
    assert "no provider for meta" in lines[3]  # a device no provider serves: the references
