"""CLIP and a LLaVA-style VLM, architecture only; parallelism is applied by the core.

Shapes: B batch, C channels, S image side, N patches, T text positions, D hidden width.
Layers are the core's pre-norm `zoo.nn.layers.TransformerLayer` (quick-GELU, biases), the same
module the GPT decoders use; CLIP's text tower is causal, its vision tower is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zoo.nn import KVCache
from zoo.nn.layers import TransformerLayer, run_layers
from zoo.nn.linear import Linear
from zoo.parallel.context import BatchGather
from zoo.spec import ModelSpec
from zoo.training.metrics import LayerFlops, linear_weights
from zoo_gpt.model import GPT
from zoo_vlm.plugin import CLIPConfig, LlavaConfig, VisionFields


def _init_tower(tower: nn.Module, width: int, std: float) -> None:
    """CLIP's initialisation (as OpenAI's and HF's): input projections of attention and MLP scaled
    by width^-0.5 and depth, embeddings at ``std``. At small widths a flat 0.02 starves the
    residual stream and contrastive training sits on a plateau for hundreds of steps."""
    depth = (2 * len(tower.layers)) ** -0.5
    for name, p in tower.named_parameters():
        if p.dim() == 1:
            nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
        elif name.endswith(("attn.qkv.weight", "mlp.proj.weight")):
            nn.init.normal_(p, std=width ** -0.5 * depth)
        elif name.endswith("attn.proj.weight"):
            nn.init.normal_(p, std=width ** -0.5)
        elif name.endswith("mlp.fc.weight"):
            nn.init.normal_(p, std=(2 * width) ** -0.5)
        else:  # token, position and patch embeddings
            nn.init.normal_(p, std=std)
    if isinstance(tower, VisionTower):
        nn.init.normal_(tower.class_token, std=width ** -0.5)


class VisionTower(nn.Module):
    """CLIP's ViT: conv patches + class token + learned positions, pre-LayerNorm, encoder layers;
    ``post_norm`` applies to the pooled class token only."""

    def __init__(self, cfg: VisionFields, spec: ModelSpec) -> None:
        super().__init__()
        d, heads = cfg.vision_hidden_size, cfg.vision_num_heads
        self.cfg = cfg
        self.patch = nn.Conv2d(cfg.num_channels, d, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_token = nn.Parameter(torch.empty(d))
        self.positions = nn.Embedding(cfg.num_patches + 1, d)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.vision_norm_eps)
        self.layers = nn.ModuleList(
            TransformerLayer(spec.block_for("V"), hidden=d, heads=heads, kv_heads=heads, head_dim=d // heads,
                             ffn_hidden=cfg.vision_ffn_hidden_size, eps=cfg.vision_norm_eps, layer=i)
            for i in range(cfg.vision_num_layers))
        self.post_norm = nn.LayerNorm(d, eps=cfg.vision_norm_eps)

    def forward(self, images: torch.Tensor, *, upto: int | None = None) -> list[torch.Tensor]:
        """images (B, C, S, S) -> hidden states 0..``upto`` (default all), each (B, 1 + N, D):
        index 0 after the pre-LayerNorm, index i after layer i (HF's ``hidden_states``)."""
        x = self.embed(images)
        states = [x]
        for layer in self.layers[: len(self.layers) if upto is None else upto]:
            x = layer(x)
            states.append(x)
        return states

    def pooled(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, S, S) -> the class token after the last layer and ``post_norm``, (B, D);
        the last layer computes that token alone (`zoo.nn.layers.run_layers`)."""
        x = self.embed(images)
        cls = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
        return self.post_norm(run_layers(self.layers, x, keep=cls)[:, 0])

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, S, S) -> the first layer's input (B, 1 + N, D)."""
        c = self.cfg
        if images.dim() != 4 or tuple(images.shape[1:]) != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(f"images of shape {tuple(images.shape)}: the vision tower takes (B, {c.num_channels}, "
                             f"{c.image_size}, {c.image_size}) (model.num_channels, model.image_size)")
        x = self.patch(images.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)  # (B, N, D)
        cls = self.class_token.to(x.dtype).expand(x.shape[0], 1, -1)
        return self.pre_norm(torch.cat([cls, x], dim=1) + self.positions.weight)


class TextTower(nn.Module):
    """CLIP's text transformer: token + learned positions, causal layers, final LayerNorm, pooled
    at the end token."""

    def __init__(self, cfg: CLIPConfig, spec: ModelSpec) -> None:
        super().__init__()
        d, heads = cfg.text_hidden_size, cfg.text_num_heads
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.positions = nn.Embedding(cfg.max_seq_length, d)
        self.layers = nn.ModuleList(
            TransformerLayer(spec.block_for("T"), hidden=d, heads=heads, kv_heads=heads, head_dim=d // heads,
                             ffn_hidden=cfg.text_ffn_hidden_size, eps=cfg.text_norm_eps, layer=i)
            for i in range(cfg.text_num_layers))
        self.norm = nn.LayerNorm(d, eps=cfg.text_norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> pooled (B, D). Padding after the end token needs no mask: causal
        attention keeps it out of every position up to the end."""
        t = tokens.shape[1]
        if t > self.cfg.max_seq_length:
            raise ValueError(f"a text of {t} tokens: the text tower's context is {self.cfg.max_seq_length} "
                             "(model.max_seq_length)")
        x = self.embed(tokens) + self.positions.weight[:t]
        end = text_ends(tokens, self.cfg.eos_token_id)
        # Causal: nothing after the batch's last end token reaches an end token, so the padding
        # there is dropped (captions are far shorter than the 77-token context); and only the end
        # token's output is read, so the last layer computes that position alone.
        x = x[:, : int(end.max()) + 1]
        return self.norm(run_layers(self.layers, x, keep=end[:, None])[:, 0])


def text_ends(tokens: torch.Tensor, eos: int | None) -> torch.Tensor:
    """(B, T) -> (B,) the position CLIP pools each text at: its first end token, or the largest id
    (OpenAI's end token) when ``eos`` is None."""
    if eos is None:
        return tokens.argmax(-1)
    is_end = tokens == eos
    if not bool(is_end.any(-1).all()):
        raise ValueError(f"a text without its end token (model.eos_token_id={eos}): CLIP pools there")
    return is_end.int().argmax(-1)  # the first one


class CLIP(nn.Module):
    def __init__(self, cfg: CLIPConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTower(cfg, spec.towers["vision"])
        self.text = TextTower(cfg, spec.towers["text"])
        self.vision_proj = Linear(cfg.vision_hidden_size, cfg.projection_dim, bias=False)
        self.text_proj = Linear(cfg.text_hidden_size, cfg.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.full((), float(cfg.logit_scale_init)))
        self.gather = BatchGather()  # the other data-parallel ranks' embeddings (set by the core)
        _init_tower(self.vision, cfg.vision_hidden_size, cfg.init_std)
        _init_tower(self.text, cfg.text_hidden_size, cfg.init_std)
        nn.init.normal_(self.vision_proj.weight, std=cfg.vision_hidden_size ** -0.5)
        nn.init.normal_(self.text_proj.weight, std=cfg.text_hidden_size ** -0.5)

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> L2-normalised (B, P)."""
        return F.normalize(self.vision_proj(self.vision.pooled(images)), dim=-1)

    def embed_texts(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> L2-normalised (B, P)."""
        return F.normalize(self.text_proj(self.text(tokens)), dim=-1)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The symmetric contrastive loss of B matching pairs against every pair of the global
        batch (this micro-batch on every data-parallel rank, with ``global_negatives``)."""
        img, txt = self.embed_images(images), self.embed_texts(tokens)
        # The paper's clip: the temperature never scales logits beyond logit_scale_max.
        scale = self.logit_scale.clamp(max=math.log(self.cfg.logit_scale_max)).exp()
        gather = self.gather if self.cfg.global_negatives else (lambda x: x)
        all_img, all_txt = gather(img), gather(txt)
        rank = self.gather.rank if self.cfg.global_negatives else 0
        target = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
        per_text = scale * txt @ all_img.t()  # (B, B * ranks): each text against every image
        per_image = scale * img @ all_txt.t()
        wide = torch.promote_types(per_text.dtype, torch.float32)  # (at least float32: a bf16 softmax loses the loss)
        return (F.cross_entropy(per_text.to(wide), target) + F.cross_entropy(per_image.to(wide), target)) / 2


def build_clip(cfg: CLIPConfig, spec: ModelSpec) -> CLIP:
    return CLIP(cfg, spec)


def clip_loss(model: CLIP, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    return model(batch["images"], batch["tokens"]), {}


def clip_example_batch(cfg: CLIPConfig, *, batch_size: int, seq_length: int, generator: torch.Generator
                       ) -> dict[str, torch.Tensor]:
    t = min(seq_length, cfg.max_seq_length)
    tokens = torch.randint(1, cfg.vocab_size, (batch_size, t), generator=generator)
    if cfg.eos_token_id is not None:
        ends = torch.randint(1, t, (batch_size,), generator=generator)
        tokens[torch.arange(batch_size), ends] = cfg.eos_token_id
    images = torch.randn(batch_size, cfg.num_channels, cfg.image_size, cfg.image_size, generator=generator)
    return {"images": images, "tokens": tokens}


# ----------------------------------------------------------------------------------------- LLaVA


class Projector(nn.Module):
    """Vision features -> the decoder's width: Linear, GELU, Linear (LLaVA-1.5's mlp2x_gelu)."""

    def __init__(self, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.fc = Linear(d_in, d_out, bias=bias)
        self.proj = Linear(d_out, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Llava(GPT):
    """A zoo-gpt decoder (embed, layers, norm, head) with a vision tower and projector in front.

    Images enter at the placeholder token ``image_token_id``: either one placeholder per image,
    which the model widens to the image's ``image_features`` positions (labels and loss mask
    widened with it, Megatron's convention), or that many placeholders already (HF's processor
    convention), which the features replace in order. Any other count is an error.
    """

    def __init__(self, cfg: LlavaConfig, spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        self.vision = VisionTower(cfg, spec.towers["vision"])
        self.projector = Projector(cfg.vision_hidden_size * len(cfg.feature_layers), cfg.hidden_size,
                                   cfg.projector_bias)
        _init_tower(self.vision, cfg.vision_hidden_size, cfg.init_std)
        for lin in (self.projector.fc, self.projector.proj):
            nn.init.normal_(lin.weight, std=cfg.init_std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        # The tower's layers past the deepest feature layer and its post-LayerNorm never run here:
        # frozen, so no gradient is awaited for them (kept for conversion both ways).
        self.upto = max(cfg.feature_layers)
        for p in [*self.vision.layers[self.upto:].parameters(), *self.vision.post_norm.parameters()]:
            p.requires_grad_(False)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(n, C, S, S) -> (n, image_features, D): the chosen layers' states, projected."""
        states = self.vision(images, upto=self.upto)
        x = torch.cat([states[i] for i in self.cfg.feature_layers], dim=-1)
        if self.cfg.vision_feature_select_strategy == "default":
            x = x[:, 1:]
        return self.projector(x)

    def forward(self, tokens: torch.Tensor, *, images: torch.Tensor | None = None, cache: KVCache | None = None,
                labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) with image placeholders, images (n, C, S, S) in order of their
        placeholders -> logits (B, T', V), or with ``labels`` the mean next-token cross entropy
        over ``loss_mask``. T' counts every image's features. A later pipeline stage gets the
        hidden state (B, T', D) as ``tokens``."""
        if self.embed is not None:
            x = self.embed(tokens)
            if images is not None:
                x, labels, loss_mask = self.insert_images(tokens, x, images, labels, loss_mask)
            elif bool((tokens == self.cfg.image_token_id).any()):
                raise ValueError(f"the text holds image placeholders (model.image_token_id={self.cfg.image_token_id}) "
                                 "but no image was given")
        else:
            x = tokens
        start = cache.pos if cache is not None else 0
        t = x.shape[1]
        if start + t > self.cfg.max_seq_length:
            raise ValueError(f"a sequence of {start + t} positions (images included): the language model's context "
                             f"is {self.cfg.max_seq_length} (model.max_seq_length)")
        positions = torch.arange(start, start + t, device=x.device)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = self.rotary(positions) if self.rotary is not None else None
        if labels is not None:  # HF marks ignored positions with -100 instead of a mask
            loss_mask = (labels != -100) if loss_mask is None else loss_mask.bool() & (labels != -100)
            labels = labels.clamp(min=0)
        keep = self.loss_positions(labels, loss_mask, cache)
        x = run_layers(self.layers, x, rope, cache, keep=keep)
        if cache is not None:
            cache.pos += t
        if self.head is None:
            return x
        return self.output(x, labels, loss_mask, keep)

    def insert_images(self, tokens: torch.Tensor, x: torch.Tensor, images: torch.Tensor,
                      labels: torch.Tensor | None, loss_mask: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        feats = self.image_features(images).to(x.dtype)  # (n, F, D)
        n, f = feats.shape[:2]
        is_image = tokens == self.cfg.image_token_id
        count = int(is_image.sum())
        if count == n * f:  # already widened: replace in order
            return x.masked_scatter(is_image[..., None], feats.reshape(-1, x.shape[-1])), labels, loss_mask
        per_row = is_image.sum(1)
        if count != n or (n and bool((per_row != per_row[0]).any())):
            raise ValueError(f"the text holds {count} image placeholder(s) (model.image_token_id="
                             f"{self.cfg.image_token_id}) for {n} image(s) of {f} features: give one placeholder per "
                             f"image (the same number in every row of a batch), or {f} per image")
        # One placeholder per image: each widened to the image's features, the loss masked there.
        if labels is not None and loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.bool)
        rows, lab_rows, mask_rows, k = [], [], [], 0
        for b in range(tokens.shape[0]):
            pieces, lab, msk, at = [], [], [], 0
            for p in is_image[b].nonzero().flatten().tolist():
                pieces += [x[b, at:p], feats[k]]
                if labels is not None:
                    lab += [labels[b, at:p], labels.new_zeros(f - 1), labels[b, p:p + 1]]
                if loss_mask is not None:
                    msk += [loss_mask[b, at:p], loss_mask.new_zeros(f - 1), loss_mask[b, p:p + 1]]
                at, k = p + 1, k + 1
            pieces.append(x[b, at:])
            rows.append(torch.cat(pieces))
            if labels is not None:
                lab_rows.append(torch.cat([*lab, labels[b, at:]]))
            if loss_mask is not None:
                mask_rows.append(torch.cat([*msk, loss_mask[b, at:]]))
        return (torch.stack(rows), torch.stack(lab_rows) if labels is not None else None,
                torch.stack(mask_rows) if loss_mask is not None else None)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed.weight
        return KVCache(num_layers=self.cfg.num_layers, batch=batch, kv_heads=self.cfg.num_kv_heads,
                       head_dim=self.cfg.head_dim, max_len=max_len, dtype=p.dtype, device=p.device)


def build_llava(cfg: LlavaConfig, spec: ModelSpec) -> Llava:
    return Llava(cfg, spec)


def llava_loss(model: Llava, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross entropy over the answer tokens (``loss_mask``): image and prompt positions
    carry none."""
    return model(batch["tokens"], images=batch.get("images"), labels=batch["labels"],
                 loss_mask=batch.get("loss_mask")), {}


def llava_example_batch(cfg: LlavaConfig, *, batch_size: int, seq_length: int, generator: torch.Generator
                        ) -> dict[str, torch.Tensor]:
    """Rows of ``seq_length`` positions: text, the image's placeholders (already widened), text."""
    f = cfg.image_features
    t = max(seq_length, f + 4)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, t + 1), generator=generator)
    tokens[tokens == cfg.image_token_id] = (cfg.image_token_id + 1) % cfg.vocab_size
    tokens[:, 2:2 + f] = cfg.image_token_id
    labels = tokens[:, 1:].clone()
    loss_mask = torch.ones(batch_size, t)
    loss_mask[:, : 2 + f] = 0
    images = torch.randn(batch_size, cfg.num_channels, cfg.image_size, cfg.image_size, generator=generator)
    return {"tokens": tokens[:, :-1], "labels": labels, "loss_mask": loss_mask, "images": images}


# ------------------------------------------------------------------------------------ throughput


def count_samples(batch: dict[str, Any]) -> int:
    return int(batch["images"].shape[0])


def _image_flops(tower: VisionTower, layers: int, *, pooled: bool) -> float:
    """One image through the first ``layers`` of the vision tower: the patch embedding (a matmul
    per patch) and the layers over 1 + N positions; ``pooled``: the last one for the class token."""
    n = tower.cfg.num_patches
    stack = [LayerFlops.of(layer) for layer in tower.layers[:layers]]
    flops = 6.0 * tower.patch.weight.numel() * n + sum(f(n + 1) for f in stack[:-1])
    return flops + stack[-1](n + 1, kept=1 if pooled else None)


def clip_flops_of_batch(model: CLIP, run: Any) -> Callable[[dict[str, torch.Tensor]], float]:
    """The FLOPs each pair needs: its image to the pooled class token, its text up to its end
    token (nothing after it reaches the pooled position), the last text layer for that position,
    both projections. Padding past a text's end is not counted, even where a batch's longer texts
    make zoo compute it; the B x B similarity matmuls are left out, as PaLM's convention does."""
    image = _image_flops(model.vision, len(model.vision.layers), pooled=True)
    proj = 6.0 * (model.vision_proj.weight.numel() + model.text_proj.weight.numel())
    text = [LayerFlops.of(layer) for layer in model.text.layers]
    eos = model.cfg.eos_token_id

    def flops(batch: dict[str, torch.Tensor]) -> float:
        lengths = (text_ends(batch["tokens"], eos) + 1).tolist()
        return sum(image + proj + sum(f(t) for f in text[:-1]) + text[-1](t, kept=1) for t in lengths)

    return flops


def llava_flops_of_batch(model: Llava, run: Any) -> Callable[[dict[str, torch.Tensor]], float]:
    """The FLOPs each sample needs: its images through the vision layers the features come from
    and the projector, every position of the widened sequence through the decoder, and the last
    layer and the head at the positions the loss reads (`zoo.nn.layers.kept_positions`; where a
    batch's rows read different positions zoo computes their union, counted here per row)."""
    cfg = model.cfg
    image = (_image_flops(model.vision, model.upto, pooled=False)
             + 6.0 * linear_weights(model.projector) * cfg.image_features)
    layers = [LayerFlops.of(layer) for layer in model.layers]
    head = model.head.weight.numel()

    def flops(batch: dict[str, torch.Tensor]) -> float:
        tokens, images = batch["tokens"], batch.get("images")
        n = 0 if images is None else images.shape[0]
        # one placeholder per image is widened to its features (`Llava.insert_images`)
        one_each = n and int((tokens == cfg.image_token_id).sum()) == n
        t = tokens.shape[1] + ((cfg.image_features - 1) * n // tokens.shape[0] if one_each else 0)
        mask = batch.get("loss_mask")
        read = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
        if batch.get("labels") is not None:
            read = read & (batch["labels"] != -100)
        body = sum(f(t) for f in layers[:-1])
        return n * image + sum(body + layers[-1](t, kept=k) + 6.0 * head * k for k in read.sum(1).tolist())

    return flops
