"""zoo's Mixtral against Hugging Face's MixtralForCausalLM: training tokens/s, live peak memory, and
how much of the MoE layer is dispatch (everything but the expert GEMMs).

Both models get the identical config (8 experts, top-2, 4 layers, hidden 512, expert width 1024 by
default), the same batch, the same AdamW and thread count, in fp32 and bf16 autocast. HF trains with
`output_router_logits=True` (otherwise it drops load balancing) and its `labels=` loss; zoo with the
family's loss (aux + z terms included, logits never materialised) under `zoo train`'s default
recompute scope; both with torch's fused AdamW (each framework's default). Each side is timed in a
fresh process under the default allocator and its memory measured in another with a fixed mmap
threshold, so peak RSS follows live memory (see benchmarks/llama_vs_hf.py). Memory is reported
above the built model, and also less what AdamW training holds on either side whatever the
implementation (fp32 gradients and two moments: 12 bytes a parameter), which at this config is most
of it: what is left is activations and working memory.

    python benchmarks/moe_vs_hf.py            # full size
    python benchmarks/moe_vs_hf.py --quick    # smaller, faster
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from llama_vs_hf import bf16_skipped, ceiling, measured_gemm_peaks

LIVE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def hf_config(a: argparse.Namespace) -> dict:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, num_local_experts=a.experts,
                num_experts_per_tok=a.top_k, max_position_embeddings=a.seq, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build(a: argparse.Namespace):
    import torch

    torch.manual_seed(0)
    if a.impl == "hf":
        from transformers import MixtralConfig, MixtralForCausalLM

        hf = MixtralForCausalLM(MixtralConfig(**hf_config(a), attn_implementation="sdpa", router_aux_loss_coef=0.01))

        def hf_loss(m, x, y):  # labels= path: logits upcast, CE, + coef * aux (output_router_logits=True)
            return m(input_ids=x, labels=y, output_router_logits=True).loss

        return hf, hf_loss
    from zoo_moe.convert import from_hf_config
    from zoo_moe.model import build as zoo_build
    from zoo_moe.model import loss
    from zoo_moe.plugin import SPECS

    from zoo.config import TrainConfig
    from zoo.nn import recompute

    cfg = from_hf_config({"model_type": "mixtral", **hf_config(a), "router_aux_loss_coef": 0.01})
    mode = TrainConfig().recompute
    model = zoo_build(cfg, SPECS[cfg.layer_spec])

    def zoo_loss(m, x, y):
        with recompute.scope(mode):
            ce, metrics = loss(m, {"tokens": x, "labels": y})
            return ce + metrics["aux_loss"] + metrics["z_loss"]

    return model, zoo_loss


def gemm_flops_per_token(a: argparse.Namespace) -> float:
    """The matrix products one trained token needs whatever the implementation (forward and backward,
    6 FLOPs a weight it passes through): attention projections, the top-k experts' SwiGLU, the
    router, the head, and causal attention's scores at half of the PaLM count (a lower bound)."""
    hd = a.hidden // a.heads
    attention = a.hidden * (a.heads + 2 * a.kv_heads) * hd + a.heads * hd * a.hidden
    per_layer = attention + a.top_k * 3 * a.hidden * a.ffn + a.experts * a.hidden
    return 6.0 * (a.layers * per_layer + a.hidden * a.vocab) + 6.0 * a.layers * a.hidden * a.seq


def worker(a: argparse.Namespace) -> None:
    import torch
    from llama_vs_hf import time_training, zoo_process_settings  # the LLaMA benchmark's timed AdamW loop

    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(a.flush_denormal == "on")
    if a.impl != "hf":
        zoo_process_settings()
    model, loss_of = build(a)
    # The state every AdamW step holds on either side: fp32 gradients and two moments per parameter.
    state_mb = 3 * sum(p.numel() * 4 for p in model.parameters()) / 2**20
    print(json.dumps({**time_training(model, loss_of, a), "state_mb": state_mb}))


def dispatch(a: argparse.Namespace) -> None:
    """One zoo MoE layer, forward + backward: whole layer vs its expert GEMMs alone (the same
    per-expert slices, timed by themselves); the rest is routing, sorting, gathers and scatters."""
    import torch

    from zoo.nn.moe import MoE
    from zoo.spec import MLPSpec, MoESpec

    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(a.flush_denormal == "on")
    torch.manual_seed(0)
    layer = MoE(MoESpec(expert=MLPSpec(activation="silu", gated=True, bias=False)), hidden=a.hidden, ffn_hidden=a.ffn,
                num_experts=a.experts, top_k=a.top_k)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(a.batch, a.seq, a.hidden, requires_grad=True)
    with torch.no_grad():
        _, experts, _, _ = layer.router(x.reshape(-1, a.hidden))
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=a.experts)
    xs = x.detach().reshape(-1, a.hidden)[order // a.top_k].clone().requires_grad_(True)

    def whole() -> None:
        layer(x).sum().backward()

    def gemms() -> None:
        layer._experts(xs, counts, layer.gate_up, layer.down).sum().backward()

    out = {}
    for name, fn in (("layer_s", whole), ("gemm_s", gemms)):
        for _ in range(2):
            fn()
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = sorted(ts)[3]
    out["dispatch_fraction"] = 1 - out["gemm_s"] / out["layer_s"]
    print(json.dumps(out))


def run_child(extra: list[str], a: argparse.Namespace, *, live: bool = True) -> dict:
    keep = {k: v for k, v in vars(a).items() if k not in ("worker", "dispatch", "impl", "precision", "quick", "flush_denormal", "bf16")}
    cmd = [sys.executable, __file__, *extra, *[f"--{k.replace('_', '-')}={v}" for k, v in keep.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), **(LIVE_ENV if live else {})}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bf16", action="store_true", help="run bf16 on a CPU without bf16 instructions too")
    # Subnormal floats run a slow microcode path on x86 CPUs (AdamW's tiny second moments in bf16
    # autocast produce them); "both" measures each precision with and without flushing them to zero.
    p.add_argument("--flush-denormal", choices=("off", "on", "both"), default="both")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dispatch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="zoo", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.dispatch:
        return dispatch(a)
    if a.quick:
        a.layers, a.seq, a.steps = 2, 256, 3
    print(f"# {platform.processor() or platform.machine()}, {a.threads} threads; {a.layers} layers, hidden {a.hidden}, "
          f"{a.experts} experts top-{a.top_k} (width {a.ffn}), seq {a.seq}, batch {a.batch}")
    peaks = measured_gemm_peaks(a.threads)
    print(f"# GEMM peak (best 2048^3 product) fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    flushes = ("off", "on") if a.flush_denormal == "both" else (a.flush_denormal,)
    skip = bf16_skipped(peaks, a.bf16)
    if skip:
        print(f"# {skip}")
    for precision, flush in [(prec, f) for prec in (("fp32",) if skip else ("fp32", "bf16")) for f in flushes]:
        res = {}
        for impl in ("hf", "zoo"):
            args = ["--worker", f"--impl={impl}", f"--precision={precision}", f"--flush-denormal={flush}"]
            # Timed under the default allocator; memory in a second process whose mmap threshold
            # makes peak RSS follow live memory (its page faults would distort the timing).
            timed = run_child(args, a, live=False)
            res[impl] = {**run_child(args, a), "tokens_per_s": timed["tokens_per_s"], "step_s": timed["step_s"]}
        z, h = res["zoo"], res["hf"]
        z_act, h_act = z["rss_over_model_mb"] - z["state_mb"], h["rss_over_model_mb"] - h["state_mb"]
        print(f"{precision} (denormals flushed: {flush}): zoo {z['tokens_per_s']:,.0f} tok/s vs HF {h['tokens_per_s']:,.0f} -> "
              f"{z['tokens_per_s'] / h['tokens_per_s']:.2f}x; peak RSS zoo {z['peak_rss_mb']:,.0f} MB vs HF "
              f"{h['peak_rss_mb']:,.0f} MB -> {z['peak_rss_mb'] / h['peak_rss_mb']:.2f}x; above the built model "
              f"{z['rss_over_model_mb']:,.0f} vs {h['rss_over_model_mb']:,.0f} MB -> "
              f"{z['rss_over_model_mb'] / h['rss_over_model_mb']:.2f}x; less the gradients and Adam moments "
              f"({z['state_mb']:,.0f} MB each side) {z_act:,.0f} vs {h_act:,.0f} MB -> {z_act / h_act:.2f}x")
        print(f"  {precision} tokens/s {ceiling(gemm_flops_per_token(a) * a.batch * a.seq, peaks[precision], h['step_s'])}")
    d = run_child(["--dispatch", f"--flush-denormal={flushes[-1]}"], a)
    print(f"dispatch: MoE layer fwd+bwd {d['layer_s'] * 1e3:.1f} ms, expert GEMMs {d['gemm_s'] * 1e3:.1f} ms -> "
          f"dispatch overhead {d['dispatch_fraction']:.0%} of the layer")


if __name__ == "__main__":
    main()
