"""`zoo prepare webdataset|images|convert-pickle`: write what `energon prepare` writes, fast.

A prepared dataset is: a `.tar.idx` beside every shard (byte-identical to Energon's),
`.nv-meta/.info.json`, `split.yaml` and `dataset.yaml`. Shards are indexed in parallel processes
reading only tar headers; no SQLite index is built (Energon's takes hours on large datasets and
training never reads it: upstream issues #231/#232). Every file is written to a temporary name
and renamed, so an interrupted or failed prepare leaves the dataset as it was.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from zoo.data.energon import samples as S
from zoo.data.energon.dataset import META, DatasetError
from zoo.data.energon.tar import TarFormatError, index_shard
from zoo.io import atomic_write_bytes, atomic_write_text

ENERGON_COMPAT = "7.4.1"  # the .info.json "energon_version" zoo writes: the format version it matches


@dataclass
class PrepareResult:
    root: Path
    shard_counts: dict[str, int]
    parts: list[str]
    splits: dict[str, list[str]]

    @property
    def total(self) -> int:
        return sum(self.shard_counts.values())


def find_shards(root: Path, exclude: str | None = None) -> list[str]:
    found = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != META)
        for f in files:
            if f.endswith(".tar"):
                rel = Path(dirpath, f).relative_to(root).as_posix()
                if not (exclude and re.search(exclude, rel)):
                    found.append(rel)
    return sorted(found)


def _index_one(args: tuple[str, str]) -> tuple[str, int, list[str], list[str], str | None]:
    root, rel = args
    path = Path(root, rel)
    try:
        ix = index_shard(path, where=str(path))
    except (TarFormatError, OSError) as e:
        return rel, 0, [], [], str(e)
    if ix.count == 0:
        return rel, 0, [], [], f"{path}: holds no sample (no member named KEY.PART)"
    atomic_write_bytes(path.with_name(path.name + ".idx"), ix.offsets.tobytes())
    return rel, ix.count, ix.keys, sorted(ix.parts), None


def _progress(it: Iterable[Any], total: int, enabled: bool, desc: str) -> Iterable[Any]:
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, total=total, desc=desc, unit="shard", file=sys.stderr)


def index_shards(root: Path, shards: Sequence[str], *, num_workers: int, progress: bool) -> tuple[dict[str, int], list[str]]:
    """Write every shard's `.tar.idx`; (shard counts, part names). Errors name every bad shard;
    duplicate keys across shards are an error (Energon 7.3+ requires unique keys)."""
    jobs = [(str(root), rel) for rel in shards]
    counts: dict[str, int] = {}
    parts: set[str] = set()
    seen: dict[str, str] = {}
    errors: list[str] = []
    workers = max(1, min(num_workers, len(jobs)))
    if workers == 1:
        results: Iterable[Any] = map(_index_one, jobs)
        pool = None
    else:
        pool = ProcessPoolExecutor(workers)
        results = pool.map(_index_one, jobs, chunksize=max(1, len(jobs) // (8 * workers)))
    try:
        for rel, count, keys, ps, err in _progress(results, len(jobs), progress, "indexing"):
            if err:
                errors.append(err)
                continue
            counts[rel] = count
            parts.update(ps)
            for k in keys:
                other = seen.setdefault(k, rel)
                if other != rel:
                    errors.append(f"{root / rel}: key {k!r} also appears in {other}: keys must be unique across shards "
                                  "(give each shard's keys a prefix, e.g. the shard name)")
                    break
    finally:
        if pool is not None:
            pool.shutdown()
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise DatasetError("\n".join(errors[:5]) + more)
    return {rel: counts[rel] for rel in shards}, sorted(parts)


def split_by_ratio(shards: list[str], ratio: Sequence[float], *, shuffle: bool) -> dict[str, list[str]]:
    """Energon's rule: whole shards, ``split_end = int(n * cumulative ratio)``; sorted order
    unless ``shuffle`` (then ``random.Random(42)`` as ``energon prepare --shuffle-tars``)."""
    import random

    if len(ratio) != 3 or sum(ratio) <= 0 or min(ratio) < 0:
        raise DatasetError(f"--split {','.join(map(str, ratio))}: expected three non-negative numbers like 8,1,1")
    order = list(shards)
    if shuffle:
        random.Random(42).shuffle(order)
    total, cum, begin, out = sum(ratio), 0.0, 0, {}
    for name, r in zip(("train", "val", "test"), ratio):
        cum += r / total
        # The last part ends at the last shard: Energon's float sum can fall just short of 1
        # (8/12 + 2/12 + 2/12 = 0.9999999999999999) and silently leave a shard in no split.
        end = len(order) if name == "test" else int(len(order) * cum)
        out[name] = order[begin:end]
        begin = end
    return out


def split_by_patterns(shards: list[str], patterns: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """``--split-parts 'train:regex'``: brace-expanded regexes matched (re.match) on shard paths."""
    from zoo.data.energon.dataset import brace_expand

    out: dict[str, list[str]] = {}
    for name, pattern in patterns:
        regexes = [re.compile(p) for p in brace_expand(pattern)]
        out[name] = [s for s in shards if any(r.match(s) for r in regexes)]
    return out


def dataset_yaml(sample_type: str | None, field_map: dict[str, str] | None, parts: Sequence[str], *,
                 where: str) -> dict[str, Any]:
    if sample_type is None:
        return {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    cls = S.sample_type("megatron.energon", sample_type, where=where)
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("__")}
    fmap = dict(field_map or {})
    for name, spec in fmap.items():
        if name not in fields:
            from zoo.errors import suggest

            raise DatasetError(f"{where}: --field-map {name}=...: {cls.__name__} has no field {name!r} "
                               f"(fields: {', '.join(fields)}){suggest(name, fields)}")
        alts = [a.strip().partition("[")[0] for a in spec.split(",")]
        if not any(a in parts for a in alts):
            raise DatasetError(f"{where}: --field-map {name}={spec}: no part {spec!r} in the shards "
                               f"(parts found: {', '.join(parts)})")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in fmap]
    if missing:
        raise DatasetError(f"{where}: --field-map must map {', '.join(missing)} for {cls.__name__} "
                           f"(parts found: {', '.join(parts)})")
    return {"sample_type": {"__module__": "megatron.energon", "__class__": cls.__name__}, "field_map": fmap}


def prepare_webdataset(root: str | os.PathLike[str], *, split: Sequence[float] | None = (8, 1, 1),
                       split_parts: Sequence[tuple[str, str]] | None = None, exclude: str | None = None,
                       sample_type: str | None = None, field_map: dict[str, str] | None = None, crude: bool = False,
                       shuffle_tars: bool = False, num_workers: int | None = None, tar_index_only: bool = False,
                       force_overwrite: bool = False, skip_dataset_yaml: bool = False, progress: bool = False,
                       ask: Callable[[str, list[str]], str] | None = None) -> PrepareResult:
    """Index the shards under ``root`` and write the metadata ``energon prepare`` writes.
    ``ask(question, parts)`` is called (on a terminal) for what the flags leave open."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    info_path = root / META / ".info.json"
    if info_path.exists() and not (force_overwrite or tar_index_only):
        raise DatasetError(f"{root}: already prepared ({info_path} exists); pass --force-overwrite to redo it")
    shards = find_shards(root, exclude)
    if not shards:
        raise DatasetError(f"{root}: no .tar shards found" + (f" (after --exclude {exclude!r})" if exclude else ""))
    counts, parts = index_shards(root, shards, num_workers=num_workers or min(16, os.cpu_count() or 1),
                                 progress=progress)
    if tar_index_only:
        return PrepareResult(root, counts, parts, {})
    # Decide everything before writing anything: a bad flag leaves the dataset untouched.
    if split_parts:
        splits = split_by_patterns(shards, split_parts)
    else:
        if split is None:
            if ask is None:
                raise DatasetError(f"{root}: give --split 8,1,1 or --split-parts 'train:REGEX'")
            split = [float(x) for x in re.split(r"[,\s]+", ask("train/val/test split, e.g. 8,1,1", parts).strip())]
        splits = split_by_ratio(shards, split, shuffle=shuffle_tars)
    if sample_type == "CrudeWebdataset":  # energon's spelling of --crude
        sample_type, crude = None, True
    yaml_doc = None
    if not skip_dataset_yaml:
        if sample_type is None and not crude:
            if ask is None:
                raise DatasetError(f"{root}: give --sample-type NAME --field-map field=part,... or --crude "
                                   f"(parts found: {', '.join(parts)}; types: {', '.join(sorted(S.SAMPLE_TYPES))})")
            sample_type = ask("sample type (or 'crude')", parts).strip()
            if sample_type.lower() == "crude":
                sample_type = None
            else:
                answer = ask("field map, e.g. image=png,caption=txt", parts)
                field_map = parse_field_map(answer)
        yaml_doc = dataset_yaml(sample_type, field_map, parts, where=str(root))
    meta = root / META
    atomic_write_text(meta / ".info.json", json.dumps({"energon_version": ENERGON_COMPAT, "shard_counts": counts},
                                                      indent=2) + "\n")
    atomic_write_text(meta / "split.yaml", yaml.safe_dump({"split_parts": splits, "exclude": []}, sort_keys=False))
    if yaml_doc is not None:
        atomic_write_text(meta / "dataset.yaml", yaml.safe_dump(yaml_doc, sort_keys=False))
    return PrepareResult(root, counts, parts, splits)


def parse_field_map(text: str) -> dict[str, str]:
    """``image=png,caption=txt`` or the JSON ``{"image": "png"}`` energon takes. An alternative
    list keeps its commas when quoted in JSON: ``{"image": "jpg,png"}``."""
    text = text.strip()
    if text.startswith("{"):
        return {str(k): str(v) for k, v in json.loads(text).items()}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, part = item.partition("=")
        if not eq:
            raise DatasetError(f"--field-map {text!r}: expected field=part pairs like image=png,caption=txt")
        out[name.strip()] = part.strip()
    return out


# ---------------------------------------------------------------------------------- writing


def write_shards(out: Path, samples: Iterable[tuple[str, dict[str, bytes]]], *, shard_size: int,
                 prefix: str = "shard") -> list[str]:
    """Write samples (key, {part: bytes}) as ``shards/<prefix>-000000.tar`` ... (deterministic
    headers: mtime 0, uid 0, mode 0644), each file renamed into place when complete."""
    (out / "shards").mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    tar = None
    buf: io.BytesIO | None = None
    count = 0

    def close() -> None:
        assert tar is not None and buf is not None
        tar.close()
        atomic_write_bytes(out / names[-1], buf.getvalue())

    for key, parts in samples:
        if tar is None or count == shard_size:
            if tar is not None:
                close()
            names.append(f"shards/{prefix}-{len(names):06d}.tar")
            buf = io.BytesIO()
            tar = tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 (closed by close())
            count = 0
        for part, data in parts.items():
            info = tarfile.TarInfo(f"{key}.{part}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
        count += 1
    if tar is not None:
        close()
    return names


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digit_samples(*, size: int = 8, repeat: int = 1) -> Iterable[tuple[str, dict[str, bytes]]]:
    """scikit-learn's 1797 handwritten digits (bundled with the package, no download) as
    samples: ``png`` (grey, 0..16 scaled to 0..255, nearest-upscaled to ``size``), ``txt`` (a
    caption), ``cls`` (the digit), ``json`` (label, name, the VQA question and answer)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)
    if size != 8:
        from PIL import Image

        images = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.NEAREST)) for im in images])
    for r in range(repeat):
        for i, (im, label) in enumerate(zip(images, d.target)):
            meta = {"label": int(label), "label_name": DIGIT_NAMES[label], "question": "What digit is this?",
                    "answer": DIGIT_NAMES[label], "answers": [DIGIT_NAMES[label]]}
            key = f"digit{i:05d}" if repeat == 1 else f"r{r:03d}_digit{i:05d}"
            yield key, {"png": png_bytes(im), "txt": f"a handwritten {label}".encode(), "cls": str(int(label)).encode(),
                        "json": json.dumps(meta).encode()}


def folder_samples(folder: Path, captions: Path | None) -> Iterable[tuple[str, dict[str, bytes]]]:
    """Images under ``folder`` (sorted), each with the caption of ``NAME.txt`` beside it, or of
    a CSV (``file,caption``) / JSONL (``{"file": ..., "caption": ...}``) file."""
    table: dict[str, str] = {}
    if captions is not None:
        text = captions.read_text(encoding="utf-8")
        if captions.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                        table[str(row["file"])] = str(row["caption"])
                    except (ValueError, KeyError) as e:
                        raise DatasetError(f"{captions}:{n}: expected {{\"file\": ..., \"caption\": ...}} ({e})") from None
        else:
            import csv

            for row in csv.DictReader(io.StringIO(text)):
                if "file" not in row or "caption" not in row:
                    raise DatasetError(f"{captions}: a CSV with the columns file,caption")
                table[row["file"]] = row["caption"]
    exts = tuple("." + e for e in S.IMAGE_EXTENSIONS)
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in exts)
    if not files:
        raise DatasetError(f"{folder}: no images ({', '.join(S.IMAGE_EXTENSIONS)})")
    for p in files:
        rel = p.relative_to(folder).as_posix()
        caption = table.get(rel) or table.get(p.name)
        if caption is None and p.with_suffix(".txt").exists():
            caption = p.with_suffix(".txt").read_text(encoding="utf-8").strip()
        if caption is None:
            raise DatasetError(f"{p}: no caption (no {p.with_suffix('.txt').name}, not in {captions or 'a captions file'})")
        key = re.sub(r"[^A-Za-z0-9_/-]", "_", rel.rsplit(".", 1)[0])
        yield key, {p.suffix.lower().lstrip(".").replace("jpeg", "jpg"): p.read_bytes(), "txt": caption.encode()}


__all__ = ["PrepareResult", "digit_samples", "find_shards", "folder_samples", "index_shards", "parse_field_map",
           "png_bytes", "prepare_webdataset", "split_by_patterns", "split_by_ratio", "write_shards"]
