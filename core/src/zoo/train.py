"""The training loop (single process, or data parallel under torchrun).

What the loop does not know: the model and its loss (the family's `build` and `loss`), the data
(the named dataset's `build`). What it owns: optimizer and schedule, gradient accumulation,
clipping, precision (fp32, bf16 autocast, fp16 with loss scaling), recomputation, validation,
NaN detection, metrics, checkpoints and exact resume.

Every layout (tensor, sequence, pipeline, context and data parallel, ZeRO-1) is applied by
`zoo.parallel.engine.Parallel` from what the family declares; the loop is the same for all of
them. Checkpoints hold the single-process model's full tensors, so a run resumes under any layout.
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
from zoo.parallel import apply as tp


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
        for key in ("tokens", "input_ids"):
            value = batch.get(key)
            if value is not None and hasattr(value, "numel"):
                return int(value.numel())
    return 0


def _to(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: (v.to(device, non_blocking=True) if hasattr(v, "to") else v) for k, v in batch.items()}
    return batch


class _Metrics:
    """metrics.jsonl (kept consistent with the checkpoint on resume), TensorBoard, the loss curve."""

    def __init__(self, run_dir: Path, *, resume_step: int, tensorboard: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        if resume_step and self.path.exists():
            # Lines written after the checkpoint we resume from belong to a run that died.
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rec = json.loads(line)
                    if rec.get("step", 0) <= resume_step:
                        self.records.append(rec)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except (ImportError, RuntimeError):  # tensorboard is optional
                self.tb = None

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self, plot: Path | None) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if plot is not None:
            from zoo.plot import loss_curve

            steps = [r["step"] for r in self.records]
            loss_curve(plot, steps, [r["loss"] for r in self.records],
                       [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r])


def run(entry: Any, run: Any, plan: Any, *, run_dir: Path) -> int:
    import torch

    from zoo import checkpoint as ckpt
    from zoo import distributed, recompute
    from zoo.convert import load_into, read_meta
    from zoo.parallel.engine import Parallel
    from zoo.progress import Progress, matmul_flops_per_token, measured_peak_flops
    from zoo.registry import get_registry

    fam, owner = entry.family, str(entry.plugin)
    _check_layout(fam, run, plan)
    # data.path names Megatron indexed data; otherwise the family's own default dataset.
    has_paths = run.data.path or run.data.train_path
    dataset_name = run.data.dataset or ("megatron" if has_paths else fam.default_dataset)
    if not dataset_name:
        raise ConfigError(f"family {fam.name!r} declares no default dataset; set data.dataset=NAME")
    ds_spec, ds_info = get_registry().dataset(dataset_name)
    build_data = resolve(ds_spec.build, owner=str(ds_info))
    build = resolve(fam.build, owner=owner)
    loss_fn = resolve(fam.loss, owner=owner)
    ckpt_root = Path(run.checkpoint.dir) if run.checkpoint.dir else run_dir / "checkpoints"

    resume_from: Path | None = None
    if run.checkpoint.resume == "auto":
        resume_from = ckpt.latest(ckpt_root)
    elif run.checkpoint.resume != "none":
        resume_from = ckpt.resolve_checkpoint(run.checkpoint.resume)
    if resume_from is None and run.checkpoint.resume == "none" and ckpt.complete_checkpoints(ckpt_root):
        raise ConfigError(
            f"{ckpt_root} already holds checkpoints; continue with checkpoint.resume=auto or use another --run-dir"
        )

    with distributed.session(backend=run.parallel.backend, device=run.train.device, timeout_s=run.parallel.timeout_s) as env:
        if env.world_size != plan.world_size:
            raise ConfigError(f"the layout was planned for {plan.world_size} processes but this job has "
                              f"{env.world_size} (--world-size is for --dry-run planning)")
        torch.manual_seed(run.train.seed)
        dev_type = "cuda" if env.device.startswith("cuda") else "cpu"
        precision = run.train.precision
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        # Every rank builds the same full model from one seed; the core then keeps this rank's
        # part, so every layout trains the same model.
        full_model = build(run.model, fam.spec_for(run.model)).to(env.device)
        n_params = sum(p.numel() for p in full_model.parameters())
        flops_per_token = matmul_flops_per_token(full_model, run.train.seq_length)
        recompute.apply(full_model, run.train.recompute)
        p_cfg = run.parallel
        try:
            par = Parallel(full_model, fam, tp=plan.tp, cp=plan.cp, pp=plan.pp, vpp=plan.vpp,
                           sequence_parallel=p_cfg.sequence_parallel, order=p_cfg.order, pp_layers=p_cfg.pp_layers,
                           pp_schedule=p_cfg.pp_schedule, rank=env.rank, world_size=env.world_size,
                           seed=run.train.seed)
        except ValueError as e:
            raise ConfigError(f"parallel: {e}") from None
        ties = _ties(full_model)
        del full_model
        model = par.model  # this rank's parameters (its tensor-parallel shards of its stages)

        # Format-1 checkpoints and HF weights hold full tensors: sliced to this rank's part on load.
        def shard_one(name: str, t: Any) -> Any:
            st = tp.tp_style(model, name)
            return tp.shard_full(t, *st) if st else t

        if run.checkpoint.load and resume_from is None:  # each rank reads only its own part
            source = run.checkpoint.load
            load_into(model, ckpt.load_initial_weights(source, par=par, model=model, family=run.family), what=source)
        sharded = None  # (optimizer tensors, loop state, RNG) of a sharded checkpoint
        if resume_from is not None:
            md = read_meta(resume_from)
            if md.family != run.family:
                raise ConfigError(f"{resume_from}: a checkpoint of {md.family!r}, not {run.family!r}")
            if md.meta.get("sharded"):  # each rank reads only the slices it holds, under any layout
                local, *sharded = ckpt.load_sharded(resume_from, par=par, model=model, rank=env.rank,
                                                    world_size=env.world_size)
                load_into(model, local, what=str(resume_from))
            else:  # format 1: full tensors in one file
                from zoo.convert import read_model_state

                load_into(model, par.local_state(read_model_state(md)), what=str(resume_from))

        if run.train.param_dtype != "fp32":  # after loading: the fp32 masters come from the checkpoint or these
            model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[run.train.param_dtype])

        # The optimizer is made after the weights are in place: ZeRO-1 copies them into its fp32 masters.
        def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(groups, lr=run.optimizer.lr, betas=(run.optimizer.beta1, run.optimizer.beta2),
                                     eps=run.optimizer.eps)

        buckets = par.make_buckets(p_cfg.bucket_size, shard=bool(p_cfg.zero))
        zero = None
        if p_cfg.zero:
            from zoo.parallel.zero import DistributedOptimizer

            # fp32 master weights and Adam state only for this rank's shard of every bucket.
            opt = zero = DistributedOptimizer(buckets, adamw, weight_decay=run.optimizer.weight_decay)
        else:
            opt = adamw(param_groups(model, run.optimizer.weight_decay))
        names = {id(p): n for n, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in param_groups(model, run.optimizer.weight_decay)]
        if zero is not None and precision == "fp16":
            from zoo.parallel.zero import DynamicLossScale

            scaler: Any = DynamicLossScale()  # overflow decided on the all-reduced norm, by every rank alike
        else:
            scaler = torch.amp.GradScaler(dev_type, enabled=precision == "fp16")
        step, consumed = 0, 0

        if resume_from is not None:
            if sharded:
                opt_tensors, state, rng = sharded
                local_shards = True  # already this rank's TP shards
            else:
                state, opt_tensors, rng = ckpt.load_train_state(md)
                local_shards = False
            opt_tensors, opt_groups = par.local_optimizer(opt_tensors, state["optimizer_param_groups"], group_names)
            to_local = (lambda name, t: t) if local_shards else shard_one
            if zero is not None:
                zero.load_full_state({k: to_local(k.partition("::")[0], v) if v.dim() else v
                                      for k, v in opt_tensors.items()}, names)
            else:  # fp32 masters saved by a bf16-parameter run are not a plain optimizer's state
                opt_tensors = {k: v for k, v in opt_tensors.items() if not k.endswith("::master")}
                ckpt.load_optimizer(opt, model, opt_tensors, opt_groups, where=resume_from, transform=to_local)
            if state.get("scaler") and scaler.is_enabled():
                scaler.load_state_dict(state["scaler"])
            if sharded:
                from zoo.dist_checkpoint import restore_rng

                restore_rng(*rng)
                if "tp_stream" in rng[0]:  # this rank's tensor-parallel dropout stream, same layout
                    par.tp_rng.load_state(rng[0]["tp_stream"])
            else:
                ckpt.restore_rng(state, rng)
            step, consumed = int(state["step"]), int(state["consumed_samples"])
            if env.is_main:
                print(f"resuming from {resume_from} (step {step})", flush=True)
        if step >= run.train.steps:
            if env.is_main:
                print(f"{run_dir}: already trained to step {step} (train.steps={run.train.steps}); nothing to do", flush=True)
            return 0
        tokenizer_dir = resolve(ds_spec.tokenizer, owner=str(ds_info))(run) if ds_spec.tokenizer else None

        def data(split: str, start: int) -> Iterator[Any]:
            return iter(build_data(run, split=split, dp_rank=par.dp_rank, dp_size=plan.dp, consumed_samples=start))

        def forward(m: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
            with torch.autocast(dev_type, dtype=amp_dtype, enabled=amp_dtype is not None), recompute.scope(run.train.recompute):
                return loss_fn(m, _to(batch, env.device))

        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / "config.yaml", run.to_yaml())
        metrics = _Metrics(run_dir, resume_step=step, tensorboard=run.logging.tensorboard) if env.is_main else None
        peak = measured_peak_flops(env.device, amp_dtype or torch.float32) if env.is_main else 1.0
        progress = Progress(run.train.steps, enabled=env.is_main and run.logging.progress, start=step)
        train_iter = data("train", consumed)
        t_last, tokens_since = time.perf_counter(), 0
        loss_value = float("nan")

        last_saved = [-1]  # decided identically on every rank (no filesystem check: it may not be shared)

        from zoo.dist_checkpoint import Saver

        # An async save writes from the live tensors while the next forward and backward run; the
        # optimizer update (the only thing that changes them) waits for it.
        saver = Saver(asynchronous=run.checkpoint.async_save, copy=False)
        token = _run_token(env.world_size)  # names this run's partial checkpoint directories

        saved_at = [time.monotonic()]
        preempt = _Preemption(run.checkpoint.save_on_sigterm)

        def save() -> None:
            last_saved[0] = step
            saved_at[0] = time.monotonic()
            # Each rank snapshots what it holds (ZeRO shards gathered over DP first: a collective);
            # the files are written now or in the background, one save in flight at most.
            if zero is not None:
                opt_state = zero.full_state(names)
            else:
                opt_state = {f"{names[id(p)]}::{k}": (v if torch.is_tensor(v) else torch.tensor(v))
                             for p, st in opt.state.items() for k, v in st.items()}
            groups = par.global_groups(ckpt.optimizer_tensors(adamw(param_groups(model, run.optimizer.weight_decay)),
                                                              model)[1])
            path = ckpt.save_sharded(ckpt_root, step=step, run=run, par=par, model=model, optimizer_state=opt_state,
                                     groups=groups, scaler=scaler, consumed_samples=consumed, tokenizer_dir=tokenizer_dir,
                                     keep_last=run.checkpoint.keep_last, ties=ties, saver=saver, token=token,
                                     rank=env.rank, world_size=env.world_size, timeout_s=run.parallel.timeout_s)
            if env.is_main and run.logging.progress:
                print(f"{'saving' if saver.asynchronous else 'saved'} checkpoint {path}", flush=True)

        try:
            while step < run.train.steps:
                lr = lr_at(step, peak=run.optimizer.lr, warmup=run.schedule.warmup_steps, total=run.train.steps,
                           decay=run.schedule.decay, min_ratio=run.schedule.min_lr_ratio)
                for group in opt.param_groups:
                    group["lr"] = lr
                batches = [next(train_iter) for _ in range(plan.grad_accum)]
                tokens_since += sum(_count_tokens(b) for b in batches) * plan.dp
                # All micro-batches (through the pipeline schedule when pp > 1); gradient
                # reductions overlap backward, the last ones are awaited in finish_grads.
                total = par.forward_backward(batches, forward, seq_length=run.train.seq_length, scale=scaler.scale)
                par.finish_grads()
                loss_value = total.item()
                if not math.isfinite(loss_value):
                    raise ZooError(f"loss is {loss_value} at step {step + 1} (lr {lr:.3g}); lower optimizer.lr or check the data")
                saver.wait()  # a save in flight still reads the parameters and optimizer state
                if zero is not None:  # clips over the shards, updates them, gathers the parameters
                    grad_norm = zero.step(max_norm=run.optimizer.grad_clip, tp_group=par.tp_group, pp_group=par.pp_group,
                                          loss_scale=scaler if precision == "fp16" else None)
                else:
                    scaler.unscale_(opt)
                    grad_norm = par.clip(run.optimizer.grad_clip)
                    scaler.step(opt)
                    scaler.update()
                if buckets is not None:
                    buckets.zero_grad()  # gradients are views into the buckets: zero, never free
                else:
                    opt.zero_grad(set_to_none=True)
                step += 1
                consumed += plan.global_batch_size
                log_now = step % run.logging.interval == 0 or step == run.train.steps
                eval_now = bool(run.train.eval_interval) and log_now and (
                    step % run.train.eval_interval == 0 or step == run.train.steps)
                # Every rank evaluates (parallel forwards are collective); DP and CP ranks average.
                val = _evaluate(par, forward, data("valid", 0), run.train.eval_steps, run.train.seq_length) if eval_now else None
                if env.is_main and log_now:
                    now = time.perf_counter()
                    tps = tokens_since / max(now - t_last, 1e-9)
                    t_last, tokens_since = now, 0
                    record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                              "tokens_per_s": tps, "mfu": tps * flops_per_token / env.world_size / peak}
                    if val is not None:
                        record["val_loss"] = val
                    assert metrics is not None
                    metrics.log(record)
                    fields = {"loss": f"{loss_value:.4f}", "lr": f"{lr:.3g}", "tok/s": f"{tps:,.0f}",
                              "mfu": f"{record['mfu']:.1%}"}
                    if "val_loss" in record:
                        fields["val"] = f"{record['val_loss']:.4f}"
                    progress.update(step, fields, log_line=True)
                elif env.is_main:
                    progress.update(step, {"loss": f"{loss_value:.4f}"}, log_line=False)
                due = bool(run.checkpoint.interval) and step % run.checkpoint.interval == 0
                stop = False
                if preempt.watching or run.checkpoint.interval_minutes > 0:
                    # Every rank must take the same decision: rank 0's clock, anyone's SIGTERM.
                    late = run.checkpoint.interval_minutes > 0 and time.monotonic() - saved_at[0] >= 60 * run.checkpoint.interval_minutes
                    flags = torch.tensor([float(preempt.requested), float(late and env.is_main)])
                    if env.world_size > 1:
                        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
                    stop, due = bool(flags[0]), due or bool(flags[1])
                if (due or stop) and step < run.train.steps:
                    save()
                if stop:
                    if env.is_main:
                        print(f"SIGTERM: saved step {step} and stopping; rerun the same command to continue", flush=True)
                    break
            if run.train.steps > 0 and step == run.train.steps and last_saved[0] != step:
                save()
            saver.wait()  # the last checkpoint is complete before the run ends
        finally:
            preempt.restore()
            if metrics is not None:
                metrics.close(run_dir / "loss.png" if step > 0 else None)
        if env.is_main:
            print(f"trained {run.family} ({run.flavor}, {n_params:,} parameters) for {step} steps; "
                  f"final loss {loss_value:.4f}; run directory {run_dir}", flush=True)
    return 0


def _evaluate(par: Any, forward: Any, it: Iterator[Any], steps: int, seq_length: int) -> float:
    batches = []
    for _ in range(steps):
        try:
            batches.append(next(it))
        except StopIteration:
            break
    modules = [par.model, *par.chunks]
    was_training = par.model.training
    for m in modules:
        m.eval()
    try:
        return par.evaluate(batches, forward, seq_length=seq_length)
    finally:
        for m in modules:
            m.train(was_training)


class _Preemption:
    """SIGTERM (a scheduler preempting the job) asks for a save at the end of the current step."""

    def __init__(self, enabled: bool) -> None:
        import signal
        import threading

        self.requested = False
        self.watching = enabled and threading.current_thread() is threading.main_thread()
        self._previous: Any = None
        if self.watching:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self.watching:
            import signal

            signal.signal(signal.SIGTERM, self._previous)
            self.watching = False


def _ties(model: Any) -> dict[str, str]:
    """Tied parameter names of the whole model: alias -> the name it shares (stored once)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _run_token(world_size: int) -> str:
    """A token every rank agrees on (rank 0's), unique to this run."""
    import secrets

    token = [secrets.token_hex(4)]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)
    return token[0]


def _check_layout(fam: Any, run: Any, plan: Any) -> None:
    """What the family or the precision cannot do under this layout, before any process starts."""
    p = run.parallel
    if plan.ep > 1:
        raise ConfigError(f"parallel.ep={plan.ep}: family {fam.name!r} has no experts to distribute")
    if plan.tp > 1 and not fam.tp_plan:
        raise ConfigError(f"parallel.tp={plan.tp}: family {fam.name!r} declares no tp_plan")
    if (plan.pp > 1 or p.sequence_parallel) and fam.pipeline is None:
        what = f"parallel.pp={plan.pp}" if plan.pp > 1 else "parallel.sequence_parallel"
        raise ConfigError(f"{what}: family {fam.name!r} declares no pipeline spec (its layer list)")
    if plan.cp > 1 and fam.sequence is None:
        raise ConfigError(f"parallel.cp={plan.cp}: family {fam.name!r} declares no sequence spec")
    if plan.cp > 1 and run.data.reset_attention_mask:
        raise ConfigError("parallel.cp > 1 with data.reset_attention_mask: ring attention has no document masking")
    if run.train.precision == "fp16" and (plan.tp > 1 or plan.pp > 1) and not p.zero:
        raise ConfigError("train.precision=fp16 with parallel.tp > 1 or pp > 1 needs parallel.zero=1 (its overflow "
                          "check is all-reduced over every parallel group; torch's GradScaler checks one rank)")
    dtype = run.train.param_dtype
    if dtype != "fp32" and not (p.zero and run.train.precision == dtype):
        raise ConfigError(f"train.param_dtype={dtype} needs parallel.zero=1 (its distributed optimizer keeps the fp32 "
                          f"master weights) and train.precision={dtype}")


__all__ = ["lr_at", "param_groups", "run"]
