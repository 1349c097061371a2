"""The optimizer side of training: the learning-rate schedule, which parameters train and in which
group (weight decay, learning-rate multipliers, frozen patterns), the optimizer (plain AdamW or
the distributed optimizer), and their checkpoint state.

One rule gives every parameter its group options (`ParamRules.options`), used by the plain
optimizer and by the distributed one alike, so ZeRO-1 on or off trains the same model. Patterns
match single-process parameter names (`fnmatch`: ``"vision.*"`` is everything under ``vision``),
so they mean the same under every layout.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zoo.checkpoint.state import Checkpoint
from zoo.checkpoint.tensorio import CheckpointError
from zoo.config import OptimizerConfig
from zoo.errors import ConfigError
from zoo.parallel.engine import Parallel
from zoo.parallel.sharding import Placements, Split, TPShard, groups_by_param, local, optimizer_state


def lr_at(step: int, *, peak: float, warmup: int, total: int, decay: str, min_ratio: float,
          decay_steps: int | None = None, warmup_init_ratio: float = 0.0, wsd_decay_steps: int = 0,
          wsd_decay: str = "exponential") -> float:
    """The learning rate of update ``step`` (0-based): megatron-core's `OptimizerParamScheduler` at
    ``num_steps = step``, except in warmup, where it is at ``step + 1`` (Megatron's first update is
    taken at the warmup's initial lr, 0 by default: a step that changes nothing). Linear warmup from
    ``peak * warmup_init_ratio`` to ``peak``; then up to ``decay_steps`` (default ``total``) cosine,
    linear, ``wsd`` (the peak, then ``wsd_decay`` to the floor over the last ``wsd_decay_steps``)
    or ``inverse_sqrt``; ``peak * min_ratio`` after; or ``constant``."""
    if warmup and step < warmup:
        start = peak * warmup_init_ratio
        return start + (peak - start) * (step + 1) / warmup
    if decay == "constant":
        return peak
    floor = peak * min_ratio
    end = total if decay_steps is None else decay_steps
    if step > end:
        return floor
    if decay == "inverse_sqrt":
        return max(floor, peak * math.sqrt(max(warmup, 1) / max(step, 1)))
    if decay == "wsd":
        stable = end - wsd_decay_steps
        if step <= stable:
            return peak
        r = (step - stable) / wsd_decay_steps
        if wsd_decay == "linear":
            coeff = 1.0 - r
        elif wsd_decay == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * r))
        elif wsd_decay == "minus_sqrt":
            coeff = 1.0 - math.sqrt(r)
        else:  # exponential: from 1 to 0, halving the distance to -1 each decay span
            coeff = 2.0 * 0.5 ** r - 1.0
        return floor + (peak - floor) * coeff
    progress = min(max(step - warmup, 0) / max(end - warmup, 1), 1.0)
    if decay == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_lr(run: Any, step: int) -> float:
    """`lr_at` for a run's ``optimizer.lr``, ``schedule`` and ``train.steps``."""
    s = run.schedule
    return lr_at(step, peak=run.optimizer.lr, warmup=s.warmup_steps, total=run.train.steps, decay=s.decay,
                 min_ratio=s.min_lr_ratio, decay_steps=s.decay_steps, warmup_init_ratio=s.warmup_init_ratio,
                 wsd_decay_steps=s.wsd_decay_steps, wsd_decay=s.wsd_decay)


@dataclass(frozen=True)
class ParamRules:
    """Per-parameter training rules, by single-process name."""

    weight_decay: float
    lr_mult: Mapping[str, float] = field(default_factory=dict)
    freeze: Sequence[str] = ()

    def frozen(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.freeze)

    def options(self, name: str, p: torch.Tensor) -> dict[str, Any]:
        """The optimizer-group options of a parameter: no weight decay on norms, biases and other
        vectors (GPT-2/LLaMA practice); the first matching learning-rate multiplier, else 1."""
        mult = next((float(m) for pattern, m in self.lr_mult.items() if fnmatch.fnmatchcase(name, pattern)), 1.0)
        return {"weight_decay": self.weight_decay if p.dim() >= 2 else 0.0, "lr_mult": mult}

    def check(self, names: Sequence[str]) -> None:
        """Every pattern must match a parameter of the whole model: a typo fails here, by name."""
        for key, patterns in (("train.freeze", self.freeze), ("optimizer.lr_mult", list(self.lr_mult))):
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                    from zoo.errors import suggest

                    raise ConfigError(f"{key}: pattern {pattern!r} matches no parameter of the model"
                                      + (suggest(pattern, names) or f" (e.g. {', '.join(list(names)[:3])})"))


def adamw_factory(cfg: OptimizerConfig, *, note: Callable[[str], None] = print
                  ) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """``groups -> torch.optim.AdamW`` for an `OptimizerConfig` (``cfg``), with its kernel choice:
    ``fused`` falls back to ``foreach``, with one ``note``, where torch has no fused kernel for the
    parameters' device (torch refuses those at construction)."""

    def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        if cfg.implementation == "fused":
            try:
                return torch.optim.AdamW(groups, **kw, fused=True)
            except RuntimeError as e:
                note(f"note: optimizer.implementation=fused unavailable here, using foreach ({str(e).splitlines()[0]})")
        return torch.optim.AdamW(groups, **kw, foreach=cfg.implementation != "for-loop")

    return adamw


def param_groups(model: nn.Module, weight_decay: float, *, rules: ParamRules | None = None,
                 placements: Placements | None = None) -> list[dict[str, Any]]:
    """Optimizer groups of the model's trainable parameters, one per distinct options (in the
    order first seen); ``placements`` give single-process names under a parallel layout.
    FSDP's DTensors of each device mesh and plain tensors (experts FSDP leaves whole when
    ep = dp) never share a group: the fused and foreach kernels take one kind per call."""
    rules = rules or ParamRules(weight_decay)
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        options = rules.options(placements.canonical(name) if placements is not None else name, p)
        mesh = id(p.device_mesh) if hasattr(p, "device_mesh") else None
        groups.setdefault((*sorted(options.items()), mesh), {**options, "params": []})["params"].append(p)
    return list(groups.values())


def freeze(model: nn.Module, placements: Placements, rules: ParamRules) -> list[str]:
    """Make the frozen parameters of this rank untrainable; returns their single-process names."""
    out = []
    for name, p in model.named_parameters():
        if rules.frozen(placements.canonical(name)):
            p.requires_grad_(False)
            out.append(placements.canonical(name))
    return out


def set_lr(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


class OptimizerState:
    """The optimizer (plain or the distributed one) as a checkpoint `Stateful`: its tensors under
    ``<single-process name>::<field>`` in the parameter's global shape, so they reshard like the
    parameters, and its groups (parameter names, options) as JSON."""

    key = "optimizer_param_groups"

    def __init__(self, optimizer: Any, model: nn.Module, par: Parallel, *, distributed: bool) -> None:
        self.optimizer, self.model, self.par, self.distributed = optimizer, model, par, distributed
        self.names = {id(p): n for n, p in model.named_parameters()}

    def _local(self) -> dict[str, torch.Tensor]:
        if self.distributed:  # gathered over DP (a collective), as full per-parameter tensors
            return self.optimizer.full_state(self.names)
        # (under FSDP the state is split like the parameters: this rank's shard of each)
        return {f"{self.names[id(p)]}::{k}": (local(v) if torch.is_tensor(v) else torch.tensor(v))
                for p, st in self.optimizer.state.items() for k, v in st.items()}

    def state_tensors(self) -> list[tuple[str, torch.Tensor, TPShard | Split | None]]:
        out = []
        for key, t in self._local().items():
            name, _, fieldname = key.partition("::")
            placement = self.par.placements[name]
            if not placement.duplicate:
                out.append((f"{placement.name}::{fieldname}", t, placement.split if t.dim() else None))
        return out

    def state_json(self) -> list[dict[str, Any]]:
        # The names of the parameters the state is for (the group options are the run config's).
        names = [self.par.placements.canonical(n) for n, p in self.model.named_parameters() if p.requires_grad]
        return self.par.global_groups([{"params": names}])

    def load_state(self, ckpt: Checkpoint, saved: Any) -> None:
        saved_names = {n for g in saved or [] for n in g["params"]}
        fields: dict[str, list[str]] = {}
        for key in ckpt.names():
            pname, sep, fieldname = key.partition("::")
            if sep:
                fields.setdefault(pname, []).append(fieldname)
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            placement = self.par.placements[name]
            if placement.name not in saved_names:
                raise CheckpointError(f"{ckpt.path / 'state.json'}: the optimizer state has no entry for parameter "
                                      f"{placement.name!r}")
            for fieldname in fields.get(placement.name, []):
                key = f"{placement.name}::{fieldname}"
                scalar = len(ckpt.shape(key)) == 0
                tensors[f"{name}::{fieldname}"] = ckpt.full(key) if scalar else ckpt.read(key, local(p).shape,
                                                                                          placement.split)
            if p.dtype != torch.float32 and "master" not in fields.get(placement.name, []):
                # a float32-parameter checkpoint resumed with bf16 parameters: its weights are the
                # masters (the parameters, loaded just before, hold their bf16 roundings)
                tensors[f"{name}::master"] = ckpt.read(placement.name, local(p).shape, placement.split).float()
        # A bf16-parameter run's fp32 masters are its weights' truth: parameters of any type are
        # set from them (a run resumed with float32 parameters continues from the exact weights)
        masters = any(key.endswith("::master") for key in tensors)
        if self.distributed:
            self.optimizer.load_full_state(tensors, self.names)
            if masters:  # (the checkpoint's property: every rank takes part in the gather)
                self.optimizer.publish([piece[3] for piece in self.optimizer.pieces])
            return
        params, groups = dict(self.model.named_parameters()), groups_by_param(self.optimizer)
        for key, value in tensors.items():
            name, _, fieldname = key.partition("::")
            if fieldname == "master":  # not a plain optimizer's state: the parameter's exact value
                with torch.no_grad():
                    local(params[name]).copy_(value)
                continue
            p = params[name]
            self.optimizer.state[p][fieldname] = optimizer_state(groups[id(p)], p, fieldname, value)


class ScalerState:
    """The fp16 loss scale (torch's GradScaler or the distributed optimizer's) as JSON."""

    key = "scaler"

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def state_tensors(self) -> list[tuple[str, torch.Tensor, TPShard | None]]:
        return []

    def state_json(self) -> Any:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state(self, ckpt: Checkpoint, saved: Any) -> None:
        if saved and self.scaler.is_enabled():
            self.scaler.load_state_dict(saved)


__all__ = ["OptimizerState", "ParamRules", "ScalerState", "freeze", "lr_at", "param_groups", "schedule_lr", "set_lr"]
