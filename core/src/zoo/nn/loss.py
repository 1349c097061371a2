"""The language-model loss without its logits: `linear_cross_entropy` (re-exported by `zoo.nn`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from zoo import kernels

# Elements of one chunk of logits in `linear_cross_entropy`. On a CPU a chunk's float32 logits
# stay in cache (16 MB); a GPU wants few, large products (a 32-row chunk of a 128k vocabulary
# keeps its tensor cores idle and launches 256 products a step), and 256 MB is little beside an
# activation memory of tens of GB.
_LOGITS_BLOCK = 1 << 22
_LOGITS_BLOCK_ACCELERATOR = 1 << 26


@functools.cache
def _accumulates_in_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``addmm(out_dtype=float32, out=acc)`` adds a bf16/fp16 product into a float32
    accumulator in place on this device (cuBLAS does; the CPU build has no such kernel): then the
    weight gradient needs no (V, D) temporary per chunk."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        acc = torch.ones(2, 2, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in float32: Gemma 2's soft-capping of logits (attention paths cap
    their scores inside their own kernels, which keep the slope for backward)."""
    return torch.tanh(x.float() / cap) * cap


class _LinearCrossEntropyFn(torch.autograd.Function):
    """Mean cross entropy of ``hidden @ weight.T`` without keeping the logits.

    The (tokens x vocab) logits are the largest activation of a language model. They are computed
    chunk by chunk; each chunk's gradients with respect to ``hidden`` and ``weight`` are formed in
    the forward pass (softmax minus one-hot), so backward only scales them by the incoming
    gradient: no logits, no log-softmax and no recomputation are kept (the idea of Liger-Kernel's
    fused linear cross entropy, here in plain PyTorch).

    In fp16 those gradients are formed before the loss scale reaches them: ``(softmax - one_hot) /
    tokens`` would sit in fp16's subnormal range (a probability of 1e-3 over 256 tokens is 4e-6),
    so they are kept per token (|d| <= 1) and divided by the token count in float32, in backward
    together with the incoming gradient (the loss scale, which exceeds fp16's largest number
    whenever it is above 65,504: torch's initial 2^16 is).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                mask: torch.Tensor, chunk: int, need: bool, softcap: float | None) -> torch.Tensor:
        k = kernels.active()  # (the whole gradient is computed here: backward only scales it)
        n = hidden.shape[0]
        # The chunk's float32 logits and their log-softmax are the loss's transient peak (the last
        # layer's activations are all still live then): rows are capped so each is ~16 MB, whatever
        # the vocabulary (1,024 rows of a 128k vocabulary would be 1 GB).
        block = _LOGITS_BLOCK if hidden.device.type == "cpu" else _LOGITS_BLOCK_ACCELERATOR
        chunk = max(1, min(chunk, block // weight.shape[0]))
        denom = mask.sum().clamp(min=1)
        per_token = hidden.dtype == torch.float16  # (see above: fp16's range)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.to(hidden.dtype)
        in_place = (need and hidden.dtype != torch.float32 and hidden.device.type != "cpu"
                    and _accumulates_in_float32(hidden.device.type, hidden.dtype))
        for s in range(0, n, chunk):
            h = hidden[s:s + chunk]
            logits = k.call("mm", h, w.t())  # (c, V)
            lab = labels[s:s + chunk]
            m = mask[s:s + chunk].float()
            if not need:
                if softcap is not None:
                    logits = soft_cap(logits, softcap)  # (Gemma 2's final soft-capping)
                total -= (torch.log_softmax(logits.float(), -1).gather(1, lab[:, None]).squeeze(1) * m).sum()
                continue
            # the rows' losses, and d loss / d logits in w's dtype (one cast for both GEMMs); with a
            # soft cap, those of the capped logits, the gradient taken back through the cap
            nll, d = k.call("cross_entropy_grad", logits, lab, m if per_token else m / denom, softcap)
            total += (nll * m).sum()
            k.call("mm", d, w, grad_h[s:s + chunk])
            if h.dtype == torch.float32 and not k.call("mm_keeps_shapes", h):  # no (V, D) temporary
                torch.addmm(grad_w, d.t(), h, out=grad_w)  # (addmm_ would be missed by FLOP counters)
            elif in_place:
                torch.addmm(grad_w, d.t(), h, out_dtype=torch.float32, out=grad_w)
            else:
                grad_w += k.call("mm", d.t(), h).float()
        inv = (1.0 / denom.float()) if per_token else None
        if need:
            if per_token:
                grad_w.mul_(inv)
            ctx.save_for_backward(grad_h, grad_w, inv)
        ctx.weight_dtype = weight.dtype
        return total / denom

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w, inv = ctx.saved_tensors
        # fp16: grad_h per token, scaled in float32 (a value the scale takes past fp16's range is a
        # real overflow, inf, for the loss scale to see)
        dh = grad_h * grad.to(grad_h.dtype) if inv is None else (grad_h.float() * (grad * inv)).to(grad_h.dtype)
        # In place: the saved fp32 (V, D) gradient is used once, and a scaled copy would double the
        # largest transient of the step (1.6 GB for a 128k x 3k vocabulary). A second backward
        # (retain_graph) is refused by autograd's version check on the saved tensor.
        return dh, grad_w.mul_(grad).to(ctx.weight_dtype), None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, head: nn.Module | torch.Tensor, labels: torch.Tensor,
                         loss_mask: torch.Tensor | None = None, *, chunk: int = 1024,
                         softcap: float | None = None) -> torch.Tensor:
    """Mean next-token cross entropy of ``hidden (N, D) @ weight (V, D).T`` over unmasked tokens,
    ``weight`` being the LM ``head`` (an `nn.Linear`, or its weight).

    Equal to ``F.cross_entropy(hidden @ weight.T, labels)`` (float32 softmax) with the peak
    memory of one ``(chunk, V)`` block instead of the whole ``(N, V)`` logits. When tensor
    parallelism made the head a vocabulary-parallel `ColumnParallelLinear`, the logits stay split
    over its group and the loss is computed vocab-parallel. ``softcap``: the logits are
    ``softcap * tanh(logits / softcap)`` (Gemma 2's final logit soft-capping).
    """
    from zoo.parallel.cuda_graphs import capturing
    from zoo.parallel.tensor_parallel import ColumnParallelLinear

    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.bool)
    elif not capturing(loss_mask):  # (a CUDA graph cannot count the kept rows: it runs them all, masked)
        # Rows the mask drops carry neither loss nor gradient, so the head runs on the kept rows
        # only: a LLaVA row is mostly image and prompt positions, an SFT row mostly prompt.
        kept = loss_mask.nonzero().flatten()
        if kept.numel() < 0.75 * loss_mask.numel():
            hidden, labels, loss_mask = hidden[kept], labels[kept], loss_mask[kept]
    if isinstance(head, ColumnParallelLinear) and head.vocab and head.shard.size > 1:
        from zoo.parallel import comm
        from zoo.parallel.tensor_parallel import vocab_parallel_cross_entropy

        logits = comm.copy_to(hidden, head.group) @ head.weight.t()
        if softcap is not None:  # (elementwise: each rank caps its share of the vocabulary)
            logits = soft_cap(logits, softcap)
        per_token = vocab_parallel_cross_entropy(logits, labels, head.group)
        mask = loss_mask.to(per_token.dtype)
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    weight = head.weight if isinstance(head, nn.Module) else head
    if torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    # Gradients are formed in forward only when backward can follow (never under no_grad/eval).
    need = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropyFn.apply(hidden, weight, labels, loss_mask, chunk, need, softcap)
