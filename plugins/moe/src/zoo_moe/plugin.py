"""Declarations of the Mixtral and Qwen2-MoE families (light: no torch). The model is in `model.py`.

A MoE decoder is LLaMA's decoder (`zoo_gpt`: RMSNorm, RoPE, grouped-query attention) with each
block's MLP replaced by the core's `zoo.nn.moe.MoE`; its config extends `zoo_gpt`'s with the
experts, the router and load balancing. ``ffn_hidden_size`` is one routed expert's width.

``pattern`` mixes in dense layers (Megatron's ``--moe-layer-freq``, Qwen2-MoE's ``mlp_only_layers``
and ``decoder_sparse_step``, DeepSeek's first dense layers, Llama 4's interleaving): one symbol per
layer, ``E`` attention + MoE, ``T`` attention + a dense SwiGLU MLP of ``dense_ffn_hidden_size``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

from zoo import Family, PipelineSpec, SequenceSpec, Throughput, hookimpl
from zoo.config import check_pattern, check_sizes, pattern_stages
from zoo.family import MOE_METRICS
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, MoESpec, NormSpec, check_routing
from zoo_gpt.plugin import GPTConfig


@dataclass(kw_only=True)
class MoEConfig(GPTConfig):
    num_experts: int
    top_k: int  # experts per token
    shared_ffn_hidden_size: int = 0  # the shared expert's width (specs with a shared expert)
    # Load balancing, on by default: the Switch aux loss (coefficient applied to what the convention
    # computes: "megatron" sums per-layer losses that are 1 when balanced; "hf" pools all layers as
    # transformers' load_balancing_loss_func does; "sequence" is Megatron's seq_aux_loss, each
    # sequence's loss averaged, DeepSeek-V3's sequence-wise balance) and the router z-loss.
    aux_loss_coeff: float = 1e-2
    aux_loss_convention: Literal["megatron", "hf", "sequence"] = "megatron"
    z_loss_coeff: float = 1e-3
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the top-k choice, moved by
    # bias_update_rate * sign(mean load - load) once per optimizer step.
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # Group-limited routing (DeepSeek-V2/V3): the top-k taken inside the best router_group_topk of
    # router_groups equal groups of experts; the gates times router_scaling (routed_scaling_factor).
    router_groups: int = 1
    router_group_topk: int = 1
    router_scaling: float = 1.0
    # None: dropless. Otherwise each expert takes at most ceil(tokens * top_k / experts * factor)
    # assignments per micro-batch and rank, keeping the highest gates ("probs") or the earliest ("position").
    capacity_factor: float | None = None
    drop_policy: Literal["probs", "position"] = "probs"
    # One symbol per layer (see SYMBOLS), "|" between pipeline stages; "" = every layer MoE.
    pattern: str = ""
    dense_ffn_hidden_size: int = 0  # the dense layers' ("T") MLP width
    layer_spec: str = "mixtral"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pattern(self.pattern, SYMBOLS, self.num_layers)
        if "E" not in self.symbols:
            raise ValueError(f"pattern={self.pattern!r} has no MoE layer ('E'); a dense model is the llama family")
        dense = self.symbols.count("T")
        if dense and self.dense_ffn_hidden_size <= 0:
            raise ValueError(f"pattern={self.pattern!r} has dense layers ('T'): set dense_ffn_hidden_size")
        # The experts, not the one dense MLP GPTConfig counted, hold the parameters.
        experts = self.num_experts * self.ffn_hidden_size + self.shared_ffn_hidden_size
        check_sizes(self, "num_experts", "top_k", parameters=3 * self.hidden_size
                    * (self.moe_layers * experts + dense * self.dense_ffn_hidden_size))
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        check_routing(self.num_experts, self.top_k, self.router_groups, self.router_group_topk)
        if self.aux_loss_convention not in ("megatron", "hf", "sequence"):
            raise ValueError(f"aux_loss_convention={self.aux_loss_convention!r}: one of 'megatron', 'hf', 'sequence'")
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"drop_policy={self.drop_policy!r}: one of 'probs', 'position'")
        if self.aux_loss_coeff == 0 and not self.expert_bias:
            # Said, never silent (transformers drops balancing unless output_router_logits is set).
            warnings.warn("MoE load balancing is off (aux_loss_coeff=0 and expert_bias=false): experts may collapse",
                          stacklevel=2)

    @property
    def symbols(self) -> str:
        # (an empty pattern stays empty, so a flavor's num_layers can be overridden alone)
        return self.pattern.replace("|", "") or "E" * self.num_layers

    @property
    def moe_layers(self) -> int:
        return self.symbols.count("E")

    @property
    def pipeline_stages(self) -> tuple[int, ...] | None:
        return pattern_stages(self.pattern)


SYMBOLS = {"E": "attention + mixture of experts", "T": "attention + dense MLP"}


_NORM = NormSpec(kind="rmsnorm")
_SWIGLU = MLPSpec(activation="silu", gated=True, bias=False)


def _spec(*, attn_bias: bool, router: Literal["softmax_topk", "sigmoid_topk"] = "softmax_topk", normalize: bool,
          shared: bool, qk_norm: bool = False) -> ModelSpec:
    moe = MoESpec(expert=_SWIGLU, router=router, normalize_topk=normalize, shared_expert=_SWIGLU if shared else None)
    # (Qwen2's attention biases are q/k/v only)
    attn = AttentionSpec(causal=True, bias=attn_bias, out_bias=False if attn_bias else None, positions="rope",
                         qk_norm=_NORM if qk_norm else None)
    blocks = {"E": BlockSpec(norm=_NORM, mixer=attn, ffn=moe), "T": BlockSpec(norm=_NORM, mixer=attn, ffn=_SWIGLU)}
    return ModelSpec(blocks=blocks, embedding="token", positions="none", final_norm=_NORM, head="lm")


SPECS = {
    # Mixtral: softmax over experts, top-k, renormalised; SwiGLU experts.
    "mixtral": _spec(attn_bias=False, normalize=True, shared=False),
    # DeepSeek-V3-style scoring on Mixtral's block: sigmoid scores, top-k renormalised.
    "mixtral_sigmoid": _spec(attn_bias=False, router="sigmoid_topk", normalize=True, shared=False),
    # Qwen2-MoE: q/k/v biases, top-k of the softmax without renormalisation, a shared expert behind
    # a sigmoid gate; "_norm" renormalises (norm_topk_prob=true).
    "qwen2_moe": _spec(attn_bias=True, normalize=False, shared=True),
    "qwen2_moe_norm": _spec(attn_bias=True, normalize=True, shared=True),
    # Qwen3-MoE: no biases, per-head q/k RMSNorm, no shared expert; "_norm": norm_topk_prob=true
    # (the released Qwen3-30B-A3B and 235B-A22B).
    "qwen3_moe": _spec(attn_bias=False, normalize=False, shared=False, qk_norm=True),
    "qwen3_moe_norm": _spec(attn_bias=False, normalize=True, shared=False, qk_norm=True),
}


def _cfg(layers: int, hidden: int, heads: int, kv: int, ffn: int, experts: int, top_k: int, *, vocab: int, ctx: int,
         theta: float, eps: float = 1e-5, shared: int = 0, spec: str = "mixtral", tie: bool = False,
         head_dim: int = 0) -> MoEConfig:
    return MoEConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     head_dim=head_dim or hidden // heads, ffn_hidden_size=ffn, max_seq_length=ctx, norm_eps=eps,
                     tie_embeddings=tie, rope_theta=theta, num_experts=experts, top_k=top_k,
                     shared_ffn_hidden_size=shared, layer_spec=spec)


def mixtral_tiny() -> MoEConfig:
    return _cfg(2, 128, 4, 2, 256, 8, 2, vocab=2048, ctx=256, theta=10000.0)


def mixtral_8x7b() -> MoEConfig:
    return _cfg(32, 4096, 32, 8, 14336, 8, 2, vocab=32000, ctx=32768, theta=1e6)


def mixtral_8x22b() -> MoEConfig:
    return _cfg(56, 6144, 48, 8, 16384, 8, 2, vocab=32768, ctx=65536, theta=1e6)


def qwen2_moe_tiny() -> MoEConfig:
    return _cfg(2, 128, 4, 2, 64, 8, 4, vocab=2048, ctx=256, theta=10000.0, eps=1e-6, shared=256, spec="qwen2_moe")


def qwen15_moe_a27b() -> MoEConfig:  # Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM)
    return _cfg(24, 2048, 16, 16, 1408, 60, 4, vocab=151936, ctx=8192, theta=1e6, eps=1e-6, shared=5632,
                spec="qwen2_moe")


def qwen2_moe_57b() -> MoEConfig:  # Qwen2-57B-A14B
    return _cfg(28, 3584, 28, 4, 2560, 64, 8, vocab=151936, ctx=32768, theta=1e6, eps=1e-6, shared=20480,
                spec="qwen2_moe")


def qwen3_moe_tiny() -> MoEConfig:
    return _cfg(2, 128, 4, 2, 64, 8, 4, vocab=2048, ctx=256, theta=10000.0, eps=1e-6, spec="qwen3_moe_norm")


def qwen3_moe_30b_a3b() -> MoEConfig:
    return _cfg(48, 2048, 32, 4, 768, 128, 8, vocab=151936, ctx=40960, theta=1e6, eps=1e-6, spec="qwen3_moe_norm",
                head_dim=128)


def qwen3_moe_235b_a22b() -> MoEConfig:
    return _cfg(94, 4096, 64, 4, 1536, 128, 8, vocab=151936, ctx=40960, theta=1e6, eps=1e-6, spec="qwen3_moe_norm",
                head_dim=128)


_COMMON = dict(
    task="causal_lm",
    config=MoEConfig,
    specs=SPECS,
    build="zoo_moe.model:build",
    loss="zoo_moe.model:loss",
    example_batch="zoo_gpt.model:example_batch",
    generate="zoo_moe.model:generate",
    default_dataset="python-docs",
    checkpoint_formats={"hf": "zoo_moe.convert:HF"},
    # No tp_plan: attention, dense layers and the shared expert are the core's layers, which split
    # like LLaMA's; routed experts are sharded over parallel.ep (and parallel.etp), never TP-split.
    # The routing statistics travel with the hidden state to the stage that computes the loss.
    pipeline=PipelineSpec(layers="layers", first=("embed",), last=("norm", "head"), input_key="tokens",
                          carries=("moe_stats",)),
    sequence=SequenceSpec(dim=1, keys=("tokens", "labels", "loss_mask", "position_ids", "segment_ids"),
                          positions="position_ids", loss_mask="loss_mask"),
    metrics=MOE_METRICS,
    throughput=Throughput(flops_per_unit="zoo_moe.model:flops_per_token"),
    recipe={"train.seq_length": 128, "train.micro_batch_size": 16, "optimizer.lr": 2e-3, "optimizer.weight_decay": 0.1,
            "schedule.warmup_steps": 30, "train.steps": 300, "train.eval_interval": 100, "logging.interval": 20},
)


@hookimpl
def zoo_families() -> list[Family]:
    return [
        Family(name="mixtral", description="Mixtral sparse MoE decoder: LLaMA attention, top-2 of 8 SwiGLU experts, "
               "load balancing on, expert parallelism",
               flavors={"tiny": mixtral_tiny, "8x7B": mixtral_8x7b, "8x22B": mixtral_8x22b}, **_COMMON),
        Family(name="qwen2-moe", aliases=("qwen2_moe",),
               description="Qwen2-MoE decoder: many small experts (top-k, not renormalised) plus a gated shared expert",
               flavors={"tiny": qwen2_moe_tiny, "A2.7B": qwen15_moe_a27b, "57B-A14B": qwen2_moe_57b}, **_COMMON),
        Family(name="qwen3-moe", aliases=("qwen3_moe",),
               description="Qwen3-MoE decoder: Qwen3's attention (q/k RMSNorm), 128 experts top-8, no shared expert",
               flavors={"tiny": qwen3_moe_tiny, "30B-A3B": qwen3_moe_30b_a3b, "235B-A22B": qwen3_moe_235b_a22b},
               **_COMMON),
    ]
