"""The training loop (single process, or data parallel under torchrun).

What the loop does not know: the model and its loss (the family's `build` and `loss`), the data
(the named dataset's `build`). What it owns: optimizer and schedule, gradient accumulation,
clipping, precision, validation, NaN detection, metrics and the run directory.

Layouts beyond plain data parallelism are refused with a clear message until the parallel core
provides them; data parallelism uses torch's DDP for now.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zoo.errors import ConfigError, ZooError
from zoo.family import resolve
from zoo.io import atomic_write_text


def lr_at(step: int, *, peak: float, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine/linear decay or constant."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if decay == "constant":
        return peak
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    floor = peak * min_ratio
    if decay == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms, biases and other vectors (GPT-2/LLaMA practice)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _count_tokens(batch: Any) -> int:
    if isinstance(batch, dict):
        for key in ("tokens", "input_ids", "images", "x"):
            value = batch.get(key)
            if value is not None and hasattr(value, "numel"):
                return int(value.numel()) if key in ("tokens", "input_ids") else int(value.shape[0])
    return 0


def _to(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: (v.to(device, non_blocking=True) if hasattr(v, "to") else v) for k, v in batch.items()}
    return batch


def run(entry: Any, run: Any, plan: Any, *, run_dir: Path) -> int:
    import torch

    from zoo import distributed
    from zoo.registry import get_registry

    fam, owner = entry.family, str(entry.plugin)
    if plan.tp * plan.pp * plan.cp * plan.ep > 1:
        raise ConfigError(
            f"parallel: tp={plan.tp} pp={plan.pp} cp={plan.cp} ep={plan.ep}: only data parallelism trains in this "
            "version (the tensor/pipeline/context/expert parallel core is not built yet); use --dry-run to plan"
        )
    if run.train.recompute != "none":
        raise ConfigError(f"train.recompute={run.train.recompute!r}: activation recomputation is not available yet")
    if run.checkpoint.resume != "none" or run.checkpoint.load:
        raise ConfigError("checkpoint.resume / checkpoint.load: checkpoints are not available in this version yet")
    dataset_name = run.data.dataset or fam.default_dataset
    if not dataset_name:
        raise ConfigError(f"family {fam.name!r} declares no default dataset; set data.dataset=NAME")
    ds_spec, ds_info = get_registry().dataset(dataset_name)
    build_data = resolve(ds_spec.build, owner=str(ds_info))
    build = resolve(fam.build, owner=owner)
    loss_fn = resolve(fam.loss, owner=owner)

    with distributed.session(backend=run.parallel.backend, device=run.train.device, timeout_s=run.parallel.timeout_s) as env:
        torch.manual_seed(run.train.seed)
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / "config.yaml", run.to_yaml())
        model = build(run.model, fam.spec_for(run.model)).to(env.device)
        n_params = sum(p.numel() for p in model.parameters())
        train_model = model
        if env.world_size > 1:
            train_model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(
            param_groups(model, run.optimizer.weight_decay),
            lr=run.optimizer.lr, betas=(run.optimizer.beta1, run.optimizer.beta2), eps=run.optimizer.eps,
        )
        precision = run.train.precision
        dev_type = "cuda" if env.device.startswith("cuda") else "cpu"
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        scaler = torch.amp.GradScaler(dev_type, enabled=precision == "fp16")

        def data(split: str) -> Iterator[Any]:
            return iter(build_data(run, split=split, rank=env.rank, world_size=env.world_size))

        def forward(m: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
            with torch.autocast(dev_type, dtype=amp_dtype, enabled=amp_dtype is not None):
                return loss_fn(m, _to(batch, env.device))

        train_iter = data("train")
        metrics_path = run_dir / "metrics.jsonl"
        log = open(metrics_path, "w", encoding="utf-8") if env.is_main else None  # noqa: SIM115 (closed below)
        t_last, tokens_since = time.perf_counter(), 0
        loss_value = float("nan")
        try:
            for step in range(run.train.steps):
                lr = lr_at(step, peak=run.optimizer.lr, warmup=run.schedule.warmup_steps, total=run.train.steps,
                           decay=run.schedule.decay, min_ratio=run.schedule.min_lr_ratio)
                for group in opt.param_groups:
                    group["lr"] = lr
                total = torch.zeros((), device=env.device)
                for micro in range(plan.grad_accum):
                    batch = next(train_iter)
                    tokens_since += _count_tokens(batch) * env.world_size
                    last = micro == plan.grad_accum - 1
                    sync = train_model.no_sync() if (env.world_size > 1 and not last) else contextlib.nullcontext()
                    with sync:
                        loss, _ = forward(train_model, batch)
                        scaler.scale(loss / plan.grad_accum).backward()
                    total += loss.detach() / plan.grad_accum
                if env.world_size > 1:
                    torch.distributed.all_reduce(total)
                    total /= env.world_size
                loss_value = total.item()
                if not math.isfinite(loss_value):
                    raise ZooError(f"loss is {loss_value} at step {step + 1} (lr {lr:.3g}); lower optimizer.lr or check the data")
                scaler.unscale_(opt)
                grad_norm = (
                    torch.nn.utils.clip_grad_norm_(model.parameters(), run.optimizer.grad_clip).item()
                    if run.optimizer.grad_clip > 0 else float("nan")
                )
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                done = step + 1
                if env.is_main and (done % run.logging.interval == 0 or done == run.train.steps):
                    now = time.perf_counter()
                    record = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                              "tokens_per_s": tokens_since / max(now - t_last, 1e-9)}
                    t_last, tokens_since = now, 0
                    if run.train.eval_interval and (done % run.train.eval_interval == 0 or done == run.train.steps):
                        record["val_loss"] = _evaluate(model, forward, data("valid"), run.train.eval_steps)
                    assert log is not None
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    if run.logging.progress:
                        extra = f" val {record['val_loss']:.4f}" if "val_loss" in record else ""
                        print(f"step {done}/{run.train.steps} loss {loss_value:.4f}{extra} lr {lr:.3g} "
                              f"{record['tokens_per_s']:,.0f} tok/s", flush=True)
        finally:
            if log is not None:
                log.close()
        if env.is_main:
            print(f"trained {run.family} ({run.flavor}, {n_params:,} parameters) for {run.train.steps} steps; "
                  f"final loss {loss_value:.4f}; run directory {run_dir}")
    return 0


def _evaluate(model: Any, forward: Any, it: Iterator[Any], steps: int) -> float:
    import torch

    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for _ in range(steps):
            try:
                batch = next(it)
            except StopIteration:
                break
            total += float(forward(model, batch)[0])
            n += 1
    model.train(was_training)
    return total / max(n, 1)
