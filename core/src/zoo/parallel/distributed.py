"""Process start-up and teardown: a plain process (world size 1) or one rank under `torchrun`.

World size 1 is not a special case for the code above this module: it gets a `DistEnv` like any
rank, and no process group is created (collectives are skipped when there is no group).
Under `torchrun` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``) the default group is created with gloo on CPU, and on CUDA with NCCL for device
tensors beside gloo for the little host-side bookkeeping that is deliberate (``cpu:gloo,cuda:nccl``:
each collective goes to the backend of its tensors' device), with a timeout so that a dead or
stuck rank fails the job instead of hanging it.

`check_collectives` (on when ``ZOO_CHECK_COLLECTIVES=1``, which every distributed test sets)
wraps the `torch.distributed` collectives so that a tensor whose device type the group's backend
does not serve (a CPU tensor on NCCL, a meta tensor anywhere) fails at the call that passes it,
naming the collective, instead of failing later, or only on a GPU cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from zoo.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # None when there is no process group (world size 1)
    device: str  # "cpu" or "cuda:<local rank>"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


def world_size_from_env() -> int:
    return _env_int("WORLD_SIZE", 1)


def pick_backend(requested: str, device: str) -> str:
    """``auto``: gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for host tensors."""
    if requested != "auto":
        return requested
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def pick_device(requested: str = "auto", *, local_rank: int = 0, what: str = "train.device") -> str:
    import torch

    if requested == "cpu":
        return "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{what}=cuda but no CUDA device is available")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return f"cuda:{local_rank % max(torch.cuda.device_count(), 1)}"
    return "cpu"


def init(*, backend: str = "auto", device: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the job described by the environment; a no-op group-wise when ``WORLD_SIZE`` is 1."""
    import torch
    import torch.distributed as dist

    world = world_size_from_env()
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world}")
    dev = pick_device(device, local_rank=local_rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    if world == 1:
        return DistEnv(rank=0, world_size=1, local_rank=0, backend=None, device=dev)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UsageError(f"WORLD_SIZE={world} but {name} is not set; launch with torchrun")
    be = pick_backend(backend, dev)
    if "nccl" in be and not dev.startswith("cuda"):
        raise UsageError("parallel.backend=nccl needs CUDA devices; use gloo on CPU")
    if os.environ.get("ZOO_CHECK_COLLECTIVES") == "1":
        check_collectives()
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": torch.device(dev)} if "nccl" in be else {}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            kwargs["store"] = _round_store(rank, world, timeout_s)
        dist.init_process_group(
            backend=be, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    global _HEARTBEAT
    if _HEARTBEAT is None:
        _HEARTBEAT = _Heartbeat(rank)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, backend=be, device=dev)


# The store keys of this round of the job (see `_round_store`).
_KEYS = "zoo/"


def _round_store(rank: int, world: int, timeout_s: float) -> Any:
    """The group's store under a prefix of this round's own. torchrun's agent keeps one store for
    every restart of the job, and torch's group set-up (gloo's addresses, NCCL's unique id) reads
    keys that the previous round's workers left there: after `--max-restarts` restarts the group
    a rank can connect to a dead predecessor's port (pytorch#135712; the restart count in the
    environment cannot be the prefix: agents count differently). So rank 0 draws a fresh token and
    hands it to each rank that says hello with a fresh nonce of its own; a stale hello only earns
    an answer nobody waits for."""
    import threading
    import uuid

    import torch.distributed as dist

    global _KEYS
    base = _store(timeout_s)
    if rank == 0:
        token = uuid.uuid4().hex
        threading.Thread(target=_admit, args=(token, world), name="zoo-admit", daemon=True).start()
    else:
        nonce = uuid.uuid4().hex
        base.set(f"zoo/hello/{rank}", nonce)
        try:
            token = base.get(f"zoo/admit/{rank}/{nonce}").decode()
        except Exception as e:  # DistStoreError: the store's timeout
            raise UsageError(f"rank {rank}: rank 0 did not admit this rank to the job within "
                             f"parallel.timeout_s={timeout_s:g} s ({type(e).__name__})") from None
        base.add(f"zoo/{token}/admitted", 1)
    _KEYS = f"zoo/{token}/"
    return dist.PrefixStore(f"zoo/{token}/pg", base)


def _admit(token: str, world: int) -> None:
    """Rank 0's side of `_round_store`: answer every new hello until every rank has joined."""
    import time

    store, answered = _store(), {}
    with contextlib.suppress(Exception):  # the store went away: the job is over
        while store.add(f"zoo/{token}/admitted", 0) < world - 1:
            for r in range(1, world):
                if store.check([f"zoo/hello/{r}"]):
                    nonce = store.get(f"zoo/hello/{r}").decode()
                    if answered.get(r) != nonce:
                        store.set(f"zoo/admit/{r}/{nonce}", token)
                        answered[r] = nonce
            time.sleep(0.02)


class CollectiveDeviceError(RuntimeError):
    """A collective received a tensor on a device its process group's backend does not serve."""


# The torch.distributed calls that take tensors; checked by `check_collectives`.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
                "isend", "irecv")


def served_devices(backend: str) -> set[str]:
    """Device types a backend serves: ``gloo`` CPU, ``nccl`` CUDA, ``cpu:gloo,cuda:nccl`` both."""
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu"}, "mpi": {"cpu", "cuda"}, "ucc": {"cpu", "cuda"}}.get(backend, {"cpu", "cuda"})


def check_tensors(name: str, tensors: Any, backend: str) -> None:
    """Fail when one of ``tensors`` (a tensor or nested lists of them) lives on a device type that
    ``backend`` does not serve."""
    import torch

    served = served_devices(backend)
    stack = [tensors]
    while stack:
        t = stack.pop()
        if isinstance(t, (list, tuple)):
            stack.extend(t)
        elif isinstance(t, torch.Tensor) and t.device.type not in served:
            raise CollectiveDeviceError(f"torch.distributed.{name}: a {t.device.type} tensor {tuple(t.shape)} "
                                        f"{str(t.dtype).removeprefix('torch.')} on a {backend} process group, which "
                                        f"serves {', '.join(sorted(served))} tensors")


def check_collectives() -> None:
    """Wrap the `torch.distributed` collectives with `check_tensors` (once per process)."""
    import functools

    import torch.distributed as dist

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_zoo_checked", False):
            continue

        def checked(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            backend = str(dist.get_backend(group)) if dist.is_initialized() else "gloo"
            check_tensors(_name, [a for a in args if not isinstance(a, (int, str))] + [
                v for k, v in kwargs.items() if k not in ("group", "op", "async_op", "src", "dst", "tag")], backend)
            return _fn(*args, **kwargs)

        functools.update_wrapper(checked, fn)
        checked._zoo_checked = True  # type: ignore[attr-defined]
        setattr(dist, name, checked)


def shutdown() -> None:
    """Destroy the default group if there is one; safe to call twice or after a failure."""
    import torch.distributed as dist

    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop.set()
        _HEARTBEAT = None
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer may already be gone; exiting matters more
            dist.destroy_process_group()


# How gloo reports a peer whose process is gone (NCCL and the store raise `DistError`s).
_PEER_FAILURE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _peer_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and "gloo" in str(e) and any(w in str(e).lower() for w in _PEER_FAILURE)


_BEAT_S = 1.0


def _store(timeout_s: float = 30.0) -> Any:
    """A client of the rendezvous store of its own (a client is not shared across threads).
    torchrun's agent hosts the store, so it outlives any worker."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class _Heartbeat:
    """Every rank counts up ``zoo/<round>/beat/<rank>`` in the store each second from a thread, which runs
    while the main thread waits inside a collective: a rank whose count stops is dead (or its
    interpreter is), one whose count goes on is alive however stuck its collective is."""

    def __init__(self, rank: int) -> None:
        import threading

        self.key, self.stop = f"{_KEYS}beat/{rank}", threading.Event()
        self.store = _store()
        self.thread = threading.Thread(target=self._run, name="zoo-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(_BEAT_S):
            try:
                self.store.add(self.key, 1)
            except Exception:  # the store is gone: the job is over anyway
                return


_HEARTBEAT: _Heartbeat | None = None


def lost_ranks(env: DistEnv) -> list[int] | None:
    """The ranks whose heartbeat stopped (watched for a few beats); None when the store is gone."""
    import time

    try:
        store = _store()
        keys = [f"{_KEYS}beat/{r}" for r in range(env.world_size)]
        before = [store.add(k, 0) for k in keys]
        time.sleep(3.5 * _BEAT_S)
        after = [store.add(k, 0) for k in keys]
        # A survivor that already diagnosed the failure and left is not a loss of its own.
        lost = [r for r in range(env.world_size) if r != env.rank and after[r] == before[r]
                and not store.check([f"{_KEYS}left/{r}"])]
        store.set(f"{_KEYS}left/{env.rank}", "1")
        return lost
    except Exception:  # the store went with its host (rank 0 without an agent)
        return None


@contextlib.contextmanager
def session(*, backend: str = "auto", device: str = "auto", timeout_s: float = 600.0) -> Iterator[DistEnv]:
    """A process group for the ``with`` block. A collective that fails because a peer died becomes
    one error on every surviving rank naming the ranks lost (gloo and NCCL only say a connection
    closed, and on another node no launcher can tell); when every rank is alive (a timeout, a
    mismatched collective) the original error goes up unchanged."""
    env = init(backend=backend, device=device, timeout_s=timeout_s)
    try:
        yield env
    except Exception as e:
        if env.world_size <= 1 or not _peer_failure(e):
            raise
        from zoo.errors import ZooError

        lost = lost_ranks(env)
        if lost == []:  # everyone is alive: a timeout or mismatch, whose own message says more
            raise
        who = ("the rendezvous store is gone too (its host, usually rank 0, died)" if lost is None else
               f"rank {', '.join(map(str, lost))} {'is' if len(lost) == 1 else 'are'} gone")
        first = " ".join(str(e).split())[:200]
        raise ZooError(f"rank {env.rank}: lost contact with the job: {who} ({type(e).__name__}: {first}); "
                       "rerun the same command to resume from the newest complete checkpoint") from None
    finally:
        shutdown()


def to_device(batch: Any, device: str) -> Any:
    """A batch's tensors moved to ``device`` (a mapping; anything else as it is)."""
    if isinstance(batch, Mapping):
        return {k: (v.to(device, non_blocking=True) if hasattr(v, "to") else v) for k, v in batch.items()}
    return batch
