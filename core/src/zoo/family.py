"""The model-family contract: what a plugin declares so the core can build, train, convert
and generate with a model it has never seen.

A plugin's entry-point module returns `Family` objects from its `zoo_families` hook. That module
must stay light (no torch, no model code): `zoo list` imports it. Everything heavy is named by a
`Ref`, a ``"module:attribute"`` string resolved the first time it is used, so `import zoo`,
`zoo --help` and `zoo list` never import a model.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from zoo.errors import PluginError
from zoo.spec import ModelSpec, check_spec

#: ``"package.module:attribute"`` (resolved lazily) or the object itself.
Ref = str | Callable[..., Any]

_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """How the core cuts a model into pipeline stages (and where sequence parallelism begins).

    ``layers`` names the model's `nn.ModuleList` of repeated blocks; ``first`` the top-level
    modules only the first stage keeps (embeddings), ``last`` those only the last stage keeps
    (final norm, output head). On every other stage those attributes are ``None`` and the model's
    forward must then take the hidden state where it normally takes ``batch[input_key]`` and return
    the hidden state instead of the loss (torchtitan's convention: one forward, no stage code).
    The blocks keep their global index as their name, so parameter names and checkpoints do not
    depend on the layout.

    ``carries``: further batch keys a stage hands to the next beside the hidden state, for models
    whose blocks take more than one input (DiT's conditioning vector, a VLM's image features).
    A stage that is not the last then returns a dict ``{input_key: hidden, **carried}`` in that
    order, and the next stage's batch has those keys replaced by what it received; gradients flow
    back through every carried tensor that requires them.
    """

    layers: str = "layers"
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    input_key: str = "tokens"
    carries: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SequenceSpec:
    """Where the sequence lives, for context and sequence parallelism.

    ``dim``: the sequence dimension of the hidden state between blocks (1 for ``(B, T, D)``;
    Megatron's ``(T, B, D)`` would be 0). ``keys``: the batch tensors split along their dim 1
    under context parallelism. ``positions``: the batch key of position ids, which the core fills
    with ``0..T-1`` when absent before it splits the sequence (so the model sees global positions);
    None if the model takes none. ``loss_mask``: the batch key marking the tokens the loss averages
    over, so context-parallel ranks' means are weighted into the global mean.
    """

    dim: int = 1
    keys: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")
    positions: str | None = "position_ids"
    loss_mask: str | None = "loss_mask"


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """A value the family's loss reports in its metrics dict, and how the core treats it.

    ``reduce``: how values combine over a step's micro-batches and the data/context-parallel
    ranks: ``mean`` (weighted like the loss), ``sum`` (counts) or ``max``. ``aux_loss``: the value
    is a scalar tensor with a gradient, an auxiliary term (a router's load-balancing loss, a
    z-loss) that the core adds to the loss it backpropagates, coefficient already applied; the
    logged ``loss`` is the main objective without it, the term is logged under its own name.
    ``vector``: the value is a 1-D tensor of a fixed length (one entry per MoE layer, say), reduced
    element-wise and logged as ``name/0``, ``name/1``, ... beside ``name``, their max (``max``),
    sum (``sum``) or mean (``mean``); an aux-loss metric cannot be one.
    ``when``: the name of a model-config attribute (a field or property); the metric exists only
    for configs where it is true or nonzero (a hybrid stack's MoE metrics: ``"moe_layers"``, so a
    pattern without MoE layers neither computes nor logs them); None: always.
    """

    name: str
    reduce: Literal["mean", "sum", "max"] = "mean"
    aux_loss: bool = False
    vector: bool = False
    when: str | None = None

    def __post_init__(self) -> None:
        if self.vector and self.aux_loss:
            raise ValueError(f"MetricSpec {self.name!r}: an auxiliary loss is a scalar (vector=False)")


# What a family with mixture-of-experts layers reports (`zoo.nn.moe.balance_metrics`): the
# balancing terms as auxiliary losses (coefficients applied), each MoE layer's load (its busiest
# expert's tokens / mean tokens per expert; `expert_load` is the worst layer's) and the
# (token, expert) assignments dropped over capacity. Declared once here for every MoE family.
MOE_METRICS = (
    MetricSpec(name="aux_loss", aux_loss=True),
    MetricSpec(name="z_loss", aux_loss=True),
    MetricSpec(name="expert_load", reduce="max", vector=True),
    MetricSpec(name="dropped", reduce="sum"),
)


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """What one unit of training work is, for ``<unit>/s`` and model FLOPs utilisation.

    ``unit``: ``tokens``, ``images``, ``frames`` or ``samples`` (printed as ``tok/s``, ``img/s``, ...).
    ``count(batch) -> int``: units in one micro-batch; None counts the elements of the batch's
    ``tokens`` (or ``input_ids``) tensor. ``flops_per_unit(model, run_config) -> float``: training
    FLOPs (forward and backward) per unit, called on the model built on the meta device; None uses
    the language-model rule (6 x matmul weights + attention, `zoo.training.metrics.lm_flops_per_token`).
    ``flops_of_batch(model, run_config) -> (batch -> float)``: for a family whose work depends on
    the data (a text cut at its end token, a head run at answer positions only): called once on the
    meta model, gives the training FLOPs one micro-batch's samples need; overrides ``flops_per_unit``.
    """

    unit: str = "tokens"
    count: Ref | None = None
    flops_per_unit: Ref | None = None
    flops_of_batch: Ref | None = None


@dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: one readable architecture, its sizes, and how it trains and converts.

    Callables named here (directly or as `Ref`) have these signatures:

    - ``build(config, spec) -> torch.nn.Module``: the plain model, on the current default device.
      Called under ``torch.device("meta")`` for dry runs, so it must not touch data.
    - ``loss(model, batch) -> (loss, metrics)``: the training objective for one micro-batch
      (next-token cross entropy, EDM denoising, captioning); ``loss`` is a scalar tensor, ``metrics``
      a dict of floats or scalar tensors to log.
    - ``example_batch(config, *, batch_size, seq_length, generator) -> dict``: a small random
      batch of the shape the model takes; the conformance suite and dry runs use it.
    - ``generate(model, config, **request)``: the generation entry (tokens, images, captions).
    - ``preview(model, config, batch, *, generator) -> zoo.media.Artifact``: a sample drawn at each
      evaluation from the first validation micro-batch (an image grid, a GIF, a text), written to
      ``<run>/samples/step_N.*`` and to TensorBoard. It runs on every rank of a pipeline-free layout
      (tensor-parallel layers communicate) and is written by rank 0.
    - ``checkpoint_formats[fmt]``: a `zoo.checkpoint.ExternalFormat` (its architecture names, key
      mapping table for a config, config translation) for ``"hf"``, ``"mamba_ssm"``, ...
    """

    name: str
    description: str
    task: str  # "causal_lm", "diffusion", "vlm", "contrastive", ...: what `zoo generate` does
    config: type  # the family's model config dataclass (sizes; `layer_spec` names a spec)
    flavors: Mapping[str, Callable[[], Any]]  # plain functions returning a config; "tiny" required
    specs: Mapping[str, ModelSpec]  # named static layer specs; config.layer_spec picks one
    build: Ref
    loss: Ref
    example_batch: Ref
    aliases: tuple[str, ...] = ()
    default_dataset: str | None = None  # a dataset name from a `zoo_datasets` hook
    checkpoint_formats: Mapping[str, Ref] = field(default_factory=dict)
    generate: Ref | None = None
    # Tensor parallelism of the family's own modules (the core derives its own layers' split:
    # `zoo.parallel.apply.derived_plan`): module-name patterns ("*" for one name component) ->
    # "column", "column_gated" ([gate; up] halves split per rank), "column_context" (a column split
    # fed by a replicated side input such as text), "row", "vocab_embedding", "vocab_head", ...;
    # and per module pattern the attributes holding head counts that become per-rank counts.
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    tp_local: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Pipeline stages (and the sequence-parallel region): None means the family runs with pp=1 only.
    pipeline: PipelineSpec | None = None
    # Context parallelism and sequence parallelism: None means cp=1 and no sequence parallelism.
    sequence: SequenceSpec | None = None
    # What the loss reports besides the loss (each key of its metrics dict must be declared here).
    metrics: tuple[MetricSpec, ...] = ()
    throughput: Throughput = field(default_factory=Throughput)
    preview: Ref | None = None
    # ``task_encoder(run_config) -> zoo.data.energon.TaskEncoder``: how Energon samples become this
    # family's batches when data.path names an Energon dataset.
    task_encoder: Ref | None = None
    recipe: Mapping[str, Any] = field(default_factory=dict)  # "section.key" -> default for all flavors
    flavor_recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def metrics_for(self, config: Any) -> tuple[MetricSpec, ...]:
        """The declared metrics a model of ``config`` reports (those whose ``when`` holds for it)."""
        def holds(m: MetricSpec) -> bool:
            if m.when is None:
                return True
            if not hasattr(config, m.when):
                raise PluginError(f"family {self.name!r}: metric {m.name!r} has when={m.when!r}, which "
                                  f"{type(config).__name__} has no attribute of that name")
            return bool(getattr(config, m.when))

        return tuple(m for m in self.metrics if holds(m))

    def spec_for(self, config: Any) -> ModelSpec:
        name = getattr(config, "layer_spec", None)
        if name not in self.specs:
            from zoo.errors import suggest

            raise PluginError(
                f"family {self.name!r}: model.layer_spec={name!r} is not one of {sorted(self.specs)}"
                + suggest(str(name), self.specs)
            )
        return self.specs[name]


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A named dataset a plugin (or the core) provides, e.g. the embedded text corpus or digits.

    ``build(run_config, *, split, dp_rank, dp_size, consumed_samples) -> Iterator[batch]`` is
    resolved lazily. It yields the micro-batches of data-parallel rank ``dp_rank``: that rank's
    slice of every global batch (``train.global_batch_size`` samples), starting after
    ``consumed_samples`` samples of the global stream, so a resumed run sees exactly the batches
    an uninterrupted one would. ``split`` is ``"train"`` or ``"valid"``.
    """

    name: str
    description: str
    build: Ref
    modality: str = "tokens"  # "tokens", "images", "video", "image_text"
    # ``tokenizer(run_config) -> Path | None``: a directory with the dataset's tokenizer.json, stored
    # with checkpoints so `zoo generate` can encode prompts.
    tokenizer: Ref | None = None
    # A stateful dataset's ``build`` also takes ``state`` (what its iterator's ``state_dict()``
    # returned on every data-parallel rank at the checkpoint, as ``{"ranks": [...]}``, or None)
    # and ``family``; the trainer saves that position in every checkpoint.
    stateful: bool = False
    # Every sample packs several documents, kept apart by ``segment_ids`` (and ``position_ids`` from
    # 0 in each): only a family whose model reads them may train on it (`check_dataset`).
    packed: bool = False
    # Samples handed out by global sample index (`zoo.config.rampup.rank_micro_batches`), so that
    # any layout and resume sees the same ones: a growing batch (`train.rampup_batch_size`) runs on it.
    indexed: bool = False
    # ``clips(count, *, frames, size) -> Iterator[(pixels, caption, info)]``: a built-in video source
    # `zoo prepare video --dataset NAME` writes as an Energon dataset; ``pixels`` (frames, size,
    # size) in [0, 1], ``info`` a JSON-able dict stored beside it. Raising ValueError names a bad option.
    clips: Ref | None = None


@dataclass(frozen=True, kw_only=True)
class CommandSpec:
    """A `zoo` sub-command contributed by a plugin.

    ``add_arguments(parser)`` fills an ``argparse`` parser; ``run(args) -> int`` executes it and
    returns the exit code. Both may be `Ref` strings so the command's module loads only when used.
    """

    name: str
    help: str
    add_arguments: Ref
    run: Ref


def resolve(ref: Ref, *, owner: str) -> Any:
    """Import the object a `Ref` names; a failure names the plugin (``owner``) and the ref."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{owner}: reference {ref!r} must look like 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # a plugin's import can fail in any way; report it, never crash zoo
        raise PluginError(f"{owner}: cannot import {module_name!r} for {ref!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{owner}: {module_name!r} has no attribute {attr!r} (from {ref!r})") from None
    return obj


def _config_has(config: Any, name: str) -> bool:
    """Whether instances of the config class ``config`` have attribute ``name`` (a field, with or
    without a default, or a property)."""
    fields = getattr(config, "__dataclass_fields__", {})
    return name.isidentifier() and (name in fields or hasattr(config, name))


def check_family(family: object, *, owner: str) -> None:
    """Validate a declared family at registration; every message names the plugin (``owner``)."""
    if not isinstance(family, Family):
        raise PluginError(f"{owner}: zoo_families must return zoo.Family objects, got {type(family).__name__}")
    where = f"{owner}: family {family.name!r}"
    for name in (family.name, *family.aliases):
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(f"{where}: name or alias {name!r} must match {_NAME.pattern}")
    if not (isinstance(family.config, type) and dataclasses.is_dataclass(family.config)):
        raise PluginError(f"{where}: config must be a dataclass type, got {family.config!r}")
    field_names = {f.name for f in dataclasses.fields(family.config)}
    if "layer_spec" not in field_names:
        raise PluginError(f"{where}: config {family.config.__name__} needs a 'layer_spec: str' field naming one of specs")
    if "tiny" not in family.flavors:
        raise PluginError(f"{where}: every family needs a 'tiny' flavor that trains on a CPU in seconds")
    if not family.specs:
        raise PluginError(f"{where}: declares no layer specs")
    for spec_name, spec in family.specs.items():
        try:
            check_spec(spec, where=f"spec {spec_name!r}")
        except TypeError as e:
            raise PluginError(f"{where}: {e}") from None
    for flavor, fn in family.flavors.items():
        if not callable(fn):
            raise PluginError(f"{where}: flavor {flavor!r} must be a function returning a {family.config.__name__}")
    for key in family.recipe:
        if not isinstance(key, str) or "." not in key:
            raise PluginError(f"{where}: recipe key {key!r} must be 'section.key'")
    unknown = set(family.flavor_recipes) - set(family.flavors)
    if unknown:
        raise PluginError(f"{where}: flavor_recipes for unknown flavors {sorted(unknown)}")
    names = [m.name for m in family.metrics]
    for m in family.metrics:
        if not isinstance(m, MetricSpec):
            raise PluginError(f"{where}: metrics must be zoo.MetricSpec objects, got {type(m).__name__}")
        if m.reduce not in ("mean", "sum", "max"):
            raise PluginError(f"{where}: metric {m.name!r}: reduce={m.reduce!r} is not one of mean, sum, max")
        if m.aux_loss and m.reduce != "mean":
            raise PluginError(f"{where}: metric {m.name!r} is an auxiliary loss, so it is averaged like the loss (reduce='mean')")
        if m.when is not None and (not isinstance(m.when, str) or not _config_has(family.config, m.when)):
            raise PluginError(f"{where}: metric {m.name!r}: when={m.when!r} must name an attribute of the model "
                              f"config {getattr(family.config, '__name__', family.config)!r}")
        if m.name in _RESERVED_METRICS or names.count(m.name) > 1:
            raise PluginError(f"{where}: metric name {m.name!r} is {'reserved' if m.name in _RESERVED_METRICS else 'declared twice'}")
    if not isinstance(family.throughput, Throughput) or not family.throughput.unit:
        raise PluginError(f"{where}: throughput must be a zoo.Throughput with a unit")
    if family.pipeline is not None and family.pipeline.input_key in family.pipeline.carries:
        raise PluginError(f"{where}: pipeline.carries repeats the input key {family.pipeline.input_key!r}")


# Keys the core itself logs in every metrics record.
_RESERVED_METRICS = frozenset({"step", "loss", "lr", "grad_norm", "val_loss", "mfu", "flops_per_s"})


def check_dataset(family: Family, dataset: DatasetSpec, run: Any) -> None:
    """Refuse a dataset ``family`` cannot train on as ``run`` configures it, naming both: token
    sequences for a family that is no language model; documents packed into a sequence and kept
    apart by ``segment_ids`` (a ``packed`` dataset such as sft's conversations, Megatron's
    ``data.reset_attention_mask``) for a family whose model does not read them (its sequence spec
    lists none, or it declares no sequence spec: a Mamba state would run on from one document into
    the next); a batch-size ramp-up
    where it cannot run (`zoo.config.rampup.check_run`)."""
    from zoo.config import rampup
    from zoo.errors import ConfigError

    if dataset.modality == "tokens" and family.task != "causal_lm":
        raise ConfigError(f"dataset {dataset.name!r} holds token sequences for language models; family "
                          f"{family.name!r} (task {family.task}) trains on its own data (leave data.path and "
                          "data.dataset unset for its default)")
    packs = dataset.packed or (dataset.modality == "tokens" and run.data.reset_attention_mask)
    if packs and "segment_ids" not in (family.sequence.keys if family.sequence is not None else ()):
        what = f"packed documents (dataset {dataset.name})" if dataset.packed else "data.reset_attention_mask"
        raise ConfigError(f"{what}: family {family.name!r} keeps no packed documents apart (its model reads no "
                          "segment_ids), so each would run on into the next")
    rampup.check_run(run, dataset)
