"""`zoo checkpoint inspect`: what a checkpoint holds, whether every byte is intact, and how two
checkpoints differ -- for a checkpoint that will not load, a resume that does not continue the
curve, a conversion that changed a tensor.

    zoo checkpoint inspect PATH            family, step, layout, every tensor and its pieces
    zoo checkpoint inspect PATH --verify   every piece's size and checksum, problems by file
    zoo checkpoint inspect A --diff B      the tensors that differ, and by how much
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.model_dir import read_meta, resolve_checkpoint
from zoo.checkpoint.tensorio import SAFETENSORS_DTYPES, CheckpointError, read_json

# safetensors' dtype names (format 1 files) -> torch's
_TORCH_DTYPES = {v: str(k).removeprefix("torch.") for k, v in SAFETENSORS_DTYPES.items()}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def _layout(path: Path, world: int | None) -> str:
    """The layout it was saved under: its config.yaml's parallel section, data parallel the rest
    of the ranks the index names."""
    import yaml

    par: dict[str, Any] = {}
    with contextlib.suppress(yaml.YAMLError, OSError, AttributeError):
        par = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("parallel") or {}
    sizes = {k: par.get(k) for k in ("tp", "pp", "vpp", "cp", "ep") if isinstance(par.get(k), int)}
    if world:
        sizes["dp"] = world // max(1, math.prod(v for k, v in sizes.items() if k in ("tp", "pp", "cp")))
    parts = [f"{k}={v}" for k, v in sizes.items() if v != 1]
    parts += [f"{k}={par[k]}" for k in ("zero", "fsdp", "sequence_parallel") if par.get(k)]
    return ", ".join(parts) or "one process (no parallelism)"


def describe(path: Path) -> list[str]:
    """The lines of ``inspect``."""
    md = read_meta(path)
    meta = md.meta
    state = read_json(path / "state.json") if (path / "state.json").is_file() else {}
    lines = [f"{path}", f"  family {meta.get('family')}, flavor {meta.get('flavor')}, kind {meta.get('kind', 'model')}, "
             f"step {state.get('step', meta.get('step', '?'))}, consumed samples {state.get('consumed_samples', '?')}"
             + (f", skipped steps {state['skipped_steps']}" if state.get("skipped_steps") else ""),
             f"  format version {meta.get('format_version')} ({'sharded' if meta.get('sharded') else 'single file'}); "
             f"saved by {_world(path)} under {_layout(path, _ranks(path))}"]
    tensors = list(_tensors(path, md))
    model = [t for t in tensors if "::" not in t[0] and not t[0].startswith("ema/")]
    optim = [t for t in tensors if "::" in t[0]]
    ema = [t for t in tensors if t[0].startswith("ema/")]
    fields = sorted({t[0].partition("::")[2] for t in optim})
    total = sum(t[3] for t in tensors)
    lines.append(f"  {len(model)} model tensors ({sum(math.prod(t[1]) for t in model):,} parameters), "
                 f"optimizer state: {', '.join(fields) or 'none'}, moving average: {'yes' if ema else 'no'}, "
                 f"loader state: {_loader(state)}; {total / 1e6:.2f} MB of tensors")
    width = max((len(t[0]) for t in tensors), default=0)
    for name, shape, dtype, _, pieces in tensors:
        lines.append(f"  {name:<{width}}  {str(list(shape)):<18} {dtype:<9} {pieces}")
    return lines


def _ranks(path: Path) -> int | None:
    index = path / "index.json"
    return read_json(index).get("world_size") if index.is_file() else None


def _world(path: Path) -> str:
    n = _ranks(path)
    return "one process" if n is None else f"{n} rank{'s' if n != 1 else ''}"


def _loader(state: dict[str, Any]) -> str:
    if state.get("data"):
        return "the Energon loader's position (state.json 'data')"
    return "consumed samples only (Megatron data restarts from that count)" if state else "none"


def _tensors(path: Path, md: Any) -> Iterator[tuple[str, tuple[int, ...], str, int, str]]:
    """(name, global shape, dtype, bytes, pieces) of every tensor."""
    if md.meta.get("sharded"):
        from zoo.checkpoint.sharded import ShardedCheckpoint

        with ShardedCheckpoint(path) as ck:
            for name, t in ck.tensors.items():
                ps = t["pieces"]
                files = sorted({p["file"].rsplit("/", 1)[-1] for p in ps})
                where = f"{len(ps)} piece{'s' if len(ps) != 1 else ''} in {', '.join(files)}"
                if len(ps) > 1:
                    where += ": " + " ".join(f"{p['offset']}+{p['shape']}" for p in ps)
                yield name, tuple(t["shape"]), t["dtype"], _nbytes(tuple(t["shape"]), t["dtype"]), where
        return
    from safetensors import safe_open

    for f in ("model.safetensors", "optimizer.safetensors", "ema.safetensors"):
        if (path / f).is_file():
            with safe_open(str(path / f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 (not a dict)
                    sl = h.get_slice(name)
                    shape, dtype = tuple(sl.get_shape()), _TORCH_DTYPES[str(sl.get_dtype())]
                    yield name, shape, dtype, _nbytes(shape, dtype), f"whole in {f}"


def verify(path: Path) -> list[str]:
    """Every piece read back against its size and checksum: the problems, each naming its file."""
    md = read_meta(path)
    problems = []
    if md.meta.get("sharded"):
        from zoo.checkpoint.sharded import ShardedCheckpoint

        with ShardedCheckpoint(path) as ck:
            for name, t in ck.tensors.items():
                for p in t["pieces"]:
                    try:
                        ck.read_piece(p, getattr(torch, t["dtype"]))
                    except CheckpointError as e:
                        problems.append(f"{p['file']}: {name} {p['offset']}+{p['shape']}: {_short(e, path)}")
        return problems
    from zoo.checkpoint.tensorio import load_file

    for f in ("model.safetensors", "optimizer.safetensors", "ema.safetensors"):
        if (path / f).is_file():
            try:
                load_file(path / f)  # (format 1 has no checksums: every header and size is checked)
            except CheckpointError as e:
                problems.append(f"{f}: {_short(e, path)}")
    return problems


def _short(e: Exception, path: Path) -> str:
    return str(e).replace(f"{path}/", "").replace(str(path), ".")


def diff(a: Path, b: Path) -> list[str]:
    """The tensors that differ between two checkpoints: missing on one side, another shape or
    dtype, or values apart (max abs difference), one tensor in memory at a time."""
    from zoo.checkpoint.reader import open_reader

    ra, rb = open_reader(read_meta(a)), open_reader(read_meta(b))
    try:
        na, nb = set(ra.names()), set(rb.names())
        out = [f"only in {a}: {n}" for n in sorted(na - nb)] + [f"only in {b}: {n}" for n in sorted(nb - na)]
        for n in sorted(na & nb):
            ta, tb = ra.full(n), rb.full(n)
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                out.append(f"{n}: {list(ta.shape)} {ta.dtype} vs {list(tb.shape)} {tb.dtype}")
            elif not bool((ta == tb).all()):
                d = (ta.double() - tb.double()).abs()
                out.append(f"{n}: max abs difference {float(d.max()):.3g} (mean {float(d.mean()):.3g}), "
                           f"{int((d > 0).sum()):,} of {d.numel():,} elements")
        return out
    finally:
        ra.close()
        rb.close()


def cmd_checkpoint(args: argparse.Namespace) -> int:
    path = resolve_checkpoint(args.path)
    if args.diff:
        other = resolve_checkpoint(args.diff)
        found = diff(path, other)
        print("\n".join(found) if found else f"no differences: every tensor of {path} equals {other}'s")
        return 1 if found else 0
    if args.verify:
        problems = verify(path)
        for line in problems:
            print(line)
        n = sum(1 for _ in _tensors(path, read_meta(path)))
        print(f"{path}: {len(problems)} problem(s) in {n} tensors" if problems else f"{path}: all {n} tensors intact")
        return 1 if problems else 0
    print("\n".join(describe(path)))
    return 0


__all__ = ["cmd_checkpoint", "describe", "diff", "verify"]
