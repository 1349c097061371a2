"""Where a zoo DiT training step goes, measured by ablation inside the step.

torch's profiler charges elementwise kernels inside a step 1.5-3x what they cost there (a bf16
tanh-GELU read 2.6 ms a call in a profile and ~1.1 ms by ablation), so this script instead swaps
one part of the step at a time for a trivial op of the same shapes and reports how much faster the
step gets. Every variant's steps alternate in one process (a shared VM's speed drifts 10-15% over
minutes) and each variant's median step is reported; differences below ~2% of a step are noise.

Parts: the adaLN norms (``x + shift``), tanh-GELU forward and its recomputation (ReLU), GELU's
derivative (the incoming gradient), the attention core (``q + v``) and AdamW (skipped). The ablated
steps compute wrong numbers on purpose; only their time is used. The sizes are
`dit_vs_diffusers.py`'s (its `add_size_args`/`diffusers_config`: DiT-S widths, 6 layers, batch 8, 256
tokens) and so is the EDM loss (computed on the patch tokens: the same sum in another order), under
`zoo train`'s process settings and elementwise recomputation.

    python benchmarks/dit_step_ablation.py [--bf16/--fp32] [--rounds 8] [--layers 6] [--batch 8]
"""

from __future__ import annotations

import argparse
import time

import torch
from dit_vs_diffusers import add_size_args, diffusers_config


def main() -> None:
    ap = argparse.ArgumentParser()
    add_size_args(ap)
    ap.add_argument("--rounds", type=int, default=8, help="steps of each variant, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32", dest="bf16", action="store_false", help="float32 instead of bf16 autocast")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from llama_vs_hf import zoo_process_settings

    zoo_process_settings()

    import zoo_dit.model as dit_model
    from zoo_dit import edm
    from zoo_dit.convert import config_from_diffusers
    from zoo_dit.model import DiT, patchify
    from zoo_dit.plugin import DIT

    import zoo.nn as znn
    from zoo.nn import AttentionCore, recompute

    torch.manual_seed(0)
    model = DiT(config_from_diffusers(diffusers_config(args)), DIT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(1)
    b = args.batch
    x0 = torch.randn(b, 4, 32, 32, generator=gen) * 0.5
    sigma = torch.exp(-1.2 + 1.2 * torch.randn(b, generator=gen))[:, None, None, None]
    noise = torch.randn(b, 4, 32, 32, generator=gen)
    labels = torch.randint(0, 1000, (b, 1), generator=gen)
    c_skip, c_out, c_in, c_noise = edm.precondition(sigma, 0.5)
    noisy = x0 + sigma * noise
    toks, pos = (torch.stack(t) for t in zip(*(patchify(img[:, None], 1, 2, 2) for img in c_in * noisy)))
    target = torch.stack([patchify(img[:, None], 1, 2, 2)[0] for img in x0])
    skip_noisy = torch.stack([patchify(img[:, None], 1, 2, 2)[0] for img in c_skip * noisy])
    out_scale, weight = c_out.view(b, 1, 1), edm.loss_weight(sigma, 0.5).view(b, 1, 1)
    state = {"skip_opt": False}

    def step() -> float:
        t0 = time.perf_counter()
        with recompute.scope("elementwise"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                out = model(toks, positions=pos, noise_level=c_noise.view(b, 1), labels=labels)
            loss = (weight * (skip_noisy + out_scale * out.float() - target) ** 2).mean()
        loss.backward()
        if not state["skip_opt"]:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    originals = (dit_model.modulated_layer_norm, znn.ACTIVATIONS["gelu_tanh"], znn._DERIVATIVES["gelu_tanh"],
                 AttentionCore.forward)

    def restore() -> None:
        (dit_model.modulated_layer_norm, znn.ACTIVATIONS["gelu_tanh"], znn._DERIVATIVES["gelu_tanh"],
         AttentionCore.forward) = originals
        state["skip_opt"] = False

    def ablate(part: str) -> None:
        restore()
        if part == "adaLN norms":
            dit_model.modulated_layer_norm = lambda x, shift, scale, eps: x + shift
        elif part == "GELU forward":
            znn.ACTIVATIONS["gelu_tanh"] = torch.relu
        elif part == "GELU derivative":
            znn._DERIVATIVES["gelu_tanh"] = lambda g, x: g
        elif part == "attention core":
            AttentionCore.forward = lambda self, q, k, v, **kw: q + v
        elif part == "AdamW":
            state["skip_opt"] = True

    parts = ["full step", "adaLN norms", "GELU forward", "GELU derivative", "attention core", "AdamW"]
    times: dict[str, list[float]] = {p: [] for p in parts}
    for part in parts:  # warm-ups: zoo-cpu-kernels compiles its kernels at the first step
        ablate(part)
        step()
        step()
    for i in range(args.rounds):
        for part in parts if i % 2 else parts[::-1]:
            ablate(part)
            times[part].append(step())
    restore()
    med = {p: sorted(t)[len(t) // 2] * 1e3 for p, t in times.items()}
    print(f"DiT {args.layers} layers x {args.hidden}, batch {b} x 256 tokens, {'bf16 autocast' if args.bf16 else 'fp32'}, "
          f"{args.threads} threads, torch {torch.__version__}; median of {args.rounds} alternating steps each")
    print(f"{'without':18s} {'step ms':>8s} {'part costs':>11s}")
    for p in parts:
        cost = "" if p == "full step" else f"{med['full step'] - med[p]:8.1f} ms"
        print(f"{p:18s} {med[p]:8.1f} {cost:>11s}")


if __name__ == "__main__":
    main()
