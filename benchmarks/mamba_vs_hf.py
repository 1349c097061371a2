"""zoo's Mamba-1 and Mamba-2 against Hugging Face's pure-PyTorch paths (`MambaForCausalLM`,
`Mamba2ForCausalLM` without CUDA kernels): training tokens/s and peak memory at sequence lengths
512, 2048 and 8192, and generation tokens/s with each side's recurrent cache.

Both sides get the identical config (2 layers, hidden 256, vocab 1024, batch 1 by default; Mamba-2
with 8 heads of 64 and mamba-ssm's and HF's defaults state 128, chunk 256: ``--state 64 --chunk
64`` is the config of the sessions before 2026-11-26's eighteenth), the same batch, AdamW and thread
count, fp32. The chunk is an algorithmic choice (any chunk computes the same function): zoo's CPU
scan uses at most 64 (`zoo_mamba.ssm.CPU_CHUNK`), so with a larger one HF also runs at chunk 64, its
fastest here, and both ratios are printed. zoo's model is built from HF's config by the plugin's own
reader. Each measurement runs in a fresh process (its peak RSS is that model's alone) with a time
limit: a side that runs out of time or memory is reported as such. (The default allocator: a low mmap threshold, which the LLaMA benchmark uses to
make RSS follow live memory, turns every scan chunk's allocation into page faults and slows both
sides ~5x.)

    python benchmarks/mamba_vs_hf.py            # 512, 2048, 8192
    python benchmarks/mamba_vs_hf.py --quick    # 512 and 2048, fewer steps
    python benchmarks/mamba_vs_hf.py --kinds mamba2 --pairs 5   # each side's median of 5 fresh processes
    python benchmarks/mamba_vs_hf.py --kinds mamba2 --state 64 --chunk 64   # earlier sessions' config
    python benchmarks/mamba_vs_hf.py --kinds mamba2 --device cuda   # on a GPU (both sides' PyTorch paths; zoo
                                                                    # takes mamba_ssm's kernels where installed)

On a GPU each length also reports zoo's step as `train.cuda_graph=true` runs it (forward and backward
replayed from a CUDA graph, `zoo.parallel.cuda_graphs`): zoo's eager step there is bound by the host
queuing its kernels, the graphed one by the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from llama_vs_hf import ceiling, measured_gemm_peaks
from zoo_mamba.ssm import CPU_CHUNK


def hf_model(a: argparse.Namespace):
    import transformers as tf

    if a.kind == "mamba":
        return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                                  state_size=16))
    return tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                                state_size=a.state, num_heads=2 * a.hidden // 64, head_dim=64,
                                                n_groups=1, chunk_size=a.chunk))


def build(a: argparse.Namespace):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    hf = hf_model(a).to(a.device)  # (built on the CPU, as zoo's: the same initial draws on any device)
    if a.impl == "hf":
        return hf, lambda m, x, y: F.cross_entropy(m(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    from zoo_mamba.convert import from_hf_config
    from zoo_mamba.model import build as zoo_build
    from zoo_mamba.plugin import SPECS

    cfg = from_hf_config(hf.config.to_dict())
    cfg.chunk_size = a.chunk if a.kind == "mamba2" else 64  # (Mamba-1's HF config has no chunk)
    del hf

    model = zoo_build(cfg, SPECS[cfg.layer_spec]).to(a.device)
    return model, lambda m, x, y: m(x, labels=y)


def worker(a: argparse.Namespace) -> None:
    import torch
    from llama_vs_hf import time_training, zoo_process_settings  # the LLaMA benchmark's timed AdamW loop

    torch.set_num_threads(a.threads)
    if a.impl != "hf" and a.device == "cpu":
        zoo_process_settings()
    model, loss_of = build(a)
    if a.generate:
        model.eval()
        prompt = torch.randint(0, a.vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(a.device)
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
        with torch.no_grad():
            def run() -> None:
                if a.impl == "hf":
                    model.generate(prompt, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                                   use_cache=True, pad_token_id=0)
                else:
                    from zoo.nn.sampling import generate_tokens

                    generate_tokens(model, context=16 + a.new_tokens, prompt=prompt, max_new_tokens=a.new_tokens,
                                    temperature=0.0)
            run()
            sync()
            t = time.perf_counter()
            run()
            sync()
        print(json.dumps({"tokens_per_s": a.new_tokens / (time.perf_counter() - t)}))
        return
    a.batch, a.precision = 1, "fp32"
    # The products with weight matrices (projections, head) a token needs forward and backward:
    # the part of the step any implementation must do; the scan's own work comes on top.
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # zoo-graph: zoo's train.cuda_graph=true step (forward and backward replayed from a CUDA graph)
    print(json.dumps({**time_training(model, loss_of, a, cuda_graph=a.impl == "zoo-graph"),
                      "gemm_flops_per_token": 6.0 * linear}))


def run_child(a: argparse.Namespace, **over: object) -> dict | str:
    keep = {k: v for k, v in vars(a).items() if k not in ("worker", "quick", "lengths", "generate")} | over
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in keep.items() if not isinstance(v, bool)]
    flags += [f"--{k}" for k, v in keep.items() if v is True]
    cmd = [sys.executable, __file__, "--worker", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.limit)
    except subprocess.TimeoutExpired:
        return f"> {a.limit:.0f} s"
    if out.returncode != 0:
        return "out of memory" if out.returncode in (-9, 137) or "MemoryError" in out.stderr else \
            "failed: " + out.stderr.strip().splitlines()[-1]
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_run(results: list[dict | str]) -> dict | str:
    """The run of median tokens/s among ``results`` (a failure's message if any failed), with the
    largest peak RSS of them and, for more than one, the spread of tokens/s."""
    bad = [r for r in results if not isinstance(r, dict)]
    if bad:
        return bad[0]
    ranked = sorted(results, key=lambda r: r["tokens_per_s"])
    mid = dict(ranked[len(ranked) // 2], peak_rss_mb=max(r["peak_rss_mb"] for r in results))
    if len(results) > 1:
        mid["spread"] = (ranked[0]["tokens_per_s"], ranked[-1]["tokens_per_s"])
    return mid


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--state", type=int, default=128, help="Mamba-2's state size (Mamba-1: 16)")
    p.add_argument("--chunk", type=int, default=256, help="Mamba-2's scan chunk in both configs")
    p.add_argument("--steps", type=int, default=5)
    # two: both sides' second step still runs ~5-15% slow (allocator and kernel caches filling)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--limit", type=float, default=180.0, help="seconds each measurement may take")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true")
    # a 2-core VM's speed drifts 10-15% between processes: more pairs, each side's median
    p.add_argument("--pairs", type=int, default=1, help="fresh-process (HF, zoo) pairs per length; medians")
    p.add_argument("--kinds", default="mamba,mamba2", help="which of mamba, mamba2 to measure")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="mamba", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="zoo", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    lengths = (512, 2048) if a.quick else (512, 2048, 8192)
    if a.quick:
        a.steps, a.limit = 3, 90.0
    where = f"{platform.processor() or platform.machine()}, {a.threads} threads"
    if a.device == "cuda":
        import torch

        where = torch.cuda.get_device_name()
    print(f"# {where}; {a.layers} layers, hidden {a.hidden}, "
          f"vocab {a.vocab}, batch 1, fp32; Mamba-2 state {a.state}, chunk {a.chunk}; each measurement limited "
          f"to {a.limit:.0f} s")
    peaks = measured_gemm_peaks(a.threads, a.device)
    print(f"# GEMM peak (best 2048^3 product; 8192^3 on a GPU) fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s")
    for kind in a.kinds.split(","):
        for seq in lengths:
            runs = [{impl: run_child(a, kind=kind, impl=impl, seq=seq)
                     for impl in (("hf", "zoo") if i % 2 == 0 else ("zoo", "hf"))}  # each pair in turn
                    for i in range(a.pairs)]
            z, h = (median_run([r[impl] for r in runs]) for impl in ("zoo", "hf"))
            line = f"{kind} T={seq}: zoo " + (f"{z['tokens_per_s']:,.0f} tok/s, {z['peak_rss_mb']:,.0f} MB"
                                              if isinstance(z, dict) else z)
            line += "; HF " + (f"{h['tokens_per_s']:,.0f} tok/s, {h['peak_rss_mb']:,.0f} MB" if isinstance(h, dict) else h)
            if isinstance(z, dict) and isinstance(h, dict):
                line += (f" -> {z['tokens_per_s'] / h['tokens_per_s']:.2f}x tokens/s, "
                         f"{z['peak_rss_mb'] / h['peak_rss_mb']:.2f}x memory; tokens/s "
                         f"{ceiling(h['gemm_flops_per_token'] * seq, peaks['fp32'], h['step_s'])}")
            if kind == "mamba2" and a.device == "cpu" and a.chunk > CPU_CHUNK and isinstance(z, dict):
                # zoo's CPU scan works in chunks of <= CPU_CHUNK whatever the config says: HF's own
                # path at that chunk too, so the ratio is not only HF's larger chunk
                hq = run_child(a, kind=kind, impl="hf", seq=seq, chunk=CPU_CHUNK)
                line += f"; HF at chunk {CPU_CHUNK} " + (f"{hq['tokens_per_s']:,.0f} tok/s -> "
                                                         f"{z['tokens_per_s'] / hq['tokens_per_s']:.2f}x"
                                                         if isinstance(hq, dict) else hq)
            if a.device == "cuda" and isinstance(z, dict) and isinstance(h, dict):
                line += (f"; step (host queuing) zoo {z['step_s'] * 1e3:.1f} ({z['host_s'] * 1e3:.1f}) ms, HF "
                         f"{h['step_s'] * 1e3:.1f} ({h['host_s'] * 1e3:.1f}) ms")
                g = run_child(a, kind=kind, impl="zoo-graph", seq=seq)  # the host out of the step
                line += ("\n  zoo with train.cuda_graph: " + (
                    f"{g['tokens_per_s']:,.0f} tok/s, {g['peak_rss_mb']:,.0f} MB, step {g['step_s'] * 1e3:.2f} ms -> "
                    f"{g['tokens_per_s'] / h['tokens_per_s']:.2f}x HF's tokens/s" if isinstance(g, dict) else g))
            if a.pairs > 1 and isinstance(z, dict) and isinstance(h, dict):
                # each pair's own ratio too: its two processes ran minutes apart at most, so a host
                # whose speed drifts by 10-15% over minutes (seen on the 2-core VMs) moves both
                paired = sorted(r["zoo"]["tokens_per_s"] / r["hf"]["tokens_per_s"] for r in runs)
                line += (f"\n  medians of {a.pairs} process pairs; tok/s ranges zoo {z['spread'][0]:,.0f}-"
                         f"{z['spread'][1]:,.0f}, HF {h['spread'][0]:,.0f}-{h['spread'][1]:,.0f}; the pairs' own "
                         f"ratios {', '.join(f'{v:.2f}' for v in paired)} (median {paired[len(paired) // 2]:.2f}x)")
            print(line, flush=True)
        gen = {impl: run_child(a, kind=kind, impl=impl, generate=True) for impl in ("hf", "zoo")}
        z, h = gen["zoo"], gen["hf"]
        if isinstance(z, dict) and isinstance(h, dict):
            print(f"{kind} generation ({a.new_tokens} tokens after 16, greedy, cached): zoo {z['tokens_per_s']:,.0f} "
                  f"tok/s vs HF {h['tokens_per_s']:,.0f} -> {z['tokens_per_s'] / h['tokens_per_s']:.2f}x", flush=True)
        else:
            print(f"{kind} generation: zoo {z}; HF {h}", flush=True)


if __name__ == "__main__":
    main()
