"""Packaging promises: the core never imports a plugin, `import zoo` is light, every in-repo
plugin is wired into the one install command, and CI runs the README's test command."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys

import tomllib
from _core_helpers import REPO

import zoo

CORE = REPO / "core" / "src" / "zoo"


def _plugin_top_packages() -> set[str]:
    from zoo.registry import GROUP, entry_points

    return {ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=GROUP)}


def test_import_zoo_loads_no_plugin_and_no_torch():
    code = (
        "import sys, zoo\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1].split(',')))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, ",".join(_plugin_top_packages())],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]


def test_every_core_module_imports_with_plugins_blocked():
    blocked = sorted(_plugin_top_packages())
    assert "acme_mixer" in blocked  # the example plugin is installed, so the block is real
    code = f"""
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED or name.startswith('zoo_'):
            raise ImportError('core imported plugin module ' + name)
sys.meta_path.insert(0, Block())
import zoo
names = [m.name for m in pkgutil.walk_packages(zoo.__path__, 'zoo.') if m.name != 'zoo.__main__']
for n in names:
    importlib.import_module(n)
print(len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    expected = [m.name for m in pkgutil.walk_packages(zoo.__path__, "zoo.") if m.name != "zoo.__main__"]
    assert int(out.stdout.strip()) == len(expected) > 10


def test_no_core_source_names_a_plugin_package():
    plugin_pkgs = _plugin_top_packages()
    for path in CORE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in plugin_pkgs and not top.startswith("zoo_"), f"{path}: imports {name}"


def test_every_in_repo_plugin_is_packaged_and_installed_by_the_one_command():
    reqs = (REPO / "requirements-dev.txt").read_text()
    # The default install brings the plot, TensorBoard, media and Energon extras (zoo-core alone runs without them).
    [extras] = re.findall(r"^-e \./core\[([a-z,]+)\]$", reqs, re.M)
    assert set(extras.split(",")) == {"plot", "tensorboard", "media", "energon"}
    assert re.search(r"^-e \./examples/third_party_plugin$", reqs, re.M)
    for pyproject in sorted((REPO / "plugins").glob("*/pyproject.toml")):
        family = pyproject.parent.name
        meta = tomllib.loads(pyproject.read_text())
        assert meta["project"]["name"] == f"zoo-{family}", pyproject
        groups = meta["project"]["entry-points"]
        eps = groups.get("zoo.plugins") or groups["zoo.kernels"]  # a family, or a kernel provider
        assert all(v.split(":")[0].split(".")[0] == f"zoo_{family.replace('-', '_')}" for v in eps.values()), pyproject
        assert re.search(rf"^-e \./plugins/{family}$", reqs, re.M), f"{family} missing from requirements-dev.txt"
    example = tomllib.loads((REPO / "examples/third_party_plugin/pyproject.toml").read_text())
    assert "mixer" in example["project"]["entry-points"]["zoo.plugins"]


def test_version_matches_the_distribution():
    from importlib.metadata import version

    assert zoo.__version__ == version("zoo-core")


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, re.S)]
    [test_block] = [b for b in blocks if "pytest" in b and "pip install" in b]
    steps = [s.strip() for s in test_block.split("&&")]
    install = next(s for s in steps if "pip install" in s)
    run = steps[-1]
    assert install.split("pip install", 1)[1].strip() in ci  # same install arguments
    assert run.startswith("python -m pytest")
    assert run in ci  # the same test command (CI may add options after it)
    [main_block] = [b for b in blocks if "zoo train" in b and "pip install" in b]
    assert main_block.split("&&")[:3] == test_block.split("&&")[:3]  # both start from the same install
