"""The parallel layout of a run: derived from the run config, the family and the world size, and
validated here once; everything downstream (the engine, the trainer, checkpoints) trusts it.

``dp`` is never configured: it is what is left, ``world // (tp * cp * pp)`` (experts are laid out
beside the dense grid, ``expert_dp = world // (etp * ep * pp)``). A layout that cannot work fails
here, before any process group exists, with the reason: sizes that do not divide, a family that
does not declare what a layout needs (a TP plan, a pipeline spec, a sequence spec, experts), and
precision rules that depend on the layout.

Model sizes are checked through the config fields families conventionally name ``num_layers``,
``num_heads``, ``num_kv_heads``, ``vocab_size`` and ``num_experts``; a family without one of them
is simply not checked on that point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zoo.config import RunConfig, rampup
from zoo.errors import ConfigError
from zoo.family import Family


@dataclass(frozen=True, kw_only=True)
class Layout:
    world_size: int
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    vpp: int
    etp: int
    expert_dp: int
    grad_accum: int  # micro-batches per optimizer step on each DP rank
    global_batch_size: int
    sequence_parallel: bool = False
    ep_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    zero: int = 0
    order: str = "tp-cp-ep-dp-pp"
    pp_layers: tuple[int, ...] | None = None
    pp_schedule: str = "1f1b"
    fsdp: int = 0  # parallel.fsdp, 0: off; FSDP shards over fsdp x cp ranks, replicated dp / fsdp times
    fsdp_dtype: str = "fp32"  # FSDP's compute dtype (train.precision): bf16 parameters, fp32 reductions
    experts: bool = False  # whether the model has mixture-of-experts layers (model.num_experts)
    rampup: tuple[int, int, int] | None = None  # train.rampup_batch_size: the global batch grows to global_batch_size

    def describe(self) -> str:
        axes = " x ".join(f"{a}={getattr(self, a)}" for a in ("tp", "cp", "dp", "pp"))
        extra = []
        if self.vpp > 1:
            extra.append(f"vpp={self.vpp}")
        if self.fsdp:
            over = f"fsdp over {'dp x cp' if self.fsdp == self.dp else 'fsdp x cp'} = {self.fsdp * self.cp} ranks" \
                if self.cp > 1 else f"fsdp over {self.fsdp} ranks"
            extra.append(over if self.fsdp == self.dp else f"hsdp: {over} x {self.dp // self.fsdp} replicas")
        if self.experts and (self.ep > 1 or self.etp != self.tp):  # (a dense model has no expert grid)
            extra.append(f"experts: etp={self.etp} x ep={self.ep} x dp={self.expert_dp}")
        tail = f" ({', '.join(extra)})" if extra else ""
        ramp = ""
        if self.rampup:
            start, increment, samples = self.rampup
            ramp = f" (ramped up from {start} by {increment} over {samples:,} samples)"
        return (
            f"world {self.world_size} = {axes}{tail}; global batch {self.global_batch_size}{ramp} = "
            f"micro {self.global_batch_size // (self.dp * self.grad_accum)} x dp {self.dp} x accumulation {self.grad_accum}"
        )


def plan(run: RunConfig, *, world_size: int, family: Family | None = None) -> Layout:
    """The layout of ``run`` on ``world_size`` processes; every rule about it is checked here
    (``family``'s declarations too, when given)."""
    p, train, model = run.parallel, run.train, run.model
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel: vpp={p.vpp} needs pp > 1 (virtual stages interleave a pipeline)")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel: sequence_parallel=true needs tp > 1 (it shards inside tensor-parallel regions)")
    if family is not None:
        _check_family(run, family)
    model_parallel = p.tp * p.cp * p.pp
    if world_size % model_parallel:
        raise ConfigError(
            f"parallel: world size {world_size} is not divisible by tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = {model_parallel}"
        )
    dp = world_size // model_parallel
    # Experts are whole on every rank that holds them unless parallel.etp splits each expert's MLP
    # (Megatron's expert tensor parallelism; its default is etp = tp, zoo's 1: torchtitan removed
    # expert TP, and Megatron recommends ETP=1 with EP for fine-grained experts).
    etp = p.etp if p.etp is not None else 1
    if etp > 1 and p.ep_dispatcher == "allgather":
        raise ConfigError(f"parallel: etp={etp} runs with ep_dispatcher=alltoall only")
    axes = p.order.split("-")
    if etp > 1 and axes.index("ep") < axes.index("tp"):  # (ExpertShard numbers pieces ETP-minor)
        raise ConfigError(f"parallel: etp={etp} needs tp before ep in parallel.order={p.order!r} (ETP ranks neighbours)")
    if world_size % (etp * p.ep * p.pp):
        raise ConfigError(f"parallel: world size {world_size} is not divisible by etp*ep*pp = {etp}*{p.ep}*{p.pp}")
    expert_dp = world_size // (etp * p.ep * p.pp)

    def field(name: str) -> int | None:
        value = getattr(model, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    layers, heads, kv_heads = field("num_layers"), field("num_heads"), field("num_kv_heads")
    vocab, experts = field("vocab_size"), field("num_experts")
    stages = p.pp * p.vpp
    pp_layers = tuple(p.pp_layers) if p.pp_layers is not None else None
    declared = getattr(model, "pipeline_stages", None)  # a hybrid pattern's "|" cuts
    if pp_layers is None and declared is not None and stages > 1:
        if len(declared) != stages:
            raise ConfigError(f"model.pattern cuts {len(declared)} pipeline stages ('|'), parallel.pp*vpp = "
                              f"{p.pp}*{p.vpp} = {stages}: make them agree (or give parallel.pp_layers)")
        pp_layers = tuple(declared)
    elif p.pp_layers is not None:
        if p.pp == 1:
            raise ConfigError("parallel: pp_layers is set but pp=1")
        if len(p.pp_layers) != stages or min(p.pp_layers) < 1:
            raise ConfigError(f"parallel: pp_layers={p.pp_layers} must list pp*vpp = {stages} stage sizes of at least 1")
        if layers is not None and sum(p.pp_layers) != layers:
            raise ConfigError(f"parallel: pp_layers={p.pp_layers} sums to {sum(p.pp_layers)}, the model has "
                              f"{layers} layers (model.num_layers)")
    elif layers is not None and stages > layers:
        raise ConfigError(f"parallel: pp*vpp = {p.pp}*{p.vpp} stages for {layers} layers (model.num_layers)")
    elif layers is not None and p.vpp > 1 and layers % stages:
        raise ConfigError(f"parallel: vpp={p.vpp} with pp={p.pp} does not divide model.num_layers={layers} evenly "
                          "(or give parallel.pp_layers)")
    # Sizes that tensor parallelism splits: attention heads, and what the config declares (Mamba heads, groups)
    split = {"num_heads": heads, **(getattr(model, "tp_split_sizes", None) or {})}
    for name, value in split.items():
        if value and value % p.tp:
            raise ConfigError(f"parallel: tp={p.tp} does not divide model.{name}={value}")
    # What context parallelism splits besides the sequence (Mamba-2's heads and groups), after TP;
    # None: the model declares it cannot run context-parallel
    if p.cp > 1 and hasattr(model, "cp_split_sizes"):
        cp_split = model.cp_split_sizes
        if cp_split is None:
            raise ConfigError(f"parallel: cp={p.cp}: model.layer_spec={getattr(model, 'layer_spec', None)!r} does not "
                              "support context parallelism; use cp=1")
        for name, value in cp_split.items():
            if value % (p.tp * p.cp):
                raise ConfigError(f"parallel: tp*cp = {p.tp}*{p.cp} does not divide model.{name}={value}")
    if kv_heads is not None and p.tp > 1 and kv_heads % p.tp and p.tp % kv_heads:
        raise ConfigError(f"parallel: tp={p.tp} and model.num_kv_heads={kv_heads} must divide one another")
    if vocab is not None and vocab % p.tp:
        raise ConfigError(f"parallel: tp={p.tp} does not divide model.vocab_size={vocab} (pad the vocabulary)")
    expert_ffn = field("moe_ffn_hidden_size") or field("ffn_hidden_size")
    if experts is not None and etp > 1 and expert_ffn is not None and expert_ffn % etp:
        raise ConfigError(f"parallel: etp={etp} does not divide the experts' hidden width {expert_ffn} (model."
                          f"{'moe_ffn_hidden_size' if field('moe_ffn_hidden_size') else 'ffn_hidden_size'})")
    if experts is not None and experts % p.ep:
        raise ConfigError(f"parallel: ep={p.ep} does not divide model.num_experts={experts}")
    if p.ep > 1 and experts is None:
        raise ConfigError(f"parallel: ep={p.ep} but the model has no experts (model.num_experts)")
    if experts is not None and p.tp > 1 and not p.sequence_parallel:
        # As Megatron: each TP rank routes its own sequence shard (replicated tokens would be
        # dispatched, and their expert gradients summed, tp times).
        raise ConfigError(f"parallel: tp={p.tp} with a mixture of experts needs parallel.sequence_parallel=true")
    if p.cp > 1 and train.seq_length % (2 * p.cp):
        raise ConfigError(f"parallel: cp={p.cp} needs train.seq_length={train.seq_length} divisible by 2*cp")
    if p.sequence_parallel and train.seq_length % p.tp:
        raise ConfigError(f"parallel: sequence_parallel needs train.seq_length divisible by tp={p.tp}")

    gbs = train.global_batch_size or train.micro_batch_size * dp
    per_step = train.micro_batch_size * dp
    if gbs % per_step:
        raise ConfigError(
            f"train: global_batch_size={gbs} is not a multiple of micro_batch_size*dp = {train.micro_batch_size}*{dp}"
        )
    if p.fsdp > 1 and dp % p.fsdp:
        raise ConfigError(f"parallel: fsdp={p.fsdp} must divide the data-parallel size dp={dp} (world {world_size} "
                          f"/ tp*cp*pp = {model_parallel}): FSDP shards over every data-parallel rank (fsdp={dp}) "
                          f"or, below that, over groups of fsdp ranks that replicate each other (HSDP)")
    if p.fsdp > 1 and p.zero:
        raise ConfigError("parallel: fsdp and zero=1 both shard the optimizer state over DP; choose one "
                          "(FSDP also shards parameters and gradients)")
    rampup.check(train, final=gbs, per_step=per_step, pp=p.pp, vpp=p.vpp)
    accum = gbs // per_step
    if p.vpp > 1 and accum % p.pp:
        raise ConfigError(f"parallel: vpp={p.vpp} (interleaved 1F1B) needs the micro-batches per step ({accum}) to be a "
                          f"multiple of pp={p.pp}; raise train.global_batch_size")
    return Layout(
        world_size=world_size, tp=p.tp, cp=p.cp, ep=p.ep, dp=dp, pp=p.pp, vpp=p.vpp,
        etp=etp, expert_dp=expert_dp, grad_accum=accum, global_batch_size=gbs, experts=experts is not None,
        rampup=tuple(train.rampup_batch_size) if train.rampup_batch_size else None,
        # Low-precision parameters always keep fp32 master weights in the distributed optimizer
        # (Megatron's --bf16): on one data-parallel rank it shards nothing, with more it is ZeRO-1.
        sequence_parallel=p.sequence_parallel, ep_dispatcher=p.ep_dispatcher,
        zero=p.zero or int(train.param_dtype != "fp32"), order=p.order,
        pp_layers=pp_layers, pp_schedule=p.pp_schedule,
        fsdp=p.fsdp if p.fsdp > 1 else 0, fsdp_dtype=train.precision,
    )


def _declares_splits(run: RunConfig, fam: Family) -> bool:
    """Whether the family's model, built on the meta device (no memory), holds layers that declare
    their tensor-parallel split (`zoo.parallel.apply.derived_plan`)."""
    import torch

    from zoo.family import resolve
    from zoo.parallel.apply import derived_plan

    with torch.device("meta"):
        model = resolve(fam.build, owner=f"family {fam.name!r}")(run.model, fam.spec_for(run.model))
    return bool(derived_plan(model)[0])


def _check_family(run: RunConfig, fam: Family) -> None:
    """What the family or the precision cannot do under this layout."""
    p = run.parallel
    if p.tp > 1 and not fam.tp_plan and not _declares_splits(run, fam):
        raise ConfigError(f"parallel.tp={p.tp}: family {fam.name!r} declares no tp_plan, and its model holds none "
                          "of the core's layers that split themselves (zoo.nn.layers' SelfAttention and MLP, "
                          "zoo.nn.linear's TokenEmbedding and LMHead)")
    if (p.pp > 1 or p.sequence_parallel) and fam.pipeline is None:
        what = f"parallel.pp={p.pp}" if p.pp > 1 else "parallel.sequence_parallel"
        raise ConfigError(f"{what}: family {fam.name!r} declares no pipeline spec (its layer list)")
    if p.cp > 1 and fam.sequence is None:
        raise ConfigError(f"parallel.cp={p.cp}: family {fam.name!r} does not support context parallelism "
                          "(it declares no sequence spec); use cp=1")
    dtype = run.train.param_dtype
    if dtype != "fp32" and run.train.precision != dtype:
        raise ConfigError(f"train.param_dtype={dtype} needs train.precision={dtype} (the parameters are stored in "
                          f"{dtype}, so the compute is too)")
    grads = run.train.grad_dtype
    if grads != "fp32" and grads != dtype:
        raise ConfigError(f"train.grad_dtype={grads} with train.param_dtype={dtype}: gradients are kept in float32 or "
                          "in the parameters' own type")
    if dtype != "fp32" and p.fsdp > 1:
        raise ConfigError(f"train.param_dtype={dtype} with parallel.fsdp: FSDP keeps fp32 parameters and computes in "
                          "train.precision itself; leave train.param_dtype=fp32")
