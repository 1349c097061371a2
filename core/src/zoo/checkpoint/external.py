"""Checkpoint conversion between zoo's model directories and external formats (Hugging Face
transformers and diffusers), and loading a model from either.

A family declares each format it converts to as an `ExternalFormat`: the format's architecture
names, a key `MappingTable` (`zoo.checkpoint.mapping`), the config translation both ways and a
`FieldTable` per config class (`zoo.checkpoint.fields`). Config files are read and written by the
library that owns them: transformers' config classes (``AutoConfig``, never remote code) and
diffusers' ``ConfigMixin`` (the model class's config, built on the meta device), so every
release's serialisation and defaults are that library's. Conversions write into a temporary
sibling directory and rename it into place, and refuse to overwrite anything.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.checkpoint.fields import FieldTable, check_config
from zoo.checkpoint.files import FileFormat, read_tensor_file, write_tensor_file
from zoo.checkpoint.mapping import MappingError, MappingTable, check_shapes, from_external, to_external
from zoo.checkpoint.model_dir import (
    META,
    build_empty,
    config_for,
    load_into,
    read_meta,
    resolve_checkpoint,
    write_model_dir,
)
from zoo.checkpoint.reader import Shape, lazy_model_state, read_model_state
from zoo.checkpoint.tensorio import CheckpointError, ShardStream, copy_tokenizer_files, read_dir, read_json
from zoo.config import torch_dtype
from zoo.errors import UsageError, ZooError
from zoo.io import make_dir_like_user

if TYPE_CHECKING:
    from zoo.registry import FamilyEntry


@dataclass(frozen=True, kw_only=True)
class ExternalFormat:
    """How a family's checkpoints look in another ecosystem (declared by the plugin).

    ``architectures`` maps the format's architecture names (HF ``config.json`` ``architectures``,
    or diffusers' ``_class_name``) to the zoo family that reads them; ``table(config)`` gives the
    key mapping; ``to_config`` and ``from_config`` translate the config document; ``stem`` names
    the weight files (``model.safetensors``; diffusers: ``diffusion_pytorch_model.safetensors``).
    A diffusers *pipeline* directory (``model_index.json``) is read through the component whose
    class is one of ``architectures``, then ``from_pipeline``.
    ``import_table(config, keys)``, when given, picks the table to import with from the keys
    present (a format with several on-disk layouts, e.g. Mixtral's per-expert and fused experts)
    and refuses a mix; export always writes ``table(config)``.

    ``from_config`` receives the library's config object (a transformers ``PretrainedConfig``; for
    diffusers the model's ``config``, every default filled in) and ``to_config`` returns one
    (a ``PretrainedConfig``, or a diffusers model built on the meta device), which is saved with
    that library's own ``save_pretrained`` / ``save_config``. ``fields`` maps each config class
    the format reads to its `FieldTable`; values a table fixes are checked before ``from_config``.
    """

    name: str
    architectures: Mapping[str, str]
    table: Callable[[Any], MappingTable]
    to_config: Callable[[Any], Any]
    from_config: Callable[[Any], Any]
    stem: str = "model"
    import_table: Callable[[Any, Collection[str]], MappingTable] | None = None
    fields: Mapping[str, FieldTable] = dataclass_field(default_factory=dict)
    # A diffusers pipeline directory (model_index.json and one folder per component): the zoo
    # config read from the model's component, completed from the others (``(config, root)``:
    # its scheduler's noise schedule, its VAE).
    from_pipeline: Callable[[Any, Path], Any] | None = None

    def table_for(self, config: Any, keys: Collection[str]) -> MappingTable:
        """The mapping to import a state dict with these keys."""
        return self.import_table(config, keys) if self.import_table is not None else self.table(config)


# `zoo convert --from/--to` names: Hugging Face transformers and diffusers directories.
FORMATS = ("hf", "diffusers")


def _file_formats() -> dict[str, tuple[Any, FileFormat]]:
    from zoo.family import resolve

    out: dict[str, tuple[Any, FileFormat]] = {}
    for entry in _registry().families.values():
        for name, ref in entry.family.checkpoint_formats.items():
            if name not in FORMATS:
                fmt = resolve(ref, owner=str(entry.plugin))
                if isinstance(fmt, FileFormat):
                    out[name] = (entry, fmt)
    return out


def _registry() -> Any:
    from zoo.registry import get_registry

    return get_registry()


@dataclass
class Loaded:
    model: Any
    family: str
    config: Any
    tokenizer_dir: Path | None


def _materialize(entry: FamilyEntry, config: Any, state: Mapping[str, Any], *, device: str, what: str,
                 dtype: Any = None) -> Any:
    """Build the model (under a forked RNG, so loading never disturbs the caller's seed) and fill it.
    ``dtype`` (bf16, fp16): the parameters are made in it (torch's default dtype during the build:
    no float32 copy of the whole model on the way) and the model is then cast as
    ``train.param_dtype`` casts it (buffers the model keeps in float32 stay so, `zoo.nn.Float32Buffers`);
    the stored values are rounded to it as they are loaded."""
    import torch

    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        try:
            if dtype is not None:
                torch.set_default_dtype(dtype)
            model = build_empty(entry, config, device=device)
        finally:
            torch.set_default_dtype(default)
    if dtype is not None:
        model.to(dtype)
    load_into(model, state, what=what)
    return model


def load(path: str | os.PathLike[str], *, device: str = "cpu", weights: str = "auto", dtype: Any = None) -> Loaded:
    """Load a zoo checkpoint or model directory, or a Hugging Face directory of a known architecture.
    ``weights``: ``auto`` takes a training checkpoint's moving average of the parameters when it
    has one (``train.ema``), ``ema`` requires it, ``raw`` takes the parameters themselves.
    ``dtype``: a torch floating dtype to hold the parameters in (None: float32, as trained)."""
    p = resolve_checkpoint(path)  # a run directory or checkpoint root: its newest complete checkpoint
    library = library_format(p)
    if library is not None:
        entry, fmt, config, _, where = _hf_source(p, library)
        state, config = _import_tensors(where, entry, fmt, config)
    else:
        md = read_meta(p)
        entry = _registry().get(md.family)
        config = config_for(entry, md.meta["model_config"], source=str(p / META))
        state = read_model_state(md, weights=weights)
    model = _materialize(entry, config, state, device=device, what=str(p), dtype=dtype)
    return Loaded(model, entry.family.name, config, p if (p / "tokenizer.json").is_file() else None)


def library_format(path: Path) -> str | None:
    """``hf`` or ``diffusers`` for a directory one of those libraries wrote (a diffusers pipeline's
    ``model_index.json`` included), None for a zoo one or anything else."""
    if not path.is_dir() or (path / META).exists():
        return None
    if (path / "model_index.json").is_file():
        return "diffusers"
    if (path / "config.json").is_file():
        return "diffusers" if "_class_name" in read_json(path / "config.json") else "hf"
    return None


def load_model(path: str | os.PathLike[str], *, device: str = "cpu", weights: str = "auto", dtype: Any = None) -> Any:
    """The model stored at ``path`` (zoo or Hugging Face directory), ready for ``model(input_ids)``."""
    return load(path, device=device, weights=weights, dtype=dtype).model


# ------------------------------------------------------------------------------------- external


def _formats(fmt_name: str) -> list[tuple[Any, ExternalFormat]]:
    from zoo.family import resolve

    out = []
    for entry in _registry().families.values():
        ref = entry.family.checkpoint_formats.get(fmt_name)
        if ref is not None:
            out.append((entry, resolve(ref, owner=str(entry.plugin))))
    return out


def _pipeline_component(root: Path, known: Mapping[str, Any], supported: str) -> Path:
    """The folder of the diffusers pipeline ``root`` that holds a model class zoo reads."""
    index = read_json(root / "model_index.json")
    found = [name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)
             and len(value) == 2 and value[1] in known and (root / name / "config.json").is_file()]
    if not found:
        classes = sorted(str(v[1]) for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[1])
        raise UsageError(f"{root / 'model_index.json'}: no component zoo reads (it has {', '.join(classes) or 'none'}; "
                         f"supported: {supported})")
    if len(found) > 1:
        raise UsageError(f"{root / 'model_index.json'}: several components zoo could read ({', '.join(found)}): "
                         "pass the one to convert (its folder)")
    return root / found[0]


def _hf_source(src: Path, fmt_name: str = "hf") -> tuple[Any, ExternalFormat, Any, Any, Path]:
    """The family, format and zoo config of the model directory ``src``, the library's config
    object it was read from, and the directory holding the weights (``src``, or the model's
    component of a diffusers pipeline)."""
    known: dict[str, tuple[Any, ExternalFormat]] = {}
    for _, fmt in _formats(fmt_name):
        for arch, family in fmt.architectures.items():
            known.setdefault(arch, (_registry().get(family), fmt))
    supported = ", ".join(f"{a} ({e.family.name})" for a, (e, _) in sorted(known.items())) or \
        f"none (no plugin declares a {fmt_name} format)"
    root = None
    if fmt_name == "diffusers" and not (src / "config.json").is_file() and (src / "model_index.json").is_file():
        root, src = src, _pipeline_component(src, known, supported)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{src}: no config.json (not a Hugging Face model directory"
                              + (" nor a diffusers pipeline's model_index.json)" if fmt_name == "diffusers" else ")"))
    archs, library_config = (_read_diffusers if fmt_name == "diffusers" else _read_transformers)(src, known, supported)
    for arch in archs:
        if arch in known:
            entry, fmt = known[arch]
            try:
                if fmt_name == "diffusers":
                    table = fmt.fields.get(arch)
                    if table is not None:
                        table.check(library_config)
                elif fmt.fields:
                    check_config(fmt.fields, library_config)
                config = fmt.from_config(library_config)
                if root is not None and fmt.from_pipeline is not None:
                    config = fmt.from_pipeline(config, root)
                # Building the model it describes (on the meta device: no memory) checks every
                # size, so a damaged config.json is named here rather than by the weights' shapes.
                build_empty(entry, config, device="meta")
            except ZooError as e:
                raise CheckpointError(f"{cfg_path}: {e}") from None
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError, AssertionError) as e:
                raise CheckpointError(f"{cfg_path}: cannot read the {arch} config ({type(e).__name__}: {e})") from None
            return entry, fmt, config, library_config, src
    raise UsageError(f"{cfg_path}: unsupported architecture {archs or '(none given)'}; supported: {supported}")


def _read_transformers(src: Path, known: Mapping[str, Any], supported: str) -> tuple[list[str], Any]:
    """transformers' own config object for ``src`` (configuration classes only: no model code is
    imported, no remote code runs)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UsageError(f"{src}: reading a Hugging Face directory needs transformers (pip install transformers)") \
            from None
    cfg_path = src / "config.json"
    doc = read_json(cfg_path)  # (only to name what is unsupported before transformers is asked)
    archs = doc.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{cfg_path}: 'architectures' must be a list of class names")
    if not any(a in known for a in archs):
        raise UsageError(f"{cfg_path}: unsupported architecture {archs or '(none given)'}; supported: {supported}")
    try:
        config = AutoConfig.from_pretrained(str(src), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # (whatever the library raises on a file it cannot read: one line naming the file)
        reason = " ".join(str(e).split())
        raise CheckpointError(f"{cfg_path}: transformers cannot read it ({type(e).__name__}: {reason[:300]})") from None
    return list(config.architectures or archs), config


def _read_diffusers(src: Path, known: Mapping[str, Any], supported: str) -> tuple[list[str], Any]:
    """diffusers' config of the model class ``src`` names, every default filled in: the class's
    own ``from_config`` on the meta device (diffusers keeps a model's config on its model class)."""
    cfg_path = src / "config.json"
    name = read_json(cfg_path).get("_class_name")
    if not isinstance(name, str) or name not in known:
        raise UsageError(f"{cfg_path}: unsupported architecture {[name] if name else '(none given)'}; "
                         f"supported: {supported}")
    return [name], diffusers_config_of(name, src)


def diffusers_config_of(class_name: str, src: Path | Mapping[str, Any], *, what: str | None = None) -> Any:
    """The ``config`` (a FrozenDict) diffusers' ``class_name`` makes of the directory or document
    ``src``; raises CheckpointError naming the file (``what``) when diffusers refuses it."""
    import warnings

    import torch

    try:
        import diffusers
    except ImportError:
        raise UsageError("reading a diffusers directory needs diffusers (pip install diffusers)") from None
    cls = getattr(diffusers, class_name)
    what = what or (str(Path(src) / "config.json") if isinstance(src, (str, Path)) else class_name)
    try:
        doc = cls.load_config(str(src)) if isinstance(src, (str, Path)) else dict(src)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # (diffusers warns of keys its class does not take: it ignores them)
            return cls.from_config(doc).config
    except Exception as e:  # (whatever the library raises on a file it cannot read: one line naming the file)
        reason = " ".join(str(e).split())
        raise CheckpointError(f"{what}: diffusers cannot read it ({type(e).__name__}: {reason[:300]})") from None


def _save_library_config(config: Any, directory: Path, *, dtype: Any) -> None:
    """Write ``config`` (from a format's ``to_config``) with its library's own writer."""
    if hasattr(config, "save_config"):  # diffusers (a model built on the meta device)
        config.save_config(str(directory))
    elif hasattr(config, "save_pretrained"):  # transformers' PretrainedConfig
        key = "dtype" if hasattr(config, "dtype") else "torch_dtype"
        setattr(config, key, str(dtype).removeprefix("torch."))
        config.save_pretrained(str(directory))
    else:
        raise TypeError(f"to_config returned {type(config).__name__}, which has neither save_pretrained "
                        "(transformers) nor save_config (diffusers)")


def _stored_head(fmt: ExternalFormat, config: Any, tensors: Mapping[str, Any]) -> Any:
    """transformers' rule for a config that ties the head to the embedding while the file stores
    both, different: the model is not tied (it computes with the stored head). ``config`` with
    ``tie_embeddings`` off in that case, else as it is."""
    import dataclasses

    import torch

    if not getattr(config, "tie_embeddings", False) or not dataclasses.is_dataclass(config):
        return config
    try:
        untied = dataclasses.replace(config, tie_embeddings=False)
        table = fmt.table_for(untied, list(tensors))
    except (ValueError, TypeError, ZooError):
        return config
    from zoo.checkpoint.rules import Rename

    names = {r.ours: r.theirs for r in table.rules if isinstance(r, Rename)}
    head, embed = names.get("head.weight"), names.get("embed.weight")
    if head is None or embed is None:
        return config
    stored = {k: k for k in tensors}
    for ours_prefix, theirs_prefix in table.import_prefixes:  # (names under another release's prefix)
        stored.update({ours_prefix + k[len(theirs_prefix):]: k for k in tensors if k.startswith(theirs_prefix)})
    if head not in stored or embed not in stored:
        return config
    a, b = tensors[stored[head]], tensors[stored[embed]]
    if a.shape == b.shape and torch.equal(a, b):
        return config
    return untied


def _import_tensors(src: Path, entry: FamilyEntry, fmt: ExternalFormat, config: Any) -> tuple[dict[str, Any], Any]:
    """The zoo state of the weights in ``src``, and the config they are (`_stored_head`)."""
    tensors = read_dir(src, stem=fmt.stem)
    config = _stored_head(fmt, config, tensors)
    try:
        state = from_external(fmt.table_for(config, list(tensors)), tensors, config)
        check_shapes(build_empty(entry, config, device="meta").state_dict(), state, what=str(src))
    except MappingError as e:
        raise CheckpointError(f"{src}: {e} (do config.json and the weights belong together?)") from None
    return state, config


def import_external(fmt_name: str, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    files = _file_formats() if fmt_name not in FORMATS else {}
    if fmt_name not in FORMATS and fmt_name not in files:
        raise UsageError(f"unknown format {fmt_name!r}; supported: {', '.join([*FORMATS, *sorted(files)])}")
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise UsageError(f"{dst} already exists; nothing was overwritten")
    if fmt_name in files:
        entry, ff = files[fmt_name]
        try:
            config, state = ff.read(read_tensor_file(src))
            check_shapes(build_empty(entry, config, device="meta").state_dict(), state, what=str(src))
        except (MappingError, ValueError) as e:
            raise CheckpointError(f"{src}: {e}") from None
        return write_model_dir(dst, family=entry.family.name, flavor="custom", config=config, state=dict(state),
                               extra_meta={"source": {"format": fmt_name, "path": str(src)}})
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    entry, fmt, config, _, where = _hf_source(src, fmt_name)
    state, config = _import_tensors(where, entry, fmt, config)
    return write_model_dir(dst, family=entry.family.name, flavor="custom", config=config, state=state,
                           extra_meta={"source": {"format": fmt_name, "path": str(src)}}, tokenizer_from=src)


def export_external(fmt_name: str, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                    max_shard_bytes: int = 5 * 2**30, dtype: str | None = None, weights: str = "auto") -> Path:

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
    if isinstance(fmt, FileFormat):
        return _export_file(fmt, md, config, dst, dtype=dtype, weights=weights)
    # Tensor by tensor: each is read when its mapping rule needs it and written out at once.
    state = lazy_model_state(md, weights=weights)
    try:
        shapes = {k: Shape(v) for k, v in state.shapes.items()}  # compared without reading any tensor
        check_shapes(build_empty(entry, config, device="meta").state_dict(), shapes, what=str(src))
    except MappingError as e:
        raise CheckpointError(str(e)) from None
    target = torch_dtype(dtype) if dtype else None
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_dir_like_user(Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-")))
    try:
        stream = ShardStream(tmp, max_shard_bytes=max_shard_bytes, dtype=target, stem=fmt.stem)
        to_external(fmt.table(config), state, config, put=stream.put)
        stream.close()
        _save_library_config(fmt.to_config(config), tmp, dtype=stream.first_dtype)
        copy_tokenizer_files(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _export_file(fmt: FileFormat, md: Any, config: Any, dst: Path, *, dtype: str | None, weights: str) -> Path:
    try:
        tensors = dict(fmt.write(config, read_model_state(md, weights=weights)))
    except MappingError as e:
        raise CheckpointError(str(e)) from None
    if dtype:
        target = torch_dtype(dtype)
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    return write_tensor_file(tensors, dst)


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
