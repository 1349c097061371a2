"""The training loop, as a `Trainer` whose parts are named: build (model, layout, optimizer),
restore, one step, evaluation (and its preview), saving, logging, and the loop that calls them.

What the trainer does not know: the model and its loss (the family's ``build`` and ``loss``), the
data (the named dataset's ``build``), what a unit of throughput is and what extra metrics the
loss reports (the family's ``throughput`` and ``metrics``). It owns: the kernels the run computes
with (`zoo.kernels`, chosen once), the optimizer and schedule, gradient accumulation, clipping,
precision (fp32, bf16 autocast, fp16 with loss scaling), recomputation, frozen parameters and
learning-rate multipliers, the moving average of the weights, validation and previews, NaN
detection, metrics, checkpoints and exact resume. Every layout is applied by
`zoo.parallel.Parallel` from what the family declares; checkpoints hold the single-process
model's names and shapes, so a run resumes under any layout.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from zoo import kernels, procs
from zoo.checkpoint.sharded import Saver
from zoo.checkpoint.state import Stateful, TrainState
from zoo.config import RunConfig, rampup, torch_dtype
from zoo.data.energon.training import path_kind
from zoo.errors import ConfigError
from zoo.family import DatasetSpec, Family, check_dataset, resolve
from zoo.io import atomic_write_text
from zoo.parallel import cuda_graphs
from zoo.parallel.distributed import to_device
from zoo.parallel.engine import Parallel, StepOutput
from zoo.parallel.layout import Layout
from zoo.training import optim
from zoo.training.ema import EMA
from zoo.training.guard import NonFiniteGuard
from zoo.training.instruments import Instruments
from zoo.training.loss_scale import DynamicLossScale
from zoo.training.metrics import MetricsLog, log_fields, measured_peak_flops, work_of
from zoo.training.progress import Progress
from zoo.training.run_control import Preemption, resume_point, run_token


class Trainer:
    """Trains ``family`` as ``run`` says under ``layout``; `fit` runs the job (one process or one
    rank under torchrun). ``dataset`` overrides the registry's lookup (tests, embedding)."""

    def __init__(self, family: Family, run: RunConfig, layout: Layout, *, run_dir: Path, owner: str | None = None,
                 dataset: DatasetSpec | None = None) -> None:
        self.family, self.run, self.layout, self.run_dir = family, run, layout, run_dir
        self.owner = owner or f"family {family.name!r}"
        self._build_model = resolve(family.build, owner=self.owner)
        self._loss = resolve(family.loss, owner=self.owner)
        self._preview = resolve(family.preview, owner=self.owner) if family.preview and run.train.preview else None
        self.dataset, self._dataset_owner = self._dataset(dataset)
        self.data_position: Any = None  # a stateful dataset's loader position (`DataPosition`)
        self.ckpt_root = Path(run.checkpoint.dir) if run.checkpoint.dir else run_dir / "checkpoints"
        self.state = TrainState()
        self.log: MetricsLog | None = None  # global rank 0's, once the loop starts

    def _dataset(self, given: DatasetSpec | None) -> tuple[DatasetSpec, str]:
        if given is not None:
            return given, self.owner
        run = self.run
        # data.path names Megatron indexed data; otherwise the family's own default dataset.
        has_paths = run.data.path or run.data.train_path
        name = run.data.dataset or (path_kind(has_paths) if has_paths else self.family.default_dataset)
        if not name:
            raise ConfigError(f"family {self.family.name!r} declares no default dataset; set data.dataset=NAME")
        from zoo.registry import get_registry

        spec, info = get_registry().dataset(name)
        check_dataset(self.family, spec, run)
        return spec, str(info)

    # ------------------------------------------------------------------------------- the job

    def fit(self) -> int:
        from zoo.parallel import distributed

        run = self.run
        resume_from = resume_point(run.checkpoint.resume, self.ckpt_root, self.run_dir)
        with distributed.session(backend=run.parallel.backend, device=run.train.device,
                                 timeout_s=run.parallel.timeout_s) as env:
            if env.world_size != self.layout.world_size:
                raise ConfigError(f"the layout was planned for {self.layout.world_size} processes but this job has "
                                  f"{env.world_size} (--world-size is for --dry-run planning)")
            self.env = env
            self.kernels = kernels.select(env.device, kernels.options(run.train))  # chosen once, held here
            with self.kernels.use():
                return self._fit(resume_from)

    def _fit(self, resume_from: Path | None) -> int:
        run, env = self.run, self.env
        if run.data.num_workers > 0:  # the workers' server imports torch while the model is built
            procs.warm()
        self.build()
        self.restore(resume_from)
        if self.state.step >= run.train.steps:
            if env.is_main:
                print(f"{self.run_dir}: already trained to step {self.state.step} (train.steps={run.train.steps}); "
                      "nothing to do", flush=True)
            return 0
        self.open_outputs()
        try:
            self.loop()
        finally:
            self.close_outputs()
        return 0

    # ------------------------------------------------------------------------------- building

    def build(self) -> None:
        """This rank's model under the layout, the frozen set, the optimizer, the loss scaler, the EMA."""
        from zoo.checkpoint.weights import ModelState
        from zoo.nn import recompute
        from zoo.parallel.sharding import aliases

        run, env, fam = self.run, self.env, self.family
        torch.manual_seed(run.train.seed)
        torch.set_flush_denormal(run.train.flush_denormal)
        self.dev_type = "cuda" if env.device.startswith("cuda") else "cpu"
        cuda_graphs.check(enabled=run.train.cuda_graph, device=env.device, layout=self.layout, precision=run.train.precision,
                          main_grads=run.train.param_dtype != "fp32" and run.train.grad_dtype == "fp32")
        self.amp_dtype = torch_dtype(run.train.precision) if run.train.precision != "fp32" else None
        full, record = self._model_on_meta()
        self.n_params = sum(p.numel() for p in full.parameters())
        self.work = work_of(fam.throughput, full, run, owner=self.owner)  # batch -> (units, FLOPs)
        self.rules = optim.ParamRules(run.optimizer.weight_decay, run.optimizer.lr_mult, run.train.freeze)
        self.rules.check([n for n, _ in full.named_parameters()])
        recompute.apply(full, run.train.recompute)
        self.ties = aliases(full)
        # Each rank materialises only its part (its stages, its tensor-parallel pieces), bitwise
        # what one process building the whole model from the seed would have.
        self.par = Parallel(full, fam, self.layout, rank=env.rank, seed=run.train.seed, init=record, device=env.device,
                            model_config=run.model)
        del full
        self.model = self.par.model  # this rank's parameters (its tensor-parallel pieces of its stages)
        self.model_state = ModelState(self.model, self.par.placements)
        if self.dataset.stateful:
            from zoo.data.energon.training import DataPosition

            self.data_position = DataPosition(self.par, micro_batches=self.layout.grad_accum)
        self.frozen = optim.freeze(self.model, self.par.placements, self.rules)

    def _model_on_meta(self) -> tuple[torch.nn.Module, Any]:
        """The model built on the meta device with its recorded initialisation; a build that
        cannot run there (it reads tensor values) is built in full, as every rank used to."""
        from zoo.parallel.materialize import DeferredInitError, record_build

        spec = self.family.spec_for(self.run.model)
        try:
            return record_build(self._build_model, self.run.model, spec)
        except DeferredInitError as e:
            if self.env.is_main:
                print(f"note: {self.owner} builds the whole model on every rank ({e})", flush=True)
            return self._build_model(self.run.model, spec).to(self.env.device), None

    def build_optimizer(self, loaded: Mapping[str, torch.Tensor] | None = None) -> None:
        """After the weights are in place: ZeRO-1 copies them (or ``loaded``, as read) into its fp32 masters."""
        run, par = self.run, self.par
        if run.train.param_dtype != "fp32":
            self.model.to(torch_dtype(run.train.param_dtype))
        adamw = optim.adamw_factory(run.optimizer, note=lambda m: print(m, flush=True) if self.env.is_main else None)
        self.buckets = par.make_buckets(run.parallel.bucket_size, shard=bool(self.layout.zero),
                                        grad_dtype=torch.float32 if run.train.grad_dtype == "fp32" else None)
        self.zero = None
        if self.layout.zero:
            from zoo.parallel.zero import DistributedOptimizer

            names = {id(p): par.placements.canonical(n) for n, p in self.model.named_parameters()}
            # fp32 master weights and Adam state only for this rank's shard of every bucket.
            self.opt: Any = DistributedOptimizer(self.buckets, adamw, group_of=lambda p: self.rules.options(names[id(p)], p))
            self.zero = self.opt
            if loaded is not None and run.train.param_dtype != "fp32":  # the values read, not bf16 roundings
                self.opt.load_full_state({f"{n}::master": t for n, t in loaded.items()},
                                         {id(p): n for n, p in self.model.named_parameters()})
        else:
            self.opt = adamw(optim.param_groups(self.model, run.optimizer.weight_decay, rules=self.rules,
                                                placements=par.placements))
        # fp16: overflow decided on the global gradient norm, by every rank of every layout alike
        self.scaler = DynamicLossScale(run.train.initial_loss_scale, run.train.loss_scale_window,
                                       enabled=run.train.precision == "fp16", ranks=self.layout.dp * self.layout.cp)
        self.ema = EMA(self.model, par.placements, run.train.ema, zero=self.zero, ramp=run.train.ema_ramp,
                       power=run.train.ema_power) if run.train.ema > 0 else None
        if run.train.cuda_graph:  # (after the buckets: gradients that are their views stay so)
            par.graphs = cuda_graphs.GraphedMicroBatches(list(self.model.parameters()), note=lambda m: print(m, flush=True))

    def stateful(self) -> list[Stateful]:
        """Everything a checkpoint saves besides the loop position and the RNG states."""
        optimizer = optim.OptimizerState(self.opt, self.model, self.par, distributed=self.zero is not None)
        extra: list[Stateful] = [s for s in (self.ema, self.data_position) if s is not None]
        return [self.model_state, optimizer, optim.ScalerState(self.scaler), *extra]

    # ------------------------------------------------------------------------------ restoring

    def restore(self, path: Path | None) -> None:
        """Weights from the checkpoint resumed (or ``checkpoint.load``), then the optimizer,
        scaler, EMA, loop position and RNG states; each rank reads only its pieces."""
        from zoo.checkpoint import rng as rng_mod
        from zoo.checkpoint.state import Checkpoint
        from zoo.checkpoint.weights import load_initial_weights

        run = self.run
        if path is None:
            weights = load_initial_weights(run.checkpoint.load, model=self.model, family=run.family,
                                           placements=self.par.placements) if run.checkpoint.load else None
            if weights is not None:
                self.model_state.load(lambda name, t: weights[name], what=run.checkpoint.load)
            self.build_optimizer(weights)
            return
        with Checkpoint(path, family=run.family, rank=self.env.rank, world_size=self.env.world_size) as ckpt:
            ckpt.restore(self.model_state)
            self.build_optimizer()
            ckpt.restore(*self.stateful()[1:])
            rng = ckpt.rng()
            self.state = ckpt.train_state()
        rng_mod.restore(rng)
        if "tp_stream" in rng.extra:  # this rank's tensor-parallel dropout stream, same layout
            self.par.tp_rng.load_state(rng.extra["tp_stream"])
        if self.env.is_main:
            print(f"resuming from {path} (step {self.state.step})", flush=True)

    # ------------------------------------------------------------------------------- a step

    def forward(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> tuple[Any, Any]:
        """The family's loss on one micro-batch (on the device) under the run's precision and recomputation."""
        from zoo.nn import recompute

        with torch.autocast(self.dev_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None), \
                recompute.scope(self.run.train.recompute):
            return self._loss(model, batch)

    def train_step(self, batches: list[Mapping[str, Any]], lr: float) -> tuple[StepOutput, torch.Tensor]:
        """Forward and backward of the step's micro-batches, then clipping and the update; returns
        the step's output and the gradient norm, whose read is the step's one wait for the device (a
        non-finite norm skips the update, `zoo.training.guard`; losses are checked at log lines)."""
        run = self.run
        optim.set_lr(self.opt, lr)
        # All micro-batches (through the pipeline schedule when pp > 1); gradient reductions
        # overlap backward, the last ones are awaited in finish_grads.
        out = self.par.forward_backward(batches, self.forward, seq_length=run.train.seq_length, scale=self.scaler.scale)
        self.inst.lap("forward_backward")
        self.par.finish_grads()
        self.inst.lap("grad_sync")
        self.guard.loss(self.state.step + 1, lr, out.loss)
        self.saver.wait()  # a save in flight still reads the parameters and optimizer state
        self.inst.lap("checkpoint")
        fp16 = run.train.precision == "fp16"  # overflow is the loss scale's to handle
        step, first = self.state.step + 1, self.state.consumed_samples
        skip = None if fp16 else (lambda norm: self.guard.skip(norm, step=step, first_sample=first))
        if self.zero is not None:  # clips over the shards, updates them, gathers the parameters
            grad_norm = self.zero.step(max_norm=run.optimizer.grad_clip, norm_squared=self.par.grad_norm_squared,
                                       loss_scale=self.scaler if fp16 else None, skip=skip)
            updated = math.isfinite(float(grad_norm))  # (an overflow or a skip left the parameters as they were)
        else:
            if fp16:
                self.scaler.unscale_(p.grad for p in self.model.parameters())
            grad_norm = self.par.clip(run.optimizer.grad_clip)
            updated = self.scaler.settle(grad_norm) if skip is None else not skip(grad_norm)
            if updated:
                self.opt.step()
        self.guard.skipped += fp16 and not updated  # (the loss scale's skips, counted as the guard's are)
        if self.buckets is not None:
            self.buckets.zero_grad()  # gradients are views into the buckets: zero, never free
        else:
            self.opt.zero_grad(set_to_none=self.par.graphs is None)  # (a graph accumulates into the same tensors)
        if self.ema is not None and updated:
            self.ema.update()
        self.state.step += 1
        self.state.consumed_samples += len(batches) * self.layout.global_batch_size // self.layout.grad_accum
        self.inst.lap("optimizer")
        return out, grad_norm

    def check_losses(self) -> None:
        self.guard.check_losses()

    # ------------------------------------------------------------------------------ evaluation

    def evaluate(self) -> StepOutput | None:
        """Validation loss and metrics (every rank: parallel forwards are collective), then the
        family's preview of the first validation micro-batch. None when the split is empty."""
        batches = list(itertools.islice(self.data("valid", 0), self.run.train.eval_steps))
        if not batches:  # (a loss over no batch would be logged as NaN)
            if self.env.is_main and not getattr(self, "_no_val_note", False):
                print("validation skipped: the validation split holds no batch", flush=True)
                self._no_val_note = True
            return None
        modules = [self.par.model, *self.par.chunks]
        was_training = self.par.model.training
        for m in modules:
            m.eval()
        try:
            batches = [to_device(b, self.env.device) for b in batches]
            out = self.par.evaluate(batches, self.forward, seq_length=self.run.train.seq_length)
            if self._preview is not None and batches:
                self.preview(batches[0])
        finally:
            for m in modules:
                m.train(was_training)
        return out

    def preview(self, batch: Mapping[str, Any]) -> None:
        """The family's sample for this evaluation, with the EMA weights when kept. It runs on the
        ranks of the first data-parallel replica (tensor-parallel layers communicate) and is
        written by rank 0, under its own random stream (training's is left untouched)."""
        lay = self.layout
        if lay.pp > 1 or lay.cp > 1:
            if self.env.is_main and not getattr(self, "_preview_note", False):
                print(f"preview skipped: family previews run with pp=1 and cp=1 (this layout: pp={lay.pp}, cp={lay.cp})",
                      flush=True)
                self._preview_note = True
            return
        replica = self.par.dp_rank == 0 or lay.fsdp  # (FSDP's forward gathers over every DP rank; so does ZeRO's EMA)
        if not replica and (self.ema is None or self.ema.zero is None):
            return
        generator = torch.Generator(self.env.device).manual_seed(self.run.train.seed + self.state.step)
        with torch.random.fork_rng(devices=[self.env.device] if self.dev_type == "cuda" else []), torch.no_grad():
            ema = self.ema.swapped() if self.ema is not None else contextlib.nullcontext()
            with ema, torch.autocast(self.dev_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                artifact = self._preview(self.model, self.run.model, batch, generator=generator) if replica else None
            self.par.reshard()
        if self.env.is_main:
            assert self.log is not None
            path = self.log.preview(artifact, self.state.step)
            if self.run.logging.progress:
                print(f"preview {path}", flush=True)

    # ------------------------------------------------------------------------------ outputs

    def data(self, split: str, start: int) -> Iterator[Any]:
        build = resolve(self.dataset.build, owner=self._dataset_owner)
        kw = {}
        if self.dataset.stateful:
            kw = {"family": self.family, "state": self.data_position.saved if split == "train" else None}
        it = iter(build(self.run, split=split, dp_rank=self.par.dp_rank, dp_size=self.layout.dp, consumed_samples=start,
                        **kw))
        if self.dataset.stateful and split == "train":
            self.data_position.batches = it
        return it

    def open_outputs(self) -> None:
        run, env = self.run, self.env
        tok = self.dataset.tokenizer
        self.tokenizer_dir = resolve(tok, owner=self._dataset_owner)(run) if tok else None
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", run.to_yaml() + self.kernels.comment())
            for note in self.kernels.notes():  # (a precision this device computes slowly)
                print(note, flush=True)
            print(f"training {run.family} ({run.flavor}, {self.n_params:,} parameters) on {self.dataset.name} to step "
                  f"{run.train.steps}; {self.layout.describe()}; run directory {self.run_dir}", flush=True)
        self.log = MetricsLog(self.run_dir, resume_step=self.state.step, tensorboard=run.logging.tensorboard) \
            if env.is_main else None
        # The better of the compute dtype's GEMM rate and fp32's: a CPU without native bf16 runs a
        # large bf16 GEMM far below its fp32 rate, which made MFU read several hundred percent.
        dtypes = {self.amp_dtype or torch.float32, torch.float32}
        self.peak = max(measured_peak_flops(env.device, d) for d in dtypes) if env.is_main else 1.0
        self.progress = Progress(run.train.steps, enabled=env.is_main and run.logging.progress, start=self.state.step)
        self.inst = Instruments(run.logging, rank=env.rank, world_size=env.world_size, device=self.par.device,
                                stage=self.par.pp_rank, run_dir=self.run_dir, is_main=env.is_main)
        # An async save writes from the live tensors while the next forward and backward run; the
        # optimizer update (the only thing that changes them) waits for it.
        self.saver = Saver(asynchronous=run.checkpoint.async_save, copy=False, on_error=run.checkpoint.on_save_error,
                           announce=env.is_main)
        self.token = run_token(env.world_size, shared=self.ckpt_root)  # names this run's partial checkpoints
        self.preempt = Preemption(run.checkpoint.save_on_sigterm)
        self.saved_step, self.saved_at = -1, time.monotonic()
        self.guard = NonFiniteGuard(run.train.skip_nonfinite, announce=env.is_main, batch=self.layout.global_batch_size,
                                    stream=f"the train stream of dataset {self.dataset.name!r}",
                                    data=self.data_position)
        self.guard.skipped, self.guard.in_a_row = self.state.skipped_steps, self.state.skipped_in_a_row  # (resumed)

    def close_outputs(self) -> None:
        self.preempt.restore()
        self.inst.close()
        if self.log is None:
            return
        note = self.log.close(plot=self.run_dir / "loss.png" if self.state.step > 0 and self.run.logging.plot else None,
                              title=f"{self.run.family} ({self.run.flavor})", log_scale=self.run.logging.plot_log_scale)
        if note:
            print(note, flush=True)

    def save(self) -> None:
        from zoo.checkpoint.state import save

        self.check_losses()  # never a checkpoint of weights a non-finite loss updated
        # Each rank snapshots what it holds (ZeRO shards gathered over DP first: a collective);
        # the files are written now or in the background, one save in flight at most.
        self.saved_step, self.saved_at = self.state.step, time.monotonic()
        run, env = self.run, self.env
        state = TrainState(self.state.step, self.state.consumed_samples, self.guard.skipped, self.guard.in_a_row)
        path = save(self.ckpt_root, state=state, run=run, par=self.par,
                    items=self.stateful(), ties=self.ties, saver=self.saver, token=self.token,
                    tokenizer_dir=self.tokenizer_dir, keep_last=run.checkpoint.keep_last, rank=env.rank,
                    world_size=env.world_size, timeout_s=run.parallel.timeout_s)
        if env.is_main and run.logging.progress:
            print(f"{'saving' if self.saver.asynchronous else 'saved'} checkpoint {path}", flush=True)

    def record(self, out: StepOutput, *, lr: float, grad_norm: torch.Tensor, units: int, flops: float,
               seconds: float, val: StepOutput | None) -> dict[str, Any]:
        """The metrics line of a step (global rank 0)."""
        unit = self.family.throughput.unit
        rate, achieved = units / max(seconds, 1e-9), flops / max(seconds, 1e-9) / self.env.world_size  # (per rank)
        metrics = {k: float(v) for k, v in out.metrics.items()}
        record: dict[str, Any] = {"step": self.state.step, "loss": metrics.pop("loss"), "lr": lr,
                                  "grad_norm": float(grad_norm), "skipped_steps": self.guard.skipped,
                                  f"{unit}_per_s": rate, "flops_per_s": achieved, "mfu": achieved / self.peak, **metrics}
        if self.scaler.is_enabled():
            record["loss_scale"] = self.scaler.scale_value
        if val is not None:
            record["val_loss"] = float(val.metrics["loss"])
            record.update({f"val_{k}": float(v) for k, v in val.metrics.items() if k != "loss"})
        return record

    # ------------------------------------------------------------------------------- the loop

    def loop(self) -> None:
        run, env, lay = self.run, self.env, self.layout
        train_iter = self.data("train", self.state.consumed_samples)
        t_last, units, flops, out, logged = time.perf_counter(), 0, 0.0, None, self.state.step
        while self.state.step < run.train.steps:
            self.inst.step_begin(self.state.step + 1)
            lr = optim.schedule_lr(run, self.state.step)
            self.guard.batch, accum = rampup.step(run.train, self.state.consumed_samples, lay)  # (this step's global batch)
            batches = [to_device(next(train_iter), env.device) for _ in range(accum)]
            self.inst.lap("data")
            for n, f in map(self.work, batches):  # this rank's share, as every data-parallel rank's
                units, flops = units + n * lay.dp, flops + f * lay.dp
            out, grad_norm = self.train_step(batches, lr)
            step = self.state.step
            self.inst.step_end(step)
            # a validation step writes a record of its own even between logging steps (it used to
            # wait for one that was both: train.eval_interval=30 under logging.interval=50 validated at 150)
            eval_now = bool(run.train.eval_interval) and (step % run.train.eval_interval == 0 or step == run.train.steps)
            log_now = eval_now or step % run.logging.interval == 0 or step == run.train.steps
            if log_now:
                self.check_losses()  # every rank: each raises the same error
            self.inst.lap("other")
            val = self.evaluate() if eval_now else None
            self.inst.lap("eval")
            timings = self.inst.interval(step - logged) if log_now else {}  # every rank: a collective
            if env.is_main and log_now:
                now = time.perf_counter()
                record = {**self.record(out, lr=lr, grad_norm=grad_norm, units=units, flops=flops, seconds=now - t_last,
                                        val=val), **timings}
                t_last, units, flops, logged = now, 0, 0.0, step
                assert self.log is not None
                self.log.log(record)
                self.progress.update(step, log_fields(record, self.family), log_line=True)
            elif env.is_main and self.progress.tty:  # a live bar reads the loss every step; a log file does not
                self.progress.update(step, {"loss": f"{float(out.metrics['loss']):.4f}"}, log_line=False)
            self.inst.lap("other")
            stop = self.checkpoint_due()
            self.inst.lap("checkpoint")
            if stop:
                break
        if run.train.steps > 0 and self.state.step == run.train.steps and self.saved_step != self.state.step:
            self.save()
        self.saver.wait()  # the last checkpoint is complete before the run ends
        self.check_losses()
        if env.is_main:
            self.finished(float(out.metrics["loss"]) if out is not None else math.nan)

    def checkpoint_due(self) -> bool:
        """Save when the interval says so; on SIGTERM save and return True (stop)."""
        run, env = self.run, self.env
        due = bool(run.checkpoint.interval) and self.state.step % run.checkpoint.interval == 0
        stop = False
        if self.preempt.watching or run.checkpoint.interval_minutes > 0:
            # Every rank must take the same decision: rank 0's clock, anyone's SIGTERM.
            late = (run.checkpoint.interval_minutes > 0
                    and time.monotonic() - self.saved_at >= 60 * run.checkpoint.interval_minutes)
            flags = torch.tensor([float(self.preempt.requested), float(late and env.is_main)], device=self.par.device)
            if env.world_size > 1:
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            stop, due = bool(flags[0]), due or bool(flags[1])
        if (due or stop) and self.state.step < run.train.steps:
            self.save()
        if stop and env.is_main:
            print(f"SIGTERM: saved step {self.state.step} and stopping; rerun the same command to continue", flush=True)
        return stop

    def finished(self, loss: float) -> None:
        run = self.run
        print(f"trained {run.family} ({run.flavor}, {self.n_params:,} parameters) for {self.state.step} steps; "
              f"final loss {loss:.4f}; run directory {self.run_dir}", flush=True)
        if self.par.graphs is not None:
            print(self.par.graphs.summary(), flush=True)
        if self.log is not None and self.log.tb_dir is not None:
            print(f"TensorBoard event files in {self.log.tb_dir} (tensorboard --logdir {self.log.tb_dir})", flush=True)


__all__ = ["Trainer"]
