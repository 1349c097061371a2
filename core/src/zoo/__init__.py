"""zoo: a plugin-based training framework of the Megatron class.

The public surface is small: the plugin contract (`Family`, `DatasetSpec`, `CommandSpec`,
`hookimpl`, the spec vocabulary in `zoo.spec`, mappings in `zoo.mapping`) and the registry
(`get_family`, `list_families`). Importing zoo loads no plugin and does not import torch.
"""

from __future__ import annotations

from zoo.family import CommandSpec, DatasetSpec, Family, PipelineSpec, Ref, SequenceSpec
from zoo.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "CommandSpec",
    "DatasetSpec",
    "Family",
    "PipelineSpec",
    "Ref",
    "SequenceSpec",
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


def load_model(path: str, *, device: str = "cpu") -> object:
    """Load a zoo checkpoint or a Hugging Face model directory; language models map
    ``model(input_ids)`` to logits ``(batch, seq, vocab)``."""
    from zoo.convert import load_model as _load

    return _load(path, device=device)
