"""Pipeline parallelism: stages cut from a plain model by the family's `PipelineSpec`, and the
schedules that run micro-batches through them.

Cutting: the blocks are split into ``pp * vpp`` contiguous virtual stages (even, or sizes given
per stage); virtual stage ``s`` lives on pipeline rank ``s % pp`` as its model chunk ``s // pp``
(Narayanan et al. 2021). A stage is a shallow copy of the model that shares its parameters, keeps
only its blocks (under their global index, so names never depend on the layout) and sets the
first-stage modules (embeddings) and last-stage modules (norm, head) to ``None`` elsewhere. A
parameter shared by a first- and a last-stage module (tied embeddings) exists on both ranks; its
gradients are summed over the embedding group (`sync_tied_grads`) so both copies stay equal.

Schedules (``parallel.pp_schedule``): ``1f1b`` (warm-up of ``pp - rank - 1`` forwards, then one
forward / one backward, then the remaining backwards; with ``vpp > 1`` the interleaved variant,
warm-up ``2 (pp - rank - 1) + (vpp - 1) pp``) and ``gpipe`` (all forwards, then all backwards).
Each rank executes its list of actions in order; sends are non-blocking and receives blocking,
which is deadlock-free for these orders. Messages carry a tag per (receiving stage, direction),
so activations and gradients that share a link never cross. A stage's output is freed right
after it is sent (only its autograd graph is kept), as in Megatron.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zoo.family import PipelineSpec
from zoo.parallel.data_parallel import grad_of
from zoo.parallel.sharding import aliases, local


def split_layers(num_layers: int, stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges per virtual stage: ``sizes`` if given, else as even as possible
    (earlier stages take the remainder: the last stage also carries the head and the loss)."""
    if sizes:
        if len(sizes) != stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"pp_layers={list(sizes)} must give {stages} stages of at least one layer "
                             f"summing to {num_layers} layers")
        counts = list(sizes)
    else:
        if stages > num_layers:
            raise ValueError(f"{stages} pipeline stages for {num_layers} layers")
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


class StageLayers(nn.ModuleDict):
    """One stage's blocks under their global indices; iterates over blocks like an `nn.ModuleList`."""

    def __iter__(self):  # type: ignore[override]
        return iter(self._modules.values())


def _cut(model: nn.Module, spec: PipelineSpec, layer_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module:
    blocks = getattr(model, spec.layers)
    stage = copy.copy(model)  # shares parameters; the tables below are its own
    stage._modules = dict(model._modules)
    stage._parameters = dict(model._parameters)
    stage._buffers = dict(model._buffers)
    stage._modules[spec.layers] = StageLayers({str(i): blocks[i] for i in layer_ids})
    for names, keep in ((spec.first, first), (spec.last, last)):
        if keep:
            continue
        for name in names:
            table = stage._parameters if name in stage._parameters else stage._modules
            table[name] = None
    return stage


def _check_spec(model: nn.Module, spec: PipelineSpec) -> None:
    blocks = getattr(model, spec.layers, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"pipeline.layers={spec.layers!r}: {type(model).__name__} has no nn.ModuleList by that name")
    for name in (*spec.first, *spec.last):
        if "." in name or not hasattr(model, name):
            raise ValueError(f"pipeline: {type(model).__name__} has no top-level attribute {name!r}")


def _tied(model: nn.Module, spec: PipelineSpec) -> dict[int, str]:
    """Parameters reachable from both a first-stage and a last-stage module: id -> first-stage name."""
    def params(names: tuple[str, ...]) -> dict[int, str]:
        out = {}
        for name in names:
            obj = getattr(model, name)
            if isinstance(obj, nn.Parameter):
                out[id(obj)] = name
            elif isinstance(obj, nn.Module):
                for n, p in obj.named_parameters():
                    out.setdefault(id(p), f"{name}.{n}")
        return out

    first, last = params(spec.first), params(spec.last)
    return {i: first[i] for i in first if i in last}


@dataclass
class Stages:
    """This rank's part of the pipeline: ``local`` holds all its parameters (for the optimizer,
    gradient buckets and checkpoints), ``chunks`` are the model chunks the schedule runs."""

    local: nn.Module
    chunks: list[nn.Module]
    virtual_stages: list[int]  # the global virtual stage of each chunk
    num_virtual: int
    # Names of this rank's parameters in the single-process model: a tied head on the last stage
    # is the first stage's embedding.
    canonical: dict[str, str] = field(default_factory=dict)
    global_order: list[str] = field(default_factory=list)  # parameter names of the whole model
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name it shares (whole model)
    tied: set[str] = field(default_factory=set)  # this rank's parameters shared by the first and last stage
    duplicates: set[str] = field(default_factory=set)  # of those, the last stage's copies (counted once)


def build_stages(model: nn.Module, spec: PipelineSpec, *, pp: int, vpp: int, rank: int,
                 sizes: Sequence[int] | None = None) -> Stages:
    _check_spec(model, spec)
    global_order = [n for n, _ in model.named_parameters()]
    num = pp * vpp
    ranges = split_layers(len(getattr(model, spec.layers)), num, sizes)
    mine = [v * pp + rank for v in range(vpp)]
    chunks = [_cut(model, spec, ranges[s], first=s == 0, last=s == num - 1) for s in mine]
    local = _cut(model, spec, [i for s in mine for i in ranges[s]], first=rank == 0, last=rank == pp - 1)
    tied = _tied(model, spec) if pp > 1 else {}
    canonical, tied_names, duplicates = {}, set(), set()
    for name, p in local.named_parameters():
        if id(p) in tied:
            tied_names.add(name)
            if rank != 0:  # the last stage's copy: counted once (on the first stage) in norms
                duplicates.add(name)
            canonical[name] = tied[id(p)]
        else:
            canonical[name] = name
    return Stages(local=local, chunks=chunks, virtual_stages=mine, num_virtual=num, canonical=canonical,
                  global_order=global_order, aliases=aliases(model), tied=tied_names, duplicates=duplicates)


def sync_tied_grads(params: Sequence[nn.Parameter], group: Any) -> None:
    """Sum the gradients of tied embeddings over the first and last stage (Megatron's embedding group)."""
    if group is None:
        return
    for g in map(grad_of, params):
        if g is not None:
            dist.all_reduce(local(g), group=group)  # (an FSDP gradient: this rank's shard)


# ------------------------------------------------------------------------------------ schedules


def schedule(kind: str, *, pp: int, vpp: int, rank: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """The ordered actions of pipeline rank ``rank``: ``("F" | "B", chunk, micro_batch)``."""
    if vpp > 1 and micro_batches % pp and kind != "forward":
        raise ValueError(f"interleaved 1F1B needs the micro-batches per step ({micro_batches}) to be a multiple of pp={pp}")
    total = micro_batches * vpp
    group = pp * vpp

    def mb(k: int) -> int:
        return (k // group) * pp + k % pp

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k % group) // pp, mb(k))

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", vpp - 1 - (k % group) // pp, mb(k))

    if kind == "forward":  # evaluation: forwards only, in the same order; micro-batches past the last
        # (eval_steps need not be a multiple of pp) are left out of every rank's list alike, so each
        # receive still meets its send, which comes earlier in the order on the rank before
        rounded = -(-micro_batches // pp) * pp * vpp
        return [a for a in map(fwd, range(rounded)) if a[2] < micro_batches]
    if kind == "gpipe":
        warmup = total
    elif kind == "1f1b":
        warmup = pp - rank - 1 if vpp == 1 else 2 * (pp - rank - 1) + (vpp - 1) * pp
        warmup = min(warmup, total)
    else:
        raise ValueError(f"unknown pipeline schedule {kind!r} (1f1b, gpipe)")
    actions = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [fwd(warmup + i), bwd(i)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_FREEABLE = {"AddBackward0"}  # outputs whose producing node saved nothing of them (residual adds)
_HEADER = 11  # dtype, ndim, up to 8 sizes, requires_grad


def _run_backward(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    # The engine's entry point checks the gradient against the graph's recorded shape, not the
    # tensor's current data, so it works on an output whose storage was already freed.
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tuple(outs), tuple(grads), False, False, (), True, True)


@dataclass
class _Sent:
    """What a forward kept for its backward: the received inputs, and the outputs sent on."""

    inputs: dict[str, torch.Tensor]
    outputs: list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]  # (tensor, shape, dtype) needing a gradient


class Pipeline:
    """Runs one optimizer step's micro-batches through this rank's chunks.

    ``step_fn(chunk, batch) -> (output, metrics)`` is the family's loss under the core's
    autocast/recompute scopes: on the last stage ``output`` is the loss, elsewhere what the stage
    hands on: the hidden state, or a dict of the tensors the family's `PipelineSpec` carries
    (``input_key`` first, then ``carries``). On stages after the first those batch keys are
    replaced by the received tensors. Counters (``sent``, ``sent_bytes``) feed the communication
    benchmark.
    """

    def __init__(self, stages: Stages, spec: PipelineSpec, *, pp_ranks: Sequence[int], pp_rank: int,
                 kind: str = "1f1b") -> None:
        self.stages, self.spec, self.ranks, self.rank, self.kind = stages, spec, list(pp_ranks), pp_rank, kind
        self.pp = len(self.ranks)
        self.vpp = len(stages.chunks)
        self.keys = (spec.input_key, *spec.carries)  # what crosses each stage boundary, in this order
        self._headers_sent: set[tuple[Any, ...]] = set()
        self._headers: dict[tuple[Any, ...], list[tuple[tuple[int, ...], torch.dtype, bool]]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self.sent = 0
        self.sent_bytes = 0

    # Stage s lives on pipeline rank s % pp. Tags: 2*s for activations into stage s, 2*s+1 for
    # gradients into stage s.
    def _peer(self, stage: int) -> int:
        return self.ranks[stage % self.pp]

    def _send(self, t: torch.Tensor, stage: int, tag: int) -> None:
        t = t.detach().contiguous()
        self._pending.append((dist.isend(t, self._peer(stage), tag=tag), t))
        self.sent += 1
        self.sent_bytes += t.numel() * t.element_size()

    def _recv(self, shape: Sequence[int], dtype: torch.dtype, stage: int, tag: int, device: torch.device) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.recv(t, self._peer(stage), tag=tag)
        return t

    def _outputs(self, out: Any, stage: int) -> list[torch.Tensor]:
        if isinstance(out, torch.Tensor) and len(self.keys) == 1:
            return [out]
        if not isinstance(out, dict) or list(out) != list(self.keys):
            got = list(out) if isinstance(out, dict) else type(out).__name__
            raise ValueError(f"pipeline stage {stage} returned {got}; the family's PipelineSpec carries {list(self.keys)} "
                             "(a dict in that order, or the hidden state alone when nothing else is carried)")
        return list(out.values())

    def _send_activations(self, outs: list[torch.Tensor], to: int, key: tuple[Any, ...]) -> None:
        if (to, key) not in self._headers_sent:  # first time for this input shape: say the shapes
            for out in outs:  # (on the activations' device: a CUDA-only backend takes no host tensor)
                header = torch.tensor([_DTYPES.index(out.dtype), out.dim(), *out.shape, *[0] * (8 - out.dim()),
                                       int(out.requires_grad)], dtype=torch.int64, device=out.device)
                self._send(header, to, 2 * to)
            self._headers_sent.add((to, key))
        for out in outs:
            self._send(out, to, 2 * to)

    def _recv_activations(self, stage: int, key: tuple[Any, ...], device: torch.device) -> dict[str, torch.Tensor]:
        if (stage, key) not in self._headers:
            heads = [self._recv((_HEADER,), torch.int64, stage - 1, 2 * stage, device).tolist()  # once per shape
                     for _ in self.keys]
            self._headers[(stage, key)] = [(tuple(h[2:2 + h[1]]), _DTYPES[h[0]], bool(h[10])) for h in heads]
        received = {}
        for name, (shape, dtype, grad) in zip(self.keys, self._headers[(stage, key)]):
            received[name] = self._recv(shape, dtype, stage - 1, 2 * stage, device).requires_grad_(grad)
        return received

    def _reap(self, wait: bool = False) -> None:
        keep = []
        for work, t in self._pending:
            if wait:
                work.wait()
            elif not work.is_completed():
                keep.append((work, t))
        self._pending = keep

    def run(self, batches: Sequence[dict[str, Any]], step_fn: Callable[[nn.Module, dict[str, Any]], tuple[Any, Any]],
            *, scale_loss: Callable[[torch.Tensor, int], torch.Tensor],
            before_backward: Callable[[int, bool], None] | None = None, forward_only: bool = False
            ) -> list[tuple[torch.Tensor, Any]]:
        """Forward and backward of every micro-batch; returns the last stage's unscaled losses and
        metrics in micro-batch order (empty elsewhere); ``scale_loss(loss, micro_batch)`` is what is
        backpropagated. ``before_backward(chunk, is_last_for_chunk)`` lets gradient buckets
        reduce on each chunk's final backward only."""
        m = len(batches)
        last_stage = self.stages.num_virtual - 1
        saved: dict[tuple[int, int], _Sent] = {}
        results: dict[int, tuple[torch.Tensor, Any]] = {}
        kind = "forward" if forward_only else self.kind
        for action, c, mb in schedule(kind, pp=self.pp, vpp=self.vpp, rank=self.rank, micro_batches=m):
            s = self.stages.virtual_stages[c]
            if action == "F":
                self._forward(c, s, mb, batches[mb], step_fn, scale_loss, saved, results, forward_only, s == last_stage)
            else:
                sent = saved.pop((c, mb))
                if before_backward is not None:
                    before_backward(c, mb == m - 1)
                if s == last_stage:
                    sent.outputs[0][0].backward()
                elif sent.outputs:
                    grads = [self._recv(shape, dtype, s + 1, 2 * s + 1, out.device) for out, shape, dtype in sent.outputs]
                    _run_backward([out for out, _, _ in sent.outputs], grads)
                for x in sent.inputs.values():  # the previous stage waits for these, in carried order
                    self._send(x.grad if x.grad is not None else torch.zeros_like(x), s - 1, 2 * (s - 1) + 1)
            self._reap()
        self._reap(wait=True)
        return [results[i] for i in sorted(results)]

    def _forward(self, c: int, s: int, mb: int, batch: dict[str, Any], step_fn: Callable[..., Any],
                 scale_loss: Callable[[torch.Tensor, int], torch.Tensor], saved: dict[tuple[int, int], _Sent],
                 results: dict[int, tuple[torch.Tensor, Any]], forward_only: bool, last: bool) -> None:
        # What the activations' shapes follow: the input's shape, or (a model whose first stage
        # computes its input, DiT's noised latents) the shapes of every tensor of the batch.
        ref = batch.get(self.spec.input_key)
        tensors = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
        shape = tuple(ref.shape) if ref is not None else tuple((k, tuple(v.shape)) for k, v in tensors)
        key = (shape, forward_only)
        inputs: dict[str, torch.Tensor] = {}
        if s > 0:
            inputs = self._recv_activations(s, key, ref.device if ref is not None else tensors[0][1].device)
            batch = {**batch, **inputs}
        out, metrics = step_fn(self.stages.chunks[c], batch)
        if last:
            results[mb] = (out.detach(), metrics)
            if not forward_only:
                loss = scale_loss(out, mb)
                saved[(c, mb)] = _Sent({k: x for k, x in inputs.items() if x.requires_grad}, [(loss, (), loss.dtype)])
            return
        outs = self._outputs(out, s)
        self._send_activations(outs, s + 1, key)
        if forward_only:
            return
        kept = []
        for i, t in enumerate(outs):
            if not t.requires_grad:
                continue
            kept.append((t, tuple(t.shape), t.dtype))
            # Only the hidden state is the stage's last result; a carried tensor (DiT's conditioning)
            # is also an input of the stage's own blocks, whose backward still reads it.
            if i == 0 and t.grad_fn is not None and t.grad_fn.name() in _FREEABLE:
                t.data = torch.empty((1,), dtype=t.dtype, device=t.device)  # the graph stays
        saved[(c, mb)] = _Sent({k: x for k, x in inputs.items() if x.requires_grad}, kept)


def gather_state(state: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """The union of every pipeline rank's tensors, on every rank of ``group`` (for full-tensor
    checkpoints). Names already seen on an earlier rank are skipped."""
    if group is None or dist.get_world_size(group) == 1:
        return dict(state)
    index = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, index, group=group)
    ranks = dist.get_process_group_ranks(group)
    out: dict[str, torch.Tensor] = {}
    me = dist.get_rank(group)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    for r, entries in enumerate(everyone):
        for name, shape, dtype in entries:
            if name in out:
                continue
            t = state[name].contiguous() if r == me else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(t, src=ranks[r], group=group)
            out[name] = t
    return out


def gather_objects(obj: Any, group: Any) -> list[Any]:
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
