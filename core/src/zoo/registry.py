"""Plugin discovery and the family registry.

Plugins are found through the ``zoo.plugins`` entry-point group and registered with pluggy, one at
a time, so that one broken plugin (an import error, a hook with the wrong signature, a family that
breaks the contract) is recorded with its error and never stops the others from loading. Which
plugins load can be restricted with ``ZOO_PLUGINS=a,b`` (entry-point or distribution names) or
``zoo --plugins a,b``; the option wins over the variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from zoo import hookspecs
from zoo.errors import PluginError, UnknownNameError, suggest
from zoo.family import CommandSpec, DatasetSpec, Family, check_family

if sys.version_info >= (3, 12):
    from importlib.metadata import EntryPoint, entry_points
else:  # the backport has the 3.12 selection API and reads the same metadata
    from importlib_metadata import EntryPoint, entry_points

GROUP = "zoo.plugins"
ENV_PLUGINS = "ZOO_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    """Where a plugin came from: its entry point and the distribution that declared it."""

    name: str  # entry-point name
    value: str  # "module" or "module:object"
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"plugin {self.name!r} ({self.distribution} {self.version})"


@dataclass(frozen=True)
class FamilyEntry:
    family: Family
    plugin: PluginInfo


@dataclass(frozen=True)
class BrokenPlugin:
    plugin: PluginInfo
    error: str


@dataclass
class Registry:
    families: dict[str, FamilyEntry] = field(default_factory=dict)  # canonical name -> entry
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> canonical name
    datasets: dict[str, tuple[DatasetSpec, PluginInfo]] = field(default_factory=dict)
    commands: dict[str, tuple[CommandSpec, PluginInfo]] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    conflicts: dict[str, list[PluginInfo]] = field(default_factory=dict)  # name -> every claimant
    skipped: list[PluginInfo] = field(default_factory=list)  # filtered out by ZOO_PLUGINS
    plugins: list[PluginInfo] = field(default_factory=list)  # loaded and valid

    def get(self, name: str) -> FamilyEntry:
        """The family called ``name`` (or an alias); a clear error otherwise."""
        if name in self.conflicts:
            raise PluginError(_conflict_message(name, self.conflicts[name]))
        canonical = self.aliases.get(name, name)
        if canonical in self.families:
            return self.families[canonical]
        for bad in self.broken:
            if name in (bad.plugin.name, bad.plugin.distribution, _strip(bad.plugin.distribution)):
                raise PluginError(f"{bad.plugin} is broken: {bad.error}")
        for info in self.skipped:
            if name in (info.name, info.distribution, _strip(info.distribution)):
                raise UnknownNameError(f"model {name!r} comes from {info}, which {ENV_PLUGINS} / --plugins excludes")
        names = [*self.families, *self.aliases]
        hint = suggest(name, names) or (f"; installed: {', '.join(sorted(self.families))}" if names else "")
        msg = f"unknown model {name!r}{hint}"
        if not names:
            msg += "; no model plugin is installed (pip install zoo-gpt, or a third-party zoo plugin)"
        if self.broken:
            msg += f"; {len(self.broken)} plugin(s) failed to load, see `zoo list`"
        raise UnknownNameError(msg)

    def dataset(self, name: str) -> tuple[DatasetSpec, PluginInfo]:
        if name not in self.datasets:
            raise UnknownNameError(f"unknown dataset {name!r}" + suggest(name, self.datasets))
        return self.datasets[name]


def _strip(dist: str) -> str:
    return dist.removeprefix("zoo-").removeprefix("zoo_")


def _conflict_message(name: str, claimants: Sequence[PluginInfo]) -> str:
    who = " and ".join(f"{c.distribution} {c.version} (entry point {c.name!r})" for c in claimants)
    return f"model name {name!r} is claimed by {who}; uninstall one or choose with {ENV_PLUGINS}"


class _PluginManager(pluggy.PluginManager):
    """Take every ``zoo_*`` function as a hook implementation, marked or not (as pytest does)."""

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("zoo_") and callable(getattr(plugin, name, None)):
            return {}
        return opts


def _info(ep: EntryPoint) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    return PluginInfo(
        name=ep.name,
        value=ep.value,
        distribution=dist.metadata["Name"] if dist is not None else "<unknown distribution>",
        version=dist.version if dist is not None else "?",
    )


def _allowed(spec: str | None) -> set[str] | None:
    if spec is None:
        return None
    return {s.strip() for s in spec.split(",") if s.strip()}


def load_registry(
    eps: Iterable[EntryPoint] | None = None, *, only: str | None = None
) -> Registry:
    """Discover plugins and build a registry. ``only`` is a comma list (``ZOO_PLUGINS`` if None)."""
    if eps is None:
        eps = entry_points(group=GROUP)
    allowed = _allowed(only if only is not None else os.environ.get(ENV_PLUGINS))
    reg = Registry()
    _add_builtin_datasets(reg)  # first, so a plugin cannot shadow a core dataset
    claims: dict[str, list[tuple[Family, PluginInfo]]] = {}
    seen: set[tuple[str, str]] = set()
    for ep in sorted(eps, key=lambda e: e.name):
        info = _info(ep)
        if (info.name, info.value) in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add((info.name, info.value))
        if allowed is not None and not allowed & {info.name, info.distribution, _strip(info.distribution)}:
            reg.skipped.append(info)
            continue
        try:
            families, datasets, commands = _load_one(ep, info)
        except PluginError as e:
            reg.broken.append(BrokenPlugin(info, str(e)))
            continue
        reg.plugins.append(info)
        for fam in families:
            for name in (fam.name, *fam.aliases):
                claims.setdefault(name, []).append((fam, info))
        for ds in datasets:
            reg.datasets.setdefault(ds.name, (ds, info))
        for cmd in commands:
            reg.commands.setdefault(cmd.name, (cmd, info))
    for name, claimants in claims.items():
        if len(claimants) > 1:
            reg.conflicts[name] = [i for _, i in claimants]
    for name, [(fam, info)] in ((n, c) for n, c in claims.items() if n not in reg.conflicts):
        if name == fam.name:
            reg.families[name] = FamilyEntry(fam, info)
        else:
            reg.aliases[name] = fam.name
    # An alias whose family lost its canonical name to a conflict points nowhere; drop it.
    reg.aliases = {a: c for a, c in reg.aliases.items() if c in reg.families}
    return reg


BUILTIN_DATASETS = (
    DatasetSpec(
        name="python-docs",
        description="documentation that ships with Python (pydoc topics, standard-library docstrings); "
        "byte-level BPE trained locally to model.vocab_size",
        build="zoo.data.corpus:build",
        tokenizer="zoo.data.corpus:tokenizer_dir",
        indexed=True,
    ),
    DatasetSpec(
        name="megatron",
        description="Megatron indexed data named by data.path (zoo prepare or Megatron-LM preprocess_data.py output)",
        build="zoo.data.megatron:build",
        indexed=True,
    ),
    DatasetSpec(
        name="sft",
        description="conversations (chat messages, or prompt/completion pairs) from .jsonl files named by data.path, "
        "rendered by the tokenizer's chat template, packed; the loss on the answers only",
        build="zoo.data.sft:build",
        tokenizer="zoo.data.sft:tokenizer_dir",
        packed=True,
        indexed=True,
    ),
    DatasetSpec(
        name="energon",
        description="an Energon WebDataset named by data.path (zoo prepare webdataset / images, or energon prepare), "
        "or a metadataset .yaml; batches from the family's task encoder",
        build="zoo.data.energon.training:build",
        modality="multimodal",
        stateful=True,
    ),
)


def _add_builtin_datasets(reg: Registry) -> None:
    from zoo._version import __version__

    core = PluginInfo(name="zoo", value="zoo", distribution="zoo-core", version=__version__)
    for ds in BUILTIN_DATASETS:
        reg.datasets.setdefault(ds.name, (ds, core))


def _load_one(ep: EntryPoint, info: PluginInfo) -> tuple[list[Family], list[DatasetSpec], list[CommandSpec]]:
    try:
        plugin = ep.load()
    except Exception as e:  # whatever a plugin raises on import, it must not take zoo down
        raise PluginError(f"import of {info.value!r} failed: {type(e).__name__}: {e}") from e
    pm = _PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(plugin, name=info.name)
        pm.check_pending()  # a zoo_* function that matches no hook (a typo) is an error too
    except pluggy.PluginValidationError as e:
        raise PluginError(f"{info}: invalid hook implementation: {' '.join(str(e).split())}") from None
    owner = str(info)

    def call(hook: str) -> list[Any]:
        try:
            results = getattr(pm.hook, hook)()
        except Exception as e:
            raise PluginError(f"{owner}: {hook}() raised {type(e).__name__}: {e}") from e
        return [x for batch in results for x in (batch or ())]

    families = call("zoo_families")
    for fam in families:
        check_family(fam, owner=owner)
    datasets = call("zoo_datasets")
    for ds in datasets:
        if not isinstance(ds, DatasetSpec):
            raise PluginError(f"{owner}: zoo_datasets must return zoo.DatasetSpec objects, got {type(ds).__name__}")
    commands = call("zoo_commands")
    for cmd in commands:
        if not isinstance(cmd, CommandSpec):
            raise PluginError(f"{owner}: zoo_commands must return zoo.CommandSpec objects, got {type(cmd).__name__}")
    return families, datasets, commands


_REGISTRY: Registry | None = None
_REGISTRY_ONLY: str | None = None


def get_registry(*, only: str | None = None) -> Registry:
    """The process-wide registry, loaded on first use (never at `import zoo`)."""
    global _REGISTRY, _REGISTRY_ONLY
    if _REGISTRY is None or only != _REGISTRY_ONLY:
        _REGISTRY = load_registry(only=only)
        _REGISTRY_ONLY = only
    return _REGISTRY


def reset_registry() -> None:
    global _REGISTRY
    _REGISTRY = None
