"""Declarations of the CLIP and LLaVA families (light: no torch). The networks are in `model.py`,
the data (digits as Energon captioning / VQA samples, the tokenizer) in `data.py`, the Hugging Face
layouts in `convert.py`.

``clip``: contrastive image-text pre-training (Radford et al. 2021): a ViT and a causal text
transformer, projections, a learnt temperature; negatives gathered over data-parallel ranks.
``llava``: a CLIP vision tower whose features (from ``vision_feature_layer``) a 2-layer GELU
projector maps into a zoo-gpt decoder's embeddings at the image placeholder (Liu et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from zoo import Family, PipelineSpec, Throughput, hookimpl
from zoo.config import check_sizes
from zoo.family import DatasetSpec
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec
from zoo_gpt.plugin import GPT2, LLAMA, GPTConfig, gpt2_tiny, llama2_7b, llama_tiny


@dataclass(kw_only=True)
class VisionFields:
    """A CLIP ViT: ``image_size`` square images of ``num_channels`` cut into ``patch_size`` patches,
    a class token, learned positions, pre- and post-LayerNorm, quick-GELU layers."""

    image_size: int
    patch_size: int
    num_channels: int = 3
    vision_hidden_size: int
    vision_num_layers: int
    vision_num_heads: int
    vision_ffn_hidden_size: int
    vision_norm_eps: float = 1e-5

    def check_vision(self) -> None:
        vh = self.vision_hidden_size
        check_sizes(self, "image_size", "patch_size", "num_channels", "vision_hidden_size", "vision_num_layers",
                    "vision_num_heads", "vision_ffn_hidden_size",
                    parameters=self.vision_num_layers * (4 * vh * vh + 2 * vh * self.vision_ffn_hidden_size)
                    + (self.image_size // self.patch_size) ** 2 * vh)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(f"vision_hidden_size={self.vision_hidden_size} is not a multiple of "
                             f"vision_num_heads={self.vision_num_heads}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(kw_only=True)
class CLIPConfig(VisionFields):
    vocab_size: int
    max_seq_length: int  # the text tower's context (77 for OpenAI's)
    text_hidden_size: int
    text_num_layers: int
    text_num_heads: int
    text_ffn_hidden_size: int
    text_norm_eps: float = 1e-5
    # Text pooling: the first position holding this id; None: the position of the largest id
    # (the original OpenAI tokenizer's end token; HF reads eos_token_id=2 configs that way).
    eos_token_id: int | None = 0
    projection_dim: int
    logit_scale_init: float = 2.6592  # ln(1 / 0.07)
    logit_scale_max: float = 100.0  # the temperature's ceiling (the paper's clip; HF has none)
    # Negatives from every data-parallel rank's micro-batch (open_clip's gather); False: local only (HF).
    global_negatives: bool = True
    init_std: float = 0.02
    layer_spec: str = "clip"

    def __post_init__(self) -> None:
        self.check_vision()
        th = self.text_hidden_size
        check_sizes(self, "vocab_size", "max_seq_length", "text_hidden_size", "text_num_layers", "text_num_heads",
                    "text_ffn_hidden_size", "projection_dim",
                    parameters=self.text_num_layers * (4 * th * th + 2 * th * self.text_ffn_hidden_size)
                    + (self.vocab_size + self.max_seq_length) * th)
        if self.text_hidden_size % self.text_num_heads:
            raise ValueError(f"text_hidden_size={self.text_hidden_size} is not a multiple of "
                             f"text_num_heads={self.text_num_heads}")

    @property
    def tp_split_sizes(self) -> dict[str, int]:
        return {"text_num_heads": self.text_num_heads, "vision_num_heads": self.vision_num_heads}


@dataclass(kw_only=True)
class LlavaConfig(GPTConfig, VisionFields):
    """A zoo-gpt decoder's config (the language model: its fields as in GPTConfig) with a vision
    tower and projector."""

    # hidden_states index of the tower (0: after pre-LayerNorm, -1: the last layer); several are
    # concatenated along the hidden size
    vision_feature_layer: int | list[int] = -2
    vision_feature_select_strategy: Literal["default", "full"] = "default"  # default drops the class token
    projector_bias: bool = True
    image_token_id: int
    # How a question becomes the prompt (training data and `zoo generate` use the same one).
    prompt_template: str = "USER: <image>\n{question} ASSISTANT:"
    layer_spec: str = "llava"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_vision()
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r}: "
                             "'default' (drop the class token) or 'full'")
        for layer in self.feature_layers:
            if not -(self.vision_num_layers + 1) <= layer <= self.vision_num_layers:
                raise ValueError(f"vision_feature_layer={layer}: the tower has hidden states 0..{self.vision_num_layers}")
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(f"image_token_id={self.image_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    @property
    def feature_layers(self) -> list[int]:
        """Indices into the tower's hidden states (num_layers + 1 of them), non-negative."""
        layers = self.vision_feature_layer if isinstance(self.vision_feature_layer, list) else [self.vision_feature_layer]
        return [i if i >= 0 else self.vision_num_layers + 1 + i for i in layers]

    @property
    def image_features(self) -> int:
        """Positions one image takes in the language model's sequence."""
        return self.num_patches + (self.vision_feature_select_strategy == "full")

    @property
    def tp_split_sizes(self) -> dict[str, int]:
        return {"vision_num_heads": self.vision_num_heads}


_LN = NormSpec(kind="layernorm")
CLIP_LAYER = BlockSpec(norm=_LN, mixer=AttentionSpec(causal=False, bias=True),
                       ffn=MLPSpec(activation="quick_gelu", gated=False, bias=True))
CLIP_TEXT_LAYER = BlockSpec(norm=_LN, mixer=AttentionSpec(causal=True, bias=True), ffn=CLIP_LAYER.ffn)
VISION = ModelSpec(blocks={"V": CLIP_LAYER}, embedding="patch_2d", positions="learned", final_norm=_LN, head="none")
TEXT = ModelSpec(blocks={"T": CLIP_TEXT_LAYER}, embedding="token", positions="learned", final_norm=_LN,
                 head="projection")
CLIP = ModelSpec(blocks={}, embedding="none", positions="none", final_norm=None, head="projection",
                 towers={"vision": VISION, "text": TEXT})
LLAVA = ModelSpec(blocks=LLAMA.blocks, embedding="token", positions="none", final_norm=LLAMA.final_norm, head="lm",
                  towers={"vision": VISION})
LLAVA_GPT2 = ModelSpec(blocks=GPT2.blocks, embedding="token", positions="learned", final_norm=GPT2.final_norm,
                       head="lm", towers={"vision": VISION})


# The built-in digits: 8x8 grey images (as RGB), 2x2 patches: 16 image tokens.
_DIGIT_VISION = dict(image_size=8, patch_size=2, num_channels=3, vision_hidden_size=64, vision_num_layers=3,
                     vision_num_heads=4, vision_ffn_hidden_size=256)


def clip_tiny() -> CLIPConfig:
    return CLIPConfig(**_DIGIT_VISION, vocab_size=512, max_seq_length=16, text_hidden_size=64, text_num_layers=2,
                      text_num_heads=4, text_ffn_hidden_size=256, projection_dim=32)


def _openai(vision: tuple[int, int, int, int, int], text: tuple[int, int, int], proj: int) -> CLIPConfig:
    image, patch, hidden, layers, heads = vision
    t_hidden, t_layers, t_heads = text
    # OpenAI's tokenizer: end token 49407, the largest id, found by argmax (eos_token_id None).
    return CLIPConfig(image_size=image, patch_size=patch, vision_hidden_size=hidden, vision_num_layers=layers,
                      vision_num_heads=heads, vision_ffn_hidden_size=4 * hidden, vocab_size=49408, max_seq_length=77,
                      text_hidden_size=t_hidden, text_num_layers=t_layers, text_num_heads=t_heads,
                      text_ffn_hidden_size=4 * t_hidden, eos_token_id=None, projection_dim=proj)


CLIP_FLAVORS = {
    "tiny": clip_tiny,
    "ViT-B/32": lambda: _openai((224, 32, 768, 12, 12), (512, 12, 8), 512),
    "ViT-B/16": lambda: _openai((224, 16, 768, 12, 12), (512, 12, 8), 512),
    "ViT-L/14": lambda: _openai((224, 14, 1024, 24, 16), (768, 12, 12), 768),
    "ViT-L/14-336": lambda: _openai((336, 14, 1024, 24, 16), (768, 12, 12), 768),
}


def _llava(lm: GPTConfig, vision: dict[str, Any], **kw: Any) -> LlavaConfig:
    fields = {k: v for k, v in vars(lm).items() if k != "layer_spec"}
    return LlavaConfig(**fields, **vision, layer_spec="llava_gpt2" if lm.layer_spec == "gpt2" else "llava", **kw)


def llava_tiny() -> LlavaConfig:
    lm = llama_tiny()
    lm.vocab_size, lm.hidden_size, lm.head_dim, lm.ffn_hidden_size, lm.max_seq_length = 512, 64, 16, 192, 64
    return _llava(lm, _DIGIT_VISION, image_token_id=1)


def llava_tiny_gpt2() -> LlavaConfig:
    lm = gpt2_tiny()
    lm.vocab_size, lm.hidden_size, lm.head_dim, lm.ffn_hidden_size, lm.max_seq_length = 512, 64, 16, 256, 64
    return _llava(lm, _DIGIT_VISION, image_token_id=1)


def llava_1_5_7b() -> LlavaConfig:
    # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 at 336 px (576 features, penultimate layer, no class
    # token), Vicuna-7B (LLaMA-2 7B, vocabulary padded to 32064), image token 32000.
    lm = llama2_7b()
    lm.vocab_size, lm.norm_eps = 32064, 1e-5
    vision = dict(image_size=336, patch_size=14, vision_hidden_size=1024, vision_num_layers=24, vision_num_heads=16,
                  vision_ffn_hidden_size=4096)
    return _llava(lm, vision, image_token_id=32000)


LLAVA_FLAVORS = {"tiny": llava_tiny, "tiny-gpt2": llava_tiny_gpt2, "1.5-7b": llava_1_5_7b}

@hookimpl
def zoo_families() -> list[Family]:
    return [
        Family(
            name="clip",
            description="CLIP (Radford et al.): ViT + causal text transformer, contrastive loss with negatives "
                        "gathered over data-parallel ranks, clamped temperature",
            task="contrastive",
            config=CLIPConfig,
            flavors=CLIP_FLAVORS,
            specs={"clip": CLIP},
            build="zoo_vlm.model:build_clip",
            loss="zoo_vlm.model:clip_loss",
            example_batch="zoo_vlm.model:clip_example_batch",
            generate="zoo_vlm.generate:classify",
            default_dataset="digits-captions",
            task_encoder="zoo_vlm.data:clip_task_encoder",
            checkpoint_formats={"hf": "zoo_vlm.convert:HF_CLIP"},
            # No tp_plan: both towers are the core's transformer layers, split as the core derives.
            throughput=Throughput(unit="samples", count="zoo_vlm.model:count_samples",
                                  flops_of_batch="zoo_vlm.model:clip_flops_of_batch"),
            # ~30 s on 2 cores; zero-shot accuracy on held-out digits in docs/vlm.md.
            recipe={"train.micro_batch_size": 64, "optimizer.lr": 2e-3, "optimizer.weight_decay": 0.1,
                    "schedule.warmup_steps": 30, "train.steps": 400, "train.eval_interval": 200,
                    "logging.interval": 50},
        ),
        Family(
            name="llava",
            description="LLaVA-style VLM: CLIP vision tower (a chosen layer's features), 2-layer GELU projector, "
                        "a zoo-gpt decoder (LLaMA or GPT-2) with images at the placeholder token",
            task="vlm",
            config=LlavaConfig,
            flavors=LLAVA_FLAVORS,
            specs={"llava": LLAVA, "llava_gpt2": LLAVA_GPT2},
            build="zoo_vlm.model:build_llava",
            loss="zoo_vlm.model:llava_loss",
            example_batch="zoo_vlm.model:llava_example_batch",
            generate="zoo_vlm.generate:answer",
            default_dataset="digits-vqa",
            task_encoder="zoo_vlm.data:llava_task_encoder",
            checkpoint_formats={"hf": "zoo_vlm.convert:HF_LLAVA"},
            # The projector is the family's own MLP; the towers and the decoder split as the core derives.
            tp_plan={"projector.fc": "column", "projector.proj": "row"},
            # The vision tower and projector run on the first stage, which merges the image features
            # into the sequence; later stages see only the decoder's hidden state.
            pipeline=PipelineSpec(layers="layers", first=("vision", "projector", "embed", "pos_embed"),
                                  last=("norm", "head"), input_key="tokens"),
            throughput=Throughput(unit="samples", count="zoo_vlm.model:count_samples",
                                  flops_of_batch="zoo_vlm.model:llava_flops_of_batch"),
            # ~40 s on 2 cores; answers on held-out digits in docs/vlm.md.
            recipe={"train.micro_batch_size": 32, "train.seq_length": 48, "optimizer.lr": 1e-3,
                    "optimizer.weight_decay": 0.1, "schedule.warmup_steps": 30, "train.steps": 600,
                    "train.eval_interval": 300, "logging.interval": 50},
        ),
    ]


@hookimpl
def zoo_datasets() -> list[DatasetSpec]:
    return [
        DatasetSpec(name="digits-captions", description="scikit-learn's 1,797 digits as Energon CaptioningSamples "
                    "('a handwritten 7'), with a byte-level BPE trained on the captions; prepared on first use",
                    build="zoo_vlm.data:build_captions", tokenizer="zoo_vlm.data:captions_tokenizer",
                    modality="image_text", stateful=True),
        DatasetSpec(name="digits-vqa", description="scikit-learn's 1,797 digits as Energon VQASamples ('What digit "
                    "is this?' -> 'seven'), with a byte-level BPE; prepared on first use",
                    build="zoo_vlm.data:build_vqa", tokenizer="zoo_vlm.data:vqa_tokenizer",
                    modality="image_text", stateful=True),
    ]
