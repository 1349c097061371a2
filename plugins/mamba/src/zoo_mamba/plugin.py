"""Declarations of the Mamba-1, Mamba-2 and hybrid families (light: no torch). The model is in `model.py`,
the mixers and scans in the core (`zoo_mamba.ssm`), so any family can put an SSM layer in its blocks.

A model is a stack of single-purpose residual layers ``x + f(norm(x))`` named by one symbol each, as
Megatron's hybrid models: ``M`` a Mamba mixer, ``*`` self-attention, ``-`` an MLP, ``E`` a mixture of
experts (the core's `zoo.nn.moe.MoE`), and ``|`` a pipeline-stage cut. ``pattern`` spells the stack;
empty means ``M`` x ``num_layers`` (plain Mamba).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

from zoo import Family, PipelineSpec, SequenceSpec, Throughput, hookimpl
from zoo.config import check_pattern, check_sizes, pattern_stages
from zoo.family import MOE_METRICS
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, MoESpec, NormSpec, SSMSpec, check_routing

SYMBOLS = {"M": "Mamba mixer", "*": "self-attention", "-": "MLP", "E": "mixture of experts"}


@dataclass(kw_only=True)
class MambaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    pattern: str = ""  # one symbol per layer (see SYMBOLS), "|" between pipeline stages; "" = all "M"
    max_seq_length: int = 2048  # longest prompt + generation (SSM layers have no limit of their own)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # Mamba mixers (M). Mamba-1 splits expand * hidden channels; Mamba-2 makes heads of ssm_head_dim
    # and shares B/C over ssm_groups groups of heads.
    ssm_state_size: int = 16
    conv_kernel: int = 4
    expand: int = 2
    dt_rank: int = 0  # Mamba-1's low-rank dt projection; 0: ceil(hidden / 16)
    ssm_head_dim: int = 64
    ssm_groups: int = 1
    # scan chunk: memory of a layer's scan is bounded by it, not by the sequence (Mamba-2 on a CPU:
    # at most zoo_mamba.ssm.CPU_CHUNK, its fastest there; mamba-ssm's kernel takes this one on a GPU)
    chunk_size: int = 64
    dt_min: float = 0.0  # Mamba-2 clamps softplus(dt + dt_bias) to [dt_min, dt_max]
    dt_max: float = math.inf
    # Attention layers (*), as LLaMA's without positions by default (NemotronH), and MLP layers (-).
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    ffn_hidden_size: int = 0
    # MoE layers (E): the core's layer, balancing on by default (see zoo_moe for the options' meaning).
    num_experts: int | None = None
    top_k: int = 2
    moe_ffn_hidden_size: int = 0
    shared_ffn_hidden_size: int = 0
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    router_groups: int = 1
    router_group_topk: int = 1
    router_scaling: float = 1.0
    layer_spec: str = "mamba2"

    def __post_init__(self) -> None:
        h, experts = self.hidden_size, (self.num_experts or 0) * self.moe_ffn_hidden_size + self.shared_ffn_hidden_size
        check_sizes(self, "vocab_size", "hidden_size", "num_layers", "max_seq_length", "ssm_state_size", "conv_kernel",
                    "expand", "ssm_head_dim", "ssm_groups", "chunk_size",
                    parameters=self.num_layers * (3 * self.expand * h * h + 3 * h * (self.ffn_hidden_size + experts))
                    + 2 * self.vocab_size * h)
        check_pattern(self.pattern, SYMBOLS, self.num_layers)
        if self.dt_rank == 0:
            self.dt_rank = math.ceil(self.hidden_size / 16)
        if "*" in self.symbols and (self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"attention layers need num_heads ({self.num_heads}) a positive multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if "*" in self.symbols and self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if "-" in self.symbols and self.ffn_hidden_size <= 0:
            raise ValueError("MLP layers ('-') need ffn_hidden_size")
        if "E" in self.symbols:
            if not self.num_experts or self.moe_ffn_hidden_size <= 0:
                raise ValueError("MoE layers ('E') need num_experts and moe_ffn_hidden_size")
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
            check_routing(self.num_experts, self.top_k, self.router_groups, self.router_group_topk)
            if self.aux_loss_coeff == 0 and not self.expert_bias:
                warnings.warn("MoE load balancing is off (aux_loss_coeff=0 and expert_bias=false)", stacklevel=2)
        elif self.num_experts is not None:
            raise ValueError(f"num_experts={self.num_experts} but pattern={self.pattern!r} has no MoE layer ('E')")
        if self.ssm_inner % self.ssm_head_dim and self.layer_spec.startswith("mamba2"):
            raise ValueError(f"expand*hidden_size={self.ssm_inner} is not a multiple of ssm_head_dim={self.ssm_head_dim}")
        if self.ssm_heads % self.ssm_groups and self.layer_spec != "mamba1":
            raise ValueError(f"{self.ssm_heads} Mamba-2 heads do not split into ssm_groups={self.ssm_groups} groups")

    @property
    def symbols(self) -> str:
        # (an empty pattern stays empty, so a flavor's num_layers can be overridden alone)
        return self.pattern.replace("|", "") or "M" * self.num_layers

    @property
    def ssm_inner(self) -> int:
        return self.expand * self.hidden_size

    @property
    def ssm_heads(self) -> int:
        return self.ssm_inner // self.ssm_head_dim

    @property
    def moe_layers(self) -> int:
        return self.symbols.count("E")

    @property
    def tp_split_sizes(self) -> dict[str, int]:
        """What tensor parallelism splits (the core checks that tp divides each): whole heads and groups."""
        out = {"ffn_hidden_size": self.ffn_hidden_size} if "-" in self.symbols else {}
        if "M" in self.symbols and self.layer_spec == "mamba1":
            out["ssm_inner"] = self.ssm_inner
        elif "M" in self.symbols:
            out |= {"ssm_heads": self.ssm_heads, "ssm_groups": self.ssm_groups, "ssm_norm_groups": self.ssm_norm_groups}
        return out

    @property
    def cp_split_sizes(self) -> dict[str, int] | None:
        """What context parallelism splits besides the sequence (the core checks that tp x cp divides
        each): Mamba-2's scan runs on a cp-th of the heads and groups over the whole sequence. None:
        this model cannot run context-parallel (Mamba-1's x_proj reads every channel of a position,
        and an attention layer with rotary positions would need the global positions)."""
        if "M" in self.symbols and self.layer_spec == "mamba1":
            return None
        if "*" in self.symbols and any(isinstance(b.mixer, AttentionSpec) and b.mixer.positions == "rope"
                                       for b in SPECS[self.layer_spec].blocks.values()):
            return None
        return {"ssm_heads": self.ssm_heads, "ssm_groups": self.ssm_groups,
                "ssm_norm_groups": self.ssm_norm_groups} if "M" in self.symbols else {}

    @property
    def ssm_norm_groups(self) -> int:
        """The groups Mamba-2's gated norm normalises over: B/C's, or one over the whole inner width
        (``mamba2_whole_norm``, which a rank holding part of the width cannot compute alone)."""
        return 1 if self.layer_spec == "mamba2_whole_norm" else self.ssm_groups

    @property
    def pipeline_stages(self) -> tuple[int, ...] | None:
        return pattern_stages(self.pattern)

    # The names the attention layer and the mapping tables read (LLaMA's).
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


_RMS = NormSpec(kind="rmsnorm")


def _hybrid(ssm: SSMSpec) -> dict[str, BlockSpec]:
    """NemotronH's layers: Mamba-2, attention without positions, squared-ReLU MLP and MoE, no biases."""
    relu2 = MLPSpec(activation="relu2", gated=False, bias=False)
    return {
        "M": BlockSpec(norm=_RMS, mixer=ssm, ffn=None),
        "*": BlockSpec(norm=_RMS, mixer=AttentionSpec(causal=True, bias=False, positions="none"), ffn=None),
        "-": BlockSpec(norm=_RMS, mixer=None, ffn=relu2),
        "E": BlockSpec(norm=_RMS, mixer=None, ffn=MoESpec(expert=relu2, router="sigmoid_topk", normalize_topk=True,
                                                         shared_expert=relu2, shared_gate=False)),
    }


_MAMBA2 = SSMSpec(kind="mamba2", gated_norm=True)


def _spec(blocks: dict[str, BlockSpec]) -> ModelSpec:
    return ModelSpec(blocks=blocks, embedding="token", positions="none", final_norm=_RMS, head="lm")


SPECS = {
    "mamba1": _spec({"M": BlockSpec(norm=_RMS, mixer=SSMSpec(kind="mamba1"), ffn=None)}),
    "mamba2": _spec({"M": BlockSpec(norm=_RMS, mixer=_MAMBA2, ffn=None)}),
    # transformers < 5's torch path: the gated norm over the whole inner width (differs when groups > 1)
    "mamba2_whole_norm": _spec({"M": BlockSpec(norm=_RMS, mixer=SSMSpec(kind="mamba2", gated_norm=True,
                                                                        norm_per_group=False), ffn=None)}),
    "nemotron_h": _spec(_hybrid(_MAMBA2)),
}


def _mamba1(layers: int, hidden: int, *, vocab: int = 50280) -> MambaConfig:
    return MambaConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, chunk_size=16, layer_spec="mamba1")


def _mamba2(layers: int, hidden: int, *, vocab: int = 50288, state: int = 128) -> MambaConfig:
    return MambaConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, ssm_state_size=state,
                       ssm_head_dim=64, chunk_size=256, layer_spec="mamba2")


def mamba_tiny() -> MambaConfig:
    # chunk 8: the tests' 64-token sequences cross chunk boundaries (the scan's results do not depend
    # on the chunk: it runs the recurrence step by step; a step of 8 x 64 tokens ~0.09 s either way)
    return MambaConfig(vocab_size=2048, hidden_size=128, num_layers=4, max_seq_length=1024, chunk_size=8,
                       layer_spec="mamba1")


def mamba2_tiny() -> MambaConfig:
    return MambaConfig(vocab_size=2048, hidden_size=128, num_layers=4, max_seq_length=1024, ssm_state_size=32,
                       ssm_head_dim=32, ssm_groups=2, chunk_size=32, layer_spec="mamba2")


def hybrid_tiny() -> MambaConfig:
    return MambaConfig(vocab_size=2048, hidden_size=128, num_layers=6, pattern="M-M|*-M", max_seq_length=1024,
                       ssm_state_size=32, ssm_head_dim=32, ssm_groups=2, chunk_size=32, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=256, tie_embeddings=False, layer_spec="nemotron_h")


def hybrid_moe_tiny() -> MambaConfig:
    return MambaConfig(vocab_size=2048, hidden_size=128, num_layers=6, pattern="M-M|*EM", max_seq_length=1024,
                       ssm_state_size=32, ssm_head_dim=32, ssm_groups=2, chunk_size=32, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=256, num_experts=4, top_k=2, moe_ffn_hidden_size=128, shared_ffn_hidden_size=128,
                       tie_embeddings=False, layer_spec="nemotron_h")


# Every rank holds whole heads and groups: in_proj's segments and the conv's channels split per
# segment, the per-head/per-channel parameters by rows, out_proj by columns; Mamba-1's x_proj is
# row-parallel and all-reduced (dt, B, C are whole on every rank), dt_proj column-parallel from it.
# The SSM mixers are the family's own modules, so it writes their plan; attention, MLP and MoE
# layers, the embedding and the head are the core's and split as the core derives.
_TP = {"layers.*.ssm.in_proj": "column_segments", "layers.*.ssm.conv1d": "channels", "layers.*.ssm": "channels",
       "layers.*.ssm.norm": "channels", "layers.*.ssm.x_proj": "row_allreduce", "layers.*.ssm.dt_proj": "column_local",
       "layers.*.ssm.out_proj": "row"}
# Mamba-2's mixer counts its own heads and groups (Mamba-1's reads its width off in_proj).
_TP_LOCAL = {"layers.*.ssm": ("heads", "groups")}

_COMMON = dict(
    task="causal_lm",
    config=MambaConfig,
    specs=SPECS,
    build="zoo_mamba.model:build",
    loss="zoo_mamba.model:loss",
    example_batch="zoo_gpt.model:example_batch",
    generate="zoo_mamba.model:generate",
    default_dataset="python-docs",
    checkpoint_formats={"hf": "zoo_mamba.convert:HF"},
    tp_plan=_TP,
    throughput=Throughput(flops_per_unit="zoo_mamba.model:flops_per_token"),
    recipe={"train.seq_length": 128, "train.micro_batch_size": 16, "optimizer.lr": 3e-3, "optimizer.weight_decay": 0.1,
            "schedule.warmup_steps": 30, "train.steps": 300, "train.eval_interval": 100, "logging.interval": 20},
)
_PIPE = PipelineSpec(layers="layers", first=("embed",), last=("norm", "head"), input_key="tokens")
# Context parallelism: the sequence split as for attention (Mamba-2's mixers trade it for head
# shards, `zoo_mamba.ssm.Mamba2Mixer`; attention layers run as ring attention); no positions.
_SEQUENCE = SequenceSpec(dim=1, keys=("tokens", "labels", "loss_mask"), positions=None)


@hookimpl
def zoo_families() -> list[Family]:
    return [
        Family(name="mamba", aliases=("mamba1",),
               description="Mamba-1: selective-scan SSM decoder (pure-PyTorch chunked scan, recurrent decoding)",
               flavors={"tiny": mamba_tiny, "130m": lambda: _mamba1(24, 768), "370m": lambda: _mamba1(48, 1024),
                        "790m": lambda: _mamba1(48, 1536), "1.4b": lambda: _mamba1(48, 2048),
                        "2.8b": lambda: _mamba1(64, 2560)},
               # No sequence spec: Mamba-1's scan runs on one rank's whole sequence (context parallelism
               # refused; sequence parallelism works: in_proj gathers the sequence, out_proj scatters it).
               pipeline=_PIPE, tp_local={}, **_COMMON),
        Family(name="mamba2",
               description="Mamba-2: SSD decoder (scalar decay per head, grouped B/C, gated RMSNorm)",
               flavors={"tiny": mamba2_tiny, "130m": lambda: _mamba2(24, 768), "370m": lambda: _mamba2(48, 1024),
                        "780m": lambda: _mamba2(48, 1536), "1.3b": lambda: _mamba2(48, 2048),
                        "2.7b": lambda: _mamba2(64, 2560)},
               pipeline=_PIPE, tp_local=_TP_LOCAL, sequence=_SEQUENCE, **_COMMON),
        Family(name="hybrid", aliases=("nemotron-h", "nemotron_h"),
               description="Hybrid decoder from a layer pattern (M Mamba-2, * attention, - MLP, E MoE, | stage cut), "
                           "NemotronH's layers",
               flavors={"tiny": hybrid_tiny, "moe-tiny": hybrid_moe_tiny},
               # The MoE layers' routing statistics travel with the hidden state to the loss.
               pipeline=PipelineSpec(layers="layers", first=("embed",), last=("norm", "head"), input_key="tokens",
                                     carries=("moe_stats",)),
               # (only a pattern with "E" layers has routing metrics)
               metrics=tuple(replace(m, when="moe_layers") for m in MOE_METRICS), tp_local=_TP_LOCAL,
               sequence=_SEQUENCE, **_COMMON),
    ]
