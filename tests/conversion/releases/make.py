"""Writes what a released transformers (and diffusers) itself saves for one tiny model of every
architecture `zoo convert` reads, with that release's own outputs, so conversion is tested against
files real releases wrote (`tests/conversion/test_release_files.py`), not only the installed one.

Run once per release, in an environment where that release (and torch) is importable; the files
are checked in beside this script:

    python -m venv /tmp/tf445 && /tmp/tf445/bin/pip install torch==2.13.0 transformers==4.45.2 diffusers==0.30.3
    /tmp/tf445/bin/python tests/conversion/releases/make.py

Each run writes ``tf<version>/<Architecture>/`` (``save_pretrained``'s config.json and weights, and
``expected.safetensors``: the inputs and the release's logits) for every architecture that release
has, and with diffusers ``diffusers<version>/<name>/`` likewise (inputs ``x, t, y`` and the
predicted ``sample``). The configurations use only fields every release knows.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 48
# (eager attention: some releases' SDPA path ignored the sliding window, which their eager path applies)
_DEC = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")


def _lm(tf: Any) -> dict[str, Callable[[], Any]]:
    moe = dict(_DEC, num_experts_per_tok=2)
    return {
        "LlamaForCausalLM": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_DEC, tie_word_embeddings=False)),
        "MistralForCausalLM": lambda: tf.MistralForCausalLM(tf.MistralConfig(**_DEC, sliding_window=4)),
        "Qwen2ForCausalLM": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_DEC, tie_word_embeddings=True)),
        "Qwen3ForCausalLM": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_DEC, head_dim=8)),
        "Gemma2ForCausalLM": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **_DEC, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
        "Gemma3ForCausalLM": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **_DEC, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
        "Gemma3ForConditionalGeneration": lambda: tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            attn_implementation="eager", text_config=dict(_DEC, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, num_hidden_layers=3),
            vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14), mm_tokens_per_image=4)),
        "GPT2LMHeadModel": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4,
                                                                     n_positions=32, attn_implementation="eager")),
        "MixtralForCausalLM": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**moe, num_local_experts=4)),
        "Qwen2MoeForCausalLM": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **moe, num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=12)),
        "Qwen3MoeForCausalLM": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **moe, num_experts=4, moe_intermediate_size=8, head_dim=8)),
        "MambaForCausalLM": lambda: tf.MambaForCausalLM(tf.MambaConfig(
            vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)),
        "Mamba2ForCausalLM": lambda: tf.Mamba2ForCausalLM(tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=16, num_heads=4, head_dim=8, n_groups=1, state_size=8, chunk_size=4,
            num_hidden_layers=2, expand=2)),
        "NemotronHForCausalLM": lambda: tf.NemotronHForCausalLM(tf.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=4, intermediate_size=24, mamba_num_heads=4, mamba_head_dim=8, n_groups=1, ssm_state_size=8,
            chunk_size=4, max_position_embeddings=32, attn_implementation="eager", **_nemotron_layers(tf))),
    }


def _nemotron_layers(tf: Any) -> dict[str, Any]:
    """Mamba, attention, MLP: the releases name the pattern differently."""
    import inspect

    params = inspect.signature(tf.NemotronHConfig.__init__).parameters
    if "layers_block_type" in params:
        return {"layers_block_type": ["mamba", "attention", "mlp"]}
    return {"hybrid_override_pattern": "M*-"}


def _clip_files(tf: Any, root: str) -> None:
    """CLIPModel: the text and image embeddings (ids end with the end token 5, padded with it)."""
    torch.manual_seed(0)
    text = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=16, projection_dim=8, eos_token_id=5)
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, image_size=8,
                  patch_size=4, projection_dim=8)
    model = _perturb(tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
                                                attn_implementation="eager")))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, VOCAB, (2, 10), generator=g)
    for row, end in enumerate((4, 9)):
        ids[row, end:] = 5
    px = torch.randn(2, 3, 8, 8, generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=px)
    where = os.path.join(root, "CLIPModel")
    model.save_pretrained(where, safe_serialization=True)
    save_file({"input_ids": ids, "pixel_values": px, "text_embeds": out.text_embeds.contiguous(),
               "image_embeds": out.image_embeds.contiguous()}, os.path.join(where, "expected.safetensors"))
    print(where)


def _perturb(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the init values (ones, zeros): a swapped tensor shows
    return model.eval()


def transformers_files() -> None:
    import transformers as tf

    root = os.path.join(HERE, f"tf{tf.__version__}")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    for name, build in _lm(tf).items():
        if not hasattr(tf, name):
            print(f"transformers {tf.__version__}: no {name}")
            continue
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _perturb(build())
            assert getattr(model.config, "_attn_implementation", "eager") in ("eager", None), name
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            where = os.path.join(root, name)
            model.save_pretrained(where, safe_serialization=True)
        save_file({"input_ids": ids, "logits": logits.contiguous()}, os.path.join(where, "expected.safetensors"))
        print(where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _clip_files(tf, root)


def diffusers_files() -> None:
    import diffusers

    root = os.path.join(HERE, f"diffusers{diffusers.__version__}")
    g = torch.Generator().manual_seed(1)
    for name, out_channels in (("dit", 4), ("dit_learn_sigma", 8)):
        torch.manual_seed(0)
        model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                out_channels=out_channels, num_layers=2, sample_size=8, patch_size=2,
                                                num_embeds_ada_norm=10)
        _perturb(model)
        blocks = model.transformer_blocks  # (a released checkpoint's per-block embedder copies are equal)
        with torch.no_grad():
            for blk in blocks[1:]:
                blk.norm1.emb.load_state_dict(blocks[0].norm1.emb.state_dict())
        x = torch.randn(2, 4, 8, 8, generator=g)
        t = torch.tensor([3, 700])
        y = torch.tensor([1, 10])  # (10: the null class)
        with torch.no_grad():
            sample = model(x, timestep=t, class_labels=y).sample
        where = os.path.join(root, name)
        model.save_pretrained(where, safe_serialization=True)
        save_file({"x": x, "t": t, "y": y, "sample": sample.contiguous()}, os.path.join(where, "expected.safetensors"))
        print(where)


if __name__ == "__main__":
    transformers_files()
    try:
        import diffusers  # noqa: F401
    except ImportError:
        pass
    else:
        diffusers_files()
