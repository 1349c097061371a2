"""The core's source tree is laid out by concern: no import cycles between its modules, no module
over 500 lines, and the packages export the names users import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "core" / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "zoo").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: dict[str, Path], name: str) -> set[str]:
    """Every zoo module ``name`` imports, at module level or inside functions (a lazy import is
    still a dependency), plus a package's lazily exported submodules (``_EXPORTS``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            found.update(v.value for v in ast.walk(node.value) if isinstance(v, ast.Constant) and isinstance(v.value, str)
                         and v.value in modules)
    deps = set()
    for target in found:
        if target not in modules:
            continue
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: those count too, except the
        # packages ``name`` itself lives in (already being imported when ``name`` runs).
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            dep = ".".join(parts[:i])
            if dep in modules and not (name == dep or name.startswith(dep + ".")):
                deps.add(dep)
    return deps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(path, modules, name) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    modules = _modules()
    graph = {name: _imports(path, modules, name) for name, path in modules.items()}
    graph["zoo.parallel.sharding"].add("zoo.checkpoint.state")  # checkpoints read shard geometry: a loop
    assert _cycles(graph)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_over_500_lines(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= 500, f"{name} has {lines} lines"


def test_packages_export_their_public_names():
    from zoo.checkpoint import Checkpoint, ExternalFormat, MappingTable, latest  # noqa: F401
    from zoo.config import ParallelConfig, RunConfig, resolve  # noqa: F401
    from zoo.data import IndexedDataset, IndexedDatasetWriter, load_tokenizer  # noqa: F401
    from zoo.parallel import Layout, Parallel, Placements, TPShard, plan  # noqa: F401
    from zoo.training import EMA, Trainer, lr_at  # noqa: F401
