"""Test helpers for zoo and for third-party plugins: run code on N gloo processes, and the
conformance checks every model family must pass (`zoo.testing.conformance`).

`run_distributed` starts ``world_size`` processes exactly as `torchrun` would describe them
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the code under test goes through
`zoo.parallel.distributed.init` like a real job. They are forked from a server process that has
imported torch once, and get the caller's environment, umask and output as spawned ones would
(`zoo.procs`). The
rendezvous store is hosted by the calling process on a port the OS picks, and ranks join it as
clients (torchrun's agent-store mode): no fixed port and no window in which another test can take
the port. Collectives are checked for tensors on a device their backend does not serve
(`zoo.parallel.distributed.check_collectives`). The first rank that raises is reported with its
traceback; ranks that are still running after ``timeout`` are killed and the call fails, so a hung
collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from zoo import procs as zoo_procs

__all__ = ["DistributedTestError", "assert_same_training", "compiled_kernels", "layout_for", "run_distributed", "run_zoo",
           "run_zoo_ranks", "threads", "train_layout"]


# After the first failure, how long to wait for messages still in flight (an earlier failure's
# report can arrive after a later one's); the other ranks' failures are consequences.
_GRACE_S = 3.0


class DistributedTestError(AssertionError):
    """A rank raised, died, or did not finish in time; the message holds the failing rank's traceback."""


def _worker(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    backend: str,
    pg_timeout: float,
    caller: Any,
) -> None:
    # A forkserver child inherits the server's environment and output, not the caller's: the
    # caller's (with ``env``), as a spawned child has them (a test's monkeypatched variables, its
    # captured output)
    zoo_procs.adopt(caller)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        # Every collective checks its tensors' devices against the group's backend (gloo here:
        # CPU only), so a tensor left on the wrong device fails here rather than on a GPU cluster.
        ZOO_CHECK_COLLECTIVES=os.environ.get("ZOO_CHECK_COLLECTIVES", "1"),
    )
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from zoo.parallel import distributed

    try:
        distributed.init(backend=backend, device="cpu", timeout_s=pg_timeout)
        out = fn(*args, **kwargs)
        # Plain pickle to bytes: the queue's own pickler would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(out), time.monotonic()))
    except BaseException as e:  # report everything, including SystemExit from CLI code under test
        # Queued before the group is torn down: tearing it down is what makes the peers fail, and
        # their errors must carry later timestamps than the cause.
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", time.monotonic()))
    finally:
        distributed.shutdown()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    collective_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result, by rank.

    ``fn`` and its arguments must be picklable (a module-level function). ``collective_timeout``
    (default: a bit under ``timeout``) is the process-group timeout, so a stuck collective raises
    inside the rank and its traceback is reported rather than only the harness timeout.
    """
    import torch.distributed as dist

    ctx = zoo_procs.context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg_timeout = collective_timeout if collective_timeout is not None else max(5.0, timeout * 0.8)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, kwargs, rank, world_size, store.port, results, backend, pg_timeout,
                  zoo_procs.callers(dict(env or {}))),
            name=f"zoo-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[tuple[float, int, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, status, payload, when = results.get(timeout=min(0.5, max(deadline - now, 0.01)))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in outputs and r not in {e[1] for e in errors}]
                for r in dead:
                    # Give a dying rank's queued message a moment to arrive before calling it a crash.
                    time.sleep(0.2)
                    if results.empty():
                        errors.append((time.monotonic(), r, f"process died with exit code {procs[r].exitcode}"))
                if dead:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)  # our own child's result  # noqa: S301
            else:
                errors.append((when, rank, payload))
                # The other ranks will fail on the broken collective within the group timeout;
                # their errors are consequences, so stop waiting after a short grace period.
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors or len(outputs) < world_size else 10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        del store
    if errors:
        when, rank, text = min(errors)  # the earliest failure is the cause, later ones are echoes
        others = sorted(r for _, r, _ in errors if r != rank)
        also = f" (ranks {others} failed after it)" if others else ""
        raise DistributedTestError(f"rank {rank} of {world_size} failed{also}:\n{text}")
    if len(outputs) < world_size:
        missing = [r for r in range(world_size) if r not in outputs]
        raise DistributedTestError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s (hung?)")
    return [outputs[r] for r in range(world_size)]


def layout_for(family: Any, world_size: int, *, model: Any = None, seq_length: int = 16,
               micro_batches: int | None = None, **parallel: Any) -> Any:
    """A validated `zoo.parallel.Layout` of ``family`` on ``world_size`` ranks for tests that
    drive `zoo.parallel.Parallel` directly: ``parallel`` holds `ParallelConfig` fields
    (``tp=2, pp=2, ...``); ``model`` the model config (default: the tiny flavor's);
    ``micro_batches`` per data-parallel rank and step (default: pp, which interleaving needs)."""
    from zoo.config import ParallelConfig, RunConfig, TrainConfig
    from zoo.parallel.layout import plan

    p = ParallelConfig(**parallel)
    dp = max(world_size // (p.tp * p.cp * p.pp), 1)
    train = TrainConfig(seq_length=seq_length, micro_batch_size=1, global_batch_size=dp * (micro_batches or p.pp))
    run = RunConfig(family=family.name, flavor="test", model=model if model is not None else family.flavors["tiny"](),
                    parallel=p, train=train)
    return plan(run, world_size=world_size, family=family)


def train_layout(layout: Mapping[str, Any], family: str, layers: int, zero: bool, *, steps: int = 3, micro: int = 4,
                 seq_length: int = 16, rows: int = 2, split_rows: bool = False, flavor: str = "tiny",
                 model: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``steps`` AdamW steps of ``family``'s ``flavor`` (``layers`` deep) under ``layout`` (on the
    ranks this runs on: call it through `run_distributed`, or directly for one process), through
    `zoo.parallel.engine.Parallel` as `zoo train` does: ``micro`` micro-batches of ``rows`` rows
    from the family's ``example_batch`` per step, each data-parallel rank taking its share. Returns
    the losses, every gradient gathered to full shape under its single-process name, the last
    step's metrics and the shapes of the parameters this rank holds.
    ``split_rows``: every micro-batch is cut into data-parallel slices of rows instead (a loss over
    a whole micro-batch, CLIP's global negatives, then equals one process's).
    ``model``: config fields set over the flavor's (checked as the config checks them)."""
    from zoo import kernels

    # The CPU products `zoo train` picks (train.cpu_gemm=auto), uncompiled elementwise kernels, in
    # the test process as in the spawned ranks.
    with kernels.select("cpu", {"cpu_gemm": "auto", "cpu_fused": "eager", "cpu_malloc": "system"}).use():
        return _train_layout(layout, family, layers, zero, steps=steps, micro=micro, seq_length=seq_length,
                             rows=rows, split_rows=split_rows, model=model, flavor=flavor)


def _train_layout(layout: Mapping[str, Any], family: str, layers: int, zero: bool, *, steps: int, micro: int,
                  seq_length: int, rows: int, split_rows: bool, model: Any, flavor: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from zoo.family import resolve
    from zoo.parallel.engine import Parallel
    from zoo.registry import get_registry
    from zoo.training.optim import ParamRules, param_groups

    fam = get_registry().get(family).family
    cfg = fam.flavors[flavor]()
    cfg.num_layers = layers
    if model:
        cfg = dataclasses.replace(cfg, **model)
    build, example, loss_fn = (resolve(r, owner="test") for r in (fam.build, fam.example_batch, fam.loss))
    torch.manual_seed(0)
    model = build(cfg, fam.spec_for(cfg))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    par = Parallel(model, fam, layout_for(fam, world, model=cfg, seq_length=seq_length, **layout), rank=rank,
                   model_config=cfg)
    # Small buckets: several reductions per step, launched while backward runs.
    buckets = par.make_buckets(20_000, shard=zero)

    def adamw(groups: Any) -> Any:
        # Adam's first steps move every weight by about lr whatever the gradient's size, so a
        # gradient that is zero up to rounding would take a full step of random sign; eps keeps
        # those still and the comparison measures the layout, not rounding amplified by Adam.
        return torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)

    if zero and buckets is not None:
        from zoo.parallel.zero import DistributedOptimizer

        rules, names = ParamRules(0.1), {id(p): n for n, p in par.model.named_parameters()}
        opt: Any = DistributedOptimizer(buckets, adamw, group_of=lambda p: rules.options(names[id(p)], p))
    else:
        opt = adamw(param_groups(par.model, 0.1))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps + 1):
        # The same global batch as one process; each data-parallel rank takes its share.
        batch = [example(cfg, batch_size=rows, seq_length=seq_length, generator=gen) for _ in range(micro)]
        if split_rows:
            n = rows // par.dp
            mine = [{k: v[par.dp_rank * n:(par.dp_rank + 1) * n] for k, v in mb.items()} for mb in batch]
        else:
            mine = batch[par.dp_rank::par.dp]
        out = par.forward_backward(mine, loss_fn, seq_length=seq_length)
        losses.append(out.loss.item())
        par.finish_grads()
        if step == steps:
            break
        if zero and buckets is not None:
            opt.step(max_norm=1.0, norm_squared=par.grad_norm_squared)
        else:
            par.clip(1.0)
            opt.step()
            if buckets is not None:
                buckets.zero_grad()
            else:
                opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": par.full_grads(), "pp_sent": par.pipeline.sent if par.pp > 1 else 0,
            "metrics": {k: float(v) for k, v in out.metrics.items()},  # the last step's, reduced over ranks
            "shapes": {n: tuple(p.shape) for n, p in par.model.named_parameters()}}  # what this rank holds


def assert_same_training(got: Mapping[str, Any], ref: Mapping[str, Any], *, rtol: float = 1e-5) -> None:
    """`train_layout` results of a layout against one process: every loss within ``rtol`` and every
    gradient within ``rtol`` in relative norm (float32 sums in another order differ in the last
    bits; Adam's normalisation carries that into the next steps)."""
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= rtol * abs(b), (got["losses"], ref["losses"])
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        err = float((got["grads"][name].double() - g.double()).norm() / g.double().norm().clamp(min=1e-30))
        assert err <= rtol, f"{name}: relative error {err:.2e}"


def run_zoo(capsys: Any, *args: str) -> Any:
    """``zoo ARGS`` in this process (no interpreter start and torch import per call), under pytest's
    ``capsys``: a `subprocess.CompletedProcess` with the exit status, stdout and stderr."""
    import subprocess

    from zoo.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


def _zoo_rank(args: list[str], out_dir: str) -> int:
    """One rank of `run_zoo_ranks`: ``zoo ARGS`` with this rank's stdout and stderr in files."""
    import sys

    from zoo.cli import main

    rank = os.environ["RANK"]
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{name}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    try:
        return main(list(args))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_zoo_ranks(nproc: int, *args: str, timeout: float = 600.0, env: Mapping[str, str] | None = None) -> Any:
    """``torchrun --nproc-per-node NPROC -m zoo ARGS`` as far as the command can tell (the same
    ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables, one thread per rank), on `run_distributed`'s
    ranks: forked from a server that imported torch once, ~4 s for 4 ranks against torchrun's ~17
    (each of its ranks a new interpreter importing torch on a 2-core CI machine). A
    `subprocess.CompletedProcess`: the highest rank's exit status (1 where a rank raised), every
    rank's stdout and stderr in rank order (torchrun interleaves them), a raising rank's traceback
    last. Tests of the launcher itself use torchrun (tests/test_distributed.py)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zoo-ranks-") as out_dir:
        try:
            codes = run_distributed(_zoo_rank, nproc, list(args), out_dir, timeout=timeout,
                                    env={"OMP_NUM_THREADS": "1", **(env or {})})
            rc, failure = max(int(c or 0) for c in codes), ""
        except DistributedTestError as e:
            rc, failure = 1, f"\n{e}\n"

        def read(name: str) -> str:
            parts = [os.path.join(out_dir, f"{name}.{r}") for r in range(nproc)]
            return "".join(open(p, encoding="utf-8", errors="replace").read() for p in parts if os.path.exists(p))

        return subprocess.CompletedProcess(["zoo", *args], rc, read("out"), read("err") + failure)


def compiled_kernels() -> Any:
    """A generator fixture body: `zoo train`'s default compiled CPU kernels (`zoo_cpu_kernels.fused`) for the
    tests that use it, where the suite's conftest switched them off (``ZOO_BACKENDS=-inductor``:
    ~3 s of compiler import in every process that trains). A module whose quality thresholds were
    set with them declares
    ``_compiled = pytest.fixture(scope="module", autouse=True)(compiled_kernels)``."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ZOO_BACKENDS", raising=False)
        yield


@contextlib.contextmanager
def threads(n: int) -> Any:
    """torch's intra-op thread count ``n`` for the duration (restored after): a comparison of bits
    with a run on another thread count (a torchrun rank has one) must split its products' sums the
    same way (oneDNN's bf16 and AMX kernels split by thread count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
