"""Building a model shard by shard: each rank holds only its own parameters, initialised to
exactly the values the single-process model has.

`record_build` runs the family's ``build`` on the meta device (no memory) while a dispatch mode
records every tensor operation it makes: factories, the in-place initialisers (``normal_``,
``uniform_``, ``fill_``...), copies, buffers computed from ``arange``. The parallel core then cuts
the meta model (tensor parallel pieces, pipeline stages) and `replay` re-runs the recorded
operations in their original order on real tensors, so the random stream advances exactly as in a
single process and every value is bitwise the same:

- an operation whose result is overwritten before anything reads it (``nn.Linear``'s default
  init, replaced by the family's own) is not kept: if it draws random numbers it runs on a
  temporary of the same shape (the draws must happen), otherwise it is skipped;
- a parameter or buffer exists in full only from its last complete overwrite to its last write;
  then this rank's piece is cut out (`TPShard.cut`) into its local tensor, and the full one freed.

Peak memory is therefore the rank's share plus about one full tensor (the one being initialised;
two where a temporary draw overlaps it). A build that reads tensor values on the meta device
cannot be recorded; `record_build` raises `DeferredInitError` and the caller builds in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# Operations that overwrite every element of their first argument without reading it.
_OVERWRITE = {"normal_", "uniform_", "fill_", "zero_", "bernoulli_", "random_", "exponential_", "cauchy_",
              "log_normal_", "geometric_", "copy_"}
# Name fragments of operations that draw from the random stream.
_RANDOM = ("normal", "uniform", "rand", "bernoulli", "random", "exponential", "cauchy", "log_normal", "geometric",
           "multinomial", "dropout")


class DeferredInitError(RuntimeError):
    """The family's build cannot be recorded on the meta device."""


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: a view of recorded storage ``key``."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def whole(self, nbytes: int) -> bool:
        """Whether the view covers its storage exactly, densely."""
        numel = 1
        for s in self.size:
            numel *= s
        dense = torch.empty_strided(self.size, self.stride, device="meta").is_contiguous()
        return self.offset == 0 and dense and numel * self.dtype.itemsize == nbytes


@dataclass
class _Op:
    func: Any
    args: Any
    kwargs: Any
    writes: list[int]  # storages written: outputs, and the mutated first argument
    reads: list[int]
    overwrites: int | None  # a storage entirely overwritten (a factory's output, or normal_ on a whole tensor)
    random: bool
    outputs: Any  # the structure of outputs, tensors replaced by _Ref


@dataclass
class InitRecord:
    """What building the model did, to replay: the operations, the random state it started from,
    and the byte size of every storage."""

    ops: list[_Op]
    rng_state: torch.Tensor
    nbytes: dict[int, int]
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # meta tensors: their storage ids stay unique

    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.nbytes: dict[int, int] = {}
        self.alive: list[torch.Tensor] = []

    def _ref(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.device.type != "meta":
            raise DeferredInitError(f"the build made a {t.device.type} tensor {tuple(t.shape)} under the meta device")
        key = InitRecord.key(t)
        self.nbytes.setdefault(key, t.untyped_storage().nbytes())
        self.alive.append(t)
        return _Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.name in ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"):
            raise DeferredInitError(f"the build reads a tensor's value ({func}), which the meta device does not have")
        out = func(*args, **kwargs)
        rargs, rkwargs = tree_map(self._ref, args), tree_map(self._ref, kwargs)
        routs = tree_map(self._ref, out)
        name = func._schema.name.split("::")[-1]
        inplace = name.endswith("_") and rargs and isinstance(rargs[0], _Ref)
        out_refs = [r for r in _refs(routs)]
        in_refs = [r for r in _refs((rargs, rkwargs))]
        writes = [r.key for r in out_refs] + ([rargs[0].key] if inplace else [])
        overwrites = None
        if inplace and name in _OVERWRITE and rargs[0].whole(self.nbytes[rargs[0].key]):
            overwrites = rargs[0].key
        elif not inplace and out_refs and not any(r.key == o.key for r in in_refs for o in out_refs):
            overwrites = out_refs[0].key if len(out_refs) == 1 else None  # a new tensor (a factory, or y = f(x))
        reads = [r.key for i, r in enumerate(in_refs) if not (inplace and i == 0 and overwrites is not None)]
        self.ops.append(_Op(func, rargs, rkwargs, writes, reads, overwrites, any(f in name for f in _RANDOM), routs))
        return out


def _refs(tree: Any) -> list[_Ref]:
    out: list[_Ref] = []
    tree_map(lambda x: out.append(x) if isinstance(x, _Ref) else None, tree)
    return out


def record_build(build: Callable[..., nn.Module], *args: Any) -> tuple[nn.Module, InitRecord]:
    """``build(*args)`` on the meta device, recorded. The random state is left as it was (meta
    operations draw nothing) and is what `replay` starts from."""
    state = torch.get_rng_state()
    recorder = _Recorder()
    try:
        with torch.device("meta"), recorder:
            model = build(*args)
    except DeferredInitError:
        raise
    except Exception as e:  # a build that needs real values (shape from data, an assert on a value)
        raise DeferredInitError(f"the build cannot run on the meta device: {type(e).__name__}: {e}") from e
    # A tensor made from Python data (``torch.tensor(2.66)``) takes no recorded operation on the
    # meta device: replaying would leave it uninitialised, so such a build runs in full instead.
    written = {k for op in recorder.ops for k in op.writes}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.numel() and InitRecord.key(t) not in written:
            raise DeferredInitError(f"{name} {tuple(t.shape)} was made from data (torch.tensor?), which the meta "
                                    "device does not record; initialise it with a factory or nn.init")
    return model, InitRecord(recorder.ops, state, recorder.nbytes, recorder.alive)


def tensor_refs(model: nn.Module) -> dict[str, _Ref]:
    """Every parameter and buffer of the recorded (meta) model by name: which storage it views
    and how (tied parameters share one)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {n: _Ref(InitRecord.key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype) for n, t in named}


def _plan(record: InitRecord, targets: Sequence[int]) -> tuple[list[str], dict[int, int], dict[int, int]]:
    """For every op: run it (``run``), draw on a temporary (``burn``) or skip it; and for every
    storage the index of its last write (when a target's value is final) and of its last use."""
    live = set(targets)
    actions = ["skip"] * len(record.ops)
    for i in range(len(record.ops) - 1, -1, -1):
        op = record.ops[i]
        if any(w in live for w in op.writes):
            actions[i] = "run"
            if op.overwrites is not None:
                live.discard(op.overwrites)
            live.update(op.reads)
        elif op.random:
            actions[i] = "burn"
    last_write: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        if actions[i] != "run":
            continue
        for k in op.writes:
            last_write[k] = i
            last_use[k] = i
        for k in op.reads:
            last_use[k] = i
    return actions, last_write, last_use


@torch.no_grad()
def replay(record: InitRecord, targets: Sequence[tuple[_Ref, Callable[[torch.Tensor], None]]], device: Any) -> None:
    """Re-run the recorded build on ``device``; each target ``(ref, keep)`` gets the full tensor
    ``ref`` views (`tensor_refs`) once its storage is final, right after its last write, and keeps
    what it needs of it."""
    device = torch.device(device)
    by_key: dict[int, list[tuple[_Ref, Callable[[torch.Tensor], None]]]] = {}
    for ref, keep in targets:
        by_key.setdefault(ref.key, []).append((ref, keep))
    actions, last_write, last_use = _plan(record, list(by_key))
    storages: dict[int, torch.UntypedStorage] = {}
    done: set[int] = set()

    def real(x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == "meta":
            return device
        if not isinstance(x, _Ref):
            return x
        storage = storages.get(x.key)
        if storage is None:  # first written by an op that overwrites it whole: a fresh storage
            storage = storages[x.key] = torch.empty(record.nbytes[x.key], dtype=torch.uint8, device=device).untyped_storage()
        return torch.empty(0, dtype=x.dtype, device=device).set_(storage, x.offset, x.size, x.stride)

    # From the state the build started from: afterwards the stream is where a full build leaves it.
    torch.set_rng_state(record.rng_state)
    for i, op in enumerate(record.ops):
        if actions[i] == "skip":
            continue
        if actions[i] == "burn":  # its result is overwritten later; its random draws are not
            op.func(*tree_map(_scratch(device), op.args), **tree_map(_scratch(device), op.kwargs))
            continue
        out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
        for ref, value in zip(_refs(op.outputs), _tensors(out)):
            if ref.key not in storages:
                storages[ref.key] = value.untyped_storage()
        for k in op.writes:
            if last_write.get(k) == i and k in by_key and k not in done:
                done.add(k)
                for ref, keep in by_key[k]:
                    keep(real(ref))
        for k in {*op.writes, *op.reads}:
            if last_use.get(k) == i:
                storages.pop(k, None)  # free the full tensor: this rank kept its piece


def allocate(roots: Sequence[nn.Module], device: Any) -> None:
    """Give every meta parameter and buffer reachable from ``roots`` uninitialised storage on
    ``device``, keeping shared parameters shared (``Module.to_empty`` would untie a tied head;
    pipeline stages are several roots sharing their blocks)."""
    memo: dict[int, torch.Tensor] = {}
    for root in roots:
        for mod in root.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is None or t.device.type != "meta":
                        continue
                    if id(t) not in memo:
                        new = torch.empty_like(t, device=device)
                        memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
                    table[name] = memo[id(t)]


def _tensors(out: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, out)
    return found


def _scratch(device: torch.device) -> Callable[[Any], Any]:
    def make(x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == "meta":
            return device
        if isinstance(x, _Ref):
            return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=device)
        return x

    return make


__all__ = ["DeferredInitError", "InitRecord", "allocate", "record_build", "replay", "tensor_refs"]
