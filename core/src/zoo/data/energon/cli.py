"""The `zoo prepare webdataset|images|convert-pickle` and `zoo data info|lint|preview` commands."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from zoo.errors import UsageError, at_least_one


def _ratio(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise UsageError(f"--split {text!r}: expected three numbers like 8,1,1") from None


def _ask(question: str, parts: list[str]) -> str:
    print(f"parts found: {', '.join(parts)}", file=sys.stderr)
    return input(f"{question}: ")


def cmd_webdataset(args: argparse.Namespace) -> int:
    from zoo.data.energon.prepare import parse_field_map, prepare_webdataset

    split_parts = []
    for item in args.split_parts or []:
        name, sep, regex = item.partition(":")
        if not sep:
            raise UsageError(f"--split-parts {item!r}: expected NAME:REGEX, e.g. 'train:shards/train_.*'")
        split_parts.append((name, regex))
    t0 = time.perf_counter()
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    res = prepare_webdataset(
        args.path, split=_ratio(args.split) if args.split else None, split_parts=split_parts or None,
        exclude=args.exclude, sample_type=args.sample_type,
        field_map=parse_field_map(args.field_map) if args.field_map else None, crude=args.crude,
        shuffle_tars=args.shuffle_tars, num_workers=args.num_workers, tar_index_only=args.tar_index_only,
        force_overwrite=args.force_overwrite, progress=not args.no_progress and sys.stderr.isatty(),
        ask=_ask if tty and not args.non_interactive else None)
    _summary(res, time.perf_counter() - t0, args.split)
    return 0


def _summary(res: Any, seconds: float, split: str | None = None) -> None:
    print(f"prepared {res.root}: {res.total:,} samples in {len(res.shard_counts)} shards ({seconds:.1f}s); "
          f"parts: {', '.join(res.parts)}")
    for name, shards in res.splits.items():
        n = sum(res.shard_counts[s] for s in shards)
        print(f"  {name:<6} {len(shards):>5} shards {n:>10,} samples")
    # The ratio divides whole shards (as energon's): a part it gives a share can still end up empty.
    asked = dict(zip(res.splits, _ratio(split))) if split else {}
    empty = [name for name, shards in res.splits.items() if not shards and asked.get(name, 0) > 0]
    if empty:
        print(f"note: {' and '.join(empty)} got no shard of {len(res.shard_counts)} at --split {split} (the split "
              "divides whole shards): more, smaller shards give every part its share")


def cmd_images(args: argparse.Namespace) -> int:
    from zoo.data.energon.media import prepare_images

    t0 = time.perf_counter()
    res = prepare_images(args.output, dataset=args.dataset, folder=args.folder, captions=args.captions,
                         shard_size=args.shard_size, split=_ratio(args.split), size=args.size, repeat=args.repeat,
                         vae=args.vae, text_encoder=args.text_encoder, force_overwrite=args.force_overwrite,
                         progress=sys.stderr.isatty(), sample_type=args.sample_type)
    _summary(res, time.perf_counter() - t0, args.split)
    print(f"next: zoo data info {res.root}")
    return 0


def cmd_video(args: argparse.Namespace) -> int:
    from zoo.data.energon.media import prepare_video

    t0 = time.perf_counter()
    res = prepare_video(args.output, dataset=args.dataset, count=args.count, frames=args.num_frames, size=args.size,
                        split=_ratio(args.split), vae=args.vae, text_encoder=args.text_encoder,
                        force_overwrite=args.force_overwrite, progress=sys.stderr.isatty())
    _summary(res, time.perf_counter() - t0, args.split)
    print(f"next: zoo train --model dit-video data.path={res.root}")
    return 0


def cmd_convert_pickle(args: argparse.Namespace) -> int:
    from zoo.data.energon.convert import convert_pickle

    n = convert_pickle(args.path, to=args.to)
    print(f"converted {n:,} pickled parts under {args.path} to .{args.to} (read without running their code)")
    return 0


def _indexed(path: str) -> Any:
    """The Megatron dataset at ``path`` (a prefix, or its .idx/.bin), or None when it is not one."""
    from pathlib import Path

    from zoo.data.indexed import IndexedDataset

    prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
    if Path(prefix + ".idx").exists() or Path(prefix + ".bin").exists():
        return IndexedDataset(prefix)
    return None


def cmd_info(args: argparse.Namespace) -> int:
    from zoo.data.energon.dataset import META, WebDataset
    from zoo.data.energon.metadataset import is_metadataset

    if args.path.endswith(".jsonl"):
        return _conversations(args, lint=False)
    if (ds := _indexed(args.path)) is not None:
        print(ds.describe())
        return 0
    if is_metadataset(args.path):
        return _info_metadataset(args.path)

    ds = WebDataset(args.path, split_part=next(iter(_splits(args.path))), load_config=False)
    total = sum(ds.shard_counts.values())
    size = sum(ds.storage.size(s) for s in ds.shards)
    info = ds.storage.text(f"{META}/.info.json") if ds.storage.exists(f"{META}/.info.json") else "{}"
    import json

    version = json.loads(info).get("energon_version", "?")
    from zoo.data.energon.dataset import read_dataset_config

    try:
        cfg = read_dataset_config(ds.storage)
        kind = "crude (CrudeWebdataset)" if cfg.sample_class is None else cfg.sample_class.__name__
        fmap = f" field_map {cfg.field_map}" if cfg.field_map else ""
    except Exception as e:  # info must work on half-prepared datasets too
        kind, fmap = f"unknown ({e})", ""
    print(f"dataset {ds.storage.display}")
    print(f"  samples {total:,} in {len(ds.shards)} shards, {size / 1e6:,.1f} MB; prepared as energon {version}")
    print(f"  sample type {kind}{fmap}")
    for part in _splits(args.path):
        d = WebDataset(args.path, split_part=part, load_config=False)
        n = len(d)
        print(f"  {part:<6} {n:>10,} samples ({n / max(total, 1):6.1%}) in {len({s for s, _, _ in d.segments})} shards")
    return 0


def _info_metadataset(path: str) -> int:
    """Each split's leaves with their share of the blend (or repetitions) and sample counts."""
    from zoo.data.energon.dataset import DatasetError, WebDataset
    from zoo.data.energon.metadataset import load_metadataset, split_names
    from zoo.data.energon.reader import resolve_subset

    print(f"metadataset {path}")
    for split in split_names(path):
        leaves, mode = load_metadataset(path, split)
        print(f"  {split} ({mode}):")
        for leaf in leaves:
            try:
                ds = WebDataset(leaf.path, split_part=leaf.split_part, split_config=leaf.split_config,
                                dataset_config=leaf.dataset_config, load_config=False)
            except DatasetError as e:
                raise DatasetError(f"{path}: split {split}: {e}") from None
            lo, hi = resolve_subset(leaf.subset, len(ds), f"{path}: {leaf.path}")
            n = hi - lo
            share = f"weight {leaf.weight:.3g}" if mode != "blend_epochized" else f"repetitions {leaf.repetitions:g}"
            soe = leaf.shuffle_over_epochs
            shuffled = "" if soe == 1 else f"  (shuffle_over_epochs {'null' if soe is None else soe})"
            print(f"    {share:<18} {n:>10,} samples  {leaf.path} [{leaf.split_part}]{shuffled}")
    return 0


def _splits(path: str) -> list[str]:
    from zoo.data.energon.dataset import META, read_split_file
    from zoo.data.energon.storage import Storage

    st = Storage(path)
    if not st.exists(f"{META}/split.yaml"):
        return ["train"]
    return [str(p) for p in read_split_file(st)["split_parts"]]


def cmd_lint(args: argparse.Namespace) -> int:
    """Every `.tar.idx` against its tar and `.info.json`, then every sample of every split decoded."""
    from zoo.data.energon.dataset import WebDataset, make_sample

    if args.path.endswith(".jsonl"):
        return _conversations(args, lint=True)
    if (indexed := _indexed(args.path)) is not None:
        return _lint_indexed(indexed)
    bad: list[str] = []
    checked = 0
    for part in (args.split_parts.split(",") if args.split_parts else _splits(args.path)):
        ds = WebDataset(args.path, split_part=part, allow_pickle=args.allow_pickle)
        index_problems = []
        for sid in sorted({s for s, _, _ in ds.segments}):
            try:
                ds.index(sid)
            except Exception as e:
                index_problems.append(str(e).splitlines()[0])
        bad += index_problems
        if index_problems:  # sample positions come from the indexes: decoding would only repeat this
            continue
        for i in range(len(ds)):
            try:
                make_sample(ds, i, restore_key=("s", 0, i), subflavors=None)
            except Exception as e:
                bad.append(str(e).splitlines()[0])
            checked += 1
    for line in bad[:50]:
        print(line)
    print(f"{checked:,} samples checked, {len(bad)} problem(s)" + (" (first 50 shown)" if len(bad) > 50 else ""))
    return 1 if bad else 0


def _conversations(args: argparse.Namespace, *, lint: bool) -> int:
    from zoo.data.sft_inspect import describe

    return describe(args.path, tokenizer=args.tokenizer, chat_template=args.chat_template,
                    seq_length=args.seq_length, lint=lint)


def _lint_indexed(ds: Any) -> int:
    """Opening checked the tables against each other and the files (every sequence lies inside
    ``.bin``, back to back); reading all of ``.bin`` once checks its pages can be read (a damaged
    disk or a file that shrank fails here, not in the middle of training)."""
    import numpy as np

    with open(ds.bin_path, "rb") as f:
        buf = bytearray(1 << 24)
        while f.readinto(buf):
            pass
    tokens = int(ds.sequence_lengths.sum(dtype=np.int64))
    print(ds.describe())
    print(f"{len(ds):,} sequences read, {tokens:,} tokens, 0 problems")
    return 0


def cmd_preview(args: argparse.Namespace) -> int:
    from zoo.data.energon.dataset import WebDataset, make_sample

    if args.path.endswith(".jsonl"):
        from zoo.data.sft_inspect import preview

        return preview(args.path, tokenizer=args.tokenizer, chat_template=args.chat_template, n=args.n)
    ds = WebDataset(args.path, split_part=args.split_part, allow_pickle=args.allow_pickle)
    for i in range(min(args.n, len(ds))):
        s = make_sample(ds, i, restore_key=("s", 0, i), subflavors=None)
        fields = s.items() if isinstance(s, dict) else ((k, getattr(s, k)) for k in s.__dataclass_fields__)
        print(f"--- sample {i}")
        for k, v in fields:
            if k in ("__restore_key__", "__sources__"):
                continue
            if hasattr(v, "shape"):
                v = f"{type(v).__name__} {tuple(v.shape)} {getattr(v, 'dtype', '')} min {float(v.min()):.3g} max {float(v.max()):.3g}"
            elif isinstance(v, bytes):
                v = f"{len(v)} bytes"
            print(f"  {k}: {v}")
    return 0


def add_prepare_parsers(prep: Any) -> None:
    w = prep.add_parser("webdataset", help="index WebDataset tar shards as Energon does (.tar.idx, .nv-meta/)")
    w.add_argument("path")
    w.add_argument("--split", help="train,val,test ratio over whole shards, e.g. 8,1,1")
    w.add_argument("--split-parts", action="append", metavar="NAME:REGEX", help="a split by shard-path regex (repeatable)")
    w.add_argument("--exclude", metavar="REGEX", help="leave out shards whose path matches")
    w.add_argument("--sample-type", help="CaptioningSample, ImageSample, VQASample, ... (dataset.yaml)")
    w.add_argument("--field-map", help="field=part pairs, e.g. image=png,caption=txt (or energon's JSON)")
    w.add_argument("--crude", action="store_true", help="a CrudeWebdataset (plain dicts, cooked by your task encoder)")
    w.add_argument("--shuffle-tars", action="store_true", help="shuffle shards before splitting (seed 42, as energon)")
    w.add_argument("--num-workers", type=at_least_one, help="indexing processes (default: cores, at most 16)")
    w.add_argument("--tar-index-only", action="store_true", help="only rebuild the .tar.idx files")
    w.add_argument("--force-overwrite", action="store_true", help="redo an already prepared dataset")
    w.add_argument("--non-interactive", action="store_true", help="never prompt (the default off a terminal)")
    w.add_argument("--no-progress", action="store_true")
    w.set_defaults(func=cmd_webdataset)

    i = prep.add_parser("images", help="images with captions (or the built-in digits) -> a prepared Energon dataset")
    i.add_argument("output")
    i.add_argument("--dataset", choices=["digits"], help="scikit-learn's handwritten digits (no download)")
    i.add_argument("--folder", help="a folder of images; captions from NAME.txt or --captions")
    i.add_argument("--captions", help="CSV (file,caption) or JSONL ({file, caption})")
    i.add_argument("--shard-size", type=at_least_one, default=100, help="samples per shard")
    i.add_argument("--split", default="8,1,1")
    i.add_argument("--sample-type", choices=["CaptioningSample", "VQASample", "ImageClassificationSample"],
                   default="CaptioningSample", help="digits: captions ('a handwritten 7', CLIP), question/answer pairs "
                   "('What digit is this?' -> 'seven', LLaVA) or classes (7, a class-conditional DiT)")
    i.add_argument("--size", type=at_least_one, default=8, help="digits: side in pixels (nearest upscaling)")
    i.add_argument("--repeat", type=at_least_one, default=1, help="digits: write the 1797 images this many times")
    i.add_argument("--vae", metavar="DIR", help="a local diffusers AutoencoderKL: also store its latents (latent.npy)")
    i.add_argument("--text-encoder", metavar="DIR", help="a local T5 encoder: also store caption embeddings (t5.npy)")
    i.add_argument("--force-overwrite", action="store_true")
    i.set_defaults(func=cmd_images)

    v = prep.add_parser("video", help="a built-in video dataset's clips (captioned, embedded) -> a prepared Energon "
                        "dataset (DiT's moving digits)")
    v.add_argument("output")
    v.add_argument("--dataset", default="moving-digits", help="a dataset whose plugin declares a clip source")
    v.add_argument("--count", type=at_least_one, default=2000, help="clips")
    v.add_argument("--num-frames", type=at_least_one, default=8)
    v.add_argument("--size", type=at_least_one, default=16, help="canvas side in pixels")
    v.add_argument("--split", default="18,1,1")
    v.add_argument("--vae", metavar="DIR", help="a local diffusers AutoencoderKL: also store the frames' latents")
    v.add_argument("--text-encoder", metavar="DIR", help="a local T5 encoder (default: the fixed-seed tiny T5)")
    v.add_argument("--force-overwrite", action="store_true")
    v.set_defaults(func=cmd_video)

    c = prep.add_parser("convert-pickle", help="rewrite .pickle/.pyd parts as .pickle.npy (or .pickle.pth), safely")
    c.add_argument("path")
    c.add_argument("--to", choices=["npy", "pth"], default="npy")
    c.set_defaults(func=cmd_convert_pickle)


def add_data_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="inspect datasets (Energon, Megatron .bin/.idx, sft .jsonl): info, lint, preview")
    what = p.add_subparsers(dest="what", metavar="ACTION", required=True)
    i = what.add_parser("info", help="samples, shards, splits and sample type")
    i.add_argument("path")
    i.set_defaults(func=cmd_info)
    lint = what.add_parser("lint", help="check every index and decode every sample")
    lint.add_argument("path")
    pv = what.add_parser("preview", help="print the first samples decoded (sft .jsonl: rendered, learned tokens marked)")
    pv.add_argument("path")
    pv.add_argument("--split-part", default="train")
    pv.add_argument("-n", type=at_least_one, default=3)
    pv.add_argument("--allow-pickle", action="store_true")
    pv.set_defaults(func=cmd_preview)
    for q in (i, lint, pv):  # (a conversations .jsonl: tokens, learned tokens and packed rows with a tokenizer)
        q.add_argument("--tokenizer", help="sft .jsonl: the tokenizer (directory, or a zoo run) to count tokens with")
        q.add_argument("--chat-template", help="sft .jsonl: a Jinja chat template file (default: the tokenizer's)")
        q.add_argument("--seq-length", type=at_least_one, help="sft .jsonl: the rows the conversations pack into")
    lint.add_argument("--split-parts", help="comma-separated (default: all)")
    lint.add_argument("--allow-pickle", action="store_true")
    lint.set_defaults(func=cmd_lint)


__all__ = ["add_data_parser", "add_prepare_parsers"]
