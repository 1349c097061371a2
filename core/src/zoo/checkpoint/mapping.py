"""Declarative checkpoint mappings between zoo's state dict and an external format.

A family declares, per external format, a `MappingTable`: a tuple of rules over key templates with
``{i}`` (layer) and ``{e}`` (expert) placeholders, expanded from the config. Rules are data; the
transforms are a closed set (rename, transpose, fuse/split with optional per-group interleaving,
stack experts, patch, replicate, tie, ignore; `zoo.checkpoint.rules`), so a table reads like the layout documentation it replaces.

Coverage is strict in both directions: every target tensor is written exactly once and every
source tensor is consumed or explicitly ignored; anything else raises `MappingError` listing the
offending keys. The same table converts both ways, so HF -> zoo -> HF is the identity.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

# The rules live in zoo.checkpoint.rules; tables import them from here too.
from zoo.checkpoint.rules import (  # noqa: F401
    Fuse,
    Ignore,
    MappingError,
    MappingTable,
    Patch,
    Rename,
    Replicate,
    Rule,
    Split,
    StackExperts,
    Tie,
    Transpose,
)

Tensor: TypeAlias = Any  # torch.Tensor; kept loose so this module imports without torch


def _placeholders(template: str) -> list[str]:
    return re.findall(r"\{(\w)\}", template)


def _expand(template: str, sizes: Mapping[str, int]) -> Iterator[tuple[dict[str, int], str]]:
    names = sorted(set(_placeholders(template)) - {"e"})  # {e} is expanded by StackExperts itself
    for values in itertools.product(*(range(sizes[n]) for n in names)):
        env = dict(zip(names, values))
        yield env, template.format_map(_Keep(env))


class _Keep(dict):  # leaves unknown placeholders ({e}) in place
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _sizes(table: MappingTable, config: Any) -> dict[str, int]:
    out = {}
    for ph, attr in table.counts.items():
        value = getattr(config, attr, None)
        if isinstance(value, int):
            out[ph] = value
    return out


def _need(sizes: Mapping[str, int], rule: Rule) -> None:
    for tmpl in _templates(rule):
        for ph in _placeholders(tmpl):
            if ph not in sizes:
                raise MappingError(f"mapping rule {rule} uses {{{ph}}} but the config has no count for it")


def _templates(rule: Rule) -> list[str]:
    out: list[str] = []
    for name in ("ours", "theirs", "to"):
        v = getattr(rule, name, None)
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, tuple):
            out += list(v)
    return out


class _Source:
    """A dict that records which keys were read; reading a key twice is a mapping bug."""

    def __init__(self, data: Mapping[str, Tensor], side: str) -> None:
        self.data, self.side, self.used = data, side, set()
        self.missing: list[str] = []
        self.pending = []

    def take(self, key: str) -> Tensor | None:
        if key not in self.data:
            self.missing.append(key)
            return None
        self.used.add(key)
        self.pending.append(key)
        return self.data[key]

    pending: list[str]  # keys taken since the sink last received a tensor (see _KeepSink)


class _Sink(dict):
    def __init__(self, side: str) -> None:
        super().__init__()
        self.side, self.twice = side, []

    def put(self, key: str, value: Tensor) -> None:
        if key in self:
            self.twice.append(key)
        self[key] = value


def _t(x: Tensor) -> Tensor:
    return x.t().contiguous()


def _interleave(parts: list[Tensor], groups: int, dim: int) -> Tensor:
    import torch

    chunks = [p.chunk(groups, dim=dim) if groups > 1 else (p,) for p in parts]
    return torch.cat([c for g in range(groups) for c in (ch[g] for ch in chunks)], dim=dim)


def _deinterleave(fused: Tensor, sizes: list[int], groups: int, dim: int) -> list[Tensor]:
    per_group = [s // groups for s in sizes]
    pieces = fused.split(per_group * groups, dim=dim)
    n = len(sizes)
    import torch

    return [torch.cat([pieces[g * n + k] for g in range(groups)], dim=dim).contiguous() for k in range(n)]


class _StreamSink(_Sink):
    """Hands each tensor on as soon as it is made (streaming export) and keeps only its name."""

    def __init__(self, side: str, put: Callable[[str, Tensor], None]) -> None:
        super().__init__(side)
        self._put = put

    def put(self, key: str, value: Tensor) -> None:
        if key in self:
            self.twice.append(key)
        self[key] = None  # type: ignore[assignment]
        self._put(key, value)


def to_external(table: MappingTable, ours: Mapping[str, Tensor], config: Any, *,
                put: Callable[[str, Tensor], None] | None = None) -> dict[str, Tensor]:
    """Our state dict -> the external format, strictly. With ``put``, every external tensor is
    handed to it as soon as it exists and nothing is kept (``ours`` may then be a lazy mapping
    that reads one tensor at a time): memory stays at about one tensor."""
    import torch

    sizes = _sizes(table, config)
    src, out = _Source(ours, "zoo"), (_Sink("external") if put is None else _StreamSink("external", put))
    for rule in table.rules:
        _need(sizes, rule)
        if isinstance(rule, Ignore):
            continue
        if isinstance(rule, Tie):
            for _, (o, th) in _zip_expand(sizes, rule.ours, rule.theirs or ""):
                x = src.take(o)
                if rule.theirs and x is not None:
                    out.put(th, x)
            continue
        if isinstance(rule, Replicate):
            x = src.take(rule.ours)
            for _, th in _expand(rule.theirs, sizes):
                if x is not None:
                    out.put(th, x)
            continue
        for env, o in _expand(rule.ours if isinstance(rule.ours, str) else rule.ours[0], sizes):
            if isinstance(rule, Patch):
                x = src.take(o)
                if x is not None:
                    kernel = [int(getattr(config, a)) for a in rule.patch]
                    c = int(getattr(config, rule.channels))
                    n = len(kernel)
                    conv = x.reshape(x.shape[0], *kernel, c).permute(0, n + 1, *range(1, n + 1))
                    out.put(rule.theirs.format_map(_Keep(env)), conv.contiguous())
                continue
            if isinstance(rule, (Rename, Transpose)):
                x = src.take(o)
                if x is not None:
                    out.put(rule.theirs.format_map(_Keep(env)), _t(x) if isinstance(rule, Transpose) else x)
            elif isinstance(rule, Fuse):
                x = src.take(o)
                if x is None:
                    continue
                groups = int(getattr(config, rule.groups)) if rule.groups else 1
                names = [t.format_map(_Keep(env)) for t in rule.theirs]
                n_parts = rule.split or len(names)
                pieces = _deinterleave(x, _fuse_widths(rule, config, x, n_parts), groups, rule.dim)
                if rule.split:
                    pieces = [torch.cat(pieces, dim=rule.dim)]
                for name, piece in zip(names, pieces):
                    out.put(name, _t(piece) if rule.transpose else piece)
            elif isinstance(rule, Split):
                parts = [src.take(p.format_map(_Keep(env))) for p in rule.ours]
                if any(p is None for p in parts):
                    continue
                fused = torch.cat(parts, dim=rule.dim)
                out.put(rule.theirs.format_map(_Keep(env)), _t(fused) if rule.transpose else fused)
            elif isinstance(rule, StackExperts):
                x = src.take(o)
                if x is None:
                    continue
                names = (rule.theirs,) if isinstance(rule.theirs, str) else rule.theirs
                for e in range(x.shape[0]):
                    for name, part in zip(names, x[e].chunk(len(names), dim=0)):
                        name = name.format_map(_Keep({**env, "e": e}))
                        out.put(name, _t(part) if rule.transpose else part.contiguous())
    _check(src, out, ignores=())
    return dict(out)


class _KeepSink(_Sink):
    """Keeps only the tensors named in ``keep`` (a pipeline stage's); the rest are checked, then
    dropped. Records which source keys each output was made from (``sources``)."""

    def __init__(self, side: str, keep: set[str], src: _Source) -> None:
        super().__init__(side)
        self.keep, self.src = keep, src
        self.sources: dict[str, set[str]] = {}

    def put(self, key: str, value: Tensor | None) -> None:
        if key in self:
            self.twice.append(key)
        self[key] = value if key in self.keep else None
        self.sources[key] = set(self.src.pending)
        self.src.pending.clear()


def from_external(table: MappingTable, theirs: Mapping[str, Tensor], config: Any, *,
                  keep: set[str] | None = None) -> dict[str, Tensor]:
    """The external format -> our state dict, strictly (unknown source keys are an error).

    ``theirs`` may be a lazy mapping (tensors read when a rule takes them); with ``keep`` only
    those of our names are returned, so a rank holding a few layers never holds the whole model,
    and when ``theirs`` can tell shapes without reading (``shape_of``, e.g. `zoo.checkpoint.tensorio.LazyTensors`)
    only the tensors the kept ones are made of are read at all."""
    import torch

    if keep is not None and hasattr(theirs, "shape_of"):
        # A dry run on shape-only tensors names the sources of the kept outputs; the real run then
        # reads only those (the others stay shape-only: mapped and checked, never read).
        dry = {k: torch.empty(theirs.shape_of(k), device="meta") for k in theirs}
        _, sources = _map_in(table, dry, config, keep)
        needed = set().union(*(v for name, v in sources.items() if name in keep))
        theirs = _OnlyReading(theirs, needed, dry)
    return _map_in(table, theirs, config, keep)[0]


def _map_in(table: MappingTable, theirs: Mapping[str, Tensor], config: Any, keep: set[str] | None
            ) -> tuple[dict[str, Tensor], dict[str, set[str]]]:
    """`from_external`'s work; also returns, under ``keep``, the source keys of every output."""
    import torch

    theirs = _strip_prefix(table, theirs)
    sizes = _sizes(table, config)
    src = _Source(theirs, "external")
    out = _Sink("zoo") if keep is None else _KeepSink("zoo", keep, src)
    ties: list[tuple[str, str, str | None]] = []
    for rule in table.rules:
        _need(sizes, rule)
        if isinstance(rule, Ignore):
            continue
        if isinstance(rule, Tie):
            ties += [t for _, t in _zip_expand(sizes, rule.ours, rule.to, rule.theirs or "")]
            continue
        if isinstance(rule, Replicate):
            copies = [(th, src.take(th)) for _, th in _expand(rule.theirs, sizes)]
            if not copies or any(x is None for _, x in copies):
                continue
            first_name, first = copies[0]
            for name, x in copies[1:]:
                if x.shape != first.shape or (x.device.type != "meta" and not torch.equal(x, first)):
                    raise MappingError(f"{name} differs from {first_name}: they are copies of one tensor ({rule.ours}) "
                                       "in this model; a checkpoint where they differ is another model")
            out.put(rule.ours, first)
            continue
        for env, o in _expand(rule.ours if isinstance(rule.ours, str) else rule.ours[0], sizes):
            if isinstance(rule, Patch):
                x = src.take(rule.theirs.format_map(_Keep(env)))
                if x is not None:
                    n = x.dim() - 2
                    out.put(o, x.permute(0, *range(2, n + 2), 1).reshape(x.shape[0], -1).contiguous())
                continue
            if isinstance(rule, (Rename, Transpose)):
                x = src.take(rule.theirs.format_map(_Keep(env)))
                if x is not None:
                    out.put(o, _t(x) if isinstance(rule, Transpose) else x)
            elif isinstance(rule, Fuse):
                parts = [src.take(t.format_map(_Keep(env))) for t in rule.theirs]
                if any(p is None for p in parts):
                    continue
                parts = [_t(p) if rule.transpose else p for p in parts]
                if rule.split:
                    [whole] = parts
                    parts = list(whole.split(_fuse_widths(rule, config, whole, rule.split), dim=rule.dim))
                groups = int(getattr(config, rule.groups)) if rule.groups else 1
                out.put(o, _interleave(parts, groups, rule.dim))
            elif isinstance(rule, Split):
                x = src.take(rule.theirs.format_map(_Keep(env)))
                if x is None:
                    continue
                x = _t(x) if rule.transpose else x
                names = [p.format_map(_Keep(env)) for p in rule.ours]
                if x.shape[rule.dim] % len(names):
                    raise MappingError(f"{rule.theirs.format_map(_Keep(env))}: dim {rule.dim} of {tuple(x.shape)} does not split in {len(names)}")
                for name, piece in zip(names, x.chunk(len(names), dim=rule.dim)):
                    out.put(name, piece.contiguous())
            elif isinstance(rule, StackExperts):
                n = sizes.get("e")
                if n is None:
                    raise MappingError(f"mapping rule {rule} needs the config's expert count")
                names = (rule.theirs,) if isinstance(rule.theirs, str) else rule.theirs
                per = [[src.take(t.format_map(_Keep({**env, "e": e}))) for t in names] for e in range(n)]
                if any(p is None for ps in per for p in ps):
                    continue
                out.put(o, torch.stack([torch.cat([_t(p) if rule.transpose else p for p in ps]) for ps in per]))
    for o, to, th in ties:
        if th and th in theirs:  # the format may carry the tied copy: consumed, never read
            src.used.add(th)
        if to in out:
            out.put(o, out[to])
            if isinstance(out, _KeepSink):  # a tied copy is made of what the original was made of
                out.sources[o] = set(out.sources.get(to, ()))
    ignores = [re.compile(r.theirs) for r in table.rules if isinstance(r, Ignore)]
    _check(src, out, ignores=ignores)
    sources = out.sources if isinstance(out, _KeepSink) else {}
    return {k: v for k, v in out.items() if v is not None}, sources


class _OnlyReading(Mapping[str, Any]):
    """``data`` for the ``needed`` keys, shape-only stand-ins for the rest."""

    def __init__(self, data: Mapping[str, Any], needed: set[str], dry: Mapping[str, Any]) -> None:
        self.data, self.needed, self.dry = data, needed, dry

    def __getitem__(self, key: str) -> Any:
        return self.data[key] if key in self.needed else self.dry[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)


def _zip_expand(sizes: Mapping[str, int], *templates: str) -> Iterator[tuple[dict[str, int], tuple[str, ...]]]:
    for env, first in _expand(templates[0], sizes):
        yield env, (first, *(t.format_map(_Keep(env)) for t in templates[1:]))


def _fuse_widths(rule: Fuse, config: Any, x: Tensor, n: int) -> list[int]:
    if rule.sizes is not None:
        widths = [int(getattr(config, attr)) for attr in rule.sizes]
        if sum(widths) != x.shape[rule.dim]:
            raise MappingError(f"{rule.ours}: parts {dict(zip(rule.sizes, widths))} do not add up to dim {rule.dim} of {tuple(x.shape)}")
        return widths
    if x.shape[rule.dim] % n:
        raise MappingError(f"{rule.ours}: cannot split dim {rule.dim} of {tuple(x.shape)} into {n} equal parts")
    return [x.shape[rule.dim] // n] * n


class _Renamed(Mapping[str, Any]):
    """A view of a (possibly lazy) mapping under other key names; reads nothing itself."""

    def __init__(self, data: Mapping[str, Any], rename: Callable[[str], str]) -> None:
        self.data = data
        self.names = {rename(k): k for k in data}

    def __getitem__(self, key: str) -> Any:
        return self.data[self.names[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self.names

    def __len__(self) -> int:
        return len(self.names)


def _strip_prefix(table: MappingTable, theirs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """Each (missing, present) pair in turn: when no key starts with ``missing``, keys starting with
    ``present`` are read as starting with ``missing``."""
    for missing, present in table.import_prefixes:
        if theirs and not any(k.startswith(missing) for k in theirs):
            theirs = _Renamed(theirs, lambda k, m=missing, p=present: m + k[len(p):] if k.startswith(p) else k)
    return theirs


def _check(src: _Source, out: _Sink, *, ignores: Iterable[re.Pattern[str]]) -> None:
    problems = []
    if src.missing:
        problems.append(f"missing in the {src.side} state: {_few(src.missing)}")
    unused = [k for k in src.data if k not in src.used and not any(p.fullmatch(k) for p in ignores)]
    if unused:
        problems.append(f"{src.side} keys not consumed by any rule: {_few(unused)}")
    if out.twice:
        problems.append(f"{out.side} keys written more than once: {_few(out.twice)}")
    if problems:
        raise MappingError("; ".join(problems))


def _few(keys: Iterable[str], n: int = 8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def check_shapes(expected: Mapping[str, Tensor], got: Mapping[str, Tensor], *, what: str) -> None:
    """Fail on the first tensor whose shape differs (a checkpoint of another flavor or family)."""
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    if missing or extra:
        parts = ([f"missing {_few(missing)}"] if missing else []) + ([f"unexpected {_few(extra)}"] if extra else [])
        raise MappingError(f"{what}: " + "; ".join(parts))
    for k, v in expected.items():
        if tuple(v.shape) != tuple(got[k].shape):
            raise MappingError(f"{what}: {k} has shape {tuple(got[k].shape)}, the model expects {tuple(v.shape)}")
