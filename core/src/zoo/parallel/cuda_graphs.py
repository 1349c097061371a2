"""A micro-batch's forward and backward replayed from a CUDA graph (``train.cuda_graph``).

A small model on a fast GPU is bound by the host, not the GPU: the host takes longer to queue a
step's hundreds of kernels than the GPU takes to run them. Captured once and replayed, the host
queues one graph launch instead of every
kernel and the step takes the GPU's time (docs/benchmarks.md). Megatron offers the same
(``--enable-cuda-graph``); this is its one-GPU form, over any family, built on
``torch.cuda.CUDAGraph``.

A replay runs the kernels the capture recorded, on the memory the capture used, so:

- the batch is copied into the graph's own input tensors; its tensor shapes and dtypes and its
  non-tensor values key the graph, and a batch of a new shape is captured anew (after WARMUP eager
  micro-batches of that shape: lazy initialisations must not happen inside a capture), up to
  MAX_GRAPHS graphs; past that a new shape runs eagerly, said once;
- gradients accumulate in place into ``.grad`` tensors that exist before the capture (the
  gradient buckets' views, or zeros created here) and that the trainer zeroes in place between steps,
  never setting them to None. A parameter that never receives a gradient therefore holds zeros, not
  None: AdamW still applies weight decay to it, where an eager step skips it;
- warm-ups, captures and the eager extra shapes run on one side stream: autograd's gradient-
  accumulation nodes outlive a step while anything keeps its graph alive, and one made on another
  stream would make the capture wait on that stream, which fails it;
- the forward must not read device values on the host (``.item()``, ``nonzero``, ``.tolist()``):
  such a capture fails, and the run goes on eagerly from then on, naming the cause in one line;
- what would not replay is refused before anything is built (``check``): layouts whose forward or
  backward talks to other ranks or swaps RNG states from Python (tensor, context, pipeline, expert,
  data parallelism; FSDP), fp16's loss scaling, and devices other than CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from zoo.errors import ConfigError
from zoo.parallel.layout import Layout

MAX_GRAPHS = 4  # graphs kept (a new batch shape past them runs eagerly)
WARMUP = 2  # eager micro-batches of a shape before it is captured

MicroBatch = Callable[[dict[str, Any], torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def check(*, enabled: bool, device: str, layout: Layout, precision: str, main_grads: bool = False) -> None:
    """Refuse ``train.cuda_graph=true`` where a replay would not do what the eager step does."""
    if not enabled:
        return
    if main_grads:
        raise ConfigError("train.cuda_graph=true with float32 gradients of low-precision parameters: each "
                          "gradient is added into its float32 bucket by a hook that drops it, and a replay "
                          "writes into gradients that exist before the capture; set train.grad_dtype to "
                          "train.param_dtype's type")
    if not device.startswith("cuda"):
        raise ConfigError(f"train.cuda_graph=true needs a CUDA device; this run is on {device!r}")
    over = [f"parallel.{name}={getattr(layout, name)}" for name in ("tp", "cp", "pp", "ep", "dp")
            if getattr(layout, name) > 1] + (["parallel.fsdp"] if layout.fsdp else [])
    if over:
        raise ConfigError(f"train.cuda_graph=true captures one GPU's step; {', '.join(over)} is not supported (its "
                         "communication and RNG bookkeeping run in Python, which a replay skips); set "
                         "train.cuda_graph=false")
    if precision == "fp16":
        raise ConfigError("train.cuda_graph=true does not support train.precision=fp16 (the loss scaler decides "
                         "skipped steps on the host); use bf16 or fp32")


def capturing(x: torch.Tensor) -> bool:
    """Whether work on ``x`` is being captured into a CUDA graph: the host must not read device
    values now (a code path with a host-side shortcut takes its general form instead)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class GraphedMicroBatches:
    """Runs ``fn(batch, weight) -> (detached loss, metrics)`` (forward and backward of one
    micro-batch, gradients accumulated into ``params``' ``.grad``) from CUDA graphs."""

    def __init__(self, params: list[nn.Parameter], *, note: Callable[[str], None] = print) -> None:
        self.params, self.note = [p for p in params if p.requires_grad], note
        self.graphs: dict[Any, _Graph] = {}
        self.seen: dict[Any, int] = {}
        self.off: str | None = None  # why the run went eager for good
        self.grads: list[torch.Tensor | None] = []
        self.side = torch.cuda.Stream()  # warm-ups, captures and extra shapes (the module's docstring says why)
        self.calls = self.replays = 0

    def __call__(self, fn: MicroBatch, batch: dict[str, Any], weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        self.calls += 1
        if self.off is not None:
            return fn(batch, weight)
        try:
            key = (_key(batch), weight.dtype)
        except _Unsupported as e:
            self._give_up(f"the batch holds {e}")
            return fn(batch, weight)
        graph = self.graphs.get(key)
        if graph is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] <= WARMUP:
                return self._on_side_stream(fn, batch, weight)
            if len(self.graphs) >= MAX_GRAPHS:
                if self.seen[key] == WARMUP + 1:
                    self.note(f"train.cuda_graph: {MAX_GRAPHS} batch shapes captured already; this new one runs eagerly")
                return self._on_side_stream(fn, batch, weight)
            graph = self._capture(key, fn, batch, weight)
            if graph is None:
                return fn(batch, weight)
        if any(p.grad is not g for p, g in zip(self.params, self.grads)):  # (the graph would write to stale memory)
            raise RuntimeError("train.cuda_graph: a parameter's .grad was replaced or set to None after the capture; "
                               "zero gradients in place (zero_grad(set_to_none=False))")
        self.replays += 1
        return graph.run(batch, weight)

    def summary(self) -> str:
        """One line for the end of a run: how much of it the graphs ran."""
        return (f"train.cuda_graph: {self.replays} of {self.calls} micro-batches replayed from {len(self.graphs)} "
                f"graph(s)" + (f"; eager from then on: {self.off}" if self.off else ""))

    def _on_side_stream(self, fn: MicroBatch, batch: dict[str, Any], weight: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """An eager micro-batch on the side stream, as torch asks of the iterations before a capture."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = fn(batch, weight)
        torch.cuda.current_stream().wait_stream(self.side)
        return out

    def _give_up(self, why: str) -> None:
        self.off = why
        self.note(f"train.cuda_graph: running eagerly from here on: {why}")

    def _capture(self, key: Any, fn: MicroBatch, batch: dict[str, Any], weight: torch.Tensor) -> _Graph | None:
        for p in self.params:  # accumulated into in place by the captured backward (never stolen)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]  # what every graph writes to, held alive
        inputs, w = _copy(batch), weight.clone()
        graph = torch.cuda.CUDAGraph()
        # One memory pool for all the graphs: they never run at once, and nothing a replay leaves
        # behind but its outputs (kept apart) is read by another.
        pool = next(iter(self.graphs.values())).graph.pool() if self.graphs else None
        try:
            with torch.cuda.graph(graph, pool=pool, stream=self.side):
                loss, metrics = fn(inputs, w)
        except Exception as e:  # noqa: BLE001 (whatever the capture met: said, then eager)
            torch.cuda.synchronize()  # a capture error leaves the device usable; anything else raises here
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self._give_up(f"capture failed ({type(e).__name__}: {first[:200]})")
            return None
        self.graphs[key] = _Graph(graph, inputs, w, loss, metrics)
        return self.graphs[key]


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict[str, Any], weight: torch.Tensor, loss: torch.Tensor,
                 metrics: dict[str, Any]) -> None:
        self.graph, self.inputs, self.weight, self.loss, self.metrics = graph, inputs, weight, loss, metrics

    def run(self, batch: dict[str, Any], weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        _fill(self.inputs, batch)
        self.weight.copy_(weight)
        self.graph.replay()
        # The outputs' memory is rewritten by the next replay (the next micro-batch): copies. A
        # metric that is no tensor was computed from what keys the graph (shapes, plain values).
        return self.loss.clone(), {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in self.metrics.items()}


class _Unsupported(Exception):
    pass


def _key(value: Any) -> Any:
    """What a graph is specific to: tensors' device, shape and dtype; other values themselves."""
    if torch.is_tensor(value):
        if value.device.type != "cuda":  # the capture would bake its values in (or copy it mid-capture)
            raise _Unsupported(f"a {value.device.type} tensor")
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, dict):  # (the containers torch's pytree walks, as `_copy` and `_fill` do)
        return ("map", tuple((k, _key(v)) for k, v in value.items()))
    if type(value) in (list, tuple):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    raise _Unsupported(f"a {type(value).__name__}")


def _copy(value: Any) -> Any:
    return tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, value)


def _fill(static: Any, value: Any) -> None:
    for s, v in zip(tree_leaves(static), tree_leaves(value)):  # (the same structure: it keys the graph)
        if torch.is_tensor(s):
            s.copy_(v)


__all__ = ["MAX_GRAPHS", "WARMUP", "GraphedMicroBatches", "capturing", "check"]
