"""Declarations of the GPT-2, LLaMA, Mistral, Qwen2 and Qwen3 families (light: no torch). The model is in
`model.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo import Family, PipelineSpec, SequenceSpec, hookimpl
from zoo.config import check_sizes
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # = num_heads: multi-head; 1: multi-query; between: grouped-query
    head_dim: int
    ffn_hidden_size: int
    max_seq_length: int  # learned position table size (GPT-2); RoPE context otherwise
    norm_eps: float
    tie_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3"|"linear", "factor": ...}
    init_std: float = 0.02
    # Sliding-window attention (Mistral, Qwen2's use_sliding_window): a query sees itself and the
    # sliding_window - 1 positions before it. window_layers: the layers that do (None: every one;
    # Qwen2's max_window_layers=m is layers m..num_layers-1).
    sliding_window: int | None = None
    window_layers: list[int] | None = None
    # The token whose embedding row gets no gradient from its use as an input (torch's
    # padding_idx, which transformers' LLaMA-like models set to pad_token_id); None: none.
    pad_token_id: int | None = None
    layer_spec: str = "llama"

    def __post_init__(self) -> None:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        check_sizes(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "ffn_hidden_size", "max_seq_length",
                    parameters=self.num_layers * (h * (2 * q + 2 * kv) + 3 * h * self.ffn_hidden_size)
                    + 2 * self.vocab_size * h)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None:
            check_sizes(self, "sliding_window")
        if self.window_layers is not None:
            if self.sliding_window is None:
                raise ValueError("window_layers is set without sliding_window")
            outside = [i for i in self.window_layers if not 0 <= i < self.num_layers]
            if outside:
                raise ValueError(f"window_layers={self.window_layers}: {outside} not among the "
                                 f"num_layers={self.num_layers} layers (0..{self.num_layers - 1})")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: it sees every earlier position)."""
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


GPT2 = ModelSpec(
    blocks={
        "T": BlockSpec(
            norm=NormSpec(kind="layernorm"),
            mixer=AttentionSpec(causal=True, bias=True, positions="none"),
            ffn=MLPSpec(activation="gelu_tanh", gated=False, bias=True),
        )
    },
    embedding="token",
    positions="learned",
    final_norm=NormSpec(kind="layernorm"),
    head="lm",
)

LLAMA = ModelSpec(
    blocks={
        "T": BlockSpec(
            norm=NormSpec(kind="rmsnorm"),
            mixer=AttentionSpec(causal=True, bias=False, positions="rope"),
            ffn=MLPSpec(activation="silu", gated=True, bias=False),
        )
    },
    embedding="token",
    positions="none",
    final_norm=NormSpec(kind="rmsnorm"),
    head="lm",
)

# LLaMA with attention biases (LlamaForCausalLM with attention_bias=True: q, k, v and o).
LLAMA_ATTN_BIAS = ModelSpec(
    blocks={"T": BlockSpec(norm=LLAMA.blocks["T"].norm,
                           mixer=AttentionSpec(causal=True, bias=True, positions="rope"),
                           ffn=LLAMA.blocks["T"].ffn)},
    embedding="token", positions="none", final_norm=NormSpec(kind="rmsnorm"), head="lm",
)

# Qwen3: LLaMA with a per-head RMSNorm of q and k before the rotation (Qwen3ForCausalLM).
QWEN3 = ModelSpec(
    blocks={"T": BlockSpec(norm=LLAMA.blocks["T"].norm, ffn=LLAMA.blocks["T"].ffn,
                           mixer=AttentionSpec(causal=True, bias=False, positions="rope",
                                               qk_norm=NormSpec(kind="rmsnorm")))},
    embedding="token", positions="none", final_norm=NormSpec(kind="rmsnorm"), head="lm",
)

# Qwen2/2.5: LLaMA with q, k and v biases (not o's), Qwen2ForCausalLM.
QWEN2 = ModelSpec(
    blocks={"T": BlockSpec(norm=LLAMA.blocks["T"].norm, ffn=LLAMA.blocks["T"].ffn,
                           mixer=AttentionSpec(causal=True, bias=True, out_bias=False, positions="rope"))},
    embedding="token", positions="none", final_norm=NormSpec(kind="rmsnorm"), head="lm",
)

# Gemma 3: zero-centred RMSNorms before and after each sublayer (sandwich), per-head q/k norms, GeGLU.
# (Its embedding scale and the local layers' own RoPE base are the model's: zoo_gpt.model.Gemma.)
_GEMMA_NORM = NormSpec(kind="rmsnorm", zero_centered=True)
GEMMA3 = ModelSpec(
    blocks={"T": BlockSpec(norm=_GEMMA_NORM, residual="sandwich",
                           mixer=AttentionSpec(causal=True, bias=False, positions="rope", qk_norm=_GEMMA_NORM),
                           ffn=MLPSpec(activation="gelu_tanh", gated=True, bias=False))},
    embedding="token", positions="none", final_norm=_GEMMA_NORM, head="lm",
)

# Gemma 2: Gemma 3's layers without the q/k norms (its attention scores are soft-capped instead:
# GemmaConfig.attn_logit_softcapping, a number of the config, not a layer kind).
GEMMA2 = ModelSpec(
    blocks={"T": BlockSpec(norm=_GEMMA_NORM, residual="sandwich",
                           mixer=AttentionSpec(causal=True, bias=False, positions="rope"),
                           ffn=GEMMA3.blocks["T"].ffn)},
    embedding="token", positions="none", final_norm=_GEMMA_NORM, head="lm",
)

# (Mistral's layers are LLaMA's; its own key exports MistralForCausalLM, which holds the window)
SPECS = {"gpt2": GPT2, "llama": LLAMA, "llama_attn_bias": LLAMA_ATTN_BIAS, "mistral": LLAMA, "qwen2": QWEN2,
         "qwen3": QWEN3, "gemma2": GEMMA2, "gemma3": GEMMA3}


def _gpt2(layers: int, hidden: int, heads: int, *, vocab: int = 50257, ctx: int = 1024) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, ffn_hidden_size=4 * hidden, max_seq_length=ctx, norm_eps=1e-5,
                     tie_embeddings=True, layer_spec="gpt2")


def gpt2_tiny() -> GPTConfig:
    return _gpt2(2, 128, 4, vocab=2048, ctx=256)


def gpt2_124m() -> GPTConfig:
    return _gpt2(12, 768, 12)


def gpt2_355m() -> GPTConfig:
    return _gpt2(24, 1024, 16)


def gpt2_774m() -> GPTConfig:
    return _gpt2(36, 1280, 20)


def gpt2_1_5b() -> GPTConfig:
    return _gpt2(48, 1600, 25)


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, *, vocab: int = 128256, ctx: int = 131072,
           tie: bool = False, theta: float = 500000.0, scaling: dict[str, Any] | None = None) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     head_dim=hidden // heads, ffn_hidden_size=ffn, max_seq_length=ctx, norm_eps=1e-5,
                     tie_embeddings=tie, rope_theta=theta, rope_scaling=scaling, layer_spec="llama")


def llama_tiny() -> GPTConfig:
    return _llama(2, 128, 4, 2, 384, vocab=2048, ctx=256, theta=10000.0)


def llama3_1b() -> GPTConfig:  # Llama 3.2 1B
    return _llama(16, 2048, 32, 8, 8192, tie=True, scaling={**_LLAMA3_ROPE, "factor": 32.0})


def llama3_3b() -> GPTConfig:  # Llama 3.2 3B
    return _llama(28, 3072, 24, 8, 8192, tie=True, scaling={**_LLAMA3_ROPE, "factor": 32.0})


def llama3_8b() -> GPTConfig:  # Llama 3.1 8B
    return _llama(32, 4096, 32, 8, 14336, scaling={**_LLAMA3_ROPE, "factor": 8.0})


def llama3_70b() -> GPTConfig:  # Llama 3.1 70B
    return _llama(80, 8192, 64, 8, 28672, scaling={**_LLAMA3_ROPE, "factor": 8.0})


def llama2_7b() -> GPTConfig:
    return _llama(32, 4096, 32, 32, 11008, vocab=32000, ctx=4096, theta=10000.0)


@dataclass(kw_only=True)
class GemmaConfig(GPTConfig):
    """Gemma 2's and 3's decoder: GPTConfig's fields (``rope_theta`` / ``rope_scaling``: the global
    layers'), the sliding-window layers' own RoPE base, the softmax scale 1/sqrt(query_pre_attn_scalar)
    and the soft caps (``cap * tanh(x / cap)``) of the attention scores and of the output logits."""

    rope_local_theta: float | None = 10000.0  # None: the sliding layers rotate as the global ones (Gemma 2)
    query_pre_attn_scalar: int | None = None  # None: head_dim (the usual scale)
    attn_logit_softcapping: float | None = None  # Gemma 2: 50
    final_logit_softcapping: float | None = None  # Gemma 2: 30
    layer_spec: str = "gemma3"

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key}={value} must be positive (or null for none)")


def _gemma3(layers: int, hidden: int, heads: int, kv: int, ffn: int, *, head_dim: int = 256, window: int = 1024,
            vocab: int = 262208, ctx: int = 131072, scaling: float | None = 8.0, qpas: int = 256,
            theta: float = 1000000.0) -> GemmaConfig:
    # every sixth layer attends to the whole context, the others to a window (Gemma 3's 5:1)
    return GemmaConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=head_dim, ffn_hidden_size=ffn, max_seq_length=ctx, norm_eps=1e-6, tie_embeddings=True,
                       rope_theta=theta, rope_scaling={"rope_type": "linear", "factor": scaling} if scaling else None,
                       sliding_window=window, window_layers=[i for i in range(layers) if (i + 1) % 6],
                       query_pre_attn_scalar=qpas, pad_token_id=0)  # (the releases' <pad>: no input gradient)


def gemma3_tiny() -> GemmaConfig:  # a window of half the recipe's 128 tokens on the first layer
    return GemmaConfig(vocab_size=2048, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       ffn_hidden_size=384, max_seq_length=256, norm_eps=1e-6, tie_embeddings=True,
                       rope_theta=10000.0, sliding_window=64, window_layers=[0])


def gemma3_270m() -> GemmaConfig:
    return _gemma3(18, 640, 4, 1, 2048, window=512, vocab=262144, ctx=32768, scaling=None)


def gemma3_1b() -> GemmaConfig:
    return _gemma3(26, 1152, 4, 1, 6912, window=512, vocab=262144, ctx=32768, scaling=None)


def gemma3_4b() -> GemmaConfig:  # (the language model of the 4B/12B/27B image-text releases)
    return _gemma3(34, 2560, 8, 4, 10240)


def gemma3_12b() -> GemmaConfig:
    return _gemma3(48, 3840, 16, 8, 15360)


def gemma3_27b() -> GemmaConfig:  # 128-wide heads, softmax scale 1/sqrt(168) = 1/sqrt(hidden / heads)
    return _gemma3(62, 5376, 32, 16, 21504, head_dim=128, qpas=168)


def _gemma2(layers: int, hidden: int, heads: int, kv: int, ffn: int, *, head_dim: int = 256, qpas: int = 256
            ) -> GemmaConfig:
    # every other layer (the even ones) slides over 4,096 positions; one RoPE base for all layers
    return GemmaConfig(vocab_size=256000, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=head_dim, ffn_hidden_size=ffn, max_seq_length=8192, norm_eps=1e-6, tie_embeddings=True,
                       rope_theta=10000.0, rope_local_theta=None, sliding_window=4096,
                       window_layers=list(range(0, layers, 2)), query_pre_attn_scalar=qpas,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, layer_spec="gemma2",
                       pad_token_id=0)  # (the releases' <pad>: no input gradient)


def gemma2_tiny() -> GemmaConfig:  # Gemma 2's caps on the tiny shape: a window of 64 on layer 0
    return GemmaConfig(vocab_size=2048, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       ffn_hidden_size=384, max_seq_length=256, norm_eps=1e-6, tie_embeddings=True,
                       rope_theta=10000.0, rope_local_theta=None, sliding_window=64, window_layers=[0],
                       attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, layer_spec="gemma2")


def gemma2_2b() -> GemmaConfig:
    return _gemma2(26, 2304, 8, 4, 9216)


def gemma2_9b() -> GemmaConfig:
    return _gemma2(42, 3584, 16, 8, 14336)


def gemma2_27b() -> GemmaConfig:  # 128-wide heads, softmax scale 1/sqrt(144) = 1/sqrt(hidden / heads)
    return _gemma2(46, 4608, 32, 16, 36864, head_dim=128, qpas=144)


def _mistral(layers: int, hidden: int, heads: int, kv: int, ffn: int, *, vocab: int = 32000, ctx: int = 32768,
             theta: float = 10000.0, window: int | None = 4096, head_dim: int | None = None) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     head_dim=head_dim or hidden // heads, ffn_hidden_size=ffn, max_seq_length=ctx, norm_eps=1e-5,
                     tie_embeddings=False, rope_theta=theta, sliding_window=window, layer_spec="mistral")


def mistral_tiny() -> GPTConfig:  # a window of half the recipe's 128 tokens, so that it matters
    return _mistral(2, 128, 4, 2, 384, vocab=2048, ctx=256, window=64)


def mistral_7b_v01() -> GPTConfig:  # Mistral 7B v0.1: a 4,096-token window
    return _mistral(32, 4096, 32, 8, 14336)


def mistral_7b_v03() -> GPTConfig:  # v0.2/v0.3: no window, 32,768-token vocabulary (v0.3)
    return _mistral(32, 4096, 32, 8, 14336, vocab=32768, theta=1000000.0, window=None)


def mistral_nemo_12b() -> GPTConfig:  # Mistral NeMo 12B: 128-wide heads (q is narrower than the width)
    return _mistral(40, 5120, 32, 8, 14336, vocab=131072, ctx=1024000, theta=1000000.0, window=None, head_dim=128)


def _qwen2(layers: int, hidden: int, heads: int, kv: int, ffn: int, *, vocab: int = 151936, ctx: int = 32768,
           tie: bool = False, theta: float = 1000000.0) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     head_dim=hidden // heads, ffn_hidden_size=ffn, max_seq_length=ctx, norm_eps=1e-6,
                     tie_embeddings=tie, rope_theta=theta, layer_spec="qwen2")


def qwen2_tiny() -> GPTConfig:
    return _qwen2(2, 128, 4, 2, 384, vocab=2048, ctx=256, theta=10000.0)


def qwen2_0_5b() -> GPTConfig:  # Qwen2.5-0.5B (the sizes below are Qwen2.5's)
    return _qwen2(24, 896, 14, 2, 4864, tie=True)


def qwen2_1_5b() -> GPTConfig:
    return _qwen2(28, 1536, 12, 2, 8960, tie=True)


def qwen2_3b() -> GPTConfig:
    return _qwen2(36, 2048, 16, 2, 11008, tie=True)


def qwen2_7b() -> GPTConfig:
    return _qwen2(28, 3584, 28, 4, 18944, vocab=152064, ctx=131072)


def qwen2_14b() -> GPTConfig:
    return _qwen2(48, 5120, 40, 8, 13824, vocab=152064, ctx=131072)


def qwen2_32b() -> GPTConfig:
    return _qwen2(64, 5120, 40, 8, 27648, vocab=152064, ctx=131072)


def qwen2_72b() -> GPTConfig:
    return _qwen2(80, 8192, 64, 8, 29568, vocab=152064, ctx=131072)


def _qwen3(layers: int, hidden: int, heads: int, kv: int, ffn: int, *, vocab: int = 151936, ctx: int = 40960,
           tie: bool = False, theta: float = 1000000.0, head_dim: int = 128) -> GPTConfig:
    # (head_dim 128 whatever the width: in the small ones q|k|v are wider than the hidden size)
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     head_dim=head_dim, ffn_hidden_size=ffn, max_seq_length=ctx, norm_eps=1e-6, tie_embeddings=tie,
                     rope_theta=theta, layer_spec="qwen3")


def qwen3_tiny() -> GPTConfig:
    return _qwen3(2, 128, 4, 2, 384, vocab=2048, ctx=256, theta=10000.0, head_dim=32)


def qwen3_0_6b() -> GPTConfig:
    return _qwen3(28, 1024, 16, 8, 3072, tie=True)


def qwen3_1_7b() -> GPTConfig:
    return _qwen3(28, 2048, 16, 8, 6144, tie=True)


def qwen3_4b() -> GPTConfig:
    return _qwen3(36, 2560, 32, 8, 9728, tie=True)


def qwen3_8b() -> GPTConfig:
    return _qwen3(36, 4096, 32, 8, 12288)


_COMMON = dict(
    task="causal_lm",
    config=GPTConfig,
    specs=SPECS,
    build="zoo_gpt.model:build",
    loss="zoo_gpt.model:loss",
    example_batch="zoo_gpt.model:example_batch",
    generate="zoo_gpt.model:generate",
    default_dataset="python-docs",
    checkpoint_formats={"hf": "zoo_gpt.convert:HF"},
    pipeline=PipelineSpec(layers="layers", first=("embed", "pos_embed"), last=("norm", "head"), input_key="tokens"),
    sequence=SequenceSpec(dim=1, keys=("tokens", "labels", "loss_mask", "position_ids", "segment_ids"),
                          positions="position_ids", loss_mask="loss_mask"),
    recipe={"train.seq_length": 128, "train.micro_batch_size": 16, "optimizer.lr": 2e-3, "optimizer.weight_decay": 0.1,
            "schedule.warmup_steps": 30, "train.steps": 400, "train.eval_interval": 100, "logging.interval": 20},
)


@hookimpl
def zoo_families() -> list[Family]:
    return [
        Family(
            name="llama", aliases=("llama3", "llama2"),
            description="LLaMA decoder: RMSNorm, RoPE (theta, llama3/linear scaling), SwiGLU, grouped-query attention",
            flavors={"tiny": llama_tiny, "3-1B": llama3_1b, "3-3B": llama3_3b, "3-8B": llama3_8b,
                     "3-70B": llama3_70b, "2-7B": llama2_7b},
            **_COMMON,
        ),
        Family(
            name="mistral",
            description="Mistral decoder: LLaMA's with sliding-window attention (v0.1; none in v0.3 and NeMo)",
            flavors={"tiny": mistral_tiny, "7B-v0.1": mistral_7b_v01, "7B-v0.3": mistral_7b_v03,
                     "Nemo-12B": mistral_nemo_12b},
            **_COMMON,
        ),
        Family(
            name="qwen2", aliases=("qwen2.5",),
            description="Qwen2/Qwen2.5 decoder: LLaMA's with q/k/v biases, grouped-query attention",
            flavors={"tiny": qwen2_tiny, "0.5B": qwen2_0_5b, "1.5B": qwen2_1_5b, "3B": qwen2_3b, "7B": qwen2_7b,
                     "14B": qwen2_14b, "32B": qwen2_32b, "72B": qwen2_72b},
            **_COMMON,
        ),
        Family(
            name="gemma3", aliases=("gemma",),
            description="Gemma 3 decoder: sandwich zero-centred RMSNorms, q/k norms, GeGLU, 5:1 sliding-window "
                        "and global layers with their own RoPE bases, scaled embeddings",
            flavors={"tiny": gemma3_tiny, "270M": gemma3_270m, "1B": gemma3_1b, "4B": gemma3_4b, "12B": gemma3_12b,
                     "27B": gemma3_27b},
            **{**_COMMON, "config": GemmaConfig, "build": "zoo_gpt.model:build_gemma"},
        ),
        Family(
            name="gemma2",
            description="Gemma 2 decoder: Gemma 3's layers without q/k norms, attention scores and output logits "
                        "soft-capped (50, 30), 1:1 sliding-window and global layers",
            flavors={"tiny": gemma2_tiny, "2B": gemma2_2b, "9B": gemma2_9b, "27B": gemma2_27b},
            **{**_COMMON, "config": GemmaConfig, "build": "zoo_gpt.model:build_gemma"},
        ),
        Family(
            name="qwen3",
            description="Qwen3 decoder: LLaMA's with per-head RMSNorm of q and k, grouped-query attention",
            flavors={"tiny": qwen3_tiny, "0.6B": qwen3_0_6b, "1.7B": qwen3_1_7b, "4B": qwen3_4b, "8B": qwen3_8b},
            **_COMMON,
        ),
        Family(
            name="gpt2",
            description="GPT-2 decoder: learned positions, LayerNorm, tanh-GELU MLP, biases, tied embeddings",
            flavors={"tiny": gpt2_tiny, "124M": gpt2_124m, "355M": gpt2_355m, "774M": gpt2_774m, "1.5B": gpt2_1_5b},
            **_COMMON,
        ),
    ]
