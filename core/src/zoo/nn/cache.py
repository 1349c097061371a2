"""Key/value buffers for incremental decoding (`KVCache`), which the attention layers fill and read
through `update` and the families create with ``new_cache``."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """Per-layer key/value buffers for incremental decoding: (B, kv_heads, max_len, hd) each.

    A layer with a sliding window (``windows[layer]`` = W) keeps only the W - 1 positions before the
    newest, all that a later query of it can see besides itself: Mistral 7B's 4,096 of a 32,768-token
    context, five of Gemma 3's six layers. ``update`` returns the keys and values a layer attends to
    in position order, the new ones last, so the queries sit ``keys - new`` positions into them."""

    def __init__(self, *, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, windows: Sequence[int | None] | None = None) -> None:
        self.windows = list(windows) if windows is not None else [None] * num_layers
        sizes = [max_len if w is None else min(max_len, w - 1) for w in self.windows]
        self.k = [torch.zeros(batch, kv_heads, n, head_dim, dtype=dtype, device=device) for n in sizes]
        self.v = [torch.zeros(batch, kv_heads, n, head_dim, dtype=dtype, device=device) for n in sizes]
        self.kept = [0] * num_layers  # positions a windowed layer's buffer holds (its last ones)
        self.max_len = max_len
        self.pos = 0  # tokens already in the cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        end = self.pos + t
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} requested")
        if self.windows[layer] is None:
            self.k[layer][:, :, self.pos:end] = k
            self.v[layer][:, :, self.pos:end] = v
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        kept = self.kept[layer]
        ks = torch.cat([self.k[layer][:, :, :kept], k], 2)  # (copies: the buffer is rewritten below)
        vs = torch.cat([self.v[layer][:, :, :kept], v], 2)
        n = min(self.k[layer].shape[2], ks.shape[2])
        self.k[layer][:, :, :n] = ks[:, :, ks.shape[2] - n:]
        self.v[layer][:, :, :n] = vs[:, :, vs.shape[2] - n:]
        self.kept[layer] = n
        return ks, vs


__all__ = ["KVCache"]
