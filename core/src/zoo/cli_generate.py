"""`zoo generate`: text from language models, images and clips from diffusion models, answers and
zero-shot labels from image-text models; each family's own entry does the work."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zoo.errors import UsageError, at_least_one


def _registry(args: argparse.Namespace) -> Any:
    from zoo.registry import get_registry

    return get_registry(only=getattr(args, "plugins", None))


def cmd_generate(args: argparse.Namespace) -> int:
    import contextlib

    import torch

    from zoo import kernels
    from zoo.checkpoint.external import load
    from zoo.checkpoint.state import resolve_checkpoint
    from zoo.config import torch_dtype
    from zoo.parallel.distributed import pick_device

    path = resolve_checkpoint(args.checkpoint)
    device = pick_device(args.device, what="--device")
    dtype = torch_dtype(args.dtype) if args.dtype != "fp32" else None  # (None: float32, no autocast)
    # Generation computes with the kernels that need no compiling (a compile costs more than a
    # short generation): torch's products and elementwise kernels, the providers' attention core.
    chosen = kernels.select(device, {"cpu_fused": "eager", "cpu_gemm": "blas", "cpu_malloc": "system",
                                     "precision": args.dtype})
    for note in chosen.notes():
        print(note.replace("fp32 is", "--dtype fp32 is"), file=sys.stderr, flush=True)  # (stdout is the output)
    loaded = load(path, device=device, weights=args.weights, dtype=dtype)
    # bf16/fp16 as a training run with train.param_dtype computes: parameters in that type, under
    # autocast (norms, softmax and the losses' reductions in float32; the families' own float32 parts stay)
    compute = torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with compute, chosen.use():
        return _generate(args, path, loaded)


def _generate(args: argparse.Namespace, path: Any, loaded: Any) -> int:
    import torch

    from zoo.data.tokenizer import load_tokenizer
    from zoo.family import resolve

    entry = _registry(args).get(loaded.family)
    fam = entry.family
    if args.model is not None and _registry(args).get(args.model).family.name != fam.name:
        raise UsageError(f"--model {args.model}: {path} holds a {fam.name!r} model")
    if fam.generate is None:
        raise UsageError(f"family {fam.name!r} (task {fam.task}) has no generation entry")
    if fam.task == "diffusion":
        return _generate_samples(args, resolve(fam.generate, owner=str(entry.plugin)), loaded)
    tok_source = args.tokenizer or loaded.tokenizer_dir
    if tok_source is None:
        raise UsageError(f"{path} holds no tokenizer.json; pass --tokenizer (a tokenizer directory or 'bytes')")
    tok = load_tokenizer(tok_source)
    if fam.task != "causal_lm":  # image-text families: the family's entry reads the request and answers in text
        labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
        if labels is not None and not all(labels):
            raise UsageError(f"--labels {args.labels!r}: an empty label (comma-separated texts, e.g. 'a 0,a 1')")
        print(resolve(fam.generate, owner=str(entry.plugin))(
            loaded.model, loaded.config, images=args.image, labels=labels, prompt=args.prompt, tokenizer=tok,
            max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache))
        return 0
    if args.prompt is None:
        raise UsageError(f"family {fam.name!r}: zoo generate continues a text: give --prompt")
    ids, end = tok.encode(args.prompt), tok.eod_id
    if args.chat:  # the prompt asked as a user message, through the chat template the model learned
        from zoo.data.sft import chat_prompt

        ids, end = chat_prompt(tok, str(tok_source), args.chat_template, args.prompt)
    generate = resolve(fam.generate, owner=str(entry.plugin))
    out = generate(loaded.model, loaded.config, prompt=torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                   temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, use_cache=not args.no_cache, eos_id=end)
    new = out[0, len(ids):].tolist()
    if end in new:
        new = new[: new.index(end)]
    elif len(new) < args.max_new_tokens:  # (said, not silent: the model's context ended the text)
        print(f"zoo: {len(new)} of the {args.max_new_tokens} new tokens asked: the model's context ends at "
              f"{len(ids) + len(new)} positions", file=sys.stderr, flush=True)
    print(tok.decode(new) if args.chat else args.prompt + tok.decode(new))  # (a chat prints the answer)
    return 0


def _generate_samples(args: argparse.Namespace, generate: Any, loaded: Any) -> int:
    """A diffusion family: images (a grid, one per --class) or a clip, written to --output."""
    output = args.output or args.video_save_path
    if output is None:
        raise UsageError("--output FILE (.png for images, .gif or .mp4 for a clip) is required for a diffusion model")
    request = {"labels": args.classes, "num_steps": args.num_steps, "guidance": args.guidance,
               "guidance_form": args.guidance_form, "guidance_channels": args.guidance_channels,
               "sampler": args.sampler, "seed": args.seed, "height": args.height,
               "width": args.width, "frames": args.num_video_frames, "num_samples": args.num_samples,
               "prompt": args.prompt, "text_encoder": args.text_encoder}
    try:
        print(f"wrote {generate(loaded.model, loaded.config, output=output, nrow=args.nrow, **{k: v for k, v in request.items() if v is not None})}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0



def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="sample text, images or clips from a checkpoint (zoo or Hugging Face directory)")
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoint directory, run directory or HF directory")
    p.add_argument("--model", "-m", help="the family the checkpoint must hold (checked; it is read from the checkpoint)")
    p.add_argument("--prompt", help="text to continue (language models) or to condition on (text-to-video)")
    p.add_argument("--chat", action="store_true",
                   help="ask --prompt as a user message through the checkpoint's chat template (an sft run's) and "
                        "print the answer")
    p.add_argument("--chat-template", help="a Jinja chat template file for --chat (default: the checkpoint's)")
    p.add_argument("--max-new-tokens", type=at_least_one, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (no KV cache)")
    p.add_argument("--tokenizer", help="tokenizer directory, tokenizer.json or 'bytes' (default: the checkpoint's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs (auto: a GPU when there is one, as train.device); a --seed draws the "
                        "same samples on either")
    p.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                   help="sample with the moving average of the weights (train.ema) or the raw ones; auto: the average if kept")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="the parameters' type: bf16/fp16 hold them in half the memory of fp32 and compute under "
                        "autocast, as train.param_dtype trains")
    v = p.add_argument_group("image-text models (CLIP, LLaVA)")
    v.add_argument("--image", nargs="+", help="image file(s), any size (resized and centre-cropped as CLIP's processor "
                                              "does): LLaVA answers --prompt about one, CLIP classifies each")
    v.add_argument("--labels", help="CLIP zero-shot: comma-separated label texts, e.g. 'a 0,a 1,a 2'")
    d = p.add_argument_group("diffusion models (DiT); DFM's argument names are accepted")
    d.add_argument("--class", dest="classes", type=int, nargs="+", help="class(es) to draw, one sample each")
    d.add_argument("--num-steps", "--num_steps", type=at_least_one,
                   help="sampler steps (default: EDM's Heun 18, 2 evaluations each; DDPM 250; DDIM 50)")
    d.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale (1: none)")
    d.add_argument("--guidance-form", choices=["standard", "dfm"], default="standard",
                   help="standard: uncond + g (cond - uncond); dfm: cond + g (cond - uncond)")
    d.add_argument("--sampler", "--solver", choices=["heun", "euler", "ddpm", "ddim"],
                   help="EDM models: heun (default) or euler; the original DiT's VP models (model.objective=vp): "
                        "ddpm (default, the learned variance) or ddim")
    d.add_argument("--guidance-channels", type=at_least_one,
                   help="VP models: guide only the first N epsilon channels (facebookresearch's sample.py: 3; "
                        "default: all, as diffusers' DiTPipeline)")
    d.add_argument("--height", type=at_least_one, help="latent height (default: the model's sample size)")
    d.add_argument("--width", type=at_least_one, help="latent width")
    d.add_argument("--num-video-frames", "--num_video_frames", type=at_least_one, help="latent frames of a clip")
    d.add_argument("--num-samples", type=at_least_one, help="samples to draw when no --class is given")
    d.add_argument("--nrow", type=at_least_one, help="images per row of the grid")
    d.add_argument("--output", help="file to write: .png (grid), .gif or .mp4 (clip)")
    d.add_argument("--video-save-path", "--video_save_path", help="DFM's name for --output")
    d.add_argument("--text-encoder", help="T5 encoder directory for --prompt (default: the built-in datasets' own)")
    p.set_defaults(func=cmd_generate)
