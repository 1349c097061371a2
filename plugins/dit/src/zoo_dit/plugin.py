"""Declarations of the DiT families (light: no torch). The network is in `model.py`, the
objectives and samplers in `diffusion.py`, `edm.py` (EDM) and `vp.py` (the original DiT's
discrete VP diffusion), the data in `data.py`.

``dit``: class-conditional DiT of Peebles & Xie (patch 2-D, adaLN-Zero with 6 chunks); its tiny
flavor trains on scikit-learn's digits (8x8 pixels, no VAE) in minutes on a CPU. ``dit-video``:
NeMo DFM's text-to-video DiT (3-D patches, self -> cross -> MLP, 9 chunks, per-head Q/K RMSNorm,
no biases, optional low-rank adaLN); its tiny flavor trains on "moving digits" clips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zoo import Family, PipelineSpec, Throughput, hookimpl
from zoo.config import check_sizes
from zoo.family import DatasetSpec, MetricSpec, SequenceSpec
from zoo.spec import AdaLNSpec, AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec


@dataclass(kw_only=True)
class DiTConfig:
    in_channels: int  # latent (or pixel) channels
    patch_size: int  # spatial patch ph = pw
    hidden_size: int
    num_layers: int
    num_heads: int
    sample_size: int  # default latent height = width (generation, diffusers' sample_size)
    patch_t: int = 1  # temporal patch (video)
    num_frames: int = 1  # default latent frames (generation)
    mlp_ratio: float = 4.0
    num_classes: int = 0  # > 0: class-conditional, with a null class for guidance
    text_dim: int = 0  # > 0: cross-attention to text embeddings of this width
    adaln_lora_rank: int = 0  # > 0: DFM's low-rank adaLN (D -> r -> chunks * D)
    norm_eps: float = 1e-6
    mlp_norm_eps: float | None = None  # diffusers' DiT uses its norm_eps (1e-5) before the MLP only
    time_freq_shift: float = 0.0  # 0: Peebles & Xie's timestep frequencies; 1: diffusers'
    # The diffusion the model is trained and sampled with: "edm" (Karras et al. 2022; from scratch)
    # or "vp", the original DiT's discrete variance-preserving one (its released checkpoints).
    objective: Literal["edm", "vp"] = "edm"
    # vp: the network also predicts the variance (Nichol & Dhariwal's learned range): its output
    # has twice the input's channels, epsilon's first.
    learn_sigma: bool = False
    # vp: the linear beta schedule (DiT's: 1000 steps from 1e-4 to 0.02)
    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    # EDM (Karras et al. 2022): data std, ln(sigma) ~ N(p_mean, p_std^2) in training
    sigma_data: float = 0.5
    p_mean: float = -1.2
    p_std: float = 1.2
    class_dropout: float = 0.1  # labels replaced by the null class (classifier-free guidance)
    text_dropout: float = 0.2  # text embeddings zeroed, per sample (DFM drops per pack)
    loss_average: Literal["sample", "token"] = "sample"  # DFM: token (large samples dominate)
    layer_spec: str = "dit"
    # The local diffusers AutoencoderKL the training latents were made with (`zoo prepare images
    # --vae DIR`); generation decodes through it. Empty: the model works on pixels.
    vae: str = ""

    def __post_init__(self) -> None:
        h = self.hidden_size  # per block: attention 4h^2 (+ cross 4h^2), MLP 2 ratio h^2, adaLN 6-9 h^2
        check_sizes(self, "in_channels", "patch_size", "hidden_size", "num_layers", "num_heads", "sample_size",
                    "patch_t", "num_frames", parameters=self.num_layers * int(17 + 2 * self.mlp_ratio) * h * h)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        quantum = 16 if self.layer_spec == "dit_video" else 4  # sin-cos halves (2-D) or t/4 + 3/8 + 3/8 (3-D)
        if self.hidden_size % quantum:
            raise ValueError(f"hidden_size={self.hidden_size}: the {self.layer_spec} position embedding needs a "
                             f"multiple of {quantum}")
        if self.loss_average not in ("sample", "token"):
            raise ValueError(f"loss_average={self.loss_average!r}: 'sample' or 'token'")
        if self.objective not in ("edm", "vp"):
            raise ValueError(f"objective={self.objective!r}: 'edm' (Karras et al.) or 'vp' (the original DiT's)")
        if self.learn_sigma and self.objective != "vp":
            raise ValueError("learn_sigma=true predicts the variance of the discrete VP diffusion: set objective=vp "
                             "(EDM's denoiser predicts the sample only)")
        if self.num_timesteps < 1:
            raise ValueError(f"num_timesteps={self.num_timesteps}: at least 1")
        if not 0 < self.beta_start <= self.beta_end < 1:
            raise ValueError(f"beta_start={self.beta_start}, beta_end={self.beta_end}: need 0 < start <= end < 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_hidden_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def token_features(self) -> int:
        return self.patch_t * self.patch_size**2 * self.in_channels

    @property
    def out_features(self) -> int:
        """Per token: the prediction's features, and with learn_sigma the variance's after them
        (per cell ``(pt, ph, pw)``: epsilon's C channels, then the variance's C)."""
        return self.token_features * (2 if self.learn_sigma else 1)

    @property
    def block(self) -> str:
        return "V" if self.layer_spec == "dit_video" else "D"


_ADALN_NORM = NormSpec(kind="layernorm", affine=False)

DIT = ModelSpec(
    blocks={"D": BlockSpec(norm=_ADALN_NORM, mixer=AttentionSpec(causal=False, bias=True),
                           ffn=MLPSpec(activation="gelu_tanh", gated=False, bias=True),
                           conditioning=AdaLNSpec(chunks=6))},
    embedding="patch_2d", positions="sincos_2d", final_norm=_ADALN_NORM, head="unpatchify",
)

_QK = NormSpec(kind="rmsnorm")
DIT_VIDEO = ModelSpec(
    blocks={"V": BlockSpec(norm=_ADALN_NORM, mixer=AttentionSpec(causal=False, bias=False, qk_norm=_QK),
                           cross_attention=AttentionSpec(causal=False, bias=False, qk_norm=_QK, cross=True),
                           ffn=MLPSpec(activation="gelu", gated=False, bias=False),
                           conditioning=AdaLNSpec(chunks=9))},
    embedding="patch_3d", positions="sincos_3d", final_norm=_ADALN_NORM, head="unpatchify",
)

SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}


def dit_tiny() -> DiTConfig:
    # scikit-learn's digits: 8x8 grey pixels (no VAE), 10 classes, 2x2 pixels per token (16 tokens).
    return DiTConfig(in_channels=1, patch_size=2, hidden_size=128, num_layers=4, num_heads=4, sample_size=8,
                     num_classes=10)


def _image(size: str, patch: int) -> DiTConfig:
    layers, hidden, heads = SIZES[size]
    # ImageNet 256x256 through Stable Diffusion's VAE: 4 x 32 x 32 latents, 1000 classes.
    return DiTConfig(in_channels=4, patch_size=patch, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     sample_size=32, num_classes=1000)


def video_tiny() -> DiTConfig:
    # "moving digits": 1 x 8 x 16 x 16 pixel clips, captions embedded by a tiny T5 (width 64), in
    # 2x4x4 patches: 64 tokens a clip (1x2x2 patches, 512 tokens, cost over 10x more a clip).
    # ln sigma ~ N(0, 1.2), DFM's mean: more steps at high noise, where the motion and the digit's
    # shape are decided (with the paper's -1.2 and lr 1e-3 the direction followed the caption after
    # ~2,400 steps; with 0 and the recipe's 2e-3, after 500: docs/dit.md).
    return DiTConfig(in_channels=1, patch_size=4, patch_t=2, hidden_size=128, num_layers=4, num_heads=4,
                     sample_size=16, num_frames=8, text_dim=64, p_mean=0.0, layer_spec="dit_video")


def _video(size: str) -> DiTConfig:
    layers, hidden, heads = SIZES[size]
    # DFM's providers: Cosmos CV4x8x8 latents (16 channels), T5-11B text (1024), adaLN-LoRA 256.
    return DiTConfig(in_channels=16, patch_size=2, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     sample_size=32, num_frames=8, text_dim=1024, adaln_lora_rank=256, norm_eps=1e-6,
                     p_mean=0.0, p_std=1.0, layer_spec="dit_video")


IMAGE_FLAVORS = {"tiny": dit_tiny, **{f"{s}/{p}": (lambda s=s, p=p: _image(s, p)) for s in SIZES for p in (2, 4, 8)}}
VIDEO_FLAVORS = {"tiny": video_tiny, **{s: (lambda s=s: _video(s)) for s in SIZES}}

_COMMON = dict(
    task="diffusion",
    config=DiTConfig,
    specs={"dit": DIT, "dit_video": DIT_VIDEO},
    build="zoo_dit.model:build",
    loss="zoo_dit.diffusion:loss",
    example_batch="zoo_dit.diffusion:example_batch",
    generate="zoo_dit.diffusion:generate",
    preview="zoo_dit.diffusion:preview",
    task_encoder="zoo_dit.data:task_encoder",
    # DiT's attention is its own (adaLN-modulated, cross-attention from text): whole heads per rank,
    # q|k|v and k|v laid out per head. Its MLP is the core's and splits as the core derives.
    tp_plan={"layers.*.attn.qkv": "column", "layers.*.attn.proj": "row", "layers.*.cross.q": "column",
             "layers.*.cross.kv": "column_context", "layers.*.cross.proj": "row",
             "layers.*.attn.q_norm": "per_head", "layers.*.attn.k_norm": "per_head",
             "layers.*.cross.q_norm": "per_head", "layers.*.cross.k_norm": "per_head"},
    pipeline=PipelineSpec(layers="layers", first=("x_embed", "t_embed", "y_embed"), last=("final",),
                          input_key="hidden", carries=("cond",)),
    metrics=(MetricSpec(name="sigma_mean"),),
    # Context parallelism splits the per-token tensors; the loss weights carry each rank's share.
    sequence=SequenceSpec(keys=("latents", "noise", "positions", "segment_ids", "loss_weight"), positions=None,
                          loss_mask="loss_weight"),
)


@hookimpl
def zoo_families() -> list[Family]:
    return [
        Family(
            name="dit",
            description="DiT (Peebles & Xie) with EDM or the original's VP diffusion: class-conditional images, "
                        "adaLN-Zero, sin-cos positions",
            flavors=IMAGE_FLAVORS,
            default_dataset="digits",
            checkpoint_formats={"diffusers": "zoo_dit.convert:DIFFUSERS", "facebook-dit": "zoo_dit.convert:REFERENCE"},
            throughput=Throughput(unit="images", count="zoo_dit.diffusion:count_samples",
                                  flops_of_batch="zoo_dit.diffusion:flops_of_batch"),
            # ~2 minutes on 2 cores; samples recognised as their class >= 90% (docs/dit.md). The EMA's
            # half-life (70 steps) is short for a short run: 0.999 would still hold 45% of the
            # zero-initialised start after 800 steps.
            recipe={"train.micro_batch_size": 32, "optimizer.lr": 2e-3, "optimizer.weight_decay": 0.0,
                    "schedule.warmup_steps": 50, "train.steps": 800, "train.eval_interval": 400,
                    "logging.interval": 50, "train.ema": 0.99},
            **_COMMON,
        ),
        Family(
            name="dit-video",
            description="NeMo DFM's text-to-video DiT with EDM: 3-D patches, cross-attention to T5, 9-chunk adaLN",
            flavors=VIDEO_FLAVORS,
            default_dataset="moving-digits",
            throughput=Throughput(unit="samples", count="zoo_dit.diffusion:count_samples",
                                  flops_of_batch="zoo_dit.diffusion:flops_of_batch"),
            # ~11 minutes on 2 cores: the motion follows the caption within 600 steps, the digit
            # comes last (docs/dit.md has the curve; benchmarks/dit_video_quality.py judges it).
            recipe={"train.micro_batch_size": 32, "optimizer.lr": 2e-3, "optimizer.weight_decay": 0.0,
                    "schedule.warmup_steps": 50, "train.steps": 4000, "train.eval_interval": 1000,
                    "logging.interval": 50, "train.ema": 0.99},
            **_COMMON,
        ),
    ]


@hookimpl
def zoo_datasets() -> list[DatasetSpec]:
    return [
        DatasetSpec(name="digits", description="scikit-learn's 1,797 handwritten digits (8x8, class labels), "
                    "prepared as an Energon dataset on first use", build="zoo_dit.data:build_digits",
                    modality="images", stateful=True),
        DatasetSpec(name="moving-digits", description="2,000 clips of a digit crossing a 16x16 canvas in 8 frames, "
                    "captioned 'a 3 moving right', embedded by a fixed-seed tiny T5; prepared on first use",
                    build="zoo_dit.data:build_moving", modality="video", stateful=True,
                    clips="zoo_dit.moving_digits:source"),
    ]
