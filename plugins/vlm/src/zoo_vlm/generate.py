"""What `zoo generate` does with a VLM: CLIP's zero-shot classification of images against label
texts, and LLaVA's answer to a question about an image (greedy or sampled, KV-cached)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.data.tokenizer import Tokenizer
from zoo.errors import UsageError
from zoo_vlm.data import CLIPTaskEncoder, image_tensor
from zoo_vlm.model import CLIP, Llava
from zoo_vlm.plugin import CLIPConfig, LlavaConfig, VisionFields


def read_images(paths: list[str], cfg: VisionFields) -> torch.Tensor:
    """Image files -> (n, C, S, S), normalised as in training. An image of another size is brought
    to the tower's S x S as CLIP's image processor does it: the shorter side resized to S (bicubic,
    the longer in proportion, rounded down), then the centre S x S cut out; a transparent image is
    laid over white first. (Training data of the
    wrong size is refused instead, `image_tensor`: a dataset should hold what the model was set up for.)"""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise UsageError(f"--image {p}: no such file")
        try:
            with Image.open(path) as img:
                if img.mode not in ("L", "RGB"):  # transparency over white, as the processor (and a viewer) shows it
                    rgba = img.convert("RGBA")
                    img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")
                w, h = img.size
                s = cfg.image_size
                if (w, h) != (s, s):
                    short, long = min(w, h), max(w, h)
                    size = (s, int(s * long / short)) if w <= h else (int(s * long / short), s)
                    img = img.resize(size, Image.Resampling.BICUBIC)
                    left, top = (img.size[0] - s) // 2, (img.size[1] - s) // 2
                    img = img.crop((left, top, left + s, top + s))
                pixels = np.asarray(img, dtype=np.uint8)
        except (OSError, UnidentifiedImageError) as e:
            raise UsageError(f"--image {p}: not an image Pillow can read ({e})") from None
        x = torch.from_numpy(pixels.astype(np.float32) / 255.0)
        x = x[None] if x.dim() == 2 else x.permute(2, 0, 1)
        try:
            out.append(image_tensor(x, cfg, str(path)))
        except ValueError as e:
            raise UsageError(str(e)) from None
    return torch.stack(out)


@torch.no_grad()
def zero_shot(model: CLIP, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """(n, C, S, S) images against (k, T) label texts -> (n, k) probabilities (softmax over the
    labels of the scaled cosine similarities, as the paper's zero-shot classifier)."""
    model.eval()
    dev = model.logit_scale.device
    scale = model.logit_scale.clamp(max=math.log(model.cfg.logit_scale_max)).exp()
    return (scale * model.embed_images(images.to(dev)) @ model.embed_texts(texts.to(dev)).t()).softmax(-1).cpu()


def classify(model: CLIP, cfg: CLIPConfig, *, images: list[str] | None = None, labels: list[str] | None = None,
             tokenizer: Tokenizer | None = None, **_: Any) -> str:
    if not images or not labels or tokenizer is None:
        raise UsageError("CLIP classifies: give --image FILE [FILE ...] and --labels 'a 0,a 1,...'")
    enc = CLIPTaskEncoder(cfg, tokenizer)
    try:
        texts = torch.stack([enc.text_ids(label, f"label {label!r}") for label in labels])
    except ValueError as e:
        raise UsageError(str(e)) from None
    probs = zero_shot(model, read_images(images, cfg), texts)
    lines = []
    for path, p in zip(images, probs):
        best = int(p.argmax())
        lines.append(f"{path}: {labels[best]} (p={float(p[best]):.2f})")
    return "\n".join(lines)


class _WithImages(nn.Module):
    """The LLaVA model as `zoo.nn.sampling.generate_tokens` calls a decoder: images go in with the
    first call (the prompt), and the cache is sized for their features."""

    def __init__(self, model: Llava, images: torch.Tensor) -> None:
        super().__init__()
        self.model, self.images = model, images.to(next(model.parameters()).device)
        self.extra = images.shape[0] * (model.cfg.image_features - 1)

    def forward(self, tokens: torch.Tensor, cache: Any = None) -> torch.Tensor:
        first = cache is None or cache.pos == 0
        return self.model(tokens, images=self.images if first else None, cache=cache)

    def new_cache(self, batch: int, max_len: int) -> Any:
        return self.model.new_cache(batch, max_len + self.extra)


@torch.no_grad()
def generate_answer(model: Llava, cfg: LlavaConfig, images: torch.Tensor, prompt_ids: list[int], *,
                    max_new_tokens: int, eos_id: int, temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, seed: int = 0, use_cache: bool = True) -> list[int]:
    """The new tokens after a prompt holding one placeholder per image (end token excluded)."""
    from zoo.nn.sampling import generate_tokens

    wrapped = _WithImages(model, images)
    out = generate_tokens(wrapped, prompt=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                          context=cfg.max_seq_length - wrapped.extra, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, use_cache=use_cache, eos_id=eos_id)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(eos_id)] if eos_id in new else new


def answer(model: Llava, cfg: LlavaConfig, *, images: list[str] | None = None, prompt: str | None = None,
           tokenizer: Tokenizer | None = None, max_new_tokens: int = 16, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0, use_cache: bool = True,
           **_: Any) -> str:
    if not images or prompt is None or tokenizer is None:
        raise UsageError("LLaVA answers a question about an image: give --image FILE and --prompt 'What digit is this?'")
    if len(images) != 1:
        raise UsageError(f"{len(images)} images: the prompt template holds one placeholder")
    ids = tokenizer.encode(cfg.prompt_template.format(question=prompt))
    new = generate_answer(model, cfg, read_images(images, cfg), ids, max_new_tokens=max_new_tokens,
                          eos_id=tokenizer.eod_id, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          use_cache=use_cache)
    return tokenizer.decode(new).strip()
