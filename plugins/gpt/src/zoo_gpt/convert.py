"""Hugging Face layouts of GPT-2 (`GPT2LMHeadModel`), the LLaMA-like decoders (`LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`), Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3
(`Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`): key tables and
config translation. The
tables are data; `zoo.checkpoint.mapping` applies them strictly both ways."""

from __future__ import annotations

from typing import Any

from zoo.checkpoint import ExternalFormat
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
        Tie("head.weight", to="embed.weight"),
        Ignore(r"lm_head\.weight"),  # tied to wte; older files store it anyway
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
        Tie("head.weight", to="embed.weight"),
        Ignore(r"lm_head\.weight"),  # (the tied copy some exports store)
        # Gemma3ForConditionalGeneration (the 4B-27B releases): its language model is this model;
        # the vision tower and projector are not (zoo's gemma3 family is the text decoder)
        Ignore(r"(vision_tower|multi_modal_projector)\..*"),
        Ignore(r"language_model\.lm_head\.weight"),
    ), import_prefixes=(("model.", "language_model.model."),))


def table(cfg: GPTConfig) -> MappingTable:
    if cfg.layer_spec in ("gemma2", "gemma3"):
        return _gemma_table(cfg)
    return _gpt2_table(cfg) if cfg.layer_spec == "gpt2" else _llama_table(cfg)


def _gemma_to_hf(cfg: Any) -> dict[str, Any]:
    gemma2 = cfg.layer_spec == "gemma2"
    architecture = "Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"
    if not cfg.tie_embeddings:
        raise UsageError(f"{architecture} ties its embeddings (model.tie_embeddings=true)")
    if not gemma2 and cfg.attn_logit_softcapping is not None:
        raise UsageError("Gemma3ForCausalLM computes its attention without a cap: model.attn_logit_softcapping="
                         f"{cfg.attn_logit_softcapping} has no place in its config (Gemma 2's layers have one)")
    layers = [i for i in range(cfg.num_layers) if cfg.window(i) is not None]
    full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    if gemma2 and cfg.rope_local_theta != cfg.rope_theta:
        raise UsageError(f"Gemma2ForCausalLM has one RoPE base: model.rope_local_theta={cfg.rope_local_theta} "
                         f"differs from model.rope_theta={cfg.rope_theta}")
    rope = full if gemma2 else {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
    return {
        "architectures": [architecture], "model_type": "gemma2" if gemma2 else "gemma3_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.max_seq_length,
        "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": True,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        "sliding_window": cfg.sliding_window if layers else None,
        "layer_types": ["sliding_attention" if i in layers else "full_attention" for i in range(cfg.num_layers)],
        "rope_parameters": rope,
        # (what transformers before 5 reads)
        "rope_theta": cfg.rope_theta, "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        **({} if gemma2 else {"rope_local_base_freq": cfg.rope_local_theta}),
        "attn_logit_softcapping": cfg.attn_logit_softcapping, "final_logit_softcapping": cfg.final_logit_softcapping,
        "attention_bias": False,
    }


# transformers' Gemma3TextConfig defaults, which the released image-text configs leave out of text_config
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                         "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}


# transformers' Gemma2Config defaults (the 2B's)
_GEMMA2_DEFAULTS = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
                    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 10000.0,
                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def _gemma_from_hf(hf: dict[str, Any], *, gemma2: bool) -> Any:
    from zoo_gpt.plugin import GemmaConfig

    name = "Gemma 2" if gemma2 else "Gemma 3"
    hf = {**(_GEMMA2_DEFAULTS if gemma2 else _GEMMA3_TEXT_DEFAULTS), **hf}
    if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
        raise UsageError(f"{name} with attention biases or bidirectional attention is not supported")
    if not gemma2 and hf.get("attn_logit_softcapping") is not None:
        # (transformers' Gemma 3 keeps the number but computes its attention without it)
        raise UsageError(f"Gemma 3 with attn_logit_softcapping={hf['attn_logit_softcapping']}: transformers' "
                         "Gemma3 ignores it, so which model is meant is unclear (Gemma 2's is model_type gemma2)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UsageError(f"{name} with hidden_activation={hf['hidden_activation']!r}: zoo's is tanh-GELU")
    n = hf["num_hidden_layers"]
    # (configs from before layer_types: Gemma 2 slides its even layers, Gemma 3 five of every six)
    pattern = 2 if gemma2 else int(hf.get("sliding_window_pattern", 6))
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                      for i in range(n)]
    params = hf.get("rope_parameters") or {}
    full = dict((params if gemma2 else params.get("full_attention")) or hf.get("rope_scaling") or {})
    theta = float(full.pop("rope_theta", hf["rope_theta"]))
    local = theta if gemma2 else (params.get("sliding_attention") or {}).get("rope_theta", hf["rope_local_base_freq"])
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    windows = windows_from_hf({**hf, "layer_types": types}, "layer_types", flag=False)
    heads = hf["num_attention_heads"]
    return GemmaConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=n, num_heads=heads,
                       num_kv_heads=hf["num_key_value_heads"] or heads, head_dim=hf["head_dim"],
                       ffn_hidden_size=hf["intermediate_size"], max_seq_length=hf["max_position_embeddings"],
                       norm_eps=hf["rms_norm_eps"], tie_embeddings=True, rope_theta=theta,
                       rope_scaling=scaling, init_std=hf.get("initializer_range", 0.02), rope_local_theta=float(local),
                       query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]), layer_spec="gemma2" if gemma2 else "gemma3",
                       attn_logit_softcapping=_cap(hf.get("attn_logit_softcapping")),
                       final_logit_softcapping=_cap(hf.get("final_logit_softcapping")), **windows)


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)


def to_hf_config(cfg: GPTConfig) -> dict[str, Any]:
    if cfg.layer_spec in ("gemma2", "gemma3"):
        return _gemma_to_hf(cfg)
    if cfg.layer_spec == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_length, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        }
    rope: dict[str, Any] = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    spec = cfg.layer_spec
    if spec == "llama" and cfg.sliding_window is not None:
        spec = "mistral"  # LlamaConfig has no window: LLaMA with one is Mistral's architecture
    if spec not in _ARCHITECTURES:
        raise UsageError(f"model.layer_spec={cfg.layer_spec!r} has no Hugging Face architecture")
    architecture, kind, windows = _ARCHITECTURES[spec]
    return {
        "architectures": [architecture], "model_type": kind,
        **windows_to_hf(cfg, windows, architecture, flag=kind.startswith("qwen")),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_length, "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        **({"attention_bias": spec == "llama_attn_bias", "mlp_bias": False} if kind in ("llama", "qwen3") else {}),
        # transformers 5 reads rope_parameters; older releases read rope_theta and rope_scaling.
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    }


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


def from_hf_config(hf: dict[str, Any]) -> GPTConfig:
    kind = hf.get("model_type")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UsageError(f"GPT-2 with activation_function={act!r} is not supported (gelu_new only)")
        d = hf["n_embd"]
        return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=d, num_layers=hf["n_layer"], num_heads=hf["n_head"],
                         num_kv_heads=hf["n_head"], head_dim=d // hf["n_head"], ffn_hidden_size=hf.get("n_inner") or 4 * d,
                         max_seq_length=hf.get("n_positions", 1024), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                         tie_embeddings=True, init_std=hf.get("initializer_range", 0.02), layer_spec="gpt2")
    if kind in ("gemma3_text", "gemma3"):
        return _gemma_from_hf((hf.get("text_config") or hf) if kind == "gemma3" else hf, gemma2=False)
    if kind == "gemma2":
        return _gemma_from_hf(hf, gemma2=True)
    if kind in _SPEC_OF:
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
            raise UsageError(f"{kind} with a non-SiLU activation or MLP biases is not supported")
        if kind == "qwen3" and hf.get("attention_bias"):
            raise UsageError("Qwen3 with attention biases is not supported")
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in rope.items() if k != "rope_type" or v != "default"} or hf.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        heads = hf["num_attention_heads"]
        spec = "llama_attn_bias" if kind == "llama" and hf.get("attention_bias") else _SPEC_OF[kind]
        return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                         num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                         head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                         ffn_hidden_size=hf["intermediate_size"], max_seq_length=hf.get("max_position_embeddings", 2048),
                         norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                         rope_theta=theta, rope_scaling=scaling, init_std=hf.get("initializer_range", 0.02),
                         layer_spec=spec, **windows_from_hf(hf, _ARCHITECTURES[spec][2], flag=kind.startswith("qwen")))
    raise UsageError(f"model_type {kind!r} is not GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma 2 or Gemma 3")


_SPEC_OF = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> layer_spec


HF = ExternalFormat(
    name="hf",
    architectures={"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2", "LlamaForCausalLM": "llama",
                   "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                   "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                   "Gemma3ForConditionalGeneration": "gemma3"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
)
