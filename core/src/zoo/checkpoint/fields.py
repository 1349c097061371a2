"""Every field of another library's config class, accounted for.

A format declares one `FieldTable` per config class it reads (transformers' ``LlamaConfig``,
diffusers' ``DiTTransformer2DModel``): each field of the class is **mapped** (zoo reads it into
its own config), **inert** (it does not change what the model computes: token ids, caching,
output switches, initialisation), or **fixed** (it changes the computation and zoo computes it
only at the listed values; any other value is refused with one line naming the field).

`unaccounted` compares a table with the installed library's class, so a release that adds a
field fails zoo's tests before it can silently change a converted model; `check` refuses, on
import, a value zoo cannot represent. Fields the installed class does not declare (keys from a
newer or older release) are ignored by that library's own model, and so by zoo too.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class FieldTable:
    """How zoo treats each field of one config class (``config_class``: the class's name)."""

    config_class: str
    mapped: tuple[str, ...] = ()
    inert: tuple[str, ...] = ()
    fixed: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for kind in ("mapped", "inert", "fixed"):
            for name in getattr(self, kind):
                if name in seen:
                    raise ValueError(f"{self.config_class}: field {name!r} is both {seen[name]} and {kind}")
                seen[name] = kind

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.mapped) | frozenset(self.inert) | frozenset(self.fixed)

    def unaccounted(self, cls: type) -> list[str]:
        """The installed class's fields this table does not name."""
        return sorted(set(class_fields(cls)) - self.names)

    def check(self, values: Mapping[str, Any], *, where: str = "") -> None:
        """Refuse the first fixed field whose value zoo cannot compute (``where``: the key of a
        nested config, named before the field)."""
        for name, allowed in self.fixed.items():
            if name in values and not any(_same(values[name], a) for a in allowed):
                shown = " or ".join(repr(a) for a in allowed)
                raise UsageError(f"{where}{self.config_class}.{name}={values[name]!r} changes the computation and "
                                 f"zoo has no equivalent (it computes {name}={shown} only)")


def _same(value: Any, allowed: Any) -> bool:
    if type(value) is bool or type(allowed) is bool:  # (True == 1 in Python; a config's 1 may mean True)
        return type(value) in (bool, int) and type(allowed) in (bool, int) and value in (0, 1) and value == allowed
    if isinstance(value, (list, tuple)) and isinstance(allowed, (list, tuple)):
        return len(value) == len(allowed) and all(_same(v, a) for v, a in zip(value, allowed))
    return bool(value == allowed)


def _base_fields() -> frozenset[str]:
    """transformers' `PretrainedConfig` fields, which every config shares (architectures, dtype,
    label maps, output switches): none changes the computation of a causal model's logits."""
    try:
        from transformers import PretrainedConfig
    except ImportError:  # (diffusers-only installs)
        return frozenset()
    return frozenset(class_fields(PretrainedConfig, own=False))


def class_fields(cls: type, *, own: bool = True) -> list[str]:
    """The fields a config class declares: a transformers config's dataclass fields (transformers 5)
    or ``__init__`` parameters (4.x, and diffusers' model classes), without the ones every
    transformers config inherits when ``own``."""
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
    else:
        params = inspect.signature(cls.__init__).parameters.values()
        names = [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if own and cls.__name__ != "PretrainedConfig":
        base = _base_fields()
        names = [n for n in names if n not in base]
    return names


def check_config(tables: Mapping[str, FieldTable], config: Any, *, where: str = "") -> None:
    """Check a transformers config object, and the sub-configs it maps (``text_config``,
    ``vision_config``), against the format's tables; a class without a table is refused."""
    from transformers import PretrainedConfig

    name = type(config).__name__
    table = tables.get(name)
    if table is None:
        have = ", ".join(sorted(tables)) or "none"
        raise UsageError(f"{where}zoo does not read {name} here (config classes it reads: {have})")
    table.check(config.to_dict(), where=where)
    for key in table.mapped:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            check_config(tables, sub, where=f"{where}{key}: ")
