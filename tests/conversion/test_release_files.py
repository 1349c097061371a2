"""Files released transformers and diffusers versions wrote themselves (`releases/make.py`), for
every architecture `zoo convert` reads: each loads through zoo's reader of that format and
computes what that release computed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

RELEASES = Path(__file__).parent / "releases"
FILES = sorted(p.parent for p in RELEASES.glob("*/*/expected.safetensors"))
# Releases whose own CPU path computed something else than their kernels and later releases, on
# the same weights: zoo follows the fixed computation, checked against the installed release
# reading that old file (the old logits must differ by the bug, or the entry is stale).
_DT_CLAMP = ("its torch fallback clamped dt at time_step_min (0.001) instead of time_step_limit; mamba_ssm's "
             "kernels and later releases clamp at the limit")
RELEASE_BUGS = {("tf4.45.2", "Mamba2ForCausalLM"): _DT_CLAMP, ("tf5.6.2", "NemotronHForCausalLM"): _DT_CLAMP,
                ("tf5.12.1", "NemotronHForCausalLM"): _DT_CLAMP}


def _installed_reading(src: Path) -> torch.nn.Module:
    """The installed transformers' model of an old file, every tensor of the file in it (transformers
    5.24 reads NemotronH's ``backbone.*`` as ``model.*`` but not ``backbone.embedding`` as
    ``model.embeddings``, which 5.6 and 5.12 wrote, and would leave that embedding at its random init)."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(src), output_loading_info=True)
    stored = load_file(src / "model.safetensors")
    for key in info["missing_keys"]:
        old = key.replace("model.embeddings.", "model.embedding.")
        assert old in info["unexpected_keys"], (key, info)
        with torch.no_grad():
            model.get_parameter(key).copy_(stored[old.replace("model.", "backbone.", 1)])
    return model.eval()


def _release(path: Path) -> str:
    return path.parent.name


def test_every_architecture_has_files_from_three_releases():
    """At least three releases per architecture (the architectures newer than transformers 4.45
    from the releases that have them), spanning 4.4x to 5.x (and two of diffusers for DiT)."""
    from zoo.checkpoint.external import _formats

    by_arch: dict[str, set[str]] = {}
    for f in FILES:
        by_arch.setdefault(f.name, set()).add(_release(f))
    tf = {a for _, fmt in _formats("hf") for a in fmt.architectures} - {"GPT2Model"}
    for arch in sorted(tf - {"LlavaForConditionalGeneration"}):  # (LLaVA's: plugins/vlm/tests/data)
        have = by_arch.get(arch, set())
        assert len(have) >= 3, (arch, sorted(have))
        assert any(r.startswith("tf5.") for r in have), (arch, sorted(have))
    for arch in ("LlamaForCausalLM", "GPT2LMHeadModel", "MixtralForCausalLM", "MambaForCausalLM"):
        assert any(r.startswith("tf4.4") for r in by_arch[arch]), arch
    for name in ("dit", "dit_learn_sigma"):
        assert len({r for r in by_arch[name] if r.startswith("diffusers")}) >= 2


@pytest.mark.parametrize("where", FILES, ids=[f"{_release(f)}-{f.name}" for f in FILES])
def test_a_released_file_loads_and_computes_what_its_release_computed(where, tmp_path):
    from zoo.checkpoint.external import load

    src = tmp_path / where.name
    shutil.copytree(where, src)  # (read as a user's directory: nothing is written beside the fixture)
    loaded = load(src)
    model = loaded.model.eval()
    ref = load_file(where / "expected.safetensors")
    with torch.no_grad():
        if "sample" in ref:
            from zoo_dit.model import patchify, unpatchify

            cfg = loaded.config
            toks, pos = patchify(ref["x"][:, :, None], 1, cfg.patch_size, cfg.patch_size)
            out = model(toks, positions=pos.expand(len(toks), -1, -1), noise_level=ref["t"].float()[:, None],
                        labels=ref["y"][:, None])
            g = ref["x"].shape[-1] // cfg.patch_size
            got, want = unpatchify(out, (1, g, g), 1, cfg.patch_size, cfg.patch_size)[:, :, 0], ref["sample"]
        elif "image_embeds" in ref:  # CLIPModel
            got = torch.cat([model.embed_texts(ref["input_ids"]), model.embed_images(ref["pixel_values"])])
            want = torch.cat([ref["text_embeds"], ref["image_embeds"]])
        else:
            got, want = model(ref["input_ids"]), ref["logits"]
            if (_release(where), where.name) in RELEASE_BUGS:
                old, want = want, _installed_reading(src)(input_ids=ref["input_ids"]).logits
                assert (old - want).abs().max() > 1e-5 * max(1.0, want.abs().max().item()), \
                    "the release's own logits agree now: drop RELEASE_BUGS' entry"
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-5 * scale
