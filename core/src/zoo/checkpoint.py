"""Training checkpoints: model, optimizer state, loss-scaler state, RNG states, step and consumed
samples, everything needed to continue bitwise. Training writes the sharded format 2
(`save_sharded`, files in `zoo.dist_checkpoint`); format 1, described here, is still read.

Layout under ``checkpoint.dir``::

    step_00000100/   model.safetensors, optimizer.safetensors, rng.safetensors, state.json,
                     config.yaml, tokenizer.json, zoo.json, COMPLETE (last)
    latest           name of the newest complete checkpoint (updated atomically after COMPLETE)

A directory without ``COMPLETE`` is never loaded; ``resume=auto`` takes the newest complete one,
so a process killed at any moment leaves the previous checkpoint as the one picked. No pickle:
tensors in safetensors, the rest in JSON.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zoo.convert import COMPLETE, ModelDir, read_meta, write_model_dir
from zoo.io import atomic_write_text
from zoo.tensorio import CheckpointError, load_file

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / COMPLETE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete checkpoint of a checkpoint root or run directory."""
    p = Path(path)
    for root in (p, p / "checkpoints"):
        if root.is_dir() and not (root / "zoo.json").exists():
            found = latest(root)
            if found is not None:
                return found
    return p


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


Transform = Callable[[str, torch.Tensor], torch.Tensor]


def optimizer_tensors(opt: torch.optim.Optimizer, model: torch.nn.Module, transform: Transform | None = None
                      ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Optimizer state keyed by parameter name (layout independent), plus its param groups as JSON.

    ``transform(param_name, tensor)`` maps parameter-shaped state to its stored form (the full
    tensor of a tensor-parallel shard)."""
    names = _param_names(model)
    state = opt.state_dict()
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in state["state"].items():
        for k, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            if transform is not None and t.dim() > 0:
                t = transform(order[idx], t)
            tensors[f"{order[idx]}::{k}"] = t
    groups = []
    for g, live in zip(state["param_groups"], opt.param_groups):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in live["params"]]})
    return tensors, groups


def load_optimizer(opt: torch.optim.Optimizer, model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                   groups: list[dict[str, Any]], *, where: Path, transform: Transform | None = None) -> None:
    names = _param_names(model)
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    saved_order = [n for g in groups for n in g["params"]]
    if saved_order != order:
        missing = sorted(set(order) - set(saved_order)) or sorted(set(saved_order) - set(order))
        raise CheckpointError(f"{where}: optimizer state is for other parameters (first difference: {missing[:1] or order[:1]})")
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.partition("::")
        if transform is not None and value.dim() > 0:
            value = transform(name, value)
        state.setdefault(order.index(name), {})[field] = value
    param_groups = []
    i = 0
    for g in groups:
        n = len(g["params"])
        param_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    opt.load_state_dict({"state": state, "param_groups": param_groups})


def save_single_file(root: Path, *, step: int, run: Any, model: torch.nn.Module, opt: torch.optim.Optimizer,
         scaler: torch.amp.GradScaler, consumed_samples: int, tokenizer_dir: Path | None,
         keep_last: int | None, write: bool = True, model_state: dict[str, torch.Tensor] | None = None,
         transform: Transform | None = None,
         opt_state: tuple[dict[str, torch.Tensor], list[dict[str, Any]]] | None = None) -> Path:
    """Format 1 (what zoo 0.1 wrote, still read): full tensors in one file per kind, written by one
    process. Training now writes the sharded format 2 (`save_sharded`); this writer stays as the
    reference for format-1 compatibility. ``opt_state`` replaces the optimizer's own export."""
    opt_tensors, groups = opt_state if opt_state is not None else optimizer_tensors(opt, model, transform)
    path = step_dir(root, step)
    if not write:
        return path
    # A save killed mid-write leaves only a hidden partial directory (never loaded); clear them.
    for stale in root.glob(".step_*.partial-*") if root.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    py_state = random.getstate()
    np_state = np.random.get_state()
    state = {
        "step": step,
        "consumed_samples": consumed_samples,
        "optimizer_param_groups": groups,
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    path = write_model_dir(
        path, family=run.family, flavor=run.flavor, config=run.model,
        state=model_state if model_state is not None else model.state_dict(),
        extra_meta={"kind": "train", "step": step},
        tensor_files={"optimizer.safetensors": opt_tensors, "rng.safetensors": rng},
        files={"state.json": json.dumps(state).encode(), "config.yaml": run.to_yaml().encode()},
        tokenizer_from=tokenizer_dir, overwrite=True,
    )
    atomic_write_text(root / "latest", path.name + "\n")
    if keep_last:
        for _, old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load_train_state(md: ModelDir) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    if md.meta.get("kind") != "train" or not (md.path / "state.json").is_file():
        raise CheckpointError(f"{md.path}: a model checkpoint without training state; use checkpoint.load to start from its weights")
    state = json.loads((md.path / "state.json").read_text())
    return state, load_file(md.path / "optimizer.safetensors"), load_file(md.path / "rng.safetensors")


def restore_rng(state: dict[str, Any], rng: dict[str, torch.Tensor]) -> None:
    """Format 1 keeps Python's and NumPy's RNG states in state.json."""
    from zoo.dist_checkpoint import restore_rng as restore

    restore(rng, {"python": state["python_rng"], "numpy": state["numpy_rng"]})


__all__ = ["complete_checkpoints", "latest", "load_sharded", "load_train_state", "read_meta", "resolve_checkpoint",
           "save_sharded", "save_single_file"]


# ---------------------------------------------------------------------- sharded (format 2) form


def _style(model: torch.nn.Module, name: str) -> str | None:
    from zoo.parallel.apply import tp_style

    st = tp_style(model, name)
    return st[0] if st else None


def sharded_entries(par: Any, model: torch.nn.Module, optimizer_state: dict[str, torch.Tensor],
                    ties: dict[str, str]) -> list[Any]:
    """The tensors this rank holds, under single-process names, each marked with whether this
    rank is the one replica that writes it (first data/context rank; first TP rank for tensors
    TP does not split). ``optimizer_state`` is ``local name::field`` -> TP-local tensor."""
    from zoo.dist_checkpoint import Entry

    replica_0 = par.dp_rank == 0 and par.cp_rank == 0
    out = []
    for name, t in model.state_dict().items():
        canon = par.canonical(name)
        if canon != name or name in ties:  # a tied alias: stored once, under the name it shares
            continue
        style = _style(model, name)
        out.append(Entry(name, t, style, replica_0 and (style is not None or par.tp_rank == 0)))
    for key, t in optimizer_state.items():
        name, _, field = key.partition("::")
        canon = par.canonical(name)
        if canon != name or name in ties:
            continue
        style = _style(model, name) if t.dim() else None
        out.append(Entry(key, t, style, replica_0 and (style is not None or par.tp_rank == 0)))
    return out


def save_sharded(root: Path, *, step: int, run: Any, par: Any, model: torch.nn.Module, optimizer_state: dict[str, torch.Tensor],
                 groups: list[dict[str, Any]], scaler: torch.amp.GradScaler, consumed_samples: int,
                 tokenizer_dir: Path | None, keep_last: int | None, ties: dict[str, str], saver: Any, token: str,
                 rank: int, world_size: int, timeout_s: float) -> Path:
    """Every rank calls this at the same step; the snapshot is taken now, the writing is done by
    ``saver`` (now, or in the background). Returns the directory the checkpoint will have."""
    from zoo.config import _plain
    from zoo.dist_checkpoint import finalize, snapshot, write_rank

    saver.wait()  # at most one save in flight, and its snapshot buffers are free again
    snap = snapshot(sharded_entries(par, model, optimizer_state, ties), tp=par.tp, tp_rank=par.tp_rank,
                    copy=saver.asynchronous and saver.copy, pool=saver.pool, rng={"tp_stream": par.tp_rng.state()})
    dst = step_dir(root, step)
    tmp = root / f".{dst.name}.partial-{token}"
    state = {"step": step, "consumed_samples": consumed_samples, "optimizer_param_groups": groups,
             "scaler": scaler.state_dict() if scaler.is_enabled() else None}
    meta = {"format": "zoo", "family": run.family, "flavor": run.flavor, "model_config": _plain(run.model),
            "ties": ties, "kind": "train", "step": step}
    config_yaml = run.to_yaml().encode()

    def work() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".step_*.partial-*"):  # killed saves of earlier runs
                if not stale.name.endswith(f"-{token}"):
                    shutil.rmtree(stale, ignore_errors=True)
        write_rank(tmp, rank, snap)
        if rank == 0:
            finalize(tmp, dst, world_size=world_size, meta=meta, state=state, files={"config.yaml": config_yaml},
                     tokenizer_from=tokenizer_dir, timeout_s=timeout_s)
            if keep_last:
                for _, old in complete_checkpoints(root)[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)

    saver.submit(work)
    return dst


def load_sharded(path: Path, *, par: Any, model: torch.nn.Module, rank: int, world_size: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], Any]:
    """This rank's model tensors (local names), optimizer tensors (``canonical name::field``,
    TP-local), the loop state and the RNG states to restore, read from a sharded checkpoint."""
    from zoo.dist_checkpoint import ShardedCheckpoint

    ck = ShardedCheckpoint(path)
    what = f" (loading {path})"
    local: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        local[name] = ck.read_local(par.canonical(name), t.shape, _style(model, name), par.tp, par.tp_rank, what=what)
    opt: dict[str, torch.Tensor] = {}
    fields: dict[str, list[str]] = {}
    for key in ck.names():
        pname, sep, field = key.partition("::")
        if sep:
            fields.setdefault(pname, []).append(field)
    for name, p in model.named_parameters():
        canon = par.canonical(name)
        for field in fields.get(canon, []):
            key = f"{canon}::{field}"
            if len(ck.shape(key)) == 0:
                opt[key] = ck.full(key)
            else:
                opt[key] = ck.read_local(key, p.shape, _style(model, name), par.tp, par.tp_rank, what=what)
    state = json.loads((path / "state.json").read_text())
    same_world = ck.index.get("world_size") == world_size
    rng = ck.rng(rank if same_world else 0)
    if not same_world:  # another layout: its tensor-parallel dropout streams start afresh
        rng[0].pop("tp_stream", None)
    ck.close()
    return local, opt, state, rng


def tp_cut(local_shape: tuple[int, ...], style: str | None, tp: int, tp_rank: int
           ) -> tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]:
    """The global shape of a tensor whose TP shard has ``local_shape``, and the function that cuts
    that shard out of the global tensor (the layout of `zoo.dist_checkpoint.regions`)."""
    from zoo.dist_checkpoint import regions

    shape, regs = regions(local_shape, style, tp, tp_rank)

    def cut(full: torch.Tensor) -> torch.Tensor:
        out = torch.empty(local_shape, dtype=full.dtype)
        for sl, offset in regs:
            part = out[sl]
            part.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, part.shape))])
        return out

    return shape, cut


def load_initial_weights(source: str, *, par: Any, model: torch.nn.Module, family: str) -> dict[str, torch.Tensor]:
    """This rank's tensors for ``checkpoint.load``: from a Hugging Face directory (``hf:DIR``, read
    lazily, keeping only this rank's stage), or a zoo checkpoint (a sharded one read slice by
    slice). The result still has to pass `zoo.convert.load_into`'s shape check."""
    from zoo.convert import CheckpointError as _CE
    from zoo.convert import _hf_source, read_meta, read_model_state
    from zoo.mapping import MappingError, from_external, read_sliced
    from zoo.tensorio import LazyTensors

    path = Path(source.removeprefix("hf:"))
    if source.startswith("hf:") or (path / "config.json").is_file() and not (path / "zoo.json").is_file():
        entry, fmt, config, _ = _hf_source(path)
        if entry.family.name != family:
            raise _CE(f"{path}: a {entry.family.name!r} model, not {family!r}")
        lazy = LazyTensors(path)
        try:
            if par.tp > 1:  # read only the rows of each HF tensor this rank's shards come from
                wanted = {}
                for name, t in model.state_dict().items():
                    shape, cut = tp_cut(tuple(t.shape), _style(model, name), par.tp, par.tp_rank)
                    wanted[name] = (par.canonical(name), shape, cut)
                got = read_sliced(fmt.table(config), lazy, config,
                                  {canon: (shape, cut) for canon, shape, cut in wanted.values()})
                return {name: got[canon] for name, (canon, _, _) in wanted.items()}
            keep = {n for name in model.state_dict() for n in (name, par.canonical(name))}
            return par.local_state(from_external(fmt.table(config), lazy, config, keep=keep))
        except MappingError as e:
            raise _CE(f"{path}: {e}") from None
    md = read_meta(path)
    if md.family != family:
        raise _CE(f"{path}: a checkpoint of {md.family!r}, not {family!r}")
    if md.meta.get("sharded"):
        from zoo.dist_checkpoint import ShardedCheckpoint

        with ShardedCheckpoint(path) as ck:
            return {name: ck.read_local(par.canonical(name), t.shape, _style(model, name), par.tp, par.tp_rank)
                    for name, t in model.state_dict().items()}
    return par.local_state(read_model_state(md))
