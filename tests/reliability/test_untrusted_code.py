"""Untrusted data never executes: every call in zoo's sources that could run code from a file
(``torch.load`` without ``weights_only=True``, pickle, ``numpy.load(allow_pickle=True)``,
``yaml.load`` without a safe loader, ``eval``/``exec``, importing a file by path, ``extractall``) is
either absent or one of the reviewed sites below, each behind the user's explicit opt-in or reading
zoo's own bytes. A new one fails here until it is reviewed; a reviewed one that disappears fails
too, so the list stays true. The scanner itself is tested on planted calls."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src")), ROOT / "benchmarks",
           ROOT / "examples"]

# (file relative to the repository, what) -> why it is safe
REVIEWED = {
    ("core/src/zoo/data/energon/samples.py", "pickle.loads"):
        "a .pickle/.pyd part, only with data.allow_pickle=true (refused otherwise, naming the fix)",
    ("core/src/zoo/data/energon/loader.py", "pickle.loads"): "messages from zoo's own loader workers",
    ("core/src/zoo/testing/__init__.py", "pickle.loads"): "results from the test's own child processes",
    ("core/src/zoo/data/energon/dataset.py", "exec_module"):
        "dataset.yaml's sample_loader.py, only with data.allow_code=true",
    ("core/src/zoo/data/energon/dataset.py", "spec_from_file_location"): "the same sample_loader.py",
}


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def risky_calls(source: str) -> list[str]:
    """The code-running calls in ``source``, by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if owner == "torch" and name == "load" and not _is_true(_kw(node, "weights_only")):
            found.append("torch.load without weights_only=True")
        elif owner in ("pickle", "cPickle", "dill") and name in ("load", "loads", "Unpickler"):
            found.append(f"pickle.{name}")
        elif owner in ("np", "numpy") and name == "load" and _is_true(_kw(node, "allow_pickle")):
            found.append("numpy.load(allow_pickle=True)")
        elif owner == "yaml" and name in ("load", "load_all", "unsafe_load", "full_load"):
            loader = _kw(node, "Loader")
            safe = isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")
            if not safe:
                found.append(f"yaml.{name} without SafeLoader")
        elif (isinstance(f, ast.Name) and name in ("eval", "exec")) or \
                name in ("exec_module", "spec_from_file_location", "extractall", "run_path"):
            found.append(name)
    return found


def _scan() -> Counter:
    sites: Counter = Counter()
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for what in risky_calls(path.read_text()):
                sites[(rel, what)] += 1
    return sites


def test_every_call_that_could_run_a_files_code_is_a_reviewed_one():
    sites = _scan()
    unreviewed = sorted(k for k in sites if k not in REVIEWED)
    assert not unreviewed, f"unreviewed code-running calls (use weights_only=True, safetensors, safe_load...): {unreviewed}"
    stale = sorted(k for k in REVIEWED if k not in sites)
    assert not stale, f"reviewed sites no longer in the sources (drop them from REVIEWED): {stale}"


@pytest.mark.parametrize("code,what", [
    ("import torch\ntorch.load(f)", "torch.load without weights_only=True"),
    ("import torch\ntorch.load(f, weights_only=False)", "torch.load without weights_only=True"),
    ("import pickle\npickle.loads(b)", "pickle.loads"),
    ("import numpy as np\nnp.load(f, allow_pickle=True)", "numpy.load(allow_pickle=True)"),
    ("import yaml\nyaml.load(s, Loader=yaml.Loader)", "yaml.load without SafeLoader"),
    ("eval(text)", "eval"),
    ("import tarfile\ntarfile.open(p).extractall('.')", "extractall"),
])
def test_the_scanner_finds_planted_calls(code, what):
    assert risky_calls(code) == [what]


def test_the_scanner_passes_the_safe_forms():
    safe = ("import torch, numpy as np, yaml\ntorch.load(f, weights_only=True)\nnp.load(f)\n"
            "yaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\nmodel.eval()\n")
    assert risky_calls(safe) == []
