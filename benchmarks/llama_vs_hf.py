"""zoo's LLaMA against Hugging Face's LlamaForCausalLM: training tokens/s, peak RSS and MFU.

Each side trains with its own training step (HF: logits, float32 upcast, cross entropy, as its
`labels=` path does; zoo: the family's loss, which never materialises the logits, under the
recompute scope `zoo train` uses by default: norm and activation outputs recomputed, bitwise exact). Both models get
the identical config (8 layers, hidden 512, 8 heads, 2 KV heads, vocab 8192,
seq 512 by default), the same batch, the same fused AdamW (both frameworks' default), the same thread count, in fp32 and in bf16
autocast. Each measurement runs in its own fresh process (so peak RSS is that model's alone), one
after another in the same run, and the GEMM peak that MFU is measured against is taken on the same
machine in the same run. zoo's processes apply what `zoo train` applies to a CPU process (freed
memory kept for reuse, `train.cpu_malloc`); the `hf+retain` rows run HF under that same setting, so
the table shows which part of the ratio it is.

On a GPU (``--device cuda``) the same two training steps run with CUDA autocast and SDPA attention
(flash in bf16) on both sides; tokens/s and MFU are against the GPU's own measured matrix-product
peaks (fp32 without TF32, as torch computes fp32 by default, and bf16), memory is the CUDA
allocator's peak, and the optional backends `zoo.backends` found are printed with the table.
``--preset 1b`` is LLaMA-3.2-1B's shape (untied embeddings: 1.5B parameters).

    python benchmarks/llama_vs_hf.py                 # full size
    python benchmarks/llama_vs_hf.py --quick         # a smaller, faster check
    python benchmarks/llama_vs_hf.py --device cuda --preset 1b   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import time


def model_config(args: argparse.Namespace) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                rms_norm_eps=1e-5, tie_word_embeddings=False)


def build(impl: str, args: argparse.Namespace):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if impl == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device(args.device):
            hf = LlamaForCausalLM(LlamaConfig(**model_config(args), attn_implementation="sdpa"))
        # HF's causal-LM loss: logits upcast to float32, then cross entropy (what labels= does,
        # without its internal shift, since the labels here are already shifted).
        return hf, lambda m, x, y: F.cross_entropy(m(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    # zoo's model from the same config, translated by the plugin's own HF config reader.
    from zoo.config import TrainConfig
    from zoo.nn import recompute
    from zoo_gpt.convert import from_hf_config
    from zoo_gpt.model import build as zoo_build
    from zoo_gpt.plugin import SPECS

    cfg = from_hf_config({"model_type": "llama", **model_config(args)})
    mode = TrainConfig().recompute  # what `zoo train` does by default (bitwise-exact elementwise recompute)

    # zoo's training loss: the family's own path (labels= gives the loss without materialising
    # logits), under the recompute scope `zoo train` puts around every forward.
    def zoo_loss(m, x, y):
        with recompute.scope(mode):
            return m(x, labels=y)

    if args.recompute:
        mode = args.recompute
    with torch.device(args.device):
        model = zoo_build(cfg, SPECS[cfg.layer_spec])
    return model, zoo_loss


_HELD: list = []  # the process's kernel selection, entered and kept (a dropped context manager is closed)


def zoo_process_settings(malloc_mode: str | None = None) -> None:
    """What `zoo train` sets in a process besides the model: the kernels it selects for the device
    under the default ``train.cpu_*`` settings (`zoo.kernels`; on a CPU with zoo-cpu-kernels freed
    memory kept for reuse, its float32 products and fused elementwise kernels), active for the rest
    of this benchmark process. ``malloc_mode``: the HF rows with zoo's allocator setting only (they
    keep torch's kernels)."""
    from zoo import kernels
    from zoo.config import TrainConfig

    if malloc_mode is None:
        held = kernels.select("cpu", kernels.options(TrainConfig())).use()
        held.__enter__()  # for the process's life: referenced from _HELD, so never closed
        _HELD.append(held)
    else:
        from zoo_cpu_kernels import malloc

        malloc.configure(malloc_mode)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.impl != "hf" and args.device == "cpu":
        zoo_process_settings("retain" if args.impl == "hf+retain" else None)
    model, loss_of = build("hf" if args.impl.startswith("hf") else "zoo", args)
    print(json.dumps(time_training(model, loss_of, args, bf16_params=args.impl == "zoo-bf16p")))


def time_training(model, loss_of, args: argparse.Namespace, *, bf16_params: bool = False,
                  cuda_graph: bool = False) -> dict:
    """Median step time of AdamW training on one fixed batch (``args``: vocab, batch, seq, precision,
    warmup, steps): tokens/s, the last loss and peak RSS. Also used by benchmarks/moe_vs_hf.py.
    ``bf16_params``: zoo's `train.param_dtype=bf16` path: bf16 parameters (autocast then re-casts
    nothing), float32 gradient buckets (`train.grad_dtype=fp32`), fp32 master weights and Adam state
    in zoo's distributed optimizer, which on one rank shards nothing (`zoo.parallel.zero`, over
    `zoo.parallel.data_parallel.GradBuckets`).
    ``cuda_graph``: zoo's `train.cuda_graph=true` path: forward and backward replayed from a CUDA graph
    (`zoo.parallel.cuda_graphs`, driven as the trainer drives it), the optimizer step eager."""
    import torch

    model.train()
    # torch's fused AdamW on both sides: `zoo train`'s default (optimizer.implementation) and the HF
    # Trainer's (adamw_torch_fused), ~3x the per-tensor loop's speed on a CPU.
    make_opt = lambda groups: torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.0, fused=True)  # noqa: E731
    buckets = None
    if bf16_params:
        from zoo.parallel.data_parallel import GradBuckets
        from zoo.parallel.zero import DistributedOptimizer

        model.to(torch.bfloat16)
        buckets = GradBuckets(model, None, shard=True, grad_dtype=torch.float32)
        opt = DistributedOptimizer(buckets, make_opt, group_of=lambda p: {"weight_decay": 0.0})
    else:
        opt = make_opt(model.parameters())
    device = getattr(args, "device", "cpu")
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, labels = x[:, :-1], x[:, 1:]
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cuda = device == "cuda"
    if cuda:
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def forward_backward(batch: dict, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_of(model, batch["inputs"], batch["labels"])
        loss.backward()  # (weight: 1, one micro-batch a step)
        return loss.detach(), {}

    graphs, one, extra_warmup = None, torch.ones((), device=device), 0
    if cuda_graph:
        from zoo.parallel.cuda_graphs import WARMUP, GraphedMicroBatches

        graphs = functools.partial(GraphedMicroBatches(list(model.parameters())), forward_backward)
        extra_warmup = WARMUP + 1  # its eager warm-up steps and the capture's, untimed

    def step() -> float:
        loss, _ = (graphs or forward_backward)({"inputs": inputs, "labels": labels}, one)
        if buckets is not None:
            buckets.finish()
            opt.step()
            buckets.zero_grad()
        else:
            opt.step()
            opt.zero_grad(set_to_none=graphs is None)  # (a graph accumulates into the same tensors)
        queued.append(time.perf_counter())  # (on a GPU: the host has queued the step's work)
        return loss.item()

    queued: list[float] = []
    for _ in range(args.warmup + extra_warmup):
        step()
    times, host = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
        host.append(queued[-1] - t)
    times.sort()
    median = times[len(times) // 2]
    if cuda:  # loss.item() synchronised every step; memory is the CUDA allocator's, not the process's
        peak = torch.cuda.max_memory_allocated() / 2**20
        # host_s ~ step_s: the step is bound by the host queuing kernels, not by the GPU's work
        return {"tokens_per_s": args.batch * args.seq / median, "step_s": median, "loss": loss,
                "host_s": sorted(host)[len(host) // 2], "peak_rss_mb": peak, "rss_over_model_mb": peak - base_mem / 2**20}
    return {"tokens_per_s": args.batch * args.seq / median, "step_s": median, "loss": loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_over_model_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss}


def gemm_peak_cuda() -> dict[str, float]:
    """The GPU's measured matrix-product peaks: 8192^3 products timed with CUDA events (median of
    10 after warm-up) on random data, fp32 without TF32 (torch's default for fp32), TF32 and bf16."""
    import torch

    out, n = {}, 8192
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = 2 * n**3 / sorted(times)[len(times) // 2]
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def gemm_peak(args: argparse.Namespace) -> None:
    import torch
    from zoo_cpu_kernels import gemm

    if args.device == "cuda":
        print(json.dumps(gemm_peak_cuda()))
        return

    torch.set_num_threads(args.threads)
    onednn = gemm.Gemm()
    with contextlib.suppress(RuntimeError):  # no oneDNN matmul in this build: torch's own mm
        onednn = gemm.configure("onednn")[0]
    out = {}
    # fp32: torch's BLAS (what HF computes with) and oneDNN's (what zoo takes where faster); the peak
    # is the better of the two, so MFU is against what this machine can do, not what a library does.
    for name, dtype, product in (("fp32_blas", torch.float32, torch.mm), ("fp32_onednn", torch.float32, onednn.mm_or_torch),
                                 ("bf16", torch.bfloat16, torch.mm)):
        # without bf16 instructions torch's bf16 product is a fallback under 1 GFLOP/s: a 2048^3
        # one would take a minute, a 512^3 one measures its rate as well
        n = 2048 if dtype != torch.bfloat16 or gemm.bf16_is_native() else 512
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        if product == onednn.mm_or_torch:  # b as a layer's weight lies ((N, K) rows), not a transposition inside the timing
            b = b.t()
        for _ in range(2):
            product(a, b)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            product(a, b)
            best = min(best, time.perf_counter() - t)
        out[name] = 2 * n**3 / best
    out["fp32"] = max(out["fp32_blas"], out["fp32_onednn"])
    out["bf16_native"] = gemm.bf16_is_native()
    print(json.dumps(out))


def bf16_skipped(peaks: dict, forced: bool, override: str = "--bf16") -> str | None:
    """Why this machine's bf16 rows are left out (None: run them; ``override``: the flag that runs
    them anyway): where oneDNN has no bf16 products (an AVX2-only CPU) torch computes them through
    fallbacks 10-400x slower than float32, so a bf16 step of either side takes minutes and measures
    the fallback, not the implementation."""
    if forced or peaks.get("bf16_native", True):
        return None
    return (f"bf16 skipped: this CPU has no bf16 products (no AVX-512 BF16, AMX or AVX-512): one runs at "
            f"{peaks['bf16'] / 1e9:.1f} GFLOP/s, fp32 at {peaks['fp32'] / 1e9:.0f}; {override} runs it anyway")


def measured_gemm_peaks(threads: int, device: str = "cpu") -> dict[str, float]:
    """This machine's GEMM peaks (FLOP/s, "fp32" and "bf16"; on a GPU "tf32" too), measured in a
    fresh process as this benchmark's MFU is: for the other benchmarks' ceilings."""
    out = subprocess.run([sys.executable, __file__, "--peak", f"--threads={threads}", f"--device={device}"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ceiling(gemm_flops_per_step: float, peak: float, peer_step_s: float) -> str:
    """The largest speed-up over a peer whose step took ``peer_step_s`` that any implementation could
    reach on this machine: the step's matrix products (``gemm_flops_per_step``, a lower bound of its
    work) at the measured GEMM ``peak`` and nothing else. A ratio target above it cannot be met here."""
    floor = gemm_flops_per_step / peak
    return (f"ceiling {peer_step_s / floor:.2f}x (the step's {gemm_flops_per_step / 1e9:.0f} GFLOP of matrix products "
            f"alone take {floor * 1e3:.0f} ms at the {peak / 1e9:.0f} GFLOP/s peak; the peer's step {peer_step_s * 1e3:.0f} ms)")


def flops_per_token(args: argparse.Namespace) -> float:
    """6 x matmul weights + 12 x layers x hidden x seq (PaLM appendix B)."""
    hd = args.hidden // args.heads
    per_layer = args.hidden * (args.heads + 2 * args.kv_heads) * hd + args.heads * hd * args.hidden + 3 * args.hidden * args.ffn
    matmul = args.layers * per_layer + args.hidden * args.vocab
    return 6.0 * matmul + 12.0 * args.layers * args.hidden * args.seq


# glibc keeps freed blocks for reuse, so a process's peak RSS depends on allocation order as much as
# on how much memory is live (the same run varies by hundreds of MB). With a fixed 1 MB mmap
# threshold every large tensor is returned to the system when freed, and peak RSS follows the
# live peak: the allocator-independent measure, taken for both sides in separate processes.
LIVE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def run_child(extra: list[str], args: argparse.Namespace, env_extra: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, *extra, *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                 if k not in ("worker", "peak", "impl", "precision", "quick", "preset", "rows",
                                                              "bf16")
                                                 and v is not None]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **(env_extra or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="4 layers, seq 256: a fast sanity run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--preset", choices=["1b"], help="1b: LLaMA-3.2-1B's shape, untied (16 layers, hidden 2048, "
                   "ffn 8192, 32/8 heads, vocab 128256), seq 2048")
    p.add_argument("--rows", help="GPU table: the rows to run, e.g. bf16:hf,bf16:zoo-bf16p (default: all)")
    p.add_argument("--recompute", choices=["none", "elementwise", "selective", "full"],
                   help="zoo's recompute mode (default: `zoo train`'s)")
    p.add_argument("--bf16", action="store_true", help="run the bf16 rows on a CPU without bf16 instructions too")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["hf", "hf+retain", "zoo", "zoo-bf16p"], help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.peak:
        return gemm_peak(args)
    if args.quick:
        args.layers, args.seq = 4, 256
    if args.preset == "1b":
        args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab, args.seq = 16, 2048, 8192, 32, 8, 128256, 2048
    if args.device == "cuda":
        return main_cuda(args)
    peak = run_child(["--peak"], args)
    fpt = flops_per_token(args)
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {platform.processor() or ''} {args.threads} threads, "
          f"torch {__import__('torch').__version__}")
    print(f"# LLaMA {args.layers}L hidden {args.hidden} heads {args.heads}/{args.kv_heads} ffn {args.ffn} vocab {args.vocab}, "
          f"batch {args.batch} x seq {args.seq}; GEMM peak fp32 {peak['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.1f} GFLOP/s")
    print(f"{'precision':<9} {'impl':<9} {'tokens/s':>9} {'MFU':>6} {'peak RSS MB':>11} {'RSS over model MB':>17} "
          f"{'live peak MB':>12}")
    results = {}
    # hf+retain: HF with zoo's allocator setting (freed memory kept for reuse), to show how much of
    # the speed ratio that setting is; its live memory is the same as HF's by construction.
    runs = [("fp32", "hf"), ("fp32", "hf+retain"), ("fp32", "zoo"), ("bf16", "hf"), ("bf16", "hf+retain"),
            ("bf16", "zoo"), ("bf16", "zoo-bf16p")]
    skip = bf16_skipped(peak, args.bf16)
    if skip:
        print(f"# {skip}")
        runs = [r for r in runs if r[0] == "fp32"]
    for precision, impl in runs:
        r = run_child(["--worker", f"--impl={impl}", f"--precision={precision}"], args)
        r["mfu"] = r["tokens_per_s"] * fpt / peak[precision]
        live = impl != "hf+retain"
        r["live_mb"] = run_child(["--worker", f"--impl={impl}", f"--precision={precision}"], args, LIVE_ENV)["peak_rss_mb"] \
            if live else float("nan")
        results[(precision, impl)] = r
        print(f"{precision:<9} {impl:<9} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.1%} {r['peak_rss_mb']:>11.0f} "
              f"{r['rss_over_model_mb']:>17.0f} {r['live_mb']:>12.0f}")
    # Targets (issue 19): fp32 >= 1.0x HF and >= 75% of the fp32 GEMM peak; bf16 >= 1.3x HF and >= 75%
    # of the bf16 GEMM peak where bf16 GEMMs are fast; live memory <= 0.8x HF in both.
    fast_bf16 = peak["bf16"] > 1.2 * peak["fp32"]
    for precision, impl in (("fp32", "zoo"), ("bf16", "zoo"), ("bf16", "zoo-bf16p")):
        if (precision, impl) not in results:
            continue
        hf, zoo = results[(precision, "hf")], results[(precision, impl)]
        speed = zoo["tokens_per_s"] / hf["tokens_per_s"]
        target = "1.0x" if precision == "fp32" else "1.3x" if fast_bf16 else "n/a: this CPU's bf16 GEMM is not faster than fp32"
        print(f"{precision} {impl}: tokens/s {speed:.2f}x HF (target {target}; "
              f"{zoo['tokens_per_s'] / results[(precision, 'hf+retain')]['tokens_per_s']:.2f}x HF with zoo's allocator "
              f"setting); MFU {zoo['mfu']:.1%} of the {precision} GEMM peak (target >= 75%); live memory "
              f"{zoo['live_mb'] / hf['live_mb']:.2f}x HF (target <= 0.8x), peak RSS {zoo['peak_rss_mb'] / hf['peak_rss_mb']:.2f}x")
    if not fast_bf16 and not skip:
        print(f"# note: bf16 GEMM peak {peak['bf16'] / 1e9:.0f} GFLOP/s vs fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s: this "
              "machine has no fast bf16 matrix unit, so bf16 is judged by MFU against its own bf16 peak only")


def main_cuda(args: argparse.Namespace) -> None:
    """The GPU table: bf16 (autocast, and zoo's bf16 parameters with fp32 masters) and fp32 on both
    sides, MFU against the GPU's measured peaks, memory from the CUDA allocator."""
    import torch

    from zoo import backends

    peak = run_child(["--peak"], args)
    fpt = flops_per_token(args)
    found = {name: backends.probe(name)[1] for name in backends.BACKENDS}
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}), SDPA attention on both sides")
    print("# backends: " + "; ".join(f"{k}: {v}" for k, v in found.items()))
    print(f"# LLaMA {args.layers}L hidden {args.hidden} heads {args.heads}/{args.kv_heads} ffn {args.ffn} vocab {args.vocab}, "
          f"batch {args.batch} x seq {args.seq}; GEMM peak fp32 {peak['fp32'] / 1e12:.1f} TFLOP/s (TF32 "
          f"{peak['tf32'] / 1e12:.1f}), bf16 {peak['bf16'] / 1e12:.1f} TFLOP/s; zoo recompute "
          f"{args.recompute or 'default (elementwise)'}")
    print(f"{'precision':<9} {'impl':<9} {'tokens/s':>9} {'step ms':>8} {'MFU':>6} {'peak MB':>8} {'over model MB':>13}")
    results = {}
    rows = [("bf16", "hf"), ("bf16", "zoo"), ("bf16", "zoo-bf16p"), ("fp32", "hf"), ("fp32", "zoo")]
    if args.rows:
        rows = [tuple(r.split(":")) for r in args.rows.split(",")]
    for precision, impl in rows:
        try:
            r = run_child(["--worker", f"--impl={impl}", f"--precision={precision}"], args)
        except subprocess.CalledProcessError as e:  # out of memory on one side: say so, go on
            print(f"{precision:<9} {impl:<9} failed: {e.stderr.strip().splitlines()[-1][:200]}")
            continue
        r["mfu"] = r["tokens_per_s"] * fpt / peak[precision]
        results[(precision, impl)] = r
        print(f"{precision:<9} {impl:<9} {r['tokens_per_s']:>9.0f} {r['step_s'] * 1e3:>8.1f} {r['mfu']:>6.1%} "
              f"{r['peak_rss_mb']:>8.0f} {r['rss_over_model_mb']:>13.0f}")
    for precision, impl in (("bf16", "zoo"), ("bf16", "zoo-bf16p"), ("fp32", "zoo")):
        if (precision, "hf") in results and (precision, impl) in results:
            hf, zoo = results[(precision, "hf")], results[(precision, impl)]
            print(f"{precision} {impl}: tokens/s {zoo['tokens_per_s'] / hf['tokens_per_s']:.2f}x HF; MFU {zoo['mfu']:.1%} "
                  f"of the {precision} peak; peak memory {zoo['peak_rss_mb'] / hf['peak_rss_mb']:.2f}x HF")


if __name__ == "__main__":
    main()
