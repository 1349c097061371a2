"""The rules of a checkpoint `MappingTable` (`zoo.checkpoint.mapping` applies them): static
data over key templates with ``{i}`` (layer) and ``{e}`` (expert) placeholders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from zoo.errors import ZooError


class MappingError(ZooError):
    """A state dict does not match the mapping; the message lists the keys at fault."""


@dataclass(frozen=True)
class Rename:
    ours: str
    theirs: str


@dataclass(frozen=True)
class Transpose:
    """A 2-D weight stored transposed there (GPT-2's ``Conv1D`` keeps ``[in, out]``)."""

    ours: str
    theirs: str


@dataclass(frozen=True)
class Fuse:
    """One of our tensors is several of theirs concatenated along ``dim``.

    With ``groups`` (a config attribute, e.g. ``"num_kv_heads"``), each of theirs is cut into that
    many chunks and ours holds them interleaved group by group: ``[q_0, k_0, v_0, q_1, k_1, v_1]``,
    so that a tensor-parallel split of ours hands every rank whole GQA groups.
    ``transpose`` applies to each of theirs (fused GPT-2 style weights).
    """

    ours: str
    theirs: tuple[str, ...]
    dim: int = 0
    groups: str | None = None
    transpose: bool = False
    # Config attributes giving each part's size along ``dim`` when they differ (GQA: q is wider
    # than k and v); None: equal parts.
    sizes: tuple[str, ...] | None = None
    # With one template in ``theirs``: that tensor already holds the parts concatenated along
    # ``dim`` (GPT-2's c_attn is q|k|v), cut into this many before interleaving per group.
    split: int = 0


@dataclass(frozen=True)
class Split:
    """Several of our tensors are one of theirs concatenated along ``dim`` (GPT-2's ``c_attn``)."""

    ours: tuple[str, ...]
    theirs: str
    dim: int = 0
    transpose: bool = False  # theirs is stored transposed; ``dim`` refers to our layout


@dataclass(frozen=True)
class StackExperts:
    """Our ``[num_experts, ...]`` tensor is one tensor per expert there (``theirs`` holds ``{e}``),
    or several per expert concatenated along their dim 0 (Mixtral's ``w1``/``w3`` are our fused
    ``[gate; up]``: ``theirs`` is then a tuple of templates)."""

    ours: str
    theirs: str | tuple[str, ...]
    transpose: bool = False


@dataclass(frozen=True)
class Patch:
    """A patch embedding: a convolution ``(out, C, *patch)`` there, a linear over each patch's
    ``(*patch, C)`` features here (``(out, prod(patch) * C)``). ``patch`` and ``channels`` name
    the config attributes of the kernel's sizes and of C (needed to export)."""

    ours: str
    theirs: str
    patch: tuple[str, ...] = ("patch_size", "patch_size")
    channels: str = "in_channels"


@dataclass(frozen=True)
class Replicate:
    """One tensor of ours is stored once per layer there (``theirs`` holds ``{i}``: diffusers' DiT
    keeps a copy of the shared timestep embedder in every block). Importing checks that the copies
    are equal: copies that differ are a different model, refused rather than averaged."""

    ours: str
    theirs: str


@dataclass(frozen=True)
class Tie:
    """Our ``ours`` is the same tensor as our ``to`` (tied embeddings); written there only as ``theirs``."""

    ours: str
    to: str
    theirs: str | None = None  # some formats store the tied copy too; None: they omit it


@dataclass(frozen=True)
class Ignore:
    """Keys of theirs that carry nothing we need (legacy buffers); a regular expression."""

    theirs: str


Rule = Rename | Transpose | Fuse | Split | StackExperts | Patch | Replicate | Tie | Ignore


@dataclass(frozen=True)
class MappingTable:
    rules: tuple[Rule, ...]
    counts: Mapping[str, str] = field(default_factory=lambda: {"i": "num_layers", "e": "num_experts"})
    # Optional prefixes of theirs that are stripped on import (GPT-2 files saved from the base model
    # lack "transformer."; the table is written with it). Applied in order, each (missing, present)
    # pair only when no key starts with ``missing``.
    import_prefixes: tuple[tuple[str, str], ...] = ()


__all__ = ["Fuse", "Ignore", "MappingError", "MappingTable", "Patch", "Rename", "Replicate", "Rule", "Split", "StackExperts", "Tie", "Transpose"]
