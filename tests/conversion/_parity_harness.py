"""One draw through the whole user path, judged against the library's own model.

The library's model is built from the drawn config with random weights (every tensor off its
initial value), saved with ``save_pretrained``, imported with ``zoo convert --from``, loaded with
``zoo.load_model``, and compared: logits (diffusers: the predicted sample) within 1e-5, the loss
and every gradient of one backward within 1e-4 relative; then exported with ``zoo convert --to``
and loaded by the library's ``from_pretrained`` with no missing, unexpected or resized key and
bitwise the same tensors. Or zoo refuses the draw: exit code 1 or 2, one ``zoo: error:`` line,
nothing written. Anything else is a silent difference, reported with the draw that reproduces it.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from _parity_draws import Draw

LOGITS_TOL = 1e-5
GRAD_TOL = 1e-4
# In float64 what is left is the float32 the libraries keep on purpose (transformers' RoPE tables
# are float32 in any dtype: ~1e-7); a different computation stays far above these.
LOGITS_TOL_64 = 1e-6
GRAD_TOL_64 = 1e-6


@dataclass
class Outcome:
    status: str  # "equal" | "refused"
    detail: str = ""


class SilentDifference(AssertionError):
    pass


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
            if name.endswith(("A_log", "dt_bias", ".D")) or "norm" in name:
                p.add_(0.1 * noise)  # off their init values (ones, zeros), so a swapped tensor shows
            else:
                p.copy_(0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _equal_dit_embedders(model: torch.nn.Module) -> None:
    """diffusers' DiT holds a copy of the timestep/class embedder in every block; a released
    checkpoint's copies are equal (zoo refuses copies that differ)."""
    blocks = model.transformer_blocks
    with torch.no_grad():
        for blk in blocks[1:]:
            blk.norm1.emb.load_state_dict(blocks[0].norm1.emb.state_dict())


def _summed_copies(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The library's gradients with each DiT embedder copy's replaced by the sum over the copies:
    the gradient of the one embedder zoo holds (and `Replicate` writes to every copy)."""
    import re

    total: dict[str, torch.Tensor] = {}
    for k, g in grads.items():
        m = re.fullmatch(r"transformer_blocks\.\d+\.(norm1\.emb\..*)", k)
        if m:
            total[m[1]] = total.get(m[1], 0) + g
    return {k: total[m[1]] if (m := re.fullmatch(r"transformer_blocks\.\d+\.(norm1\.emb\..*)", k)) else g
            for k, g in grads.items()}


def _zoo(*argv: str) -> tuple[int, str]:
    from zoo.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(list(argv))
    return code, err.getvalue()


def _refusal(code: int, err: str, dst: Path, draw: Draw) -> Outcome:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Writing", "Loading"))
             and "it/s]" not in ln]
    if code not in (1, 2) or len(lines) != 1 or not lines[0].startswith("zoo: error:") or "Traceback" in err:
        raise SilentDifference(f"zoo convert --from exited {code} without a one-line error:\n{err}\n{draw.shown()}")
    if dst.exists():
        raise SilentDifference(f"zoo convert refused but wrote {dst}\n{draw.shown()}")
    return Outcome("refused", lines[0].removeprefix("zoo: error: "))


def _inputs(draw: Draw, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    if draw.kind == "dit":
        c = draw.config
        x = torch.randn(draw.batch, c["in_channels"], c["sample_size"], c["sample_size"], generator=g)
        t = torch.randint(0, 1000, (draw.batch,), generator=g).float()
        y = torch.randint(0, c["num_embeds_ada_norm"] + 1, (draw.batch,), generator=g)  # (the last: the null class)
        return x, t, y
    if draw.kind == "clip":
        t, vcfg = draw.config.text_config, draw.config.vision_config
        eot = t.vocab_size - 1 if t.eos_token_id == 2 else t.eos_token_id  # (legacy: the highest id ends a text)
        tokens = torch.randint(0, t.vocab_size - 1, (draw.batch, draw.seq), generator=g)
        tokens[tokens == eot] = (eot + 1) % (t.vocab_size - 1)
        for row in range(draw.batch):
            end = int(torch.randint(1, draw.seq, (), generator=g)) if row else draw.seq - 1
            tokens[row, end:] = eot  # (padded with it after, as OpenAI's tokenizer does)
        pixels = torch.randn(draw.batch, vcfg.num_channels, vcfg.image_size, vcfg.image_size, generator=g)
        return tokens, pixels
    if draw.kind == "llava":
        c, v = draw.config, draw.vocab_size
        grid = (c.vision_config.image_size // c.vision_config.patch_size) ** 2
        n_image = grid + (c.vision_feature_select_strategy == "full")  # (full keeps the class token)
        tokens = torch.randint(0, v - 1, (draw.batch, draw.seq + n_image), generator=g)
        at = int(torch.randint(0, draw.seq, (), generator=g))
        tokens[:, at:at + n_image] = c.image_token_index  # (widened, as HF's processor does)
        labels = torch.randint(0, v, tokens.shape, generator=g)
        pixels = torch.randn(draw.batch, 3, c.vision_config.image_size, c.vision_config.image_size, generator=g)
        return tokens, labels, pixels
    v = draw.vocab_size
    tokens = torch.randint(0, v, (draw.batch, draw.seq), generator=g)
    labels = torch.randint(0, v, (draw.batch, draw.seq), generator=g)
    return tokens, labels


_CLIP_LOSS: dict[int, torch.Tensor] = {}  # the model's own loss of its last forward (CLIP's contrastive one)


def _theirs_out(model: torch.nn.Module, draw: Draw, inputs) -> torch.Tensor:
    if draw.kind == "clip":
        out = model(input_ids=inputs[0], pixel_values=inputs[1], return_loss=True)
        _CLIP_LOSS[id(model)] = out.loss  # (the contrastive loss of the same forward)
        return torch.cat([out.text_embeds, out.image_embeds])
    if draw.kind == "dit":
        x, t, y = inputs
        return model(x, timestep=t, class_labels=y).sample
    if draw.kind == "llava":
        return model(input_ids=inputs[0], pixel_values=inputs[2], use_cache=False).logits
    return model(input_ids=inputs[0], use_cache=False).logits


def _ours_out(model: torch.nn.Module, draw: Draw, inputs) -> torch.Tensor:
    if draw.kind == "clip":
        _CLIP_LOSS[id(model)] = model(inputs[1], inputs[0])
        return torch.cat([model.embed_texts(inputs[0]), model.embed_images(inputs[1])])
    if draw.kind == "dit":
        from zoo_dit.model import patchify, unpatchify

        x, t, y = inputs
        cfg = model.cfg
        toks, pos = patchify(x[:, :, None], 1, cfg.patch_size, cfg.patch_size)
        out = model(toks, positions=pos.expand(len(x), -1, -1), noise_level=t[:, None], labels=y[:, None])
        g = x.shape[-1] // cfg.patch_size
        return unpatchify(out, (1, g, g), 1, cfg.patch_size, cfg.patch_size)[:, :, 0]
    if draw.kind == "llava":
        return model(inputs[0], images=inputs[2])
    return model(inputs[0])


def _loss(out: torch.Tensor, draw: Draw, inputs, target: torch.Tensor | None) -> torch.Tensor:
    if draw.kind == "dit":
        return torch.nn.functional.mse_loss(out, target)
    logits = out.flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                             inputs[1].flatten())


def _close(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """The difference of ``a`` from the reference ``b`` by norm, relative to ``b``'s norm or ``floor``."""
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), floor, 1e-30)).item()


def _judge(theirs: torch.nn.Module, ours: torch.nn.Module, draw: Draw, seed: int, fmt, logits_tol: float,
           grad_tol: float) -> str | None:
    """What differs between the library's model and zoo's (outputs, loss, one step's gradients), or None."""
    from zoo.checkpoint.mapping import to_external

    dtype = next(theirs.parameters()).dtype
    inputs = _inputs(draw, seed)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    want = _theirs_out(theirs, draw, inputs)
    got = _ours_out(ours, draw, inputs)
    scale = max(1.0, want.abs().max().item())
    worst = (got - want).abs().max().item()
    if not worst <= logits_tol * scale:
        return f"outputs differ by {worst:.3g} (scale {scale:.3g})"

    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 2)).to(dtype) if draw.kind == "dit" else None
    if draw.kind == "clip":
        loss_theirs, loss_ours = _CLIP_LOSS.pop(id(theirs)), _CLIP_LOSS.pop(id(ours))
    else:
        loss_theirs, loss_ours = _loss(want, draw, inputs, target), _loss(got, draw, inputs, target)
    rel = abs(loss_ours.item() - loss_theirs.item()) / max(abs(loss_theirs.item()), 1e-12)
    if not rel <= grad_tol:
        return f"losses differ: {loss_ours.item()} vs {loss_theirs.item()}"
    loss_theirs.backward()
    loss_ours.backward()
    grads_theirs = {k: p.grad for k, p in theirs.named_parameters(remove_duplicate=False) if p.grad is not None}
    params = dict(theirs.named_parameters(remove_duplicate=False))
    if draw.file_name is not None:  # (an image-text model: its language model's, under its files' names)
        params = {draw.file_name(k): p for k, p in params.items() if draw.file_name(k) is not None}
        grads_theirs = {draw.file_name(k): g for k, g in grads_theirs.items() if draw.file_name(k) is not None}
    if draw.kind == "dit":
        grads_theirs = _summed_copies(grads_theirs)
    table = fmt.table_for(ours.cfg, list(grads_theirs))
    state = {k: torch.zeros_like(v) for k, v in ours.state_dict().items()}  # (buffers: no gradient)
    state.update({k: p.grad if p.grad is not None else torch.zeros_like(p)
                  for k, p in ours.named_parameters(remove_duplicate=False)})
    grads_ours = to_external(table, state, ours.cfg)
    # A gradient that is zero in exact arithmetic (a key bias under softmax, a top-1 renormalised
    # gate) is rounding noise on both sides: differences are judged against the model's largest
    # gradient too.
    floor = 1e-3 * max(g.double().norm().item() for g in grads_theirs.values())
    seen: set[int] = set()
    for key, ref in grads_theirs.items():
        if id(params[key]) in seen:  # (a tied weight: compared under its first name)
            continue
        seen.add(id(params[key]))
        mine = grads_ours.get(key)
        for ours_prefix, theirs_prefix in table.import_prefixes:  # (transformers' in-memory names)
            if mine is None and key.startswith(theirs_prefix):
                mine = grads_ours.get(ours_prefix + key[len(theirs_prefix):])
        if mine is None:
            if ref.abs().max() == 0:
                continue
            return f"no gradient of zoo's maps to {key}"
        rel = _close(mine.reshape(ref.shape), ref, floor)
        if not rel <= grad_tol:
            return f"gradient of {key} differs by {rel:.3g} relative"

    return None


def run(draw: Draw, seed: int, tmp: Path) -> Outcome:
    import zoo
    from zoo.checkpoint.external import _formats

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = draw.build(draw.config).float().eval()
    _randomise(theirs, seed)
    if draw.kind == "dit":
        _equal_dit_embedders(theirs)
    src, dst, back = tmp / "theirs", tmp / "zoo", tmp / "back"
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        theirs.save_pretrained(src, safe_serialization=True)
    fmt_name = "diffusers" if draw.library == "diffusers" else "hf"
    code, err = _zoo("convert", "--from", fmt_name, str(src), str(dst))
    if code != 0:
        return _refusal(code, err, dst, draw)

    ours = zoo.load_model(str(dst)).eval()
    fmt = next(f for _, f in _formats(fmt_name) if draw.architecture in f.architectures)
    problem = _judge(theirs, ours, draw, seed, fmt, LOGITS_TOL, GRAD_TOL)
    if problem is not None:
        # A float32 difference is either a different computation or rounding in an ill-conditioned
        # draw (a gradient that is zero in exact arithmetic, a LayerNorm over two features): in
        # float64 the same computation agrees far closer, a different one keeps its difference.
        import copy

        theirs64, ours64 = copy.deepcopy(theirs).double(), zoo.load_model(str(dst)).eval().double()
        for p in (*theirs64.parameters(), *ours64.parameters()):
            p.grad = None
        again64 = _judge(theirs64, ours64, draw, seed, fmt, LOGITS_TOL_64, GRAD_TOL_64)
        if again64 is not None:
            raise SilentDifference(f"{problem}; in float64: {again64}\n{draw.shown()}")

    code, err = _zoo("convert", "--to", fmt_name, str(dst), str(back))
    if code != 0:
        raise SilentDifference(f"zoo convert --to failed on a model it imported:\n{err}\n{draw.shown()}")
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        import transformers

        cls = getattr(transformers, draw.export_class) if draw.export_class else type(theirs)
        again, info = cls.from_pretrained(back, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SilentDifference(f"from_pretrained of the export: {problems}\n{draw.shown()}")
    sd_theirs, sd_again = theirs.state_dict(), again.state_dict()
    if draw.export_name is not None:  # (an image-text model's language model, exported alone)
        sd_theirs = {draw.export_name(k): v for k, v in sd_theirs.items() if draw.export_name(k) is not None}
    if sd_theirs.keys() != sd_again.keys():
        raise SilentDifference(f"the export's keys differ: {sorted(sd_theirs.keys() ^ sd_again.keys())}\n{draw.shown()}")
    for k, v in sd_theirs.items():
        if not torch.equal(v, sd_again[k]):
            raise SilentDifference(f"the export's {k} is not bitwise the original\n{draw.shown()}")
    return Outcome("equal")
