"""Optional backends (`zoo.backends`): found when importable, refused with the reason when their
import fails either way (not installed: ImportError; built for another CUDA/torch: RuntimeError),
switched off by ZOO_BACKENDS, and never needed: the pure-PyTorch paths are what every other test
runs (none of these packages installs on the CI machine)."""

from __future__ import annotations

import sys

import pytest
import torch

from zoo import backends


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A clean probe cache and a site directory where fake builds can be dropped."""
    backends.probe.cache_clear()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ZOO_BACKENDS", raising=False)
    yield tmp_path
    for name in ("flash_attn", "causal_conv1d", "mamba_ssm"):
        sys.modules.pop(name, None)
    backends.probe.cache_clear()


def test_nothing_installed_means_every_pytorch_path(fresh):
    import importlib.util

    from zoo_mamba import ssm

    for name, _, status, fallback in backends.report():
        if importlib.util.find_spec(backends.BACKENDS[name].module.split(".")[0]) is None:  # (a GPU box may have some)
            assert status.startswith("ModuleNotFoundError: No module named"), (name, status)
        assert fallback
    if importlib.util.find_spec("mamba_ssm") is None:
        assert backends.kernel("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined") is None
        x = torch.zeros(1)
        assert all(ssm._kernel(k, x) is None for k in ssm._KERNELS)  # zoo_mamba.ssm's scans (tested elsewhere)


def test_an_importable_build_is_used_unless_switched_off(fresh, monkeypatch):
    (fresh / "flash_attn").mkdir()
    (fresh / "flash_attn" / "__init__.py").write_text("__version__ = '9.9'\ndef flash_attn_func(q, k, v):\n    return q\n")
    assert backends.probe("flash-attn")[1] == "available (9.9)"
    assert backends.kernel("flash-attn", "flash_attn", "flash_attn_func")(1, 2, 3) == 1
    assert backends.kernel("flash-attn", "flash_attn", "no_such_function") is None  # an older build
    for spec in ("-flash-attn", "off", "-apex, -flash-attn"):
        monkeypatch.setenv("ZOO_BACKENDS", spec)
        backends.probe.cache_clear()
        assert backends.kernel("flash-attn", "flash_attn", "flash_attn_func") is None, spec
        assert backends.probe("flash-attn")[1] == "switched off by ZOO_BACKENDS"
    monkeypatch.setenv("ZOO_BACKENDS", "-apex")
    backends.probe.cache_clear()
    assert backends.kernel("flash-attn", "flash_attn", "flash_attn_func") is not None


def test_a_build_for_another_cuda_is_not_available_and_says_why(fresh, capsys):
    (fresh / "causal_conv1d").mkdir()
    (fresh / "causal_conv1d" / "__init__.py").write_text(
        "raise RuntimeError('causal_conv1d was compiled against CUDA 12.4; this torch has none')\n")
    module, why = backends.probe("causal-conv1d")
    assert module is None and why.startswith("RuntimeError: causal_conv1d was compiled against CUDA 12.4")
    from zoo.cli import main

    assert main(["version"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("backend causal-conv1d"))
    assert "RuntimeError: causal_conv1d was compiled against CUDA 12.4" in line
    assert line.endswith("zoo uses zoo_mamba.ssm's shifted multiply-adds (CPU), torch.nn.functional.conv1d (other devices)")


# Stand-ins for mamba_ssm and causal_conv1d written from their documented contracts (layouts,
# argument names, return values), each the plain recurrence or convolution, recording its calls.
_FAKES = {
    "mamba_ssm/__init__.py": "__version__ = '2.2-fake'\ncalls = []\n",
    "mamba_ssm/ops/__init__.py": "",
    "mamba_ssm/ops/triton/__init__.py": "",
    "mamba_ssm/ops/selective_scan_interface.py": """
import torch
import mamba_ssm

def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    # u, delta (batch, dim, L); A (dim, N); B, C (batch, N, L)
    mamba_ssm.calls.append("selective_scan_fn")
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1)
    return (y, h) if return_last_state else y
""",
    "mamba_ssm/ops/triton/ssd_combined.py": """
import torch
import mamba_ssm

def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    # x (batch, L, heads, head_dim), dt (batch, L, heads), A (heads,), B, C (batch, L, groups, N)
    mamba_ssm.calls.append("mamba_chunk_scan_combined")
    r = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(r, 2), C.repeat_interleave(r, 2)
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    return (y, h) if return_final_states else y
""",
    "causal_conv1d/__init__.py": """
import torch.nn.functional as F
calls = []

def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    # x (batch, dim, L), weight (dim, width)
    calls.append("causal_conv1d_fn")
    y = F.conv1d(F.pad(x, (weight.shape[1] - 1, 0)), weight[:, None], bias, groups=x.shape[1])
    return F.silu(y) if activation in ("silu", "swish") else y
""",
}


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_the_mixers_run_mamba_ssm_and_causal_conv1d_on_cuda_when_they_import(fresh, monkeypatch, kind):
    """Where the packages import and the tensors are on CUDA, the Mamba mixers hand their scan and
    convolution to them (in the kernels' own layouts) and compute what zoo's PyTorch path does,
    forward and backward; a decoding step with a cached state stays on zoo's recurrence. (No CUDA
    here: the device test is switched, and the kernels are stand-ins from their documented APIs.)"""
    import importlib

    from zoo_mamba import ssm

    from zoo.spec import SSMSpec

    for path, text in _FAKES.items():
        (fresh / path).parent.mkdir(parents=True, exist_ok=True)
        (fresh / path).write_text(text)
    torch.manual_seed(0)
    spec = SSMSpec(kind=kind, gated_norm=kind == "mamba2")
    mixer = (ssm.Mamba1Mixer(spec, hidden=16, inner=32, state=4, conv=4, dt_rank=2, chunk=8, layer=0) if kind == "mamba1"
             else ssm.Mamba2Mixer(spec, hidden=16, heads=4, head_dim=8, groups=2, state=4, conv=4, chunk=8, eps=1e-5,
                                  dt_limit=(0.0, float("inf")), layer=0)).double()
    u = torch.randn(2, 19, 16, dtype=torch.float64)

    def run(cuda: bool):
        monkeypatch.setattr(ssm, "_on_cuda", lambda x: cuda)
        mixer.zero_grad()
        y = mixer(u)
        y.backward(torch.ones_like(y))
        return y.detach(), {n: p.grad.clone() for n, p in mixer.named_parameters()}

    want, want_grads = run(False)
    mamba_ssm, conv = importlib.import_module("mamba_ssm"), importlib.import_module("causal_conv1d")
    assert mamba_ssm.calls == [] and conv.calls == []
    got, got_grads = run(True)
    scan = "selective_scan_fn" if kind == "mamba1" else "mamba_chunk_scan_combined"
    assert mamba_ssm.calls == [scan] and conv.calls == ["causal_conv1d_fn"]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-5, atol=1e-6), name
    cache = ssm.SSMCache(1)  # prefill, then one token: the cached step runs zoo's recurrence
    with torch.no_grad():
        mixer(u[:, :18], cache)
        mamba_ssm.calls.clear()
        mixer(u[:, 18:], cache)
    assert mamba_ssm.calls == []
