"""Caption embeddings for text-conditioned DiTs, through transformers' T5 encoder.

``TextEncoder(path)`` loads a T5 encoder and its tokenizer from a local directory (no download:
``local_files_only``); without a path it builds the default: a tiny byte-level T5 encoder (ByT5's
tokenizer needs no vocabulary file) initialised from a fixed seed, so the built-in datasets' captions
are embedded the same way everywhere through the same code as a real encoder. Embeddings keep each
caption's true length (DFM pads them to 512 and trains on the padding).
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


__all__ = ["DEFAULT_SEED", "TextEncoder"]
