"""One decoder for GPT-2 and LLaMA; the layer spec picks norm, positions, biases and MLP.

Shapes: B batch, T sequence, D hidden, V vocab. Attention and MLP are the core's shared decoder
layers (`zoo.nn.layers`: q|k|v fused per KV group, [gate; up] fused). Parallelism, recomputation
and precision are applied from outside by the core.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zoo.nn import KVCache, RMSNorm, Rotary, linear_cross_entropy, make_norm, soft_cap
from zoo.nn.layers import TransformerLayer, kept_positions, run_layers, take_positions
from zoo.nn.linear import LMHead, TokenEmbedding
from zoo.spec import AttentionSpec, BlockSpec, ModelSpec
from zoo_gpt.plugin import GemmaConfig, GPTConfig


class Block(TransformerLayer):
    def __init__(self, cfg: GPTConfig, spec: BlockSpec, layer: int) -> None:
        super().__init__(spec, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, ffn_hidden=cfg.ffn_hidden_size, eps=cfg.norm_eps, layer=layer,
                         window=cfg.window(layer))


class GPT(nn.Module):
    # The layer spec's block symbol (a subclass with other blocks overrides it, `layer_symbols` and `make_block`)
    symbol = "T"
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2's final soft-capping)

    def __init__(self, cfg: GPTConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.cfg = cfg
        block = spec.block_for(self.symbol)
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.pos_embed = nn.Embedding(cfg.max_seq_length, cfg.hidden_size) if spec.positions == "learned" else None
        uses_rope = isinstance(block.mixer, AttentionSpec) and block.mixer.positions == "rope"
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) if uses_rope else None
        symbols = self.layer_symbols(cfg)
        self.layers = nn.ModuleList(self.make_block(cfg, spec.block_for(s), i) for i, s in enumerate(symbols))
        assert spec.final_norm is not None
        self.norm = make_norm(spec.final_norm, cfg.hidden_size, cfg.norm_eps)
        self.head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self._init(cfg)

    def layer_symbols(self, cfg: Any) -> str:
        """The block symbol of each layer."""
        return self.symbol * cfg.num_layers

    def make_block(self, cfg: GPTConfig, spec: BlockSpec, layer: int) -> nn.Module:
        return Block(cfg, spec, layer)

    def _init(self, cfg: GPTConfig) -> None:
        # GPT-2 initialisation; residual output projections scaled by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.num_layers))
            else:
                nn.init.normal_(p, std=cfg.init_std)
        for m in self.modules():  # a zero-centred norm's weight is its scale - 1
            if isinstance(m, RMSNorm) and m.zero_centered:
                nn.init.zeros_(m.weight)

    def forward(self, tokens: torch.Tensor, *, cache: KVCache | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V); with ``cache``, T new tokens after ``cache.pos`` old ones.

        With ``labels`` (B, T) it returns the mean next-token cross entropy instead, computed
        without materialising the logits (`zoo.nn.linear_cross_entropy`). ``position_ids`` (B, T)
        restart positions per packed document; ``segment_ids`` (B, T) keep attention inside them.
        """
        x, rope = self.embed_input(tokens, cache, position_ids)
        keep = self.loss_positions(labels, loss_mask, cache)
        x = run_layers(self.layers, x, rope, cache, segment_ids, keep=keep)
        if cache is not None:
            cache.pos += tokens.shape[1]
        if self.head is None:  # not the last pipeline stage: hand the hidden state on
            return x
        return self.output(x, labels, loss_mask, keep)

    def loss_positions(self, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                       cache: KVCache | None) -> torch.Tensor | None:
        """On the last stage, when the loss mask drops most positions (a prompt, an image), the
        positions it reads: the last layer and the head compute only those."""
        if self.head is None or labels is None or cache is not None:
            return None
        return kept_positions(loss_mask)

    def embed_input(self, tokens: torch.Tensor, cache: KVCache | None, position_ids: torch.Tensor | None
                    ) -> tuple[torch.Tensor, Any]:
        """The blocks' input and rotary tables: (B, T, D) and `rope_tables`."""
        t = tokens.shape[1]
        start = cache.pos if cache is not None else 0
        if start + t > self.cfg.max_seq_length:
            raise ValueError(f"{start + t} positions exceed the model's context of {self.cfg.max_seq_length}")
        positions = position_ids if position_ids is not None else torch.arange(start, start + t, device=tokens.device)
        # A later pipeline stage has no embedding and receives the hidden state instead of tokens.
        x = self.embed(tokens) if self.embed is not None else tokens  # (B, T, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        return x, self.rope_tables(positions)

    def rope_tables(self, positions: torch.Tensor) -> Any:
        """What the blocks rotate with at ``positions``: (cos, sin), or None without RoPE."""
        return self.rotary(positions) if self.rotary is not None else None

    def output(self, x: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and head: logits, or with ``labels`` the mean cross entropy (no logits kept).
        ``keep``: x holds only these positions (`loss_positions`), so labels and mask are cut alike."""
        x = self.norm(x)
        if keep is not None:
            labels, loss_mask = take_positions(labels, keep), take_positions(loss_mask, keep)
        if labels is not None:
            mask = loss_mask.flatten().bool() if loss_mask is not None else None
            return linear_cross_entropy(x.flatten(0, 1), self.head, labels.flatten(), mask, softcap=self.logit_softcap)
        logits = self.head(x)
        return logits if self.logit_softcap is None else soft_cap(logits, self.logit_softcap).to(logits.dtype)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed.weight
        return KVCache(num_layers=self.cfg.num_layers, batch=batch, kv_heads=self.cfg.num_kv_heads,
                       head_dim=self.cfg.head_dim, max_len=max_len, dtype=p.dtype, device=p.device,
                       windows=[self.cfg.window(i) for i in range(self.cfg.num_layers)])


class GemmaBlock(TransformerLayer):
    """A Gemma 2/3 layer: sliding-window layers rotate with the local RoPE base, the others with the
    global one (``rope`` holds both: ``{True: local, False: global}``); Gemma 2's soft-capped scores."""

    def __init__(self, cfg: GemmaConfig, spec: BlockSpec, layer: int) -> None:
        qpas = cfg.query_pre_attn_scalar
        super().__init__(spec, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, ffn_hidden=cfg.ffn_hidden_size, eps=cfg.norm_eps, layer=layer,
                         window=cfg.window(layer), scale=None if qpas is None else qpas ** -0.5,
                         softcap=cfg.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, rope: Any = None, cache: KVCache | None = None,
                segment_ids: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, rope[self.attn.window is not None], cache, segment_ids, keep)


class Gemma(GPT):
    """Gemma 2's and 3's decoder: GPT's with the embeddings scaled by sqrt(hidden) (rounded to their
    dtype, as Gemma does), two rotary tables, the global layers' and the sliding-window layers' (Gemma
    2 has one table, its scaling included: it serves both), and Gemma 2's soft-capped logits."""

    def __init__(self, cfg: GemmaConfig, spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        same = cfg.rope_local_theta is None or (cfg.rope_local_theta == cfg.rope_theta and not cfg.rope_scaling)
        self.rotary_local = None if same else Rotary(cfg.head_dim, cfg.rope_local_theta, None)
        self.logit_softcap = cfg.final_logit_softcapping

    def make_block(self, cfg: GemmaConfig, spec: BlockSpec, layer: int) -> nn.Module:
        return GemmaBlock(cfg, spec, layer)

    def embed_input(self, tokens: torch.Tensor, cache: KVCache | None, position_ids: torch.Tensor | None
                    ) -> tuple[torch.Tensor, Any]:
        x, rope = super().embed_input(tokens, cache, position_ids)
        if self.embed is not None:  # (a later pipeline stage receives the scaled hidden state)
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        return x, rope

    def rope_tables(self, positions: torch.Tensor) -> dict[bool, Any]:
        """Both tables, keyed by whether the layer has a window (`GemmaBlock` picks its own)."""
        glob = super().rope_tables(positions)
        return {False: glob, True: glob if self.rotary_local is None else self.rotary_local(positions)}


def build(cfg: GPTConfig, spec: ModelSpec) -> GPT:
    return GPT(cfg, spec)


def build_gemma(cfg: GemmaConfig, spec: ModelSpec) -> Gemma:
    return Gemma(cfg, spec)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross entropy, averaged over the tokens the loss mask keeps."""
    return model(batch["tokens"], labels=batch["labels"], loss_mask=batch.get("loss_mask"),
                 position_ids=batch.get("position_ids"), segment_ids=batch.get("segment_ids")), {}


def example_batch(cfg: GPTConfig, *, batch_size: int, seq_length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    data = torch.randint(0, cfg.vocab_size, (batch_size, seq_length + 1), generator=generator)
    return {"tokens": data[:, :-1], "labels": data[:, 1:]}


def generate(model: GPT, cfg: GPTConfig, **request: Any) -> torch.Tensor:
    from zoo.nn.sampling import generate_tokens

    return generate_tokens(model, context=cfg.max_seq_length, **request)
