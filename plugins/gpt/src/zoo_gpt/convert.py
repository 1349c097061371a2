"""Hugging Face layouts of GPT-2 (`GPT2LMHeadModel`) and LLaMA (`LlamaForCausalLM`): key tables
and config translation. The tables are data; `zoo.checkpoint.mapping` applies them strictly both ways."""

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
    if cfg.layer_spec == "llama_attn_bias":
        rules.append(Fuse("layers.{i}.attn.qkv.bias", tuple(k.replace(".weight", ".bias") for k in qkv),
                          groups="num_kv_heads", sizes=("q_size", "kv_size", "kv_size")))
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


def table(cfg: GPTConfig) -> MappingTable:
    return _gpt2_table(cfg) if cfg.layer_spec == "gpt2" else _llama_table(cfg)


def to_hf_config(cfg: GPTConfig) -> dict[str, Any]:
    if cfg.layer_spec == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_length, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        }
    rope: dict[str, Any] = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    qwen3 = cfg.layer_spec == "qwen3"
    return {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama",
        **({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers} if qwen3 else {}),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_length, "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.layer_spec == "llama_attn_bias", "mlp_bias": False,
        # transformers 5 reads rope_parameters; older releases read rope_theta and rope_scaling.
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    }


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
    if kind in ("llama", "qwen3"):
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
            raise UsageError("LLaMA with a non-SiLU activation or MLP biases is not supported")
        if kind == "qwen3" and (hf.get("use_sliding_window") or hf.get("attention_bias")):
            raise UsageError("Qwen3 with sliding-window attention or attention biases is not supported")
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in rope.items() if k != "rope_type" or v != "default"} or hf.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        heads = hf["num_attention_heads"]
        return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                         num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                         head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                         ffn_hidden_size=hf["intermediate_size"], max_seq_length=hf.get("max_position_embeddings", 2048),
                         norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                         rope_theta=theta, rope_scaling=scaling, init_std=hf.get("initializer_range", 0.02),
                         layer_spec="qwen3" if kind == "qwen3"
                         else "llama_attn_bias" if hf.get("attention_bias") else "llama")
    raise UsageError(f"model_type {kind!r} is not GPT-2, LLaMA or Qwen3")


HF = ExternalFormat(
    name="hf",
    architectures={"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2", "LlamaForCausalLM": "llama",
                   "Qwen3ForCausalLM": "qwen3"},
    table=table,
    to_config=to_hf_config,
    from_config=from_hf_config,
)
