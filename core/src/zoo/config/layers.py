"""Layering and type checking of run configurations.

Layers, lowest first: the section defaults (`zoo.config.sections`) < the family's flavor (the
``model`` section) and recipe < YAML files (``--config a.yaml``, in order) < command-line overrides
``section.key=value``. Every value is checked against the field's type when it is set, so an error
names the layer it came from (file, recipe or command line), the key and the expected type; an
unknown key suggests the closest valid ones.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import yaml

from zoo.config import foreign
from zoo.config.sections import SECTIONS, RunConfig
from zoo.errors import ConfigError, suggest

# ---------------------------------------------------------------------------------------------
# Typed values


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return repr(tp).replace("typing.", "")
    return getattr(tp, "__name__", repr(tp))


class _Mismatch(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` or raise `_Mismatch`. Lenient only where it is lossless."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        # Exact type first, so `str | list` keeps a list and `int | float` keeps an int.
        for arg in sorted(args, key=lambda a: 0 if _exact(value, a) else 1):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):  # "1e6" is a string to YAML 1.1
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise _Mismatch from None
            if f.is_integer():
                return int(f)
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise _Mismatch
            items = [_coerce(v, a) for v, a in zip(value, args)]
        else:
            items = [_coerce(v, args[0]) if args else v for v in value]
        return tuple(items) if (origin or tp) is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch
        args = typing.get_args(tp)
        return {_coerce(k, args[0]): _coerce(v, args[1]) for k, v in value.items()} if args else dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        raise _Mismatch  # nested dataclasses are set key by key, never as a blob
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    return value


def _exact(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    if tp is type(None):
        return value is None
    if isinstance(origin, type):
        if origin is int and isinstance(value, bool):
            return False
        return isinstance(value, origin)
    return False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------------------------------------
# Layering


class Layers:
    """A nested dict of values, set key by key with type checks, then built into a `RunConfig`."""

    def __init__(self, model_cls: type, model_defaults: Any) -> None:
        self.schema: dict[str, type] = {"model": model_cls, **SECTIONS}
        self.values: dict[str, dict[str, Any]] = {"model": _plain_shallow(model_defaults)}
        self.origin: dict[str, str] = {}  # dotted key -> the layer that set it last
        for name, cls in SECTIONS.items():
            self.values[name] = _plain_shallow(cls())

    def keys(self) -> list[str]:
        out: list[str] = []
        for section, cls in self.schema.items():
            out += dotted_keys(cls, section)
        return out

    def set(self, dotted: str, value: Any, *, source: str) -> None:
        parts = dotted.split(".")
        section = parts[0]
        if section not in self.schema or len(parts) < 2:
            if section not in self.schema and isinstance(value, Mapping) and value:
                # another framework's section in a YAML file (DFM's `dataset:`): name its first key
                first, inner = next(iter(value.items()))
                self.set(f"{dotted}.{first}", inner, source=source)
            raise ConfigError(
                f"{source}: unknown key {dotted!r}"
                + (foreign.hint(dotted, value, self.keys()) or suggest(dotted, self.keys()) or suggest(section, self.schema))
                + ("" if len(parts) > 1 or section not in self.schema else " (give section.key)")
            )
        cls: Any = self.schema[section]
        node = self.values[section]
        for i, name in enumerate(parts[1:], start=1):
            hints = _hints(cls)
            if name not in hints or name not in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(f"{source}: unknown key {dotted!r}"
                                  + (foreign.hint(dotted, value, self.keys()) or suggest(dotted, self.keys())))
            tp = hints[name]
            if i < len(parts) - 1:
                if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
                    raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} is a {_type_name(tp)}, it has no sub-keys")
                cls, node = tp, node[name]
                continue
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{source}: {dotted} is a group of keys ({_type_name(tp)}); set {dotted}.<key>")
                for k, v in value.items():
                    self.set(f"{dotted}.{k}", v, source=source)
                return
            try:
                node[name] = _coerce(value, tp)
            except _Mismatch:
                # YAML reads {a:1} as the key 'a:1' without a value: say what to write instead
                glued = isinstance(value, Mapping) and any(v is None and ":" in str(k) for k, v in value.items())
                hint = " (YAML needs a space after ':' in a mapping: {key: value})" if glued else ""
                raise ConfigError(
                    f"{source}: {dotted}={_show(value)}: expected {_type_name(tp)}, got {type(value).__name__}{hint}"
                ) from None
            self.origin[dotted] = source

    def update(self, tree: Mapping[str, Any], *, source: str, prefix: str = "") -> None:
        """Set every leaf of a nested mapping (a YAML document)."""
        for key, value in tree.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, Mapping) and self._is_group(dotted):
                self.update(value, source=source, prefix=dotted + ".")
            else:
                self.set(dotted, value, source=source)

    def _is_group(self, dotted: str) -> bool:
        parts = dotted.split(".")
        if parts[0] not in self.schema:
            return False
        cls: Any = self.schema[parts[0]]
        for name in parts[1:]:
            tp = _hints(cls).get(name)
            if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
                return False
            cls = tp
        return True

    def build(self, *, family: str, flavor: str) -> RunConfig:
        built = {}
        for name, cls in self.schema.items():
            try:
                built[name] = _build(cls, self.values[name], name)
            except ConfigError as e:
                # A section's own check names the key ("steps=-1 must be at least 1"); say which
                # layer (file or command line) set it.
                keys = [k for k in self.origin if k.startswith(name + ".")
                        and re.search(rf"(?<![\w.]){re.escape(k.rsplit('.', 1)[1])}=", str(e))]
                if keys:
                    raise ConfigError(f"{e} (set by {self.origin[keys[0]]})") from None
                raise
        return RunConfig(family=family, flavor=flavor, **built)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain_shallow(obj: Any) -> dict[str, Any]:
    """A dataclass as nested dicts of its fields (dataclass fields recurse, other values stay)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = _plain_shallow(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
    return out


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in values:
            continue
        tp, v = hints[f.name], values[f.name]
        kwargs[f.name] = _build(tp, v, f"{where}.{f.name}") if isinstance(tp, type) and dataclasses.is_dataclass(tp) else v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a config's own __post_init__ check
        raise ConfigError(f"{where}: {e}") from None


def dotted_keys(cls: type, prefix: str) -> list[str]:
    """Every settable key of config dataclass ``cls`` under ``prefix`` (nested groups flattened)."""
    out = []
    for name, tp in _hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += dotted_keys(tp, f"{prefix}.{name}")
        else:
            out.append(f"{prefix}.{name}")
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.steps=10"`` -> ``("train.steps", 10)``; the value is read as YAML (so lists work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(c.isspace() for c in key):
        raise ConfigError(f"command line: {text!r} is not an override; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # a value YAML cannot read is taken as the literal string
    if re.fullmatch(r"\s*\d+(:\d+)+\s*", raw):  # YAML 1.1 reads 5:7 as 307 (base 60); here it is a step range
        value = raw.strip()
    return key.strip(), value


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of sections, got {type(data).__name__}")
    return data


def resolve(
    *,
    family: str,
    flavor: str,
    model_cls: type,
    model_defaults: Any,
    recipe: Iterable[tuple[str, Mapping[str, Any]]] = (),
    files: Iterable[tuple[str, Mapping[str, Any]]] = (),
    overrides: Iterable[str] = (),
) -> RunConfig:
    """Compose the layers. ``recipe`` and ``files`` are ``(source name, mapping)`` pairs, lowest first."""
    layers = Layers(model_cls, model_defaults)
    for source, tree in recipe:
        for key, value in tree.items():
            layers.set(key, value, source=source)
    for source, tree in files:
        tree = {k: v for k, v in tree.items() if k not in ("family", "flavor")}
        layers.update(tree, source=source)
    for text in overrides:
        key, value = parse_override(text)
        layers.set(key, value, source=f"command line ({text})")
    return layers.build(family=family, flavor=flavor)


def config_from_dict(cls: type, data: Mapping[str, Any], *, source: str) -> Any:
    """Build dataclass ``cls`` from a plain mapping (a checkpoint's JSON), type-checking every value."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} for {cls.__name__}" + suggest(unknown[0], names))
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = config_from_dict(tp, value, source=f"{source}: {name}")
            continue
        try:
            kwargs[name] = _coerce(value, tp)
        except _Mismatch:
            raise ConfigError(f"{source}: {name}={_show(value)}: expected {_type_name(tp)}") from None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None
