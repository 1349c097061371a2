"""zoo's CLIP and LLaVA against Hugging Face's CLIPModel and LlavaForConditionalGeneration: training
samples/s and live peak memory at the same tiny-but-real config, batch, AdamW and thread count, in
fp32 and bf16 autocast.

Both sides get the identical model (converted from HF's config): CLIP's symmetric contrastive loss
(HF: `return_loss=True`), LLaVA's next-token loss on the answer (HF: `labels=` with -100 on image and
prompt positions, its processor's widened placeholders; zoo: the same rows). zoo trains under
`zoo train`'s default recompute scope. Each side is timed in a fresh process under the default
allocator, and its memory measured in another with a fixed mmap threshold, so that peak RSS follows
live memory (see benchmarks/llama_vs_hf.py).

    python benchmarks/vlm_vs_hf.py            # full size
    python benchmarks/vlm_vs_hf.py --quick    # smaller, faster
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

LIVE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def vision(a: argparse.Namespace) -> dict:
    return dict(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, image_size=a.image, patch_size=a.patch, projection_dim=a.hidden)


def build(a: argparse.Namespace):
    """(model, loss(model, batch)) and the batch, for ``a.model`` in ``a.impl``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(a.batch, 3, a.image, a.image, generator=g)
    if a.model == "clip":
        text = dict(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                    num_attention_heads=a.heads, vocab_size=a.vocab, max_position_embeddings=a.text_seq,
                    projection_dim=a.hidden, eos_token_id=1)
        hf = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision(a), projection_dim=a.hidden,
                                        attn_implementation="sdpa"))
        tokens = torch.randint(2, a.vocab, (a.batch, a.text_seq), generator=g)
        tokens[:, -1] = 1
        batch = {"images": images, "tokens": tokens}
        if a.impl == "hf":
            return hf, lambda m, b: m(input_ids=b["tokens"], pixel_values=b["images"], return_loss=True).loss, batch
        from zoo_vlm import convert
        from zoo_vlm.model import build_clip, clip_loss
        from zoo_vlm.plugin import CLIP

        cfg = convert.clip_from_hf(hf.config.to_dict())
        return build_clip(cfg, CLIP), lambda m, b: clip_loss(m, b)[0], batch
    image_id = a.vocab - 1
    lm = tf.LlamaConfig(hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                        num_attention_heads=a.heads, num_key_value_heads=a.heads // 2, vocab_size=a.vocab,
                        max_position_embeddings=2 * a.seq)
    hf = tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**vision(a)),
                                                         text_config=lm, image_token_index=image_id,
                                                         attn_implementation="sdpa"))
    n = (a.image // a.patch) ** 2
    tokens = torch.randint(0, a.vocab - 1, (a.batch, a.seq + 1), generator=g)
    tokens[:, 4:4 + n] = image_id
    answer = a.seq - 8  # the answer: the last 8 positions
    if a.impl == "hf":
        labels = torch.full_like(tokens, -100)
        labels[:, answer + 1:] = tokens[:, answer + 1:]
        return hf, lambda m, b: m(input_ids=b["ids"], pixel_values=b["images"], labels=b["hf_labels"]).loss, \
            {"ids": tokens, "images": images, "hf_labels": labels}
    from zoo_vlm import convert
    from zoo_vlm.model import build_llava, llava_loss
    from zoo_vlm.plugin import LLAVA

    cfg = convert.llava_from_hf(hf.config.to_dict())
    loss_mask = torch.zeros(a.batch, a.seq)
    loss_mask[:, answer:] = 1
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask, "images": images}
    return build_llava(cfg, LLAVA), lambda m, b: llava_loss(m, b)[0], batch


def worker(a: argparse.Namespace) -> None:
    import torch

    from zoo.config import TrainConfig
    from zoo.nn import recompute

    torch.set_num_threads(a.threads)
    if a.impl != "hf":
        from llama_vs_hf import zoo_process_settings

        zoo_process_settings()
    model, loss_of, batch = build(a)
    model.train()
    # fused on both sides: `zoo train`'s default (optimizer.implementation) and the HF Trainer's
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0, fused=True)
    dtype = torch.bfloat16 if a.precision == "bf16" else None
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def step() -> float:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None), recompute.scope(TrainConfig().recompute):
            loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    median = sorted(times)[len(times) // 2]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"samples_per_s": a.batch / median, "peak_rss_mb": peak, "over_model_mb": peak - base}))


def run_child(extra: list[str], a: argparse.Namespace, *, live: bool) -> dict:
    keep = {k: v for k, v in vars(a).items()
            if k not in ("worker", "impl", "precision", "quick", "model", "models", "precisions", "bf16")}
    cmd = [sys.executable, __file__, *extra, *[f"--{k.replace('_', '-')}={v}" for k, v in keep.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), **(LIVE_ENV if live else {})}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--text-seq", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--models", default="clip,llava")
    p.add_argument("--precisions", default="fp32,bf16", help="bf16 is left out on a CPU without bf16 instructions "
                   "unless named alone or with --bf16")
    p.add_argument("--bf16", action="store_true", help="run bf16 on a CPU without bf16 instructions too")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="zoo", help=argparse.SUPPRESS)
    p.add_argument("--model", default="clip", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.quick:
        a.layers, a.batch, a.steps = 2, 16, 3
    print(f"# {platform.processor() or platform.machine()}, {a.threads} threads; towers {a.layers} layers, hidden "
          f"{a.hidden}, {a.image}px images in {a.patch}px patches, batch {a.batch}; LLaVA rows of {a.seq}")
    precisions = a.precisions.split(",")
    if "bf16" in precisions and len(precisions) > 1:
        from llama_vs_hf import bf16_skipped, measured_gemm_peaks

        skip = bf16_skipped(measured_gemm_peaks(a.threads), a.bf16)
        if skip:
            print(f"# {skip}")
            precisions.remove("bf16")
    for model in a.models.split(","):
        for precision in precisions:
            res = {}
            for impl in ("hf", "zoo"):
                args = ["--worker", f"--impl={impl}", f"--model={model}", f"--precision={precision}"]
                # Speed under the default allocator (as users run); memory in a second process whose
                # mmap threshold makes peak RSS follow live memory (each large block returned at free),
                # which costs page faults that would distort the timing.
                res[impl] = {**run_child(args, a, live=True),
                             "samples_per_s": run_child(args, a, live=False)["samples_per_s"]}
            z, h = res["zoo"], res["hf"]
            print(f"{model} {precision}: zoo {z['samples_per_s']:,.1f} samples/s vs HF {h['samples_per_s']:,.1f} -> "
                  f"{z['samples_per_s'] / h['samples_per_s']:.2f}x; peak RSS zoo {z['peak_rss_mb']:,.0f} MB vs HF "
                  f"{h['peak_rss_mb']:,.0f} MB -> {z['peak_rss_mb'] / h['peak_rss_mb']:.2f}x; above the built model "
                  f"(activations, gradients, optimizer state) {z['over_model_mb']:,.0f} vs {h['over_model_mb']:,.0f} MB "
                  f"-> {z['over_model_mb'] / h['over_model_mb']:.2f}x")


if __name__ == "__main__":
    main()
