"""Autoregressive sampling for language models: greedy, temperature, top-k, top-p, KV cache.

Works with any model whose ``forward(tokens, cache=...)`` returns logits ``(B, T, V)`` and which
offers ``new_cache(batch, max_len)``; without a cache the whole sequence is re-run every step
(the reference the cached path is tested against).
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.errors import UsageError


def filter_logits(logits: torch.Tensor, *, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Mask logits outside the top-k and outside the smallest set with probability >= top_p."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first is always kept).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


@torch.no_grad()
def generate_tokens(
    model: Any,
    *,
    prompt: torch.Tensor,
    max_new_tokens: int,
    context: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Return ``prompt`` (B, T) followed by up to ``max_new_tokens`` sampled tokens, on the prompt's
    device; the model runs where its parameters are.

    ``temperature=0`` is greedy decoding. A prompt that does not fit the model's ``context`` with
    at least one new token is an error, not a silent truncation; so is a setting outside its meaning
    (a negative temperature would decode greedily, a top-p above 1 or of 0 or a negative top-k filter
    nothing); a top-k of 0 is no top-k filter, as in Hugging Face's `generate`.
    """
    if not temperature >= 0:  # (NaN too)
        raise UsageError(f"sampling: temperature={temperature:g} must be at least 0 (0 decodes greedily)")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"sampling: top_p={top_p:g} must be in (0, 1] (1 keeps every token)")
    if top_k is not None and top_k < 0:
        raise UsageError(f"sampling: top_k={top_k} must be at least 0 (0: no top-k filter)")
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise UsageError("the prompt encodes to no tokens")
    t = prompt.shape[1]
    if t >= context:
        raise UsageError(f"the prompt is {t} tokens; the model's context is {context} (leave room for new tokens)")
    max_new_tokens = min(max_new_tokens, context - t)
    device, given = next(model.parameters()).device, prompt.device  # (the tokens go back where the prompt was)
    prompt = prompt.to(device)
    # Tokens are drawn on the CPU whatever the model's device: a seed gives the same text on a GPU
    # (one host read a token, which the end-of-text check makes anyway).
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    was_training = model.training
    model.eval()
    out = prompt
    cache = model.new_cache(prompt.shape[0], t + max_new_tokens) if use_cache else None
    step_input = prompt
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache) if use_cache else model(out)
        last = logits[:, -1].float()
        if temperature <= 0:
            nxt = last.argmax(-1, keepdim=True)
        else:
            probs = filter_logits(last / temperature, top_k=top_k, top_p=top_p).softmax(-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(device)
        if eos_id is not None:
            nxt = torch.where(finished[:, None], torch.full_like(nxt, eos_id), nxt)
            finished |= nxt[:, 0] == eos_id
        out = torch.cat([out, nxt], dim=1)
        step_input = nxt
        if eos_id is not None and bool(finished.all()):
            break
    model.train(was_training)
    return out.to(given)
