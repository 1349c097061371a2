"""zoo's blocked CPU attention (`zoo_cpu_kernels.attention`) against torch's CPU kernel
(`scaled_dot_product_attention`, which picks its flash-attention kernel on a CPU): forward and
backward time, and the error of each against float64, at the shapes of the benchmarks' models.

Both sides get the same (B, H, T, hd) queries and (B, KV, T, hd) keys and values in the memory
layout the attention layers pass (sequence-major), in bf16 (where `zoo.nn.attention` takes the
blocked path; on a CPU with AMX below 1,024 keys only) and fp32 (where it takes it for causal
attention with grouped KV heads only), causal and not. The median of 7 timed calls after 2 warm-up ones; the same thread count.

    python benchmarks/attention_cpu.py
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

# (name, B, H, KV, T, hd)
SHAPES = [
    ("llama_vs_hf layer", 4, 8, 2, 512, 64),
    ("MHA, T=2048", 1, 16, 16, 2048, 64),
    ("hd 128, T=1024", 2, 8, 8, 1024, 128),
    ("DiT-S/2 (256 tokens)", 8, 6, 6, 256, 64),
]


def median_ms(fn, n: int = 7) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def timed(fn, base: list[torch.Tensor], grad: torch.Tensor, want: list[torch.Tensor], dtype: torch.dtype,
          n: int = 7) -> tuple[float, float]:
    """``fn(q, k, v)`` forward and backward in ``dtype``: (median ms, the largest relative error of
    the output and the three gradients against ``want``, float64's)."""
    xs = [x.detach().to(dtype).clone().requires_grad_(True) for x in base]
    gd = grad.to(dtype)

    def step():
        for x in xs:
            x.grad = None
        fn(*xs).backward(gd)

    out = fn(*xs)
    out.backward(gd)
    got = [out.detach(), *(x.grad for x in xs)]
    err = max(float((a.double() - w).norm() / w.norm()) for a, w in zip(got, want))
    return median_ms(step, n), err


def main() -> None:
    from zoo_cpu_kernels.attention import blocked_attention

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {args.threads} threads, torch {torch.__version__}")
    print(f"{'shape':<22} {'dtype':<8} {'mask':<6} {'torch ms':>9} {'zoo ms':>8} {'speed':>6} {'torch err':>10} {'zoo err':>9}")
    for name, b, h, kv, t, hd in SHAPES:
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(b, t, n, hd, generator=g).transpose(1, 2) for n in (h, kv, kv)]
        grad = torch.randn(b, h, t, hd, generator=g)
        for causal in (True, False):
            ref = [x.detach().double().requires_grad_(True) for x in base]
            out = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=h != kv)
            out.backward(grad.double())
            want = [out.detach(), *(x.grad for x in ref)]
            for dtype in (torch.bfloat16, torch.float32):
                row = {}
                def torch_side(q, k, v, causal=causal, gqa=h != kv):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

                def zoo_side(q, k, v, causal=causal):
                    return blocked_attention(q, k, v, causal=causal)

                for side, fn in (("torch", torch_side), ("zoo", zoo_side)):
                    row[side] = timed(fn, base, grad, want, dtype)
                print(f"{name:<22} {str(dtype)[6:]:<8} {'causal' if causal else 'full':<6} {row['torch'][0]:>9.1f} "
                      f"{row['zoo'][0]:>8.1f} {row['torch'][0] / row['zoo'][0]:>5.2f}x {row['torch'][1]:>10.1e} "
                      f"{row['zoo'][1]:>9.1e}")
    print("# times: forward + backward; err: the largest relative error (norm) of the output and the three "
          "gradients against float64. On a CPU zoo.nn.attention takes the blocked path for bf16/fp16 (over "
          "fewer than 1,024 keys on a CPU with AMX), and for fp32 causal attention with grouped KV heads.")
    windows()


# Sliding windows (Mistral's): (name, B, H, KV, T, hd, window)
WINDOWS = [("T=4096, window 512", 1, 8, 2, 4096, 64, 512), ("T=2048, window 256", 2, 8, 2, 2048, 64, 256)]


def windows() -> None:
    """Sliding-window attention: torch's kernel with the window as a mask (what it can do: every
    query against every key) against the blocked path, which reads each query block's keys from
    its window's start, and against the blocked path's plain causal attention (the work saved)."""
    from zoo_cpu_kernels.attention import blocked_attention

    from zoo.nn.attention_ops import causal_mask

    print(f"\n{'sliding window':<22} {'dtype':<8} {'torch ms':>9} {'zoo ms':>8} {'speed':>6} {'causal ms':>10} "
          f"{'torch err':>10} {'zoo err':>9}")
    for name, b, h, kv, t, hd, w in WINDOWS:
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(b, t, n, hd, generator=g).transpose(1, 2) for n in (h, kv, kv)]
        grad = torch.randn(b, h, t, hd, generator=g)
        mask = causal_mask(t, t, 0, w, "cpu")
        ref = [x.detach().double().requires_grad_(True) for x in base]
        out = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=True)
        out.backward(grad.double())
        want = [out.detach(), *(x.grad for x in ref)]
        for dtype in (torch.bfloat16, torch.float32):
            sides = {"torch": lambda q, k, v, mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                        enable_gqa=True),
                     "zoo": lambda q, k, v, w=w: blocked_attention(q, k, v, causal=True, window=w),
                     "causal": lambda q, k, v: blocked_attention(q, k, v, causal=True)}
            row = {side: timed(fn, base, grad, want, dtype, n=5) for side, fn in sides.items()}
            print(f"{name:<22} {str(dtype)[6:]:<8} {row['torch'][0]:>9.1f} {row['zoo'][0]:>8.1f} "
                  f"{row['torch'][0] / row['zoo'][0]:>5.2f}x {row['causal'][0]:>10.1f} {row['torch'][1]:>10.1e} "
                  f"{row['zoo'][1]:>9.1e}")
    print("# causal ms: the blocked path without the window (every earlier key), for the work the window saves.")
    softcapped()


# Gemma 2's soft-capped attention (cap 50): (name, B, H, KV, T, hd, window)
SOFTCAPPED = [("4x512, hd 64", 4, 8, 4, 512, 64, None), ("2B layer, T=2048", 1, 8, 4, 2048, 256, None),
              ("2B local, T=2048 w512", 1, 8, 4, 2048, 256, 512)]


def softcapped() -> None:
    """Soft-capped scores (``cap tanh(s / cap)``, which no fused kernel of torch's applies): transformers'
    own Gemma 2 eager attention (`eager_attention_forward`, the scores written out in the inputs'
    dtype with an additive mask) against the blocked path and zoo's written-out path (a GPU's)."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    from zoo_cpu_kernels.attention import blocked_attention

    from zoo.nn.attention_ops import _capped_attention, causal_mask

    cap = 50.0
    print(f"\n{'soft-capped (50)':<22} {'dtype':<8} {'HF ms':>9} {'zoo ms':>8} {'speed':>6} {'written ms':>10} "
          f"{'HF err':>10} {'zoo err':>9}")
    for name, b, h, kv, t, hd, w in SOFTCAPPED:
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(b, t, n, hd, generator=g).transpose(1, 2) * 2 for n in (h, kv, kv)]
        grad = torch.randn(b, h, t, hd, generator=g)
        mask = causal_mask(t, t, 0, w, "cpu")
        ref = [x.detach().double().requires_grad_(True) for x in base]
        out = _capped_attention(*ref, mask[None, None], cap)
        out.backward(grad.double())
        want = [out.detach(), *(x.grad for x in ref)]
        module = SimpleNamespace(num_key_value_groups=h // kv, head_dim=hd, training=False)
        for dtype in (torch.bfloat16, torch.float32):
            additive = torch.zeros(t, t, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)[None, None]
            sides = {"hf": lambda q, k, v, a=additive, m=module, hd=hd: eager_attention_forward(
                         m, q, k, v, a, scaling=hd ** -0.5, softcap=cap)[0].transpose(1, 2),
                     "zoo": lambda q, k, v, w=w: blocked_attention(q, k, v, causal=True, window=w, softcap=cap),
                     "written": lambda q, k, v, m=mask[None, None]: _capped_attention(q, k, v, m, cap)}
            row = {side: timed(fn, base, grad, want, dtype, n=5) for side, fn in sides.items()}
            print(f"{name:<22} {str(dtype)[6:]:<8} {row['hf'][0]:>9.1f} {row['zoo'][0]:>8.1f} "
                  f"{row['hf'][0] / row['zoo'][0]:>5.2f}x {row['written'][0]:>10.1f} {row['hf'][1]:>10.1e} "
                  f"{row['zoo'][1]:>9.1e}")
    print("# HF: transformers' Gemma 2 eager attention; zoo: the blocked path (what zoo.nn.attention takes on a CPU);"
          " written: zoo's written-out path (a GPU's, a decoding step's).")


if __name__ == "__main__":
    main()
