"""Hugging Face layouts of GPT-2 (`GPT2LMHeadModel`), the LLaMA-like decoders (`LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`), Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3
(`Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`): key tables and
config translation. The
tables are data; `zoo.checkpoint.mapping` applies them strictly both ways."""

from __future__ import annotations

from typing import Any

from zoo.checkpoint import ExternalFormat
from zoo.checkpoint.fields import FieldTable
from zoo.checkpoint.hf import library_config, make_config, rope_fields, rope_of
from zoo.checkpoint.mapping import Fuse, Ignore, MappingTable, Rename, Tie, Transpose
from zoo.errors import UsageError
from zoo_gpt.plugin import GPTConfig


def _llama_table(cfg: GPTConfig) -> MappingTable:
    L = "model.layers.{i}."
    qkv = tuple(L + f"self_attn.{n}_proj.weight" for n in "qkv")
    rules: list[Any] = [
        Rename("embed.weight", "model.embed_tokens.weight"),
        Rename("layers.{i}.attn_norm.weight", L + "input_layernorm.weight"),
        Fuse("layers.{i}.attn.qkv.weight", qkv, groups="num_kv_heads", sizes=("q_size", "kv_size", "kv_size")),
        Rename("layers.{i}.attn.proj.weight", L + "self_attn.o_proj.weight"),
        Rename("layers.{i}.mlp_norm.weight", L + "post_attention_layernorm.weight"),
        Fuse("layers.{i}.mlp.fc.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")),
        Rename("layers.{i}.mlp.proj.weight", L + "mlp.down_proj.weight"),
        Rename("norm.weight", "model.norm.weight"),
        Tie("head.weight", to="embed.weight") if cfg.tie_embeddings else Rename("head.weight", "lm_head.weight"),
        Ignore(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
    ]
    if cfg.layer_spec == "qwen3":
        rules += [Rename("layers.{i}.attn.q_norm.weight", L + "self_attn.q_norm.weight"),
                  Rename("layers.{i}.attn.k_norm.weight", L + "self_attn.k_norm.weight")]
    if cfg.layer_spec in ("llama_attn_bias", "qwen2"):  # q|k|v biases; LLaMA's attention_bias has o's too
        rules.append(Fuse("layers.{i}.attn.qkv.bias", tuple(k.replace(".weight", ".bias") for k in qkv),
                          groups="num_kv_heads", sizes=("q_size", "kv_size", "kv_size")))
    if cfg.layer_spec == "llama_attn_bias":
        rules.append(Rename("layers.{i}.attn.proj.bias", L + "self_attn.o_proj.bias"))
    if cfg.tie_embeddings:
        rules.append(Ignore(r"lm_head\.weight"))  # some exports store the tied copy as well
    return MappingTable(rules=tuple(rules))


def _gpt2_table(cfg: GPTConfig) -> MappingTable:
    H = "transformer.h.{i}."
    rules = (
        Rename("embed.weight", "transformer.wte.weight"),
        Rename("pos_embed.weight", "transformer.wpe.weight"),
        Rename("layers.{i}.attn_norm.weight", H + "ln_1.weight"),
        Rename("layers.{i}.attn_norm.bias", H + "ln_1.bias"),
        # c_attn is a Conv1D ([in, out]) holding q|k|v along out; ours interleaves per head group.
        Fuse("layers.{i}.attn.qkv.weight", (H + "attn.c_attn.weight",), split=3, transpose=True, groups="num_kv_heads"),
        Fuse("layers.{i}.attn.qkv.bias", (H + "attn.c_attn.bias",), split=3, groups="num_kv_heads"),
        Transpose("layers.{i}.attn.proj.weight", H + "attn.c_proj.weight"),
        Rename("layers.{i}.attn.proj.bias", H + "attn.c_proj.bias"),
        Rename("layers.{i}.mlp_norm.weight", H + "ln_2.weight"),
        Rename("layers.{i}.mlp_norm.bias", H + "ln_2.bias"),
        Transpose("layers.{i}.mlp.fc.weight", H + "mlp.c_fc.weight"),
        Rename("layers.{i}.mlp.fc.bias", H + "mlp.c_fc.bias"),
        Transpose("layers.{i}.mlp.proj.weight", H + "mlp.c_proj.weight"),
        Rename("layers.{i}.mlp.proj.bias", H + "mlp.c_proj.bias"),
        Rename("norm.weight", "transformer.ln_f.weight"),
        Rename("norm.bias", "transformer.ln_f.bias"),
        *_head(cfg),
        Ignore(r"transformer\.h\.\d+\.attn\.(masked_)?bias"),  # legacy causal-mask buffers
    )
    return MappingTable(rules=rules, import_prefixes=(("transformer.", ""),))


def _gemma_table(cfg: GPTConfig) -> MappingTable:
    L = "model.layers.{i}."
    qkv = tuple(L + f"self_attn.{n}_proj.weight" for n in "qkv")
    qk_norms = (Rename("layers.{i}.attn.q_norm.weight", L + "self_attn.q_norm.weight"),  # (Gemma 3's)
                Rename("layers.{i}.attn.k_norm.weight", L + "self_attn.k_norm.weight"))
    return MappingTable(rules=(
        Rename("embed.weight", "model.embed_tokens.weight"),
        Rename("layers.{i}.attn_norm.weight", L + "input_layernorm.weight"),
        Fuse("layers.{i}.attn.qkv.weight", qkv, groups="num_kv_heads", sizes=("q_size", "kv_size", "kv_size")),
        *(qk_norms if cfg.layer_spec == "gemma3" else ()),
        Rename("layers.{i}.attn.proj.weight", L + "self_attn.o_proj.weight"),
        Rename("layers.{i}.post_attn_norm.weight", L + "post_attention_layernorm.weight"),  # (after attention)
        Rename("layers.{i}.mlp_norm.weight", L + "pre_feedforward_layernorm.weight"),
        Fuse("layers.{i}.mlp.fc.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")),
        Rename("layers.{i}.mlp.proj.weight", L + "mlp.down_proj.weight"),
        Rename("layers.{i}.post_mlp_norm.weight", L + "post_feedforward_layernorm.weight"),
        Rename("norm.weight", "model.norm.weight"),
        *_head(cfg),
        # Gemma3ForConditionalGeneration (the 4B-27B releases): its language model is this model;
        # the vision tower and projector are not (zoo's gemma3 family is the text decoder)
        Ignore(r"(vision_tower|multi_modal_projector)\..*"),
        *((Ignore(r"language_model\.lm_head\.weight"),) if cfg.tie_embeddings else ()),
    ), import_prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")))


def _head(cfg: GPTConfig) -> tuple[Any, ...]:
    """The head: the embedding (a stored copy ignored), or its own ``lm_head`` (a file whose config
    ties it but which stores a different head: transformers computes with that head)."""
    if cfg.tie_embeddings:
        return (Tie("head.weight", to="embed.weight"), Ignore(r"lm_head\.weight"))  # (the copy some exports store)
    return (Rename("head.weight", "lm_head.weight"),)


def table(cfg: GPTConfig) -> MappingTable:
    if cfg.layer_spec in ("gemma2", "gemma3"):
        return _gemma_table(cfg)
    return _gpt2_table(cfg) if cfg.layer_spec == "gpt2" else _llama_table(cfg)


def _gemma_to_hf(cfg: Any) -> Any:
    gemma2 = cfg.layer_spec == "gemma2"
    architecture = "Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"
    if not gemma2 and cfg.attn_logit_softcapping is not None:
        raise UsageError("Gemma3ForCausalLM computes its attention without a cap: model.attn_logit_softcapping="
                         f"{cfg.attn_logit_softcapping} has no place in its config (Gemma 2's layers have one)")
    layers = [i for i in range(cfg.num_layers) if cfg.window(i) is not None]
    one_table = cfg.rope_local_theta is None or (cfg.rope_local_theta == cfg.rope_theta and not cfg.rope_scaling)
    if gemma2 and not one_table:
        raise UsageError(f"Gemma2ForCausalLM rotates every layer with one RoPE table: model.rope_local_theta="
                         f"{cfg.rope_local_theta} (unscaled, for the sliding layers) has no place in its config; "
                         "set it to null")
    if not gemma2 and cfg.rope_local_theta is None:
        raise UsageError("Gemma3ForCausalLM's sliding layers have their own RoPE base: model.rope_local_theta=null "
                         "(Gemma 2's one table) has no place in its config")
    kind = "gemma2" if gemma2 else "gemma3_text"
    rope = rope_fields(kind, cfg.rope_theta, cfg.rope_scaling)
    if not gemma2 and "rope_parameters" in rope:
        rope = {"rope_parameters": {"full_attention": rope["rope_parameters"],
                                    "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}}
    elif not gemma2:
        rope["rope_local_base_freq"] = cfg.rope_local_theta
    return make_config(
        kind, architectures=[architecture], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=cfg.max_seq_length,
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
        sliding_window=cfg.sliding_window if layers else None,
        layer_types=["sliding_attention" if i in layers else "full_attention" for i in range(cfg.num_layers)],
        attn_logit_softcapping=cfg.attn_logit_softcapping, final_logit_softcapping=cfg.final_logit_softcapping,
        attention_bias=False, attention_dropout=0.0, pad_token_id=cfg.pad_token_id, **rope)


def _gemma_from_hf(config: Any, *, gemma2: bool, tied: bool, final_cap: bool = True) -> Any:
    """``tied``: the head is the embedding (the top-level flag of an image-text config decides);
    ``final_cap``: the head's logits are soft-capped as ``final_logit_softcapping`` says."""
    from zoo_gpt.plugin import GemmaConfig

    what = "Gemma 2" if gemma2 else "Gemma 3"
    hf = config.to_dict()
    n = hf["num_hidden_layers"]
    # (configs from before layer_types: Gemma 2 slides its even layers, Gemma 3 five of every six)
    pattern = 2 if gemma2 else int(hf.get("sliding_window_pattern", 6))
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                      for i in range(n)]
    params = getattr(config, "rope_parameters", None)
    if not gemma2 and params is not None and "full_attention" in params:  # (transformers 5: one table per kind)
        theta, scaling = rope_of(params["full_attention"], what=what)
        local, _ = rope_of(params.get("sliding_attention") or {"rope_theta": theta}, what=f"{what} (local)")
    else:
        theta, scaling = rope_of(config, what=what)
        local = None if gemma2 else float(hf.get("rope_local_base_freq", 10000.0))
    windows = windows_from_hf({**hf, "layer_types": types}, "layer_types", flag=False)
    heads = hf["num_attention_heads"]
    return GemmaConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=n, num_heads=heads,
                       num_kv_heads=hf["num_key_value_heads"] or heads, head_dim=hf["head_dim"],
                       ffn_hidden_size=hf["intermediate_size"], max_seq_length=hf["max_position_embeddings"],
                       norm_eps=hf["rms_norm_eps"], tie_embeddings=tied, rope_theta=theta,
                       rope_scaling=scaling, init_std=hf["initializer_range"],
                       rope_local_theta=None if local is None else float(local),
                       query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]), layer_spec="gemma2" if gemma2 else "gemma3",
                       attn_logit_softcapping=_cap(hf.get("attn_logit_softcapping")),
                       final_logit_softcapping=_cap(hf.get("final_logit_softcapping")) if final_cap else None,
                       pad_token_id=hf.get("pad_token_id"), **windows)


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)


def to_hf_config(cfg: GPTConfig) -> Any:
    """transformers' config object for ``cfg`` (refused where the architecture has no place for it)."""
    if cfg.layer_spec in ("gemma2", "gemma3"):
        return _gemma_to_hf(cfg)
    if cfg.layer_spec == "gpt2":
        if cfg.num_kv_heads != cfg.num_heads or cfg.head_dim * cfg.num_heads != cfg.hidden_size:
            raise UsageError(f"GPT2LMHeadModel has hidden_size / num_heads per head and no grouped KV: model.head_dim="
                             f"{cfg.head_dim}, num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, hidden_size="
                             f"{cfg.hidden_size}")
        return make_config(
            "gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_length, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_heads, n_inner=cfg.ffn_hidden_size, activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    spec = cfg.layer_spec
    if spec == "llama" and cfg.sliding_window is not None:
        spec = "mistral"  # LlamaConfig has no window: LLaMA with one is Mistral's architecture
    if spec not in _ARCHITECTURES:
        raise UsageError(f"model.layer_spec={cfg.layer_spec!r} has no Hugging Face architecture")
    architecture, kind, windows = _ARCHITECTURES[spec]
    return make_config(
        kind, architectures=[architecture],
        **windows_to_hf(cfg, windows, architecture, flag=kind.startswith("qwen")),
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_length, rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=spec == "llama_attn_bias", mlp_bias=False, attention_dropout=0.0, pad_token_id=cfg.pad_token_id,
        **rope_fields(kind, cfg.rope_theta, cfg.rope_scaling))


# layer_spec -> (architecture, model_type, how its config says which layers slide: see windows_from_hf)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", None),
    "llama_attn_bias": ("LlamaForCausalLM", "llama", None),
    "mistral": ("MistralForCausalLM", "mistral", "all"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", "from_max_window_layers"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", "from_max_window_layers"),
}


def windows_from_hf(hf: dict[str, Any], rule: str | None, *, flag: bool) -> dict[str, Any]:
    """GPTConfig's ``sliding_window`` and ``window_layers`` from a Hugging Face config whose
    layers slide by ``rule``: "all" (Mistral, Mixtral, Qwen3-MoE: every layer when a window is set),
    "from_max_window_layers" (Qwen2, Qwen3: layers from max_window_layers on), "qwen2_moe" (every
    other layer below max_window_layers, as transformers builds Qwen2-MoE); an explicit
    ``layer_types`` list decides except under "all", whose models ignore it. ``flag``: the window
    is on only with ``use_sliding_window`` (the Qwen configs, which keep a window size either way)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", not flag) else None
    if not window or rule is None:
        if window:
            raise UsageError(f"{hf.get('model_type')} with sliding_window={window}: the architecture has none")
        return {}
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    if rule == "all":
        layers = list(range(n))
    elif types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != n:
            raise UsageError(f"layer_types={types}: one of 'sliding_attention', 'full_attention' per layer "
                             f"({n} layers)")
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif rule == "layer_types":
        raise UsageError(f"{hf.get('model_type')}: its config names no layer_types")
    elif rule == "from_max_window_layers":
        layers = list(range(int(hf.get("max_window_layers", 28)), n))
    else:
        layers = [i for i in range(n) if i % 2 == 0 and i < int(hf.get("max_window_layers", 28))]
    if not layers:
        return {}
    return {"sliding_window": int(window), "window_layers": None if len(layers) == n else layers}


def windows_to_hf(cfg: GPTConfig, rule: str | None, architecture: str, *, flag: bool) -> dict[str, Any]:
    """The window fields of a Hugging Face config for ``cfg`` (the inverse of `windows_from_hf`):
    the "all" architectures hold one window for every layer; the others also the list of layers
    that slide (``layer_types``, and ``max_window_layers`` for readers from before it)."""
    layers = [i for i in range(cfg.num_layers) if cfg.window(i) is not None]
    if rule is None:
        if layers:
            raise UsageError(f"{architecture} has no sliding-window attention (model.sliding_window="
                             f"{cfg.sliding_window})")
        return {}
    fields: dict[str, Any] = {"sliding_window": cfg.sliding_window if layers else None}
    if flag:
        fields["use_sliding_window"] = bool(layers)
    if rule == "all":
        if layers and len(layers) != cfg.num_layers:
            raise UsageError(f"{architecture} slides every layer's attention or none; model.window_layers="
                             f"{cfg.window_layers} has no place in its config")
        return fields
    fields["max_window_layers"] = cfg.num_layers
    if layers:
        fields["layer_types"] = ["sliding_attention" if i in layers else "full_attention" for i in range(cfg.num_layers)]
        if rule == "from_max_window_layers" and layers == list(range(layers[0], cfg.num_layers)):
            fields["max_window_layers"] = layers[0]
    return fields


def from_hf_config(config: Any) -> GPTConfig:
    """zoo's config for transformers' ``config`` (a config object, or a document transformers turns
    into one); the fixed fields were checked against `FIELDS` before."""
    config = library_config(config)
    hf = config.to_dict()
    kind = hf.get("model_type")
    if kind == "gpt2":
        d, heads = hf["n_embd"], hf["n_head"]
        return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=d, num_layers=hf["n_layer"], num_heads=heads,
                         num_kv_heads=heads, head_dim=d // heads, ffn_hidden_size=hf["n_inner"] or 4 * d,
                         max_seq_length=hf["n_positions"], norm_eps=hf["layer_norm_epsilon"],
                         tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"],
                         layer_spec="gpt2")
    if kind == "gemma3":
        # (Gemma3ForConditionalGeneration's head caps nothing, whatever its text_config's
        # final_logit_softcapping says: transformers applies it in Gemma3ForCausalLM only)
        return _gemma_from_hf(config.text_config, gemma2=False, tied=bool(config.tie_word_embeddings),
                              final_cap=False)
    if kind in ("gemma3_text", "gemma2"):
        return _gemma_from_hf(config, gemma2=kind == "gemma2", tied=bool(config.tie_word_embeddings))
    if kind in _SPEC_OF:
        theta, scaling = rope_of(config, what=kind)
        heads = hf["num_attention_heads"]
        spec = "llama_attn_bias" if kind == "llama" and hf.get("attention_bias") else _SPEC_OF[kind]
        return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                         num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                         head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                         ffn_hidden_size=hf["intermediate_size"], max_seq_length=hf["max_position_embeddings"],
                         norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
                         rope_theta=theta, rope_scaling=scaling, init_std=hf["initializer_range"],
                         pad_token_id=hf.get("pad_token_id"), layer_spec=spec, **windows_from_hf(hf, _ARCHITECTURES[spec][2], flag=kind.startswith("qwen")))
    raise UsageError(f"model_type {kind!r} is not GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma 2 or Gemma 3")


_SPEC_OF = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> layer_spec


# ----------------------------------------------------------------------------- fields accounted for
# Every field of each config class: read (mapped), without effect on what the model computes
# (inert), or computed by zoo at the listed values only (fixed; anything else is refused on import).
# Dropout probabilities are inert: they change nothing at inference and zoo trains without dropout.
# Legacy names (transformers 4.x: rope_theta, rope_scaling, ...) are listed for the releases that have them.
_IDS = ("use_cache", "bos_token_id", "eos_token_id")
# (pad_token_id is mapped: transformers' LLaMA-like and Gemma embeddings give its row no input gradient)
_DECODER = ("pad_token_id", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "initializer_range", "rms_norm_eps", "tie_word_embeddings",
            "rope_parameters", "rope_theta", "rope_scaling", "head_dim")
_QWEN_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
_GEMMA = ("pad_token_id", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "initializer_range", "rms_norm_eps",
          "tie_word_embeddings",  # (an image-text config's own flag decides for its text_config)
          "rope_parameters", "rope_theta", "rope_scaling", "query_pre_attn_scalar", "sliding_window", "layer_types",
          "final_logit_softcapping")
_GEMMA_FIXED = {"hidden_activation": ("gelu_pytorch_tanh", "gelu_tanh"),
                "attention_bias": (False,), "use_bidirectional_attention": (False, None), "hidden_act": (None, "gelu_pytorch_tanh")}

FIELDS = {t.config_class: t for t in (
    FieldTable(config_class="GPT2Config",
               mapped=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon",
                       "initializer_range", "tie_word_embeddings"),
               inert=(*_IDS, "pad_token_id", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout", "n_ctx",
                      # (the sequence-classification head's, which a causal LM does not build)
                      "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                      "reorder_and_upcast_attn"),  # (an fp16 upcast of the same product)
               fixed={"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
                      "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}),
    FieldTable(config_class="LlamaConfig", mapped=(*_DECODER, "attention_bias"),
               inert=(*_IDS, "attention_dropout", "pretraining_tp"),  # (tp: the same product in slices)
               fixed={"hidden_act": ("silu",), "mlp_bias": (False,)}),
    FieldTable(config_class="MistralConfig", mapped=(*_DECODER, "sliding_window"), inert=(*_IDS, "attention_dropout"),
               fixed={"hidden_act": ("silu",)}),
    FieldTable(config_class="Qwen2Config", mapped=(*_DECODER, *_QWEN_WINDOWS), inert=(*_IDS, "attention_dropout"),
               fixed={"hidden_act": ("silu",)}),
    FieldTable(config_class="Qwen3Config", mapped=(*_DECODER, *_QWEN_WINDOWS), inert=(*_IDS, "attention_dropout"),
               fixed={"hidden_act": ("silu",), "attention_bias": (False,)}),
    FieldTable(config_class="Gemma2Config", mapped=(*_GEMMA, "attn_logit_softcapping"),
               inert=(*_IDS, "attention_dropout", "cache_implementation"), fixed=_GEMMA_FIXED),
    FieldTable(config_class="Gemma3TextConfig",
               mapped=(*_GEMMA, "rope_local_base_freq", "sliding_window_pattern"),
               inert=(*_IDS, "attention_dropout", "cache_implementation"),
               fixed={**_GEMMA_FIXED, "attn_logit_softcapping": (None,)}),
    # Gemma3ForConditionalGeneration: zoo's gemma3 is its language model (text in, text out); the
    # vision tower and the image-token fields only act on images.
    FieldTable(config_class="Gemma3Config",
               inert=("vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index",
                      "initializer_range"),
               mapped=("text_config", "tie_word_embeddings")),
)}


HF = ExternalFormat(
    name="hf",
    architectures={"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2", "LlamaForCausalLM": "llama",
                   "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                   "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                   "Gemma3ForConditionalGeneration": "gemma3"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
    fields=FIELDS,
)
