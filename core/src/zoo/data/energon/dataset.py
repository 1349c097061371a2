"""A prepared Energon dataset on disk (or behind an fsspec URL): `.nv-meta/.info.json` (or the
older `.info.yaml`), `split.yaml`, `dataset.yaml`, and one `.tar.idx` per shard.

`WebDataset` turns one split part into a flat sample space: ``segments`` of (shard, first,
end) local sample indices after `exclude` (whole shards, or single ``shard/key`` samples), and
`raw(i)` reads sample ``i`` of that space with one ranged read through the shard's index. How
a raw sample becomes a typed one (``field_map``) or a crude dict is `make_sample`.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

from zoo.data.energon import samples as S
from zoo.data.energon.storage import Storage
from zoo.data.energon.tar import TarFormatError, index_shard, parse_sample, read_idx
from zoo.errors import ZooError, reading

META = ".nv-meta"


class DatasetError(ZooError, ValueError):
    """A dataset whose metadata is missing or inconsistent; the message names the file."""


def brace_expand(pattern: str) -> list[str]:
    """``shards/{000..099}.tar`` and ``{a,b}`` as Energon's split files write them."""
    import braceexpand

    return list(braceexpand.braceexpand(pattern))


def _yaml(storage: Storage, rel: str) -> Any:
    try:
        return yaml.safe_load(storage.text(rel))
    except yaml.YAMLError as e:
        raise DatasetError(f"{storage.where(rel)}: not valid YAML: {' '.join(str(e).split())}") from None


def read_split_file(storage: Storage, name: str = "split.yaml") -> dict[str, Any]:
    """A split file (YAML or JSON) whose ``split_parts`` maps part names to shard lists."""
    rel = f"{META}/{name}"
    with reading(storage.where(rel), DatasetError):
        doc = (json.loads(storage.text(rel)) if name.endswith(".json") else _yaml(storage, rel)) or {}
        parts = doc.get("split_parts") if isinstance(doc, dict) else None
        if not isinstance(parts, dict) or not all(isinstance(v, (list, type(None))) for v in parts.values()):
            raise DatasetError(f"{storage.where(rel)}: needs split_parts: {{train: [shards...], ...}}")
        return doc


def is_dataset(path: str) -> bool:
    st = Storage(path)
    return st.exists(f"{META}/.info.json") or st.exists(f"{META}/.info.yaml")


@dataclass(frozen=True)
class DatasetConfig:
    """dataset.yaml: a typed sample class with its field map, or crude dicts."""

    sample_class: type[S.Sample] | None  # None: crude
    field_map: dict[str, str] | None
    subflavors: dict[str, Any]
    sample_loader: str | None = None
    part_filter: str | None = None


def read_dataset_config(storage: Storage, name: str = "dataset.yaml") -> DatasetConfig:
    rel = f"{META}/{name}"
    if not storage.exists(rel):
        raise DatasetError(f"{storage.where(rel)}: missing; write one with `zoo prepare webdataset "
                           f"{storage.display} --sample-type ... --field-map ...` (or --crude)")
    where = storage.where(rel)
    with reading(where, DatasetError):
        return _dataset_config(_yaml(storage, rel) or {}, where)


def _dataset_config(doc: Any, where: str) -> DatasetConfig:
    if not isinstance(doc, dict):
        raise DatasetError(f"{where}: expected a mapping, found a {type(doc).__name__}")
    subflavors = doc.get("subflavors") or {}
    if not isinstance(subflavors, dict):
        raise DatasetError(f"{where}: subflavors must be a mapping")
    if doc.get("__class__") == "CrudeWebdataset":
        return DatasetConfig(None, None, subflavors)
    st = doc.get("sample_type")
    if isinstance(st, dict):
        cls = S.sample_type(st.get("__module__", ""), st.get("__class__", ""), where=where)
    elif "__class__" in doc:  # Energon 6's deprecated XxxWebdataset factories
        cls = S.sample_type(doc.get("__module__", ""), doc["__class__"], where=where)
    else:
        raise DatasetError(f"{where}: needs sample_type: {{__module__: megatron.energon, __class__: NAME}} "
                           "or __class__: CrudeWebdataset")
    fmap = doc.get("field_map")
    loader = doc.get("sample_loader")
    if fmap is None and loader is None:
        raise DatasetError(f"{where}: a typed dataset needs field_map (or sample_loader)")
    if fmap is not None:
        import dataclasses

        if not isinstance(fmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fmap.items()):
            raise DatasetError(f"{where}: field_map must map field names to part names (field: ext)")

        fields = {f.name for f in dataclasses.fields(cls)}
        bad = [k for k in fmap if k not in fields]
        if bad:
            from zoo.errors import suggest

            raise DatasetError(f"{where}: field_map key {bad[0]!r} is not a field of {cls.__name__} "
                               f"({', '.join(sorted(f for f in fields if not f.startswith('__')))}){suggest(bad[0], fields)}")
    return DatasetConfig(cls, dict(fmap) if fmap else None, subflavors, loader, doc.get("part_filter"))


class WebDataset:
    """One split part of a prepared dataset: its samples, readable by index."""

    def __init__(self, path: str, *, split_part: str = "train", split_config: str = "split.yaml",
                 dataset_config: str = "dataset.yaml", allow_pickle: bool = False, allow_code: bool = False,
                 load_config: bool = True) -> None:
        self.path = str(path)
        self.storage = Storage(path)
        self.split_part = split_part
        self.allow_pickle = allow_pickle
        self.shard_counts = self._info()
        self.shards = list(self.shard_counts)
        self.config = read_dataset_config(self.storage, dataset_config) if load_config else None
        if self.config is not None and (self.config.sample_loader or self.config.part_filter) and not allow_code:
            raise DatasetError(f"{self.storage.where(META + '/' + dataset_config)}: sample_loader/part_filter run "
                               "Python code shipped with the dataset; set data.allow_code=true if you trust it")
        self._idx: dict[int, np.ndarray] = {}  # before _segments: excluded keys of a remote shard read it
        selected, excluded_keys = self._split(split_config)
        self.segments = self._segments(selected, excluded_keys)
        self._starts = np.cumsum([0] + [e - b for _, b, e in self.segments]).tolist()
        self._where: dict[str, str] = {}  # shard -> its display path, built once (named per sample)

    # ----------------------------------------------------------------------------- metadata

    def _info(self) -> dict[str, int]:
        st = self.storage
        for rel, load in ((f"{META}/.info.json", json.loads), (f"{META}/.info.yaml", yaml.safe_load)):
            if st.exists(rel):
                try:
                    doc = load(st.text(rel))
                except (ValueError, yaml.YAMLError) as e:
                    raise DatasetError(f"{st.where(rel)}: unreadable: {' '.join(str(e).split())}") from None
                counts = doc.get("shard_counts") if isinstance(doc, dict) else None
                if not isinstance(counts, dict) or not all(type(v) is int and v >= 0 for v in counts.values()):
                    raise DatasetError(f"{st.where(rel)}: needs a shard_counts mapping of shard -> sample count")
                return {str(k): v for k, v in counts.items()}
        raise DatasetError(f"{st.display}: not a prepared Energon dataset (no {META}/.info.json or .info.yaml); "
                           f"run `zoo prepare webdataset {st.display}`")

    def _split(self, name: str) -> tuple[list[str], dict[str, set[str]]]:
        st = self.storage
        rel = f"{META}/{name}"
        if not st.exists(rel):
            raise DatasetError(f"{st.where(rel)}: missing split file; run `zoo prepare webdataset {st.display} --split 8,1,1`")
        with reading(st.where(rel), DatasetError):
            return self._read_split(st, rel, name)

    def _read_split(self, st: Storage, rel: str, name: str) -> tuple[list[str], dict[str, set[str]]]:
        doc = read_split_file(st, name)
        parts = doc["split_parts"]
        if self.split_part not in parts:
            raise DatasetError(f"{st.where(rel)}: no split part {self.split_part!r} (it has {', '.join(parts) or 'none'})")
        excl_shards: set[str] = set()
        excl_keys: dict[str, set[str]] = {}
        for entry in doc.get("exclude") or []:
            for item in brace_expand(str(entry)):
                if item in self.shard_counts:
                    excl_shards.add(item)
                    continue
                shard, _, key = item.rpartition("/")
                while shard and shard not in self.shard_counts:  # keys may contain '/' themselves
                    shard, _, head = shard.rpartition("/")
                    key = f"{head}/{key}"
                if not shard:
                    raise DatasetError(f"{st.where(rel)}: exclude entry {item!r} names no shard of {META}/.info.json")
                excl_keys.setdefault(shard, set()).add(key)
        selected: list[str] = []
        for pattern in parts[self.split_part] or []:
            for shard in brace_expand(str(pattern)):
                if shard not in self.shard_counts:
                    raise DatasetError(f"{st.where(rel)}: split {self.split_part!r} names {shard!r}, which "
                                       f"{META}/.info.json does not list")
                if shard not in excl_shards:
                    selected.append(shard)
        return selected, excl_keys

    def _segments(self, selected: list[str], excl_keys: dict[str, set[str]]) -> list[tuple[int, int, int]]:
        segs: list[tuple[int, int, int]] = []
        for shard in selected:
            sid = self.shards.index(shard)
            n = self.shard_counts[shard]
            drop = excl_keys.get(shard)
            if not drop:
                if n:
                    segs.append((sid, 0, n))
                continue
            keys = index_shard(self.storage.join(shard), where=self.storage.where(shard)).keys \
                if not self.storage.url else self._remote_keys(shard)
            begin = 0
            for i, key in enumerate(keys):
                if key in drop:
                    if i > begin:
                        segs.append((sid, begin, i))
                    begin = i + 1
            if begin < len(keys):
                segs.append((sid, begin, len(keys)))
        return segs

    def _remote_keys(self, shard: str) -> list[str]:
        idx = self.index(self.shards.index(shard))
        return [self._read(self.shards.index(shard), i)[0] for i in range(len(idx) - 1)]

    # ------------------------------------------------------------------------------ samples

    def __len__(self) -> int:
        return self._starts[-1]

    def index(self, sid: int) -> np.ndarray:
        idx = self._idx.get(sid)
        if idx is None:
            shard = self.shards[sid]
            rel = str(idx_path_rel(shard))
            where = self.storage.where(rel)
            if not self.storage.exists(rel):
                raise DatasetError(f"{where}: missing; run `zoo prepare webdataset {self.storage.display} --tar-index-only`")
            idx = read_idx(self.storage.bytes(rel), where=where)
            if len(idx) - 1 != self.shard_counts[shard]:
                raise DatasetError(f"{where}: indexes {len(idx) - 1} samples but {META}/.info.json says "
                                   f"{self.shard_counts[shard]}; rerun `zoo prepare webdataset {self.storage.display}`")
            size = self.storage.size(shard)
            if int(idx[-1]) > size:
                raise DatasetError(f"{where}: ends at byte {int(idx[-1])} but {self.storage.where(shard)} has "
                                   f"{size} bytes (truncated tar, or an index of another file)")
            self._idx[sid] = idx
        return idx

    def locate(self, i: int) -> tuple[int, int]:
        """(shard id, sample index in that shard) of sample ``i`` of this split."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample {i} of {len(self)}")
        s = bisect.bisect_right(self._starts, i) - 1
        sid, begin, _ = self.segments[s]
        return sid, begin + i - self._starts[s]

    def _read(self, sid: int, j: int) -> tuple[str, dict[str, bytes]]:
        idx = self.index(sid)
        shard = self.shards[sid]
        start, end = int(idx[j]), int(idx[j + 1])
        try:
            return parse_sample(self.storage.read(shard, start, end), start, where=self.shard_where(shard))
        except TarFormatError as e:
            raise DatasetError(f"{self.storage.where(shard)}: sample {j}'s byte range [{start}, {end}) from its .tar.idx "
                               f"does not parse: the .tar.idx does not match this tar (rerun `zoo prepare webdataset "
                               f"{self.storage.display} --tar-index-only`); {str(e).rpartition(': ')[2]}") from None

    def raw(self, i: int) -> tuple[str, str, dict[str, bytes]]:
        """(shard, key, parts as bytes) of sample ``i``."""
        sid, j = self.locate(i)
        key, parts = self._read(sid, j)
        return self.shards[sid], key, parts

    def shard_where(self, shard: str) -> str:
        where = self._where.get(shard)
        if where is None:
            where = self._where[shard] = self.storage.where(shard)
        return where

    def where(self, shard: str, key: str) -> str:
        return f"{self.shard_where(shard)}/{key}"


def idx_path_rel(shard: str) -> str:
    return shard + ".idx"


def make_sample(ds: WebDataset, i: int, *, restore_key: tuple[Any, ...], subflavors: dict[str, Any] | None,
                decode: bool = True) -> Any:
    """Sample ``i`` of ``ds``: its typed class filled by the field map, or a crude dict of decoded
    parts (raw bytes with ``decode=False``) with Energon's base keys."""
    shard, key, parts = ds.raw(i)
    where = ds.where(shard, key)
    cfg = ds.config
    assert cfg is not None
    flavors = {**cfg.subflavors, **(subflavors or {})} or None
    base = {"__key__": key, "__restore_key__": restore_key, "__subflavors__": flavors,
            "__sources__": ((ds.path, i, shard, tuple(f"{key}.{p}" for p in parts)),)}
    if cfg.sample_class is None:
        crude = dict(base, __shard__=shard)
        for part, data in parts.items():
            crude[part] = S.decode_part(part, data, allow_pickle=ds.allow_pickle, where=f"{where}.{part}") \
                if decode else data
        return crude
    if cfg.field_map is None:
        return _sample_loader(ds, cfg, base, parts, where)
    cache: dict[str, Any] = {}
    fields = {name: S.field_value(parts, spec, allow_pickle=ds.allow_pickle, where=where, cache=cache)
              for name, spec in cfg.field_map.items()}
    try:
        return cfg.sample_class(**base, **fields)
    except TypeError as e:
        raise DatasetError(f"{where}: {cfg.sample_class.__name__}: {e} (check field_map in {META}/dataset.yaml)") from None


def _sample_loader(ds: WebDataset, cfg: DatasetConfig, base: dict[str, Any], parts: dict[str, bytes], where: str) -> Any:
    """dataset.yaml's ``sample_loader: file.py:function`` (opted in with allow_code)."""
    import importlib.util

    assert cfg.sample_loader is not None
    file, _, fn = cfg.sample_loader.partition(":")
    spec = importlib.util.spec_from_file_location("zoo_sample_loader", ds.storage.join(f"{META}/{file}"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    decoded = {p: S.decode_part(p, d, allow_pickle=ds.allow_pickle, where=f"{where}.{p}") for p, d in parts.items()}
    return cfg.sample_class(**base, **getattr(module, fn)({**base, **decoded}))  # type: ignore[misc]


__all__ = ["DatasetConfig", "DatasetError", "WebDataset", "brace_expand", "is_dataset", "make_sample",
           "read_dataset_config"]
