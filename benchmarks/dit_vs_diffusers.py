"""zoo's DiT against diffusers' DiTTransformer2DModel: same config, same EDM loss, same threads.

Both models are built from the same sizes (default: DiT-S/2 widths at 6 layers, 4x32x32 latents,
1000 classes) with the same weights (converted by `zoo_dit.convert`). Each training step draws the
same batch, noise levels and noise, computes EDM's preconditioned loss and runs backward and an
AdamW step; the two sides' steps alternate after two warm-ups. Reported: training images/s (of
the median step; and the median of the rounds' own ratios, each round one step of each side back
to back), the peak bytes autograd keeps for backward (every tensor saved by the forward, counted once per storage, parameters aside: the activations' live peak on any
device; a bf16 copy of a weight that autocast saves counts, the float32 weight itself does not), and
sampling time for 18 Heun steps (35 network evaluations) with batched classifier-free guidance
(each side's faster of two runs, in the order diffusers, zoo, zoo, diffusers).
fp32 and bf16 autocast. Both sides run in this one process, under `zoo train`'s allocator setting
(`train.cpu_malloc`: freed memory kept for reuse), which therefore helps both.

    python benchmarks/dit_vs_diffusers.py [--layers 6] [--batch 8] [--steps 9] [--threads 2] [--bf16]
    python benchmarks/dit_vs_diffusers.py --device cuda --batch 64   # on a GPU (CUDA autocast, SDPA on both sides)

On a GPU zoo's step is also timed as `train.cuda_graph=true` runs it (forward and backward replayed
from a CUDA graph, `zoo.parallel.cuda_graphs`; after the alternating steps, on the same weights).
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable

import torch


def saved_bytes(fn, recompute: bool, params: set[int]) -> tuple[object, int]:
    """Run ``fn()`` and count the bytes of the distinct storages autograd saved for backward, the
    parameters' own (``params``: their storages) aside, which the model holds whatever is saved;
    with ``recompute``, under zoo's elementwise recomputation (what `zoo train` runs by default),
    whose recipes hold no tensor of their own."""
    from zoo.nn import recompute as rc

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        packed = rc._pack(t) if recompute else t
        if isinstance(packed, torch.Tensor) and packed.untyped_storage().data_ptr() not in params:
            st = packed.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return packed

    with rc.scope("elementwise" if recompute else "none"), \
            torch.autograd.graph.saved_tensors_hooks(pack, rc._unpack):
        out = fn()
    return out, sum(seen.values())


def add_size_args(ap: argparse.ArgumentParser) -> None:
    """The model and batch sizes (DiT-S widths at 6 layers, batch 8; `dit_step_ablation.py` too)."""
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)


def diffusers_config(args: argparse.Namespace) -> dict:
    """`DiTTransformer2DModel`'s config for those sizes: 4x32x32 latents, patch 2, 1000 classes."""
    return {"num_attention_heads": args.heads, "attention_head_dim": args.hidden // args.heads, "in_channels": 4,
            "out_channels": 4, "num_layers": args.layers, "sample_size": 32, "patch_size": 2,
            "num_embeds_ada_norm": 1000, "norm_eps": 1e-6}


def build_pair(args: argparse.Namespace, dev: torch.device) -> types.SimpleNamespace:
    """diffusers' model and zoo's with the same weights on ``dev``, one fixed batch (args.batch
    images, noise levels, noise, labels) and, for each side, the forward `edm_loss` takes:
    ``theirs, ours, initial`` (diffusers' initial state), ``cfg, pos, edm_loss(forward, dtype),
    f_theirs, f_ours``. (`benchmarks/step_profile.py` builds the same pair.)"""
    from diffusers import DiTTransformer2DModel
    from zoo_dit import edm
    from zoo_dit.convert import config_from_diffusers, from_diffusers
    from zoo_dit.model import DiT, patchify, unpatchify
    from zoo_dit.plugin import DIT

    dconf = diffusers_config(args)
    torch.manual_seed(0)
    theirs = DiTTransformer2DModel(**dconf)
    with torch.no_grad():  # one shared timestep/class embedder, as in every converted checkpoint
        for blk in theirs.transformer_blocks[1:]:
            blk.norm1.emb.load_state_dict(theirs.transformer_blocks[0].norm1.emb.state_dict())
    initial = {k: v.clone() for k, v in theirs.state_dict().items()}
    cfg = config_from_diffusers(dconf)
    ours = DiT(cfg, DIT)
    ours.load_state_dict(from_diffusers(theirs.state_dict(), cfg))
    theirs.to(dev)
    ours.to(dev)
    gen = torch.Generator().manual_seed(1)
    b = args.batch
    x0 = torch.randn(b, 4, 32, 32, generator=gen) * 0.5
    sigma = torch.exp(-1.2 + 1.2 * torch.randn(b, generator=gen))
    noise = torch.randn(b, 4, 32, 32, generator=gen)
    labels = torch.randint(0, 1000, (b,), generator=gen)
    pos = patchify(x0[0, :, None], 1, 2, 2)[1][None].expand(b, -1, -1)
    x0, sigma, noise, labels, pos = (t.to(dev) for t in (x0, sigma, noise, labels, pos))

    def edm_loss(forward, dtype):
        s = sigma[:, None, None, None]
        c_skip, c_out, c_in, c_noise = edm.precondition(s, 0.5)
        noisy = x0 + s * noise
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out = forward(c_in * noisy, c_noise.flatten())
        d = c_skip * noisy + c_out * out.float()
        return (edm.loss_weight(s, 0.5) * (d - x0) ** 2).mean()

    def f_theirs(x, cn):
        return theirs(x, timestep=cn, class_labels=labels).sample

    def f_ours(x, cn):  # (the batch's patches in one copy each way, as diffusers' patch conv takes them)
        out = ours(patchify(x[:, :, None], 1, 2, 2)[0], positions=pos, noise_level=cn[:, None], labels=labels[:, None])
        return unpatchify(out, (1, 16, 16), 1, 2, 2)[:, :, 0]

    return types.SimpleNamespace(theirs=theirs, ours=ours, initial=initial, cfg=cfg, pos=pos, edm_loss=edm_loss,
                                 f_theirs=f_theirs, f_ours=f_ours)


def graphed_step_s(model: torch.nn.Module, loss: Callable[[], torch.Tensor], steps: int) -> float:
    """Median step of ``model`` trained as `zoo train` does with train.cuda_graph=true: forward and
    backward (under elementwise recomputation) replayed from a CUDA graph, AdamW eager."""
    from zoo.nn import recompute
    from zoo.parallel.cuda_graphs import WARMUP, GraphedMicroBatches

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    graphs = GraphedMicroBatches(list(model.parameters()))

    def forward_backward(batch: dict, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        with recompute.scope("elementwise"):
            out = loss()
        out.backward()
        return out.detach(), {}

    one, times = torch.ones((), device="cuda"), []
    for _ in range(WARMUP + 1 + steps):  # (its eager warm-ups and the capture first, untimed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs(forward_backward, {}, one)
        opt.step()
        opt.zero_grad(set_to_none=False)  # (the graph accumulates into the same tensors)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    assert graphs.replays == steps + 1 and graphs.off is None, graphs.off  # (the capture replays once)
    return sorted(times[WARMUP + 1:])[steps // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    add_size_args(ap)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="run bf16 on a CPU without bf16 instructions too")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from llama_vs_hf import bf16_skipped, ceiling, measured_gemm_peaks, zoo_process_settings

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not cuda:
        zoo_process_settings()
    # a step's time is its GPU work's: wait for it before reading the clock
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from zoo_dit import edm
    from zoo_dit.convert import from_diffusers
    from zoo_dit.model import patchify, unpatchify

    from zoo.nn import recompute

    pair = build_pair(args, dev)
    theirs, ours, initial, cfg, pos = pair.theirs, pair.ours, pair.initial, pair.cfg, pair.pos
    edm_loss, f_theirs, f_ours = pair.edm_loss, pair.f_theirs, pair.f_ours
    n_params = sum(p.numel() for p in ours.parameters())
    where = torch.cuda.get_device_name() if cuda else f"{args.threads} threads"
    print(f"DiT {args.layers} layers x {args.hidden} ({n_params / 1e6:.1f}M parameters), 4x32x32 latents, patch 2 "
          f"(256 tokens), batch {args.batch}, {where}, torch {torch.__version__}")

    b = args.batch
    # The matrix products of a training step any implementation needs (forward and backward: 6 FLOPs
    # a weight per token): each block's q, k, v, out and MLP weights and the final projection per
    # token, attention's scores (non-causal); the per-image adaLN and embedders are left out.
    tokens, h = b * 256, args.hidden
    gemm_flops = 6.0 * tokens * (args.layers * (12 * h * h + 2 * 256 * h) + h * 2 * 2 * 4)
    peaks = measured_gemm_peaks(args.threads, args.device)
    results: dict[tuple[str, str], dict[str, float]] = {}
    skip = bf16_skipped(peaks, args.bf16)
    if skip:
        print(f"# {skip}")
    for dtype in ("fp32",) if skip else ("fp32", "bf16"):
        sides = []
        for name, model, fwd in (("diffusers", theirs, f_theirs), ("zoo", ours, f_ours)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # zoo train's and HF Trainer's default
            model.train()
            zoo = name == "zoo"  # zoo's step as `zoo train` runs it: elementwise recomputation
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            loss, peak = saved_bytes(lambda f=fwd, d=dtype: edm_loss(f, d), zoo, params)  # warm-up step, measures saved bytes
            loss.backward()
            del loss  # (its autograd graph, kept alive, would hold the gradient nodes made on this stream)
            opt.step()
            opt.zero_grad(set_to_none=True)

            def step(fwd=fwd, opt=opt, zoo=zoo, dtype=dtype, host=None) -> float:
                sync()
                t0 = time.perf_counter()
                with recompute.scope("elementwise" if zoo else "none"):
                    loss = edm_loss(fwd, dtype)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if host is not None:  # the host has queued the step's work (a GPU's may still run)
                    host.append(time.perf_counter() - t0)
                sync()
                return time.perf_counter() - t0

            step()  # a second warm-up (zoo's first compiles its fused CPU kernels, zoo_cpu_kernels.fused)
            sides.append((name, step, peak, [], []))
        # The two sides' steps alternate, so a drift of the machine's speed (a shared VM's is
        # 10-15% over minutes) falls on both alike; each side's median step is reported.
        for i in range(args.steps):
            for _name, step, _, times, host in (sides if i % 2 else sides[::-1]):
                times.append(step(host=host))
        for name, _, peak, times, host in sides:
            results[(name, dtype)] = {"img_s": b / sorted(times)[len(times) // 2], "saved_mb": peak / 2**20,
                                      "step_ms": sorted(times)[len(times) // 2] * 1e3,
                                      "host_ms": sorted(host)[len(host) // 2] * 1e3}
        z, d = results[("zoo", dtype)], results[("diffusers", dtype)]
        # Each round's two steps ran back to back: the median of their ratios leaves out a speed
        # change of the machine that lasts a few steps (this VM's: up to 1.5x for tens of seconds),
        # which can still move one side's median more than the other's.
        by_side = {name: times for name, _, _, times, _ in sides}
        pairs = sorted(t_d / t_z for t_d, t_z in zip(by_side["diffusers"], by_side["zoo"]))
        print(f"train {dtype}: images/s zoo {z['img_s']:7.2f}  diffusers {d['img_s']:7.2f}  -> "
              f"{z['img_s'] / d['img_s']:.2f}x (rounds' median {pairs[len(pairs) // 2]:.2f}x, range "
              f"{pairs[0]:.2f}-{pairs[-1]:.2f}) | saved for backward zoo {z['saved_mb']:7.1f} MiB  diffusers "
              f"{d['saved_mb']:7.1f} MiB -> {z['saved_mb'] / d['saved_mb']:.2f}x")
        if cuda:  # host ~ step: bound by the host queuing kernels, not by the GPU's work
            print(f"  step (host queuing) zoo {z['step_ms']:.1f} ({z['host_ms']:.1f}) ms, diffusers "
                  f"{d['step_ms']:.1f} ({d['host_ms']:.1f}) ms")
        if cuda:  # zoo's train.cuda_graph=true step: its host work out of the way
            step_s = graphed_step_s(ours, lambda d=dtype: edm_loss(f_ours, d), args.steps)
            print(f"  zoo with train.cuda_graph: images/s {b / step_s:7.2f}, step {step_s * 1e3:.1f} ms -> "
                  f"{b / step_s / d['img_s']:.2f}x diffusers")
        print(f"  {dtype} images/s {ceiling(gemm_flops, peaks[dtype], b / d['img_s'])}")

    # Sampling: 18 Heun steps (35 evaluations), cond + uncond in one forward, same noise, same weights
    # (the initial ones: diffusers trains its per-block embedder copies apart, so they no longer convert).
    theirs.load_state_dict(initial)
    ours.load_state_dict(from_diffusers(initial, cfg))
    ours.eval()
    theirs.eval()
    n = 4
    lab = torch.arange(n, device=dev)
    start = torch.randn(n, 4, 32, 32, generator=torch.Generator().manual_seed(2)).to(dev)
    sigmas = edm.karras_sigmas(18).to(dev)

    def denoiser(fwd):
        def d(x, s):
            xin = torch.cat([x, x])
            sv = s.reshape(1).float().expand(2 * n)
            c_skip, c_out, c_in, c_noise = edm.precondition(sv[:, None, None, None], 0.5)
            out = fwd(c_in * xin, c_noise.flatten(), torch.cat([lab, torch.full_like(lab, 1000)]))
            den = c_skip * xin + c_out * out.float()
            return edm.guide(*den.chunk(2), 1.5)
        return d

    def s_theirs(x, cn, y):
        return theirs(x, timestep=cn, class_labels=y).sample

    def s_ours(x, cn, y):
        out = ours(patchify(x[:, :, None], 1, 2, 2)[0], positions=pos[:1].expand(len(x), -1, -1),
                   noise_level=cn[:, None], labels=y[:, None])
        return unpatchify(out, (1, 16, 16), 1, 2, 2)[:, :, 0]

    times: dict[str, float] = {}
    samples = {}
    # diffusers, zoo, zoo, diffusers: each side's faster run, so that a drift of the machine's
    # speed over the ~half minute falls on both sides alike
    for name, fwd in (("diffusers", s_theirs), ("zoo", s_ours), ("zoo", s_ours), ("diffusers", s_theirs)):
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            samples[name] = edm.sample(denoiser(fwd), start, sigmas)
            sync()
            times[name] = min(times.get(name, float("inf")), time.perf_counter() - t0)
    gap = float((samples["zoo"] - samples["diffusers"]).abs().max())
    print(f"sampling 18 Heun steps (35 NFE), {n} images with guidance: zoo {times['zoo']:.2f}s  diffusers "
          f"{times['diffusers']:.2f}s -> {times['diffusers'] / times['zoo']:.2f}x (samples differ by {gap:.1e})")


if __name__ == "__main__":
    main()
