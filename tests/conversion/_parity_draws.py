"""Random small configurations of every architecture `zoo convert` reads, drawn from
``random.Random(seed)`` over each mapped field's legal range with its edges (top-1 and top-all
experts, one KV head and as many as query heads, tied and untied embeddings, every RoPE type the
library knows, windows, biases, chunk sizes that do not divide the sequence, learn_sigma), and
now and then a value of a fixed field zoo does not compute (which must then be refused).

A draw is a `Draw`: the library's config object, how to build the library's model from it, and
the inputs to run. Draws the library itself rejects are drawn again (they are not checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from random import Random
from typing import Any

import torch
from _parity_harness import CLIP, DIT, LLAVA

from zoo.testing.conversion import Draw


def _rare(rng: Random, p: float = 0.08) -> bool:
    """A fixed field set off its supported value now and then, so refusals are drawn too."""
    return rng.random() < p


def _heads(rng: Random) -> tuple[int, int]:
    heads = rng.choice([1, 2, 3, 4, 6])
    kv = rng.choice([1, heads, rng.choice([d for d in range(1, heads + 1) if heads % d == 0])])
    return heads, kv


def _rope(rng: Random, ctx: int) -> dict[str, Any]:
    theta = rng.choice([10000.0, 500000.0, 1e6, float(rng.randint(100, 20000))])
    kind = rng.choice(["default", "default", "linear", "llama3", "dynamic", "yarn"])
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": theta}
    if kind in ("linear", "dynamic", "yarn"):
        params["factor"] = rng.choice([1.0, 2.0, 4.0, round(rng.uniform(1.0, 8.0), 3)])
    if kind == "yarn":
        params["original_max_position_embeddings"] = ctx // 2
    if kind == "llama3":
        params.update(factor=rng.choice([2.0, 8.0, 32.0]), low_freq_factor=1.0, high_freq_factor=rng.choice([2.0, 4.0]),
                      original_max_position_embeddings=rng.choice([4, 8, 16]))
    return params


def _decoder(rng: Random, *, head_dim_free: bool = True) -> dict[str, Any]:
    heads, kv = _heads(rng)
    per = rng.choice([2, 4, 6, 8])
    hidden = heads * per
    head_dim = rng.choice([2, 4, 8, per]) if head_dim_free else per
    ctx = 64
    return dict(vocab_size=rng.randint(17, 97), hidden_size=hidden, intermediate_size=rng.randint(5, 48),
                num_hidden_layers=rng.randint(1, 3), num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, max_position_embeddings=ctx, rms_norm_eps=rng.choice([1e-6, 1e-5, 3e-4]),
                tie_word_embeddings=rng.random() < 0.5, rope_parameters=_rope(rng, ctx),
                hidden_act="gelu" if _rare(rng) else "silu", initializer_range=0.02)


def _windows(rng: Random, cfg: dict[str, Any], *, flag: bool, types: bool) -> None:
    if rng.random() < 0.5:
        return
    cfg["sliding_window"] = rng.randint(1, 10)
    if flag:
        cfg["use_sliding_window"] = True
        n = cfg["num_hidden_layers"]
        cfg["max_window_layers"] = rng.randint(0, n)
        if types and rng.random() < 0.5:
            cfg["layer_types"] = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(n)]


def _lm(model_type: str) -> Callable[[Any], torch.nn.Module]:
    def build(config: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if model_type in _MOE:  # the reference: experts one by one (grouped_mm needs 16-byte aligned sizes)
            return AutoModelForCausalLM.from_config(config, experts_implementation="eager")
        return AutoModelForCausalLM.from_config(config)
    return build


_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "nemotron_h")


def _image_text(architecture: str) -> Callable[[Any], torch.nn.Module]:
    def build(config: Any) -> torch.nn.Module:
        import transformers

        return getattr(transformers, architecture)(config)
    return build


def _tf(model_type: str, fields: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


def llama(rng: Random) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng)
    cfg.update(attention_bias=rng.random() < 0.3, mlp_bias=_rare(rng))
    return "llama", cfg


def mistral(rng: Random) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng)
    _windows(rng, cfg, flag=False, types=False)
    return "mistral", cfg


def qwen2(rng: Random) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng, head_dim_free=False)
    cfg.pop("head_dim")
    _windows(rng, cfg, flag=True, types=True)
    return "qwen2", cfg


def qwen3(rng: Random) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng)
    cfg.update(attention_bias=_rare(rng))
    _windows(rng, cfg, flag=True, types=True)
    return "qwen3", cfg


def _gemma(rng: Random, kind: str) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng)
    del cfg["hidden_act"]
    n = cfg["num_hidden_layers"]
    cfg.update(hidden_activation="gelu_pytorch_tanh" if not _rare(rng) else "silu",
               query_pre_attn_scalar=rng.choice([cfg["head_dim"], 16, 7]), sliding_window=rng.randint(1, 10),
               layer_types=[rng.choice(["sliding_attention", "full_attention"]) for _ in range(n)],
               final_logit_softcapping=rng.choice([None, 30.0, 0.5]), tie_word_embeddings=not _rare(rng))
    rope = cfg.pop("rope_parameters")
    if kind == "gemma2":
        cfg.update(attn_logit_softcapping=rng.choice([None, 50.0, 0.3]), rope_parameters=rope)
    else:
        cfg.update(attn_logit_softcapping=0.5 if _rare(rng) else None,
                   rope_parameters={"full_attention": rope, "sliding_attention": {
                       "rope_type": "default", "rope_theta": rng.choice([10000.0, 500.0])}})
    return kind, cfg


def gemma3_image_text(rng: Random) -> tuple[str, dict[str, Any]]:
    """Gemma3ForConditionalGeneration (the 4B-27B releases): a Gemma 3 text config under a tiny
    SigLIP tower; the top-level flag ties the head."""
    _, text = _gemma(rng, "gemma3_text")
    tied = text.pop("tie_word_embeddings")
    vision = dict(hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return "gemma3", dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=tied)


def _language_model(name: str) -> str | None:
    """Gemma3ForConditionalGeneration's in-memory names -> the language model's, as its files hold it."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    return None


def _as_causal_lm(name: str) -> str | None:
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name if name.startswith("lm_head.") else None


def clip(rng: Random) -> tuple[str, dict[str, Any]]:
    """CLIPModel: both towers and the projections; ``eos_token_id`` 2 is the legacy rule (pool at the
    highest id, OpenAI's end token), any other id pools at its first occurrence."""
    def tower(**more: Any) -> dict[str, Any]:
        heads = rng.choice([1, 2, 4])
        return dict(hidden_size=heads * rng.choice([2, 4, 8]), intermediate_size=rng.randint(4, 24),
                    num_hidden_layers=rng.randint(1, 2), num_attention_heads=heads,
                    layer_norm_eps=rng.choice([1e-5, 1e-6]), hidden_act="gelu" if _rare(rng) else "quick_gelu",
                    attention_dropout=0.0, **more)
    vocab = rng.randint(17, 60)
    size = rng.choice([4, 8, 12])
    text = tower(vocab_size=vocab, max_position_embeddings=rng.choice([16, 20]),
                 eos_token_id=rng.choice([2, 2, rng.randint(3, vocab - 1)]))
    vision = tower(image_size=size, patch_size=rng.choice([p for p in (2, 4, 6) if size % p == 0]),
                   num_channels=rng.choice([3, 3, 1]))
    return "clip", dict(text_config=text, vision_config=vision, projection_dim=rng.choice([4, 8, 16]),
                        logit_scale_init_value=rng.choice([2.6592, 1.0, 5.0]))


def llava(rng: Random) -> tuple[str, dict[str, Any]]:
    """LlavaForConditionalGeneration: a LLaMA under a CLIP vision tower, the feature layer(s) and
    strategy, the projector's bias; the image token is the vocabulary's last id."""
    _, text = llama(rng)
    text["vocab_size"] = max(text["vocab_size"], 20)
    heads = rng.choice([1, 2, 4])
    size = rng.choice([4, 8])
    layers = rng.randint(1, 3)
    vision = dict(hidden_size=heads * rng.choice([2, 4, 8]), intermediate_size=rng.randint(4, 24),
                  num_hidden_layers=layers, num_attention_heads=heads, image_size=size,
                  patch_size=rng.choice([p for p in (2, 4) if size % p == 0]), projection_dim=8,
                  hidden_act="gelu" if _rare(rng) else "quick_gelu", layer_norm_eps=rng.choice([1e-5, 1e-6]))
    layer = rng.choice([-1, -2, [-2, -1], -layers]) if layers > 1 else -1
    return "llava", dict(text_config={"model_type": "llama", **text}, vision_config={"model_type": "clip_vision_model",
                         **vision}, image_token_index=text["vocab_size"] - 1,
                         vision_feature_select_strategy=rng.choice(["default", "full"]), vision_feature_layer=layer,
                         multimodal_projector_bias=rng.random() < 0.7,
                         projector_hidden_act="relu" if _rare(rng) else "gelu",
                         tie_word_embeddings=rng.random() < 0.3)


def gpt2(rng: Random) -> tuple[str, dict[str, Any]]:
    heads = rng.choice([1, 2, 3, 4])
    d = heads * rng.choice([2, 4, 8])
    return "gpt2", dict(vocab_size=rng.randint(17, 97), n_positions=64, n_embd=d, n_layer=rng.randint(1, 3),
                        n_head=heads, n_inner=rng.choice([None, rng.randint(5, 40)]),
                        layer_norm_epsilon=rng.choice([1e-5, 1e-6]),
                        activation_function="relu" if _rare(rng) else rng.choice(["gelu_new", "gelu_pytorch_tanh"]),
                        scale_attn_by_inverse_layer_idx=_rare(rng), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=rng.random() < 0.7)


def _experts(rng: Random) -> tuple[int, int]:
    e = rng.randint(1, 6)
    return e, rng.choice([1, e, rng.randint(1, e)])


def mixtral(rng: Random) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng)
    e, k = _experts(rng)
    cfg.update(num_local_experts=e, num_experts_per_tok=k, router_jitter_noise=0.1 if _rare(rng) else 0.0,
               router_aux_loss_coef=rng.choice([0.001, 0.02]))
    _windows(rng, cfg, flag=False, types=False)
    return "mixtral", cfg


def _qwen_moe(rng: Random, kind: str) -> tuple[str, dict[str, Any]]:
    cfg = _decoder(rng, head_dim_free=kind == "qwen3_moe")
    if kind == "qwen2_moe":
        cfg.pop("head_dim")
    e, k = _experts(rng)
    n = cfg["num_hidden_layers"]
    cfg.update(num_experts=e, num_experts_per_tok=k, moe_intermediate_size=rng.randint(3, 24),
               norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=rng.choice([1, 1, 2]),
               mlp_only_layers=sorted(rng.sample(range(n), rng.randint(0, n - 1))) if n > 1 else [])
    if kind == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=rng.randint(3, 24), qkv_bias=not _rare(rng))
        _windows(rng, cfg, flag=True, types=False)
    else:
        cfg.update(attention_bias=_rare(rng))
        if rng.random() < 0.3:
            cfg.update(use_sliding_window=True, sliding_window=rng.randint(1, 10))
    return kind, cfg


def mamba(rng: Random) -> tuple[str, dict[str, Any]]:
    hidden = rng.choice([8, 12, 16, 20])
    return "mamba", dict(vocab_size=rng.randint(17, 97), hidden_size=hidden, state_size=rng.randint(2, 16),
                         num_hidden_layers=rng.randint(1, 3), expand=rng.choice([1, 2]),
                         conv_kernel=rng.choice([2, 3, 4]), time_step_rank=rng.choice(["auto", 1, 3, 8]),
                         use_bias=_rare(rng), use_conv_bias=not _rare(rng), layer_norm_epsilon=rng.choice([1e-5, 1e-6]),
                         tie_word_embeddings=rng.random() < 0.5)


def mamba2(rng: Random) -> tuple[str, dict[str, Any]]:
    hidden, expand = rng.choice([8, 12, 16]), rng.choice([1, 2])
    inner = hidden * expand
    head_dim = rng.choice([d for d in (2, 4, 8) if inner % d == 0])
    heads = inner // head_dim
    groups = rng.choice([g for g in range(1, heads + 1) if heads % g == 0])
    low, high = rng.choice([(0.0, math.inf), (0.001, 0.1), (0.0, 1.0), (0.01, math.inf)])
    return "mamba2", dict(vocab_size=rng.randint(17, 97), hidden_size=hidden, expand=expand, num_heads=heads,
                          head_dim=head_dim, n_groups=groups, state_size=rng.randint(2, 16),
                          num_hidden_layers=rng.randint(1, 3), conv_kernel=rng.choice([2, 3, 4]),
                          chunk_size=rng.choice([3, 5, 7, 16]), time_step_limit=(low, high),
                          use_bias=_rare(rng), layer_norm_epsilon=rng.choice([1e-5, 1e-6]),
                          tie_word_embeddings=rng.random() < 0.5)


def nemotron_h(rng: Random) -> tuple[str, dict[str, Any]]:
    hidden = rng.choice([8, 16])
    heads, kv = _heads(rng)
    n = rng.randint(1, 4)
    kinds = ["mamba", "attention", "mlp", "moe"]
    types = [rng.choice(kinds) for _ in range(n)]
    e = rng.randint(2, 6)
    groups = rng.choice([1, 1, 2]) if e % 2 == 0 else 1
    topk_group = 1
    k = 2 * topk_group if groups > 1 else rng.randint(1, e)
    head_dim = rng.choice([2, 4])
    inner = 2 * hidden
    return "nemotron_h", dict(
        vocab_size=rng.randint(17, 97), hidden_size=hidden, layers_block_type=types, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=rng.choice([4, 8]), intermediate_size=rng.randint(5, 24),
        ssm_state_size=rng.randint(2, 8), mamba_num_heads=inner // head_dim, mamba_head_dim=head_dim,
        n_groups=rng.choice([1, 2]), chunk_size=rng.choice([3, 5, 16]), expand=2, conv_kernel=rng.choice([2, 4]),
        n_routed_experts=e, num_experts_per_tok=k, moe_intermediate_size=rng.randint(3, 12),
        moe_shared_expert_intermediate_size=rng.randint(3, 12), n_group=groups, topk_group=topk_group,
        routed_scaling_factor=rng.choice([1.0, 2.5]), max_position_embeddings=64,
        mlp_hidden_act="relu2", tie_word_embeddings=rng.random() < 0.5, layer_norm_epsilon=rng.choice([1e-5, 1e-6]))


def dit(rng: Random) -> dict[str, Any]:
    c = rng.randint(1, 4)
    sample = rng.choice([4, 6, 8])
    return dict(num_attention_heads=rng.choice([1, 2, 3]), attention_head_dim=rng.choice([4, 8, 16]), in_channels=c,
                out_channels=c + 1 if _rare(rng) else rng.choice([None, c, 2 * c, 2 * c]), num_layers=rng.randint(1, 3), sample_size=sample,
                patch_size=rng.choice([p for p in (1, 2) if sample % p == 0]),
                num_embeds_ada_norm=rng.randint(1, 10), norm_eps=rng.choice([1e-5, 1e-6]),
                activation_fn="gelu" if _rare(rng) else "gelu-approximate")


TRANSFORMERS: dict[str, Callable[[Random], tuple[str, dict[str, Any]]]] = {
    "LlamaForCausalLM": llama, "MistralForCausalLM": mistral, "Qwen2ForCausalLM": qwen2, "Qwen3ForCausalLM": qwen3,
    "Gemma2ForCausalLM": partial(_gemma, kind="gemma2"), "Gemma3ForCausalLM": partial(_gemma, kind="gemma3_text"),
    "GPT2LMHeadModel": gpt2, "MixtralForCausalLM": mixtral,
    "Qwen2MoeForCausalLM": partial(_qwen_moe, kind="qwen2_moe"),
    "Qwen3MoeForCausalLM": partial(_qwen_moe, kind="qwen3_moe"),
    "MambaForCausalLM": mamba, "Mamba2ForCausalLM": mamba2, "NemotronHForCausalLM": nemotron_h,
    "Gemma3ForConditionalGeneration": gemma3_image_text, "CLIPModel": clip, "LlavaForConditionalGeneration": llava,
}
_IMAGE_TEXT = {"Gemma3ForConditionalGeneration": dict(file_name=_language_model, export_class="Gemma3ForCausalLM",
                                                      export_name=_as_causal_lm),
               "CLIPModel": dict(probe=CLIP), "LlavaForConditionalGeneration": dict(probe=LLAVA)}
ARCHITECTURES = (*TRANSFORMERS, "DiTTransformer2DModel")


def draw(architecture: str, seed: int) -> Draw:
    """The draw ``seed`` of ``architecture`` (redrawn from the same stream while the library
    rejects the configuration)."""
    rng = Random(f"{architecture}:{seed}")
    last: Exception | None = None
    for _ in range(50):
        if architecture == "DiTTransformer2DModel":
            from diffusers import DiTTransformer2DModel

            kwargs = dit(rng)
            candidate = Draw(architecture, "diffusers", kwargs, lambda kw: DiTTransformer2DModel(**kw), probe=DIT,
                             batch=rng.randint(1, 3))
        else:
            model_type, fields = TRANSFORMERS[architecture](rng)
            try:
                config = _tf(model_type, {**fields, "architectures": [architecture]})
            except Exception as e:  # (transformers' validators: ValueError and huggingface_hub's own errors)
                last = e
                continue
            build = _image_text(architecture) if architecture in _IMAGE_TEXT else _lm(model_type)
            if architecture == "CLIPModel":
                rng_seq = min(config.text_config.max_position_embeddings, rng.randint(3, 16))
            candidate = Draw(architecture, "transformers", config, build,
                             seq=rng_seq if architecture == "CLIPModel" else rng.randint(3, 17),
                             batch=rng.randint(2, 3) if architecture == "CLIPModel" else rng.randint(1, 3),
                             **_IMAGE_TEXT.get(architecture, {}))
        try:  # the library must build it (on the meta device: no memory) for it to be a checkpoint
            with torch.device("meta"):
                candidate.build(candidate.config)
        except Exception as e:
            last = e
            continue
        return candidate
    raise RuntimeError(f"{architecture}: no configuration the library accepts in 50 tries (last: {last})")
