"""zoo's probes for the architectures that are not causal LMs, over the public harness
(`zoo.testing.conversion`: one draw through the user's path, judged against the library's model)."""

from __future__ import annotations

import re

import torch

from zoo.testing.conversion import CAUSAL_LM, Draw, Outcome, Probe, SilentDifference, run

# ------------------------------------------------------------------------------------ DiT


def _dit_inputs(draw: Draw, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    c = draw.config
    x = torch.randn(draw.batch, c["in_channels"], c["sample_size"], c["sample_size"], generator=g)
    t = torch.randint(0, 1000, (draw.batch,), generator=g).float()
    y = torch.randint(0, c["num_embeds_ada_norm"] + 1, (draw.batch,), generator=g)  # (the last: the null class)
    return x, t, y


def _dit_ours(model: torch.nn.Module, draw: Draw, inputs) -> tuple[torch.Tensor, None]:
    from zoo_dit.model import patchify, unpatchify

    x, t, y = inputs
    cfg = model.cfg
    toks, pos = patchify(x[:, :, None], 1, cfg.patch_size, cfg.patch_size)
    out = model(toks, positions=pos.expand(len(x), -1, -1), noise_level=t[:, None], labels=y[:, None])
    g = x.shape[-1] // cfg.patch_size
    return unpatchify(out, (1, g, g), 1, cfg.patch_size, cfg.patch_size)[:, :, 0], None


def _dit_loss(out: torch.Tensor, draw: Draw, inputs, seed: int) -> torch.Tensor:
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2)).to(out.dtype)
    return torch.nn.functional.mse_loss(out, target)


def _equal_dit_embedders(model: torch.nn.Module) -> None:
    """diffusers' DiT holds a copy of the timestep/class embedder in every block; a released
    checkpoint's copies are equal (zoo refuses copies that differ)."""
    blocks = model.transformer_blocks
    with torch.no_grad():
        for blk in blocks[1:]:
            blk.norm1.emb.load_state_dict(blocks[0].norm1.emb.state_dict())


_COPY = re.compile(r"transformer_blocks\.\d+\.(norm1\.emb\..*)")


def _summed_copies(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The library's gradients with each DiT embedder copy's replaced by the sum over the copies:
    the gradient of the one embedder zoo holds (and `Replicate` writes to every copy)."""
    total: dict[str, torch.Tensor] = {}
    for k, g in grads.items():
        m = _COPY.fullmatch(k)
        if m:
            total[m[1]] = total.get(m[1], 0) + g
    return {k: total[m[1]] if (m := _COPY.fullmatch(k)) else g for k, g in grads.items()}


DIT = Probe(inputs=_dit_inputs,
            theirs=lambda model, draw, inputs: (model(inputs[0], timestep=inputs[1], class_labels=inputs[2]).sample,
                                                None),
            ours=_dit_ours, loss=_dit_loss, prepare=_equal_dit_embedders, grads=_summed_copies)

# ------------------------------------------------------------------------------------ CLIP


def _clip_inputs(draw: Draw, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    t, vcfg = draw.config.text_config, draw.config.vision_config
    eot = t.vocab_size - 1 if t.eos_token_id == 2 else t.eos_token_id  # (legacy: the highest id ends a text)
    tokens = torch.randint(0, t.vocab_size - 1, (draw.batch, draw.seq), generator=g)
    tokens[tokens == eot] = (eot + 1) % (t.vocab_size - 1)
    for row in range(draw.batch):
        end = int(torch.randint(1, draw.seq, (), generator=g)) if row else draw.seq - 1
        tokens[row, end:] = eot  # (padded with it after, as OpenAI's tokenizer does)
    pixels = torch.randn(draw.batch, vcfg.num_channels, vcfg.image_size, vcfg.image_size, generator=g)
    return tokens, pixels


def _clip_theirs(model: torch.nn.Module, draw: Draw, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=inputs[0], pixel_values=inputs[1], return_loss=True)
    return torch.cat([out.text_embeds, out.image_embeds]), out.loss  # (the contrastive loss of the same forward)


def _clip_ours(model: torch.nn.Module, draw: Draw, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([model.embed_texts(inputs[0]), model.embed_images(inputs[1])]), model(inputs[1], inputs[0])


CLIP = Probe(inputs=_clip_inputs, theirs=_clip_theirs, ours=_clip_ours)

# ----------------------------------------------------------------------------------- LLaVA


def _llava_inputs(draw: Draw, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    c, v = draw.config, draw.vocab_size
    grid = (c.vision_config.image_size // c.vision_config.patch_size) ** 2
    n_image = grid + (c.vision_feature_select_strategy == "full")  # (full keeps the class token)
    tokens = torch.randint(0, v - 1, (draw.batch, draw.seq + n_image), generator=g)
    at = int(torch.randint(0, draw.seq, (), generator=g))
    tokens[:, at:at + n_image] = c.image_token_index  # (widened, as HF's processor does)
    labels = torch.randint(0, v, tokens.shape, generator=g)
    pixels = torch.randn(draw.batch, 3, c.vision_config.image_size, c.vision_config.image_size, generator=g)
    return tokens, labels, pixels


LLAVA = Probe(inputs=_llava_inputs,
              theirs=lambda model, draw, inputs: (model(input_ids=inputs[0], pixel_values=inputs[2],
                                                        use_cache=False).logits, None),
              ours=lambda model, draw, inputs: (model(inputs[0], images=inputs[2]), None),
              loss=CAUSAL_LM.loss)

__all__ = ["CLIP", "DIT", "LLAVA", "Outcome", "SilentDifference", "run"]
