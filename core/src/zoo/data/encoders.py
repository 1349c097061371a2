"""Encoders that turn media into what a diffusion model trains on: caption embeddings (a
transformers T5 encoder) and image latents (a diffusers ``AutoencoderKL``), both loaded from a
local directory only (no download). `zoo prepare images|video --vae DIR --text-encoder DIR`
stores their outputs as ``latent.npy`` / ``t5.npy`` parts; a DiT trained on such latents decodes
its samples through the same VAE.

``TextEncoder(path)`` loads a T5 encoder and its tokenizer (``local_files_only``); without a path
it builds the default: a tiny byte-level T5 encoder (ByT5's tokenizer needs no vocabulary file)
initialised from a fixed seed, so the built-in datasets' captions are embedded the same way
everywhere through the same code as a real encoder. Embeddings keep each caption's true length
(DFM pads them to 512 and trains on the padding).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DEFAULT_SEED = 20261123  # the default encoder's weights follow from this seed alone


class TextEncoder:
    def __init__(self, path: str | None = None) -> None:
        from transformers import T5EncoderModel

        if path is not None:
            from transformers import AutoTokenizer

            self.tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = T5EncoderModel.from_pretrained(path, local_files_only=True).eval()
            self.name = str(path)
        else:
            from transformers import ByT5Tokenizer, T5Config

            self.tokenizer = ByT5Tokenizer()
            config = T5Config(vocab_size=384, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                              dropout_rate=0.0, feed_forward_proj="gated-gelu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(DEFAULT_SEED)
                self.model = T5EncoderModel(config).eval()
            self.name = f"tiny-byt5-seed{DEFAULT_SEED}"
        self.dim = int(self.model.config.d_model)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> list[np.ndarray]:
        """One ``(length, dim)`` float32 array per caption (its own tokens, no padding)."""
        tokens = self.tokenizer(captions, padding=True, return_tensors="pt")
        hidden = self.model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
        lengths = tokens["attention_mask"].sum(1).tolist()
        return [hidden[i, :n].float().numpy().copy() for i, n in enumerate(lengths)]


class ImageVAE:
    """A diffusers ``AutoencoderKL`` from a local directory: ``encode`` pixels in [-1, 1]
    ``(N, 3, H, W)`` to latents ``(N, C, H/f, W/f)`` scaled by its ``scaling_factor`` (the mean
    of the posterior: the same pixels always give the same latents), ``decode`` back."""

    def __init__(self, path: str) -> None:
        try:
            from diffusers import AutoencoderKL
        except ImportError as e:
            raise ImportError("--vae needs diffusers: pip install diffusers") from e
        try:
            # (low_cpu_mem_usage=False: without accelerate installed diffusers would warn, then do this)
            self.model = AutoencoderKL.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False).eval()
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a diffusers AutoencoderKL directory ({' '.join(str(e).split())[:200]})") from None
        cfg = self.model.config
        self.path = str(path)
        self.factor = 2 ** (len(cfg.block_out_channels) - 1)  # each down block but the last halves H and W
        self.channels = int(cfg.latent_channels)
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift = float(getattr(cfg, "shift_factor", None) or 0.0)  # (SD3/Flux VAEs shift before scaling)
        self.in_channels = int(cfg.in_channels)

    def check_size(self, height: int, width: int, where: str) -> None:
        if height % self.factor or width % self.factor:
            raise ValueError(f"{where}: {height}x{width} pixels do not divide by the VAE's downsampling factor "
                             f"{self.factor} ({self.path})")

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[1] != self.in_channels:
            pixels = pixels.expand(-1, self.in_channels, -1, -1) if pixels.shape[1] == 1 else pixels
        return (self.model.encode(pixels.float()).latent_dist.mean - self.shift) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.model.decode(latents.float() / self.scaling_factor + self.shift).sample


__all__ = ["DEFAULT_SEED", "ImageVAE", "TextEncoder"]
