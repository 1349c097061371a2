"""The sections of a run configuration: one small dataclass per concern, composed into a
`RunConfig`. How values are layered and type-checked is `zoo.config.layers`."""

from __future__ import annotations

import dataclasses
import io
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

AXES = ("tp", "cp", "ep", "dp", "pp")

# The most parameters a configuration may describe: far beyond any model trained so far, so a
# size typed or decoded wrong (a layer count of 10**13) is refused instead of built for hours.
MAX_PARAMETERS = 10**13


def check_sizes(config: object, *names: str, parameters: int | None = None) -> None:
    """For a family's config ``__post_init__``: ``names`` are positive integers, and the
    ``parameters`` they add up to stay below `MAX_PARAMETERS`. Raises ValueError naming the keys."""
    for name in names:
        value = getattr(config, name)
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:  # a float, a string, None
            ok = False
        if not ok:
            raise ValueError(f"{name}={value!r} must be at least 1")
    if parameters is not None and parameters > MAX_PARAMETERS:
        sizes = ", ".join(f"{n}={getattr(config, n)}" for n in names)
        raise ValueError(f"{sizes} describe a model of ~1e{len(str(parameters)) - 1} parameters, more than the "
                         f"{MAX_PARAMETERS:.0e} zoo builds")


def check_pattern(pattern: str, symbols: Mapping[str, str], num_layers: int) -> str:
    """For a family's config ``__post_init__``: a layer pattern (one symbol per layer, ``|`` between
    pipeline stages; "" means the family's homogeneous default, checked by the caller) against the
    ``symbols`` it knows (symbol -> what it builds) and ``num_layers``. Returns the layers' symbols."""
    unknown = sorted(set(pattern) - set(symbols) - {"|"})
    if unknown:
        raise ValueError(f"pattern={pattern!r}: unknown symbol(s) {', '.join(map(repr, unknown))}; "
                         f"one of {', '.join(f'{k!r} ({v})' for k, v in symbols.items())}, '|' (stage cut)")
    layers = pattern.replace("|", "")
    if pattern and len(layers) != num_layers:
        raise ValueError(f"pattern={pattern!r} has {len(layers)} layers, num_layers={num_layers}; "
                         f"set num_layers={len(layers)} with it")
    if pattern and any(not part for part in pattern.split("|")):
        raise ValueError(f"pattern={pattern!r}: every pipeline stage ('|') needs at least one layer")
    return layers


def pattern_stages(pattern: str) -> tuple[int, ...] | None:
    """Layers per pipeline stage when a layer pattern has cuts (the core's default for parallel.pp_layers)."""
    return tuple(len(p) for p in pattern.split("|")) if "|" in pattern else None


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline stages
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank, interleaved 1F1B when > 1
    pp_layers: list[int] | None = None  # layers per (virtual) stage, e.g. [3, 4, 4, 3]; None: even
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"  # gpipe: all forwards, then all backwards
    cp: int = 1  # context parallel size (ring attention)
    ep: int = 1  # expert parallel size
    etp: int | None = None  # expert tensor parallel size; only 1 (experts whole, sharded over ep)
    # How tokens reach the experts of other EP ranks: alltoall sends each token only where its
    # experts are (counts exchanged first); allgather gives every EP rank every token and sums the
    # experts' outputs back with a reduce-scatter (more traffic, no counts, no uneven splits).
    ep_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    sequence_parallel: bool = False  # shard norm/dropout regions along the sequence inside TP
    zero: int = 0  # 1: distributed optimizer (fp32 master weights and Adam state sharded over DP)
    # FSDP (torch's fully_shard): parameters, gradients and optimizer state sharded over this many
    # data-parallel ranks (x cp): all of them (the data-parallel size), or a divisor of it, whose
    # groups of neighbouring ranks then replicate each other (HSDP); 0: off.
    fsdp: int = 0
    order: str = "tp-cp-ep-dp-pp"  # leftmost axis varies fastest: TP ranks are neighbours
    bucket_size: int = 40_000_000  # gradient elements per DP bucket (Megatron's default)
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = 600.0  # collective timeout: a dead rank fails the job instead of hanging it

    def __post_init__(self) -> None:
        check_sizes(self, "tp", "pp", "vpp", "cp", "ep")
        if self.etp is not None and self.etp < 1:
            raise ValueError(f"etp={self.etp} must be at least 1")
        if self.fsdp < 0:
            raise ValueError(f"fsdp={self.fsdp} must be 0 (off), the data-parallel size or a divisor of it (HSDP)")
        if self.zero not in (0, 1):
            raise ValueError(f"zero={self.zero}: only 0 (off) and 1 (distributed optimizer) exist")
        axes = self.order.split("-")
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"order={self.order!r} must name each of {'-'.join(AXES)} once")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive")


@dataclass(kw_only=True)
class DataConfig:
    path: str | list[Any] | None = None  # Megatron blend "0.5 A 0.3 B" or a YAML list; None: family default
    # Per-split blends (Megatron's --train-data-path ...): each uses all documents of its datasets
    # and takes precedence over data.path (with data.split) for that split.
    train_path: str | list[Any] | None = None
    valid_path: str | list[Any] | None = None
    test_path: str | list[Any] | None = None
    dataset: str | None = None  # a named dataset from a plugin; None: the family's default_dataset
    split: str = "969,30,1"  # train,valid,test proportions of documents
    tokenizer: str | None = None  # HF tokenizer dir, tiktoken file, "bytes"; None: the dataset's own
    # data.dataset=sft (conversations, data.path a .jsonl file): a Jinja chat template file, or "zoo"
    # for zoo's plain one; None: the tokenizer directory's own, else zoo's
    chat_template: str | None = None
    # Megatron's document options: restart positions after each end-of-document token, keep
    # attention inside documents, leave EOD tokens out of the loss. They need the EOD id: from
    # data.tokenizer, or data.eod_id.
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    eod_id: int | None = None
    num_workers: int = 0
    cache_dir: str | None = None  # where built indices and prepared corpora are cached
    # Energon datasets (data.path a prepared WebDataset directory, URL or metadataset .yaml):
    shuffle_buffer_size: int | None = 100  # samples mixed across slices before encoding
    max_samples_per_sequence: int | None = 100  # slice length: smaller reads more randomly, seeks more
    # k: the slices of k epochs shuffled together; -1: slices drawn with replacement; null: in order
    # (times a metadataset reference's own, Energon's rule)
    shuffle_over_epochs_multiplier: int | None = 1
    packing_buffer_size: int | None = None  # samples the task encoder's select_samples_to_pack sees at once
    prefetch_factor: int = 2  # batches each worker makes ahead
    watchdog_timeout: float = 60.0  # seconds a worker may take for one batch before the run stops, naming it
    allow_pickle: bool = False  # .pickle/.pyd parts run code when loaded: refused unless set
    allow_code: bool = False  # a dataset.yaml's sample_loader.py: refused unless set

    def __post_init__(self) -> None:
        soe = self.shuffle_over_epochs_multiplier
        if soe is not None and not (soe >= 1 or soe == -1):
            raise ValueError(f"shuffle_over_epochs_multiplier={soe}: a whole number >= 1, -1 (slices drawn with "
                             "replacement) or null (no shuffling)")


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-4  # peak learning rate
    weight_decay: float = 0.1  # never applied to norms, biases and embeddings' position tables
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # torch's AdamW kernels: "fused" (one pass over each tensor, ~3x the per-tensor loop's speed on a
    # CPU; the HF Trainer's default too), falling back to "foreach" on a device torch has no fused
    # kernel for; "foreach" and "for-loop" on request. All three compute the same update.
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    # Learning-rate multipliers by parameter-name pattern (fnmatch over single-process names, the
    # first matching pattern wins), e.g. {"vision.*": 0.1}; parameters matching none get 1.
    lr_mult: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pattern, mult in self.lr_mult.items():
            if not isinstance(pattern, str) or isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult < 0:
                raise ValueError(f"lr_mult: {pattern!r}: {mult!r} must map a name pattern to a number >= 0")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Megatron's learning-rate schedules (`zoo.training.optim.lr_at`)."""

    warmup_steps: int = 0
    warmup_init_ratio: float = 0.0  # lr where warmup starts, as a fraction of the peak (Megatron's --lr-warmup-init)
    # After warmup: cosine or linear to the floor, constant, wsd (warmup-stable-decay: the peak,
    # then wsd_decay over the last wsd_decay_steps) or inverse_sqrt (peak * sqrt(warmup / step)).
    decay: Literal["cosine", "linear", "constant", "wsd", "inverse_sqrt"] = "cosine"
    decay_steps: int | None = None  # the step the decay ends at, the floor after it (None: train.steps)
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak
    wsd_decay_steps: int = 0  # decay="wsd": steps of the final decay
    wsd_decay: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"  # Megatron's default

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.warmup_init_ratio < 0 or self.min_lr_ratio < 0:
            raise ValueError("warmup_steps, warmup_init_ratio and min_lr_ratio must not be negative")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise ValueError(f"decay_steps={self.decay_steps} ends the decay before warmup_steps={self.warmup_steps} "
                             "end the warmup")
        if self.decay == "wsd" and self.wsd_decay_steps < 1:
            raise ValueError("decay=wsd needs wsd_decay_steps (the steps of the final decay), at least 1")


def torch_dtype(name: str) -> Any:
    """The torch dtype of a configuration's precision name (``fp32``, ``bf16``, ``fp16``), as
    ``train.precision``, ``train.param_dtype``, ``zoo generate --dtype`` and ``zoo convert --dtype`` spell them."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 200
    micro_batch_size: int = 8
    global_batch_size: int | None = None  # None: micro_batch_size x dp (no accumulation)
    # [start, increment, samples]: Megatron's --rampup-batch-size (zoo.training.rampup); needs global_batch_size
    rampup_batch_size: list[int] | None = None
    seq_length: int = 256
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # compute: bf16/fp16 autocast over fp32 parameters
    # Parameter storage: bf16/fp16 keep parameters in that type and fp32 master weights in the
    # distributed optimizer (used whatever parallel.zero says: on one data-parallel rank it shards
    # nothing; needs the same train.precision; Megatron's --bf16 / --fp16). fp16 adds dynamic loss
    # scaling.
    param_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # The gradient buckets' type, where gradients accumulate over micro-batches and are reduced over
    # data-parallel ranks: fp32 (Megatron's --accumulate-allreduce-grads-in-fp32, which its --bf16
    # turns on), or the parameters' own bf16/fp16 (half the bucket memory and reduction bytes, each
    # sum rounded to 8 or 11 bits).
    grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # fp16's dynamic loss scale (`zoo.training.loss_scale`, every layout): the loss is multiplied by it
    # before backward; a step whose gradients overflow is skipped and halves it, loss_scale_window
    # clean steps in a row double it (Megatron's --initial-loss-scale / --loss-scale-window).
    initial_loss_scale: float = 65536.0
    loss_scale_window: int = 2000
    seed: int = 1234
    # Activation recomputation (`zoo.nn.recompute`): elementwise recomputes norm and activation outputs
    # (bitwise exact, a few percent of step time), selective adds the attention core, full whole blocks.
    recompute: Literal["none", "elementwise", "selective", "full"] = "elementwise"
    # A step whose gradient norm is not finite (a NaN/inf loss or gradient) is skipped, no update;
    # more than this many in a row stop the run naming the step and its samples (0: stop at the first).
    skip_nonfinite: int = 3
    eval_interval: int = 50  # steps between validations; 0 disables
    eval_steps: int = 10
    # At each validation, a family that declares a preview writes a sample (image grid, GIF, text)
    # to <run>/samples/step_N.* and TensorBoard.
    preview: bool = True
    # Exponential moving average of the parameters (decay per step, e.g. 0.9999; 0 keeps none),
    # in fp32, sharded like the parameters, saved with checkpoints; `zoo generate` and HF export
    # use it when present (--weights ema|raw).
    ema: float = 0.0
    # The decay ramps up over the first updates, min(ema, n / (n + 9)) at the n-th (0 at the first:
    # the average starts at the first update's weights), as diffusers' EMAModel does by default, so
    # a short run's average is not held back by the initial weights.
    ema_ramp: bool = False
    # With ema_ramp: diffusers' use_ema_warmup instead, 1 - n^-ema_power (2/3 suits runs of a
    # million steps, 3/4 of a few hundred thousand); 0 keeps n / (n + 9).
    ema_power: float = 0.0
    # Parameter-name patterns (fnmatch over single-process names, e.g. "vision.*") that are frozen:
    # no gradient, no optimizer state, still saved with the model.
    freeze: list[str] = field(default_factory=list)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Flush subnormal floats to zero on the CPU (process-wide; CUDA is unaffected). Some x86 CPUs run
    # them on a slow microcode path and bf16 AdamW produces them (a step several times slower on some
    # VMs, no change on others). Changes no value above 1.2e-38.
    flush_denormal: bool = False
    # On a CPU, keep freed memory in the process for the next step instead of returning it to the
    # system and page-faulting it back (zoo_cpu_kernels.malloc, when installed). A MALLOC_*
    # variable in the environment or a preloaded jemalloc/tcmalloc wins. "system": glibc's defaults.
    cpu_malloc: Literal["retain", "system"] = "retain"
    # float32 matrix products on a CPU (zoo_cpu_kernels.gemm, when zoo-cpu-kernels is installed):
    # "auto" takes oneDNN's where torch's BLAS is MKL on a non-Intel x86 with AVX-512 (MKL's generic
    # kernels there stop at AVX2; on an AVX2-only CPU they are the faster), "onednn" always, "blas"
    # never. tanh-GELU on a CPU is oneDNN's kernel where "auto" finds AVX-512 or "onednn" asks, and a
    # bf16 autocast linear one oneDNN call with its bias (keeping the fp32 weight, not a bf16 copy,
    # for backward) where the CPU has bf16 instructions, unless "blas". fp16 and accelerators are
    # unaffected.
    cpu_gemm: Literal["auto", "onednn", "blas"] = "auto"
    # Elementwise work on a CPU (adaLN and RMS norms, SwiGLU, tanh-GELU's derivative, float32 weight
    # gradients' transposed operands) as kernels torch's compiler (inductor) generates, for tensors of
    # >= 2^18 elements: "auto" where it can build them (a C++ compiler; compiled once per process),
    # else torch's eager kernels, as under "eager" (zoo_cpu_kernels.fused).
    cpu_fused: Literal["auto", "eager"] = "auto"
    # On one CUDA GPU: each micro-batch's forward and backward replayed from a CUDA graph captured once per
    # batch shape (zoo.parallel.cuda_graphs), so the host queues one launch, not hundreds of kernels: what a
    # small model on a fast GPU waits on (docs/benchmarks.md). Megatron's
    # --enable-cuda-graph. fp32/bf16, no model parallelism or data parallelism; a forward that reads device
    # values on the host cannot be captured, and the run then goes on eagerly, saying why.
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        check_sizes(self, "steps", "micro_batch_size", "seq_length", "loss_scale_window")
        if not (self.initial_loss_scale > 0 and math.isfinite(self.initial_loss_scale)):
            raise ValueError(f"initial_loss_scale={self.initial_loss_scale} must be a positive finite number "
                             "(2**16 is torch's default)")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema={self.ema} must be a decay in [0, 1) (0 disables the moving average)")
        if self.ema_ramp and not self.ema:
            raise ValueError("ema_ramp=true ramps the moving average's decay up to ema, which is 0 (no average): set ema")
        if self.ema_power < 0 or (self.ema_power and not self.ema_ramp):
            raise ValueError(f"ema_power={self.ema_power} shapes ema_ramp's warmup: a positive power with "
                             "ema_ramp=true (0: n / (n + 9))")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}"
            )
        if self.rampup_batch_size is not None:
            ramp = self.rampup_batch_size
            if len(ramp) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in ramp):
                raise ValueError(f"rampup_batch_size={ramp}: [start, increment, samples], three integers")
            start, increment, samples = ramp
            if self.global_batch_size is None:
                raise ValueError(f"rampup_batch_size={ramp} ramps up to global_batch_size: set it")
            if not 0 < start < self.global_batch_size or increment < 1 or samples < 1 \
                    or (self.global_batch_size - start) % increment:
                raise ValueError(f"rampup_batch_size={ramp}: [start, increment, samples] with 0 < start < "
                                 f"global_batch_size={self.global_batch_size}, global_batch_size - start a multiple "
                                 f"of increment, samples >= 1")


@dataclass(kw_only=True)
class CheckpointConfig:
    # None: <run dir>/checkpoints. Elsewhere, a fresh start is refused where the run directory holds
    # another run's checkpoints (it would rewrite that run's metrics and config).
    dir: str | None = None
    interval: int = 0  # steps between saves; 0: only at the end
    # "auto": continue from the newest complete checkpoint in checkpoint.dir if there is one (so
    # rerunning a command after a crash or preemption continues it); "none": start fresh (refused
    # when checkpoint.dir already holds checkpoints); or a checkpoint path.
    resume: str = "auto"
    load: str | None = None  # initial weights, e.g. "hf:/path/to/model"
    keep_last: int | None = None  # retention; None keeps all
    interval_minutes: float = 0.0  # also save when this many minutes passed since the last save; 0: off
    async_save: bool = False  # copy tensors off and write in a background thread while training goes on
    save_on_sigterm: bool = True  # preemption: SIGTERM saves at the end of the current step, then exits
    # A save that fails (a full disk, a file-size limit, a lost mount) leaves the previous checkpoint
    # complete and `latest` on it; "stop" ends the run with the error, "continue" warns and trains on
    # (an async save's failure is reported at the next step).
    on_save_error: Literal["stop", "continue"] = "stop"


def parse_window(value: str | None, *, key: str) -> tuple[int, int] | None:
    """``"START:END"`` (steps, both included) or ``"STEP"`` -> (start, end); None when unset."""
    if value in (None, ""):
        return None
    text = str(value)
    try:
        a, _, b = text.partition(":")
        start, end = int(a), int(b or a)
    except ValueError:
        raise ValueError(f"{key}={text!r}: give steps as START:END (e.g. 5:7) or one step") from None
    if not 1 <= start <= end:
        raise ValueError(f"{key}={text!r}: steps start at 1 and END is not before START")
    return start, end


@dataclass(kw_only=True)
class LoggingConfig:
    interval: int = 10  # steps between metric lines
    progress: bool = True
    tensorboard: bool = True  # written when the tensorboard package is installed
    plot: bool = True  # <run>/loss.png at the end (needs matplotlib)
    plot_log_scale: bool = False  # loss axis in log scale
    # Per-phase wall time (data, forward_backward, grad_sync, optimizer, checkpoint, eval) on each
    # log line and in metrics.jsonl / TensorBoard, min and max over ranks: a clock read per phase.
    timers: bool = True
    # Name a rank whose batches are ready later than the first rank's by more than (factor - 1) of
    # a step, on average, for 2 logging intervals in a row (a slow data path or host); 0: never.
    straggler_factor: float = 1.5
    profile: str = ""  # "START:END" (steps): a PyTorch profiler trace per rank, <run>/profile/rank_N.json
    memory_snapshot: int = 0  # at this step: the allocator history (CUDA) or a peak-memory line per rank (CPU)

    def __post_init__(self) -> None:
        parse_window(self.profile, key="profile")
        if self.straggler_factor != 0 and self.straggler_factor <= 1:
            raise ValueError(f"straggler_factor={self.straggler_factor} must be above 1 (or 0 to turn the warning off)")
        if self.memory_snapshot < 0:
            raise ValueError(f"memory_snapshot={self.memory_snapshot} must be a step (0: none)")


SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass(kw_only=True)
class RunConfig:
    """The resolved configuration of one run: the family's model config plus one per concern."""

    family: str
    flavor: str
    model: Any  # the family's config dataclass instance
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "flavor": self.flavor, **{
            name: plain(getattr(self, name)) for name in ("model", *SECTIONS)
        }}

    def to_yaml(self) -> str:
        buf = io.StringIO()
        yaml.safe_dump(self.to_dict(), buf, sort_keys=False, default_flow_style=False)
        return buf.getvalue()


def plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    return obj
