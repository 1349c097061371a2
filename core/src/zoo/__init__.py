"""zoo: a plugin-based training framework of the Megatron class.

The public surface is small: the plugin contract (`Family` and what it declares, `DatasetSpec`,
`CommandSpec`, `hookimpl`, the spec vocabulary in `zoo.spec`, checkpoint mappings in
`zoo.checkpoint`) and the registry (`get_family`, `list_families`). Importing zoo loads no plugin
and does not import torch.

The packages, by concern: `zoo.config` (run configuration), `zoo.data` (tokenizers, datasets),
`zoo.parallel` (layouts and their mechanics), `zoo.checkpoint` (checkpoints and conversion),
`zoo.training` (the `Trainer`, recomputation, metrics, plots), `zoo.nn` (shared model
primitives), `zoo.media` (images and videos written by families), `zoo.testing`.
"""

from __future__ import annotations

from zoo._version import __version__
from zoo.family import CommandSpec, DatasetSpec, Family, MetricSpec, PipelineSpec, Ref, SequenceSpec, Throughput
from zoo.hookspecs import hookimpl

__all__ = [
    "CommandSpec",
    "DatasetSpec",
    "Family",
    "MetricSpec",
    "PipelineSpec",
    "Ref",
    "SequenceSpec",
    "Throughput",
    "__version__",
    "get_family",
    "hookimpl",
    "list_families",
    "load_model",
]


def get_family(name: str) -> Family:
    """The installed family called ``name`` (or an alias); loads the plugins on first use."""
    from zoo.registry import get_registry

    return get_registry().get(name).family


def list_families() -> list[str]:
    from zoo.registry import get_registry

    return sorted(get_registry().families)


def load_model(path: str, *, device: str = "cpu", weights: str = "auto", dtype: object = None) -> object:
    """Load a zoo checkpoint or a Hugging Face model directory; language models map
    ``model(input_ids)`` to logits ``(batch, seq, vocab)``. ``weights``: ``auto`` takes a training
    checkpoint's moving average of the parameters when it has one, ``raw`` the parameters.
    ``dtype`` (``torch.bfloat16``, ``torch.float16``): parameters in that type, as
    ``train.param_dtype`` holds them; run the model under ``torch.autocast`` of the same type."""
    from zoo.checkpoint.external import load_model as _load

    return _load(path, device=device, weights=weights, dtype=dtype)
