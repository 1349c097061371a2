"""Optional backends (`zoo.backends`): found when importable, refused with the reason when their
import fails either way (not installed: ImportError; built for another CUDA/torch: RuntimeError),
switched off by ZOO_BACKENDS, and never needed: the pure-PyTorch paths are what every other test
runs (none of these packages installs on the CI machine)."""

from __future__ import annotations

import sys

import pytest

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

    from zoo.nn import ssm

    for name, _, status, fallback in backends.report():
        if importlib.util.find_spec(backends.BACKENDS[name].module.split(".")[0]) is None:  # (a GPU box may have some)
            assert status.startswith("ModuleNotFoundError: No module named"), (name, status)
        assert fallback
    if importlib.util.find_spec("mamba_ssm") is None:
        assert backends.kernel("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined") is None
        assert ssm._kernels() is None  # Mamba-2 takes zoo.nn.ssm's chunked scan (tested against the recurrence)


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
    assert line.endswith("zoo uses torch.nn.functional.conv1d with left padding")
