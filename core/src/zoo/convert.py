"""Checkpoint conversion between zoo's model directories and external formats (Hugging Face).

A zoo model directory::

    zoo.json            format version, family, flavor, model config, tied-tensor aliases
    model.safetensors   the model's tensors (tied aliases stored once)
    tokenizer.json      when the model has a tokenizer
    COMPLETE            written last: a directory without it is never loaded

Training checkpoints (`zoo.checkpoint`) are model directories with optimizer and loop state added,
so everything that reads a model reads a training checkpoint too. Conversions write into a
temporary sibling directory and rename it into place, and refuse to overwrite anything.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.errors import UsageError
from zoo.mapping import MappingError, MappingTable, check_shapes, from_external, to_external
from zoo.tensorio import CheckpointError, ShardStream, copy_tokenizer_files, read_dir, unique_tensors

FORMAT_VERSION = 1
META = "zoo.json"
COMPLETE = "COMPLETE"


@dataclass(frozen=True, kw_only=True)
class ExternalFormat:
    """How a family's checkpoints look in another ecosystem (declared by the plugin).

    ``architectures`` maps the format's architecture names (HF ``config.json`` ``architectures``)
    to the zoo family that reads them; ``table(config)`` gives the key mapping; ``to_config`` and
    ``from_config`` translate the config document.
    """

    name: str
    architectures: Mapping[str, str]
    table: Callable[[Any], MappingTable]
    to_config: Callable[[Any], dict[str, Any]]
    from_config: Callable[[dict[str, Any]], Any]


@dataclass
class ModelDir:
    path: Path
    meta: dict[str, Any]

    @property
    def family(self) -> str:
        return str(self.meta["family"])


# ------------------------------------------------------------------------------ zoo directories


def read_meta(path: str | os.PathLike[str]) -> ModelDir:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint directory")
    if not (p / META).is_file():
        hint = " (it looks like a Hugging Face model: use `zoo convert --from hf`)" if (p / "config.json").is_file() else ""
        raise CheckpointError(f"{p}: not a zoo checkpoint (no {META}){hint}")
    if not (p / COMPLETE).is_file():
        raise CheckpointError(f"{p}: incomplete checkpoint (no {COMPLETE} marker: the save was interrupted)")
    try:
        meta = json.loads((p / META).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p / META}: not valid JSON ({e})") from None
    version = meta.get("format_version")
    if meta.get("sharded"):
        from zoo.dist_checkpoint import FORMAT_VERSION as SHARDED_VERSION

        if not isinstance(version, int) or version > SHARDED_VERSION:
            raise CheckpointError(f"{p}: checkpoint format version {version!r}; this zoo reads versions up to "
                                  f"{SHARDED_VERSION} (upgrade zoo-core)")
    elif not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{p}: checkpoint format version {version!r}; this zoo reads versions up to {FORMAT_VERSION} (upgrade zoo-core)")
    for key in ("family", "model_config"):
        if key not in meta:
            raise CheckpointError(f"{p / META}: missing {key!r}")
    return ModelDir(p, meta)


def write_model_dir(
    dst: str | os.PathLike[str],
    *,
    family: str,
    flavor: str,
    config: Any,
    state: Mapping[str, Any],
    extra_meta: Mapping[str, Any] | None = None,
    files: Mapping[str, bytes] | None = None,
    tensor_files: Mapping[str, Mapping[str, Any]] | None = None,
    tokenizer_from: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a complete zoo model directory atomically (temp dir, marker last, rename)."""
    from zoo.config import _plain
    from zoo.io import atomic_write_text
    from zoo.tensorio import save_file

    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise UsageError(f"{dst} already exists; nothing was overwritten")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-"))
    try:
        unique, ties = unique_tensors(state)
        save_file(unique, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, tensors in (tensor_files or {}).items():
            save_file(tensors, tmp / name)
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
        meta = {"format": "zoo", "format_version": FORMAT_VERSION, "family": family, "flavor": flavor,
                "model_config": _plain(config), "ties": ties, **(extra_meta or {})}
        atomic_write_text(tmp / META, json.dumps(meta, indent=2))
        complete_and_move(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def complete_and_move(tmp: Path, dst: Path) -> None:
    """Mark a fully written directory complete (the marker last, everything synced first) and move
    it to ``dst``, replacing what is there; a crash at any point leaves either the old ``dst`` or
    the new one, never a directory without its marker under that name."""
    _fsync_dir(tmp)
    (tmp / COMPLETE).write_text("")  # last: only now is the directory a checkpoint
    _fsync_dir(tmp)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_model_state(md: ModelDir) -> dict[str, Any]:
    """The model's full tensors (a sharded training checkpoint is assembled tensor by tensor)."""
    from zoo.tensorio import load_file

    if md.meta.get("sharded"):
        from zoo.dist_checkpoint import ShardedCheckpoint

        with ShardedCheckpoint(md.path) as ck:
            state = {name: ck.full(name) for name in ck.names() if "::" not in name}
    else:
        state = load_file(md.path / "model.safetensors")
    for alias, original in md.meta.get("ties", {}).items():
        if original not in state:
            raise CheckpointError(f"{md.path}: tied tensor {alias!r} refers to missing {original!r}")
        state[alias] = state[original]
    return state


# ------------------------------------------------------------------------------------- building


def _registry() -> Any:
    from zoo.registry import get_registry

    return get_registry()


def config_for(entry: Any, data: Mapping[str, Any], *, source: str) -> Any:
    from zoo.config import config_from_dict

    return config_from_dict(entry.family.config, data, source=source)


def build_empty(entry: Any, config: Any, *, device: str = "cpu") -> Any:
    import torch

    from zoo.family import resolve

    build = resolve(entry.family.build, owner=str(entry.plugin))
    with torch.device(device):
        return build(config, entry.family.spec_for(config))


def load_into(model: Any, state: Mapping[str, Any], *, what: str) -> None:
    expected = model.state_dict()
    try:
        check_shapes(expected, state, what=what)
    except MappingError as e:
        raise CheckpointError(str(e)) from None
    model.load_state_dict(dict(state), strict=True)


@dataclass
class Loaded:
    model: Any
    family: str
    config: Any
    tokenizer_dir: Path | None


def _materialize(entry: Any, config: Any, state: Mapping[str, Any], *, device: str, what: str) -> Any:
    """Build the model (under a forked RNG, so loading never disturbs the caller's seed) and fill it."""
    import torch

    with torch.random.fork_rng(devices=[]):
        model = build_empty(entry, config, device=device)
    load_into(model, state, what=what)
    return model


def load(path: str | os.PathLike[str], *, device: str = "cpu") -> Loaded:
    """Load a zoo checkpoint or model directory, or a Hugging Face directory of a known architecture."""
    p = Path(path)
    if p.is_dir() and not (p / META).exists() and (p / "config.json").is_file():
        entry, fmt, config, _ = _hf_source(p)
        state = _import_tensors(p, entry, fmt, config)
    else:
        md = read_meta(p)
        entry = _registry().get(md.family)
        config = config_for(entry, md.meta["model_config"], source=str(p / META))
        state = read_model_state(md)
    model = _materialize(entry, config, state, device=device, what=str(p))
    return Loaded(model, entry.family.name, config, p if (p / "tokenizer.json").is_file() else None)


def load_model(path: str | os.PathLike[str], *, device: str = "cpu") -> Any:
    """The model stored at ``path`` (zoo or Hugging Face directory), ready for ``model(input_ids)``."""
    return load(path, device=device).model


# ------------------------------------------------------------------------------------- external


def _formats(fmt_name: str) -> list[tuple[Any, ExternalFormat]]:
    from zoo.family import resolve

    out = []
    for entry in _registry().families.values():
        ref = entry.family.checkpoint_formats.get(fmt_name)
        if ref is not None:
            out.append((entry, resolve(ref, owner=str(entry.plugin))))
    return out


def _hf_source(src: Path) -> tuple[Any, ExternalFormat, Any, dict[str, Any]]:
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{src}: no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    archs = hf.get("architectures") or []
    known: dict[str, tuple[Any, ExternalFormat]] = {}
    for _, fmt in _formats("hf"):
        for arch, family in fmt.architectures.items():
            known.setdefault(arch, (_registry().get(family), fmt))
    for arch in archs:
        if arch in known:
            entry, fmt = known[arch]
            try:
                config = fmt.from_config(hf)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{cfg_path}: cannot read the {arch} config ({type(e).__name__}: {e})") from None
            return entry, fmt, config, hf
    supported = ", ".join(f"{a} ({e.family.name})" for a, (e, _) in sorted(known.items())) or "none (no plugin declares an hf format)"
    raise UsageError(f"{cfg_path}: unsupported architecture {archs or '(none given)'}; supported: {supported}")


def _import_tensors(src: Path, entry: Any, fmt: ExternalFormat, config: Any) -> dict[str, Any]:
    tensors = read_dir(src)
    try:
        state = from_external(fmt.table(config), tensors, config)
        check_shapes(build_empty(entry, config, device="meta").state_dict(), state, what=str(src))
    except MappingError as e:
        raise CheckpointError(f"{src}: {e}") from None
    return state


def import_external(fmt_name: str, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    if fmt_name != "hf":
        raise UsageError(f"unknown format {fmt_name!r}; supported: hf")
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise UsageError(f"{dst} already exists; nothing was overwritten")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    entry, fmt, config, _ = _hf_source(src)
    state = _import_tensors(src, entry, fmt, config)
    return write_model_dir(dst, family=entry.family.name, flavor="custom", config=config, state=state,
                           extra_meta={"source": {"format": "hf", "path": str(src)}}, tokenizer_from=src)


def export_external(fmt_name: str, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                    max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> Path:
    import torch

    from zoo.io import atomic_write_text

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise UsageError(f"{dst} already exists; nothing was overwritten")
    md = read_meta(src)
    entry = _registry().get(md.family)
    ref = entry.family.checkpoint_formats.get(fmt_name)
    if ref is None:
        have = ", ".join(entry.family.checkpoint_formats) or "none"
        raise UsageError(f"family {entry.family.name!r} cannot be exported to {fmt_name!r}; its formats: {have}")
    from zoo.family import resolve

    fmt: ExternalFormat = resolve(ref, owner=str(entry.plugin))
    config = config_for(entry, md.meta["model_config"], source=str(src / META))
    # Tensor by tensor: each is read when its mapping rule needs it and written out at once.
    state = lazy_model_state(md)
    try:
        shapes = {k: _Shape(v) for k, v in state.shapes.items()}  # compared without reading any tensor
        check_shapes(build_empty(entry, config, device="meta").state_dict(), shapes, what=str(src))
    except MappingError as e:
        raise CheckpointError(str(e)) from None
    target = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype] if dtype else None
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-"))
    try:
        stream = ShardStream(tmp, max_shard_bytes=max_shard_bytes, dtype=target)
        to_external(fmt.table(config), state, config, put=stream.put)
        stream.close()
        hf_config = fmt.to_config(config)
        hf_config["torch_dtype"] = hf_config["dtype"] = str(stream.first_dtype).removeprefix("torch.")
        atomic_write_text(tmp / "config.json", json.dumps(hf_config, indent=2))
        copy_tokenizer_files(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


class _LazyState(Mapping[str, Any]):
    """A model's tensors read on access (``shapes`` without reading), one at a time."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], Any], ties: Mapping[str, str]) -> None:
        self.shapes = {**shapes, **{a: shapes[o] for a, o in ties.items() if o in shapes}}
        self._read, self._ties = read, ties

    def __getitem__(self, key: str) -> Any:
        if key not in self.shapes:
            raise KeyError(key)
        return self._read(self._ties.get(key, key))

    def __iter__(self) -> Any:
        return iter(self.shapes)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self.shapes

    def __len__(self) -> int:
        return len(self.shapes)


class _Shape:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def lazy_model_state(md: ModelDir) -> _LazyState:
    """Like `read_model_state`, but each tensor is read only when asked for; ``.shapes`` costs
    no tensor data."""
    ties = md.meta.get("ties", {})
    if md.meta.get("sharded"):
        from zoo.dist_checkpoint import ShardedCheckpoint

        ck = ShardedCheckpoint(md.path)
        shapes = {n: ck.shape(n) for n in ck.names() if "::" not in n}
        return _LazyState(shapes, ck.full, ties)
    from safetensors import safe_open

    path = md.path / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{md.path}: model.safetensors is missing")
    handle = safe_open(str(path), framework="pt")
    shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118 (not a dict)
    return _LazyState(shapes, handle.get_tensor, ties)


def parse_size(text: str) -> int:
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    t = text.strip().lower()
    for unit, mult in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise UsageError(f"--max-shard-size {text!r}: expected a size like 5GB or 500MB") from None
