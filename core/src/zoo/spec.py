"""Layer specs: static, typed descriptions of what a model's blocks are made of.

A spec is data, not a program. It says *which* attention, MLP or mixture of experts, norm,
position embedding, state-space mixer or conditioning a block uses; the sizes (hidden width,
heads, layers) live in the family's config dataclass. A family's ``build`` turns a spec into
modules; the core's layers for this vocabulary (`zoo.nn.layers`, `zoo.nn.moe`, `zoo.nn.linear`)
declare how they split under tensor parallelism and where recomputation applies, so a model file
never changes when the layout does (docs/plugins.md: what the core reads from a plugin).

Rules, learnt from Megatron-Core's spec builders growing into flag factories:
- every spec is a frozen dataclass with keyword-only fields; build them as module constants;
- a variant is its own named spec (``GPT2_BLOCK``, ``LLAMA_BLOCK``), never another boolean passed
  to a function that returns a spec;
- third parties extend the vocabulary by subclassing `MixerSpec`, `FeedForwardSpec` or
  `ConditioningSpec` with their own frozen dataclass and build their own module for it, whose
  tensor-parallel split the family declares (``tp_plan``) or the module itself does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

NormKind = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "relu2"]
PositionKind = Literal["none", "learned", "rope", "sincos_2d", "sincos_3d"]


@dataclass(frozen=True, kw_only=True)
class NormSpec:
    kind: NormKind
    affine: bool = True  # DiT's adaLN norms carry no weight of their own
    bias: bool = True  # LayerNorm only; RMSNorm never has one
    # The weight is stored as scale - 1, starting at zero (Gemma; Megatron's apply_layernorm_1p):
    # weight decay then pulls the scale towards one, not zero. RMSNorm only.
    zero_centered: bool = False


@dataclass(frozen=True, kw_only=True)
class MixerSpec:
    """Base of everything that mixes information across positions (attention, SSM, ...)."""


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(MixerSpec):
    causal: bool
    bias: bool  # q/k/v/out projection biases (GPT-2, CLIP yes; LLaMA no)
    out_bias: bool | None = None  # the output projection's, when it differs (Qwen2: q/k/v only); None: ``bias``
    positions: PositionKind = "none"  # rotary is applied inside attention; absolute ones are not
    qk_norm: NormSpec | None = None  # per-head norm of q and k (DFM's video DiT)
    cross: bool = False  # keys/values come from a context (text embeddings), not the input


@dataclass(frozen=True, kw_only=True)
class SSMSpec(MixerSpec):
    """A selective state-space mixer (Gu & Dao 2023; Dao & Gu 2024)."""

    kind: Literal["mamba1", "mamba2"]
    conv_bias: bool = True
    proj_bias: bool = False
    gated_norm: bool = False  # Mamba-2 normalises y * silu(z) before out_proj
    # ... per group of B/C heads, as mamba-ssm and Megatron (TP-invariant); False: over the whole
    # inner width, as transformers' Mamba2 torch path did before v5 (its CUDA path was per group)
    norm_per_group: bool = True


@dataclass(frozen=True, kw_only=True)
class FeedForwardSpec:
    """Base of the position-wise part of a block."""


@dataclass(frozen=True, kw_only=True)
class MLPSpec(FeedForwardSpec):
    activation: Activation
    gated: bool  # SwiGLU-style act(gate(x)) * up(x); under TP gate and up are split per rank
    bias: bool


@dataclass(frozen=True, kw_only=True)
class MoESpec(FeedForwardSpec):
    expert: MLPSpec
    router: Literal["softmax_topk", "sigmoid_topk"] = "softmax_topk"
    normalize_topk: bool = True  # renormalise the top-k weights to sum to one (Mixtral)
    aux_loss: Literal["none", "switch"] = "switch"  # load balancing (Fedus et al. 2021)
    shared_expert: MLPSpec | None = None
    shared_gate: bool = True  # the shared expert's output scaled by sigmoid(x W) (Qwen2-MoE; not NemotronH)


@dataclass(frozen=True, kw_only=True)
class ConditioningSpec:
    """Base of how a block is conditioned on something other than its input (time, class)."""


@dataclass(frozen=True, kw_only=True)
class AdaLNSpec(ConditioningSpec):
    """Adaptive LayerNorm: shift/scale/gate chunks regressed from the conditioning vector."""

    chunks: int  # 6 for DiT (attn + MLP), 9 with cross-attention (DFM video DiT)
    zero_init: bool = True  # adaLN-Zero: every block starts as the identity (Peebles & Xie)


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    """One residual block: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))`` (pre-norm); ``sandwich``
    (Gemma 2/3): ``x + norm(mixer(norm(x)))``, each sublayer's output normed too before the residual."""

    norm: NormSpec
    mixer: MixerSpec | None
    ffn: FeedForwardSpec | None
    cross_attention: AttentionSpec | None = None
    conditioning: ConditioningSpec | None = None
    residual: Literal["pre_norm", "post_norm", "sandwich"] = "pre_norm"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A whole model: which block sits at each layer, and the ends of the stack.

    ``blocks`` maps a one-character symbol to a block; a homogeneous model has one symbol, a hybrid
    one (Mamba + attention, as Megatron's ``"M-M*-"`` patterns) has several and its config carries
    the pattern. ``towers`` names sub-models built from other specs (a VLM's vision tower).
    """

    blocks: Mapping[str, BlockSpec]
    embedding: Literal["token", "patch_2d", "patch_3d", "none"]
    positions: PositionKind  # absolute positions added at the input ("rope" lives in attention)
    final_norm: NormSpec | None
    head: Literal["lm", "unpatchify", "projection", "none"]
    towers: Mapping[str, ModelSpec] = field(default_factory=dict)

    def block_for(self, symbol: str) -> BlockSpec:
        try:
            return self.blocks[symbol]
        except KeyError:
            raise KeyError(f"layer pattern symbol {symbol!r} is not one of {sorted(self.blocks)}") from None


def check_routing(num_experts: int, top_k: int, groups: int = 1, group_topk: int = 1) -> None:
    """A router's sizes, one clear line each (`zoo.nn.moe.Router`; a family's config calls it to fail at load)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    if groups < 1 or num_experts % groups:
        raise ValueError(f"router_groups={groups} must divide the {num_experts} experts into equal groups")
    if groups > 1 and not (1 <= group_topk <= groups and top_k % group_topk == 0
                           and top_k // group_topk <= num_experts // groups):
        raise ValueError(f"router_group_topk={group_topk} of router_groups={groups}: top_k={top_k} must split into "
                         f"group_topk equal parts of at most {num_experts // groups} experts (a group's size)")


def check_spec(spec: object, *, where: str) -> None:
    """Reject anything that is not static spec data: a `ModelSpec` of frozen dataclasses."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"{where}: a layer spec must be a zoo.spec.ModelSpec, got {type(spec).__name__}")
    _check_frozen(spec, where)


def _check_frozen(value: object, where: str) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(type(value), "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{where}: {type(value).__name__} must be a frozen dataclass (specs are static data)")
        for f in dataclasses.fields(value):
            _check_frozen(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_frozen(v, f"{where}[{k!r}]")
    elif callable(value):
        raise TypeError(f"{where}: specs hold data, not callables ({value!r})")


def describe(spec: object, indent: int = 0) -> str:
    """A readable multi-line rendering of a spec for `zoo info`."""
    pad = "  " * indent
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        lines = [f"{type(spec).__name__}"]
        for f in dataclasses.fields(spec):
            v = getattr(spec, f.name)
            if dataclasses.is_dataclass(v) or (isinstance(v, Mapping) and v):
                lines.append(f"{pad}  {f.name}: {describe(v, indent + 1)}")
            else:
                lines.append(f"{pad}  {f.name}: {v!r}")
        return "\n".join(lines)
    if isinstance(spec, Mapping):
        lines = [""]
        for k, v in spec.items():
            lines.append(f"{pad}  {k!r}: {describe(v, indent + 1)}")
        return "\n".join(lines)
    return repr(spec)
