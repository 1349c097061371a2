"""GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 against Hugging Face transformers, built from tiny configs
(no download): logits match to 1e-5 in float32 and HF -> zoo -> HF is bitwise identical."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import zoo
from zoo.checkpoint import export_external, import_external
from zoo.checkpoint.tensorio import CheckpointError
from zoo.errors import UsageError, ZooError


def _llama(**kw):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return LlamaForCausalLM(LlamaConfig(**{**base, **kw}))


_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

CASES = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "llama-gqa": lambda: _llama(),
    "llama-mqa-tied": lambda: _llama(num_key_value_heads=1, tie_word_embeddings=True),
    "llama-mha": lambda: _llama(num_key_value_heads=4),
    "llama3-rope-scaling": lambda: _llama(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "llama-linear-rope": lambda: _llama(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-qkv-bias": lambda: _llama(attention_bias=True),
    # per-head q/k RMSNorm; head_dim 16, not hidden/heads (as Qwen3-0.6B's 128 against 1024/16)
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                  max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen3-tied": lambda: Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48,
                                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                       max_position_embeddings=64, tie_word_embeddings=True)),
    # Sliding windows of 8 positions over the 40 tokens compared
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**_SMALL, sliding_window=8)),
    "mistral-no-window": lambda: MistralForCausalLM(MistralConfig(**_SMALL, sliding_window=None, head_dim=16)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**{**_SMALL, "tie_word_embeddings": True})),  # q/k/v biases, o none
    "qwen2-window-layer-1": lambda: Qwen2ForCausalLM(Qwen2Config(**_SMALL, use_sliding_window=True, sliding_window=8,
                                                                 max_window_layers=1)),
    # Gemma 3: sandwich zero-centred norms, q/k norms, GeGLU, scaled embeddings, a softmax scale of
    # 1/sqrt(24) (not head_dim's 16), sliding layers with their own RoPE base, linear-scaled global RoPE
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**_SMALL, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # Gemma 2: Gemma 3's layers without q/k norms, attention scores and logits soft-capped; caps set
    # near the tiny model's score and logit sizes (0.05, 0.5) so that they bend them
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        **{**_SMALL, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, attn_logit_softcapping=0.05, final_logit_softcapping=0.5, rope_theta=1000.0)),
    # Gemma 3 with a final logit cap (transformers applies it; the attention cap it ignores: refused)
    "gemma3-softcap": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**_SMALL, "tie_word_embeddings": True}, head_dim=16, sliding_window=8, final_logit_softcapping=0.5,
        layer_types=["sliding_attention", "full_attention"])),
    "qwen3-window-layer-types": lambda: Qwen3ForCausalLM(Qwen3Config(
        **{**_SMALL, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def _hf(case, tmp_path):
    torch.manual_seed(0)
    model = CASES[case]().eval()
    # Random init leaves norms at one and biases at zero; perturb every tensor so a swapped or
    # untransposed weight cannot hide.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    return model, src


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_and_round_trip_is_bitwise(case, tmp_path):
    hf_model, src = _hf(case, tmp_path)
    dst = tmp_path / "zoo"
    import_external("hf", src, dst)
    ours = zoo.load_model(str(dst)).eval()
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = ours(tokens)
    assert got.shape == (2, 40, 96)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    # Loading the HF directory directly gives the same model.
    direct = zoo.load_model(str(src)).eval()
    with torch.no_grad():
        assert torch.equal(direct(tokens), got)

    back = tmp_path / "back"
    export_external("hf", dst, back)
    original, exported = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)


@pytest.mark.parametrize(("case", "windows"), [("mistral-window", [8, 8]), ("qwen2-window-layer-1", [None, 8]),
                                               ("qwen3-window-layer-types", [8, None, 8]), ("gemma3", [8, None, 8]),
                                               ("gemma2", [8, None, 8])])
def test_the_window_reaches_the_layers_it_names_and_changes_the_result(case, windows, tmp_path):
    """Each layer gets the window Hugging Face's config gives it, and the window matters: the same
    weights with every layer attending to the whole past give other logits."""
    hf_model, src = _hf(case, tmp_path)
    ours = zoo.load_model(str(src)).eval()
    assert [layer.attn.window for layer in ours.layers] == windows
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    for layer in ours.layers:
        layer.attn.window = None
    with torch.no_grad():
        assert (ours(tokens) - hf_model(tokens).logits).abs().max() > 1e-3


def test_soft_caps_reach_every_layer_and_the_logits_and_change_the_result(tmp_path):
    """Gemma 2's caps arrive where its config puts them (every layer's attention, the output), the
    training loss equals cross entropy of Hugging Face's (capped) logits, and each cap matters: the
    same weights without it give other logits. Gemma 3 with an attention cap is refused: transformers'
    Gemma 3 holds the number and computes without it."""

    hf_model, src = _hf("gemma2", tmp_path)
    ours = zoo.load_model(str(src)).eval()
    assert {layer.attn.softcap for layer in ours.layers} == {0.05} and ours.logit_softcap == 0.5
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        loss = torch.nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten())
        torch.testing.assert_close(ours(tokens, labels=labels), loss, atol=1e-6, rtol=0)
        ours.logit_softcap = None
        assert (ours(tokens) - expected).abs().max() > 1e-2
        ours.logit_softcap = 0.5
        for layer in ours.layers:
            layer.attn.softcap = None
        assert (ours(tokens) - expected).abs().max() > 1e-4
    config = json.loads((src / "config.json").read_text())
    gemma3 = {**config, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    (src / "config.json").write_text(json.dumps(gemma3))
    with pytest.raises(ZooError, match=r"Gemma3TextConfig.attn_logit_softcapping=0.05 changes the computation"):
        zoo.load_model(str(src))


def test_gemma3_image_text_checkpoint_gives_its_language_model(tmp_path):
    """The Gemma 3 4B-27B releases are Gemma3ForConditionalGeneration checkpoints: their language
    model imports as the gemma3 family (the vision tower and projector left out, by name), with the
    logits the image-text model gives a text; a release's config (its text_config names only what
    differs from transformers' defaults) reads as zoo's flavor of that size."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from zoo_gpt import plugin
    from zoo_gpt.convert import from_hf_config

    torch.manual_seed(0)
    text = {**_SMALL, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2}
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    hf_model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                           mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_model.save_pretrained(tmp_path / "hf")
    import_external("hf", tmp_path / "hf", tmp_path / "zoo")
    ours = zoo.load_model(str(tmp_path / "zoo")).eval()
    assert ours.cfg.window_layers == [0, 2]
    tokens = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf_model(input_ids=tokens).logits, atol=1e-5, rtol=0)
    release = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                               "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                               "sliding_window": 1024}}
    assert from_hf_config(release) == plugin.gemma3_4b()


def test_llama_with_a_window_exports_as_mistral_and_a_windowed_subset_is_refused(tmp_path):
    """LlamaConfig holds no window: a LLaMA-spec model with one exports as MistralForCausalLM, which
    transformers loads to the same logits; windows on some layers only have no place in Mistral's
    config and are refused, not dropped."""
    import dataclasses

    from zoo.checkpoint.model_dir import write_model_dir
    from zoo_gpt import plugin
    from zoo_gpt.model import build

    cfg = dataclasses.replace(plugin.llama_tiny(), sliding_window=8)
    torch.manual_seed(0)
    model = build(cfg, plugin.SPECS["llama"]).eval()
    write_model_dir(tmp_path / "zoo", family="llama", flavor="tiny", config=cfg, state=model.state_dict())
    export_external("hf", tmp_path / "zoo", tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model).__name__ == "MistralForCausalLM" and hf_model.config.sliding_window == 8
    tokens = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), atol=1e-5, rtol=0)
    partial = dataclasses.replace(cfg, window_layers=[0])
    write_model_dir(tmp_path / "partial", family="llama", flavor="tiny", config=partial,
                    state=build(partial, plugin.SPECS["llama"]).state_dict())
    with pytest.raises(UsageError, match="MistralForCausalLM slides every layer's attention or none"):
        export_external("hf", tmp_path / "partial", tmp_path / "hf2")


def test_sharded_export_and_import(tmp_path):
    hf_model, src = _hf("llama-gqa", tmp_path)
    dst = tmp_path / "zoo"
    import_external("hf", src, dst)
    sharded = tmp_path / "sharded"
    export_external("hf", dst, sharded, max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    reloaded = AutoModelForCausalLM.from_pretrained(sharded).eval()
    tokens = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)
    again = tmp_path / "again"
    import_external("hf", sharded, again)  # sharded input is read too
    with torch.no_grad():
        torch.testing.assert_close(zoo.load_model(str(again))(tokens), hf_model(tokens).logits, atol=1e-5, rtol=0)


def test_gpt2_base_model_without_prefix(tmp_path):
    hf_model, src = _hf("gpt2", tmp_path)
    base = tmp_path / "base"
    hf_model.transformer.save_pretrained(base)  # GPT2Model: keys without "transformer."
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2Model"]
    ours = zoo.load_model(str(base)).eval()
    tokens = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf_model(tokens).logits, atol=1e-5, rtol=0)


def test_bad_inputs_are_clear(tmp_path):
    _, src = _hf("llama-gqa", tmp_path)
    # Unknown architecture names what is supported.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(UsageError, match=r"unsupported architecture \['BertForMaskedLM'\]; supported: .*LlamaForCausalLM \(llama\)"):
        import_external("hf", other, tmp_path / "x")
    # Missing keys are listed.
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    broken = tmp_path / "missing"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    from safetensors.torch import save_file

    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing in the external state: model\.layers\.1\.mlp\.up_proj\.weight"):
        import_external("hf", broken, tmp_path / "y")
    # A corrupted file names the file.
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((src / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"corrupt/model.safetensors: not a readable safetensors file"):
        import_external("hf", corrupt, tmp_path / "z")
    assert not (tmp_path / "z").exists()
    # The destination is never overwritten.
    dst = tmp_path / "zoo"
    import_external("hf", src, dst)
    with pytest.raises(UsageError, match="already exists; nothing was overwritten"):
        import_external("hf", src, dst)


def test_foreign_checkpoint_names_first_mismatching_tensor(tmp_path):
    _, src = _hf("llama-gqa", tmp_path)
    dst = tmp_path / "zoo"
    import_external("hf", src, dst)
    meta = json.loads((dst / "zoo.json").read_text())
    meta["model_config"]["hidden_size"] = 64  # claims another flavor than its tensors
    meta["model_config"]["head_dim"] = 16
    (dst / "zoo.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"embed.weight has shape \(96, 32\), the model expects \(96, 64\)"):
        zoo.load_model(str(dst))


def test_segments_equal_separate_documents(tmp_path):
    """Two documents packed in one sample with reset positions and segment ids give each document the
    logits it gets alone (the independent reference: HF run on each document separately)."""
    hf_model, src = _hf("llama-gqa", tmp_path)
    ours = zoo.load_model(str(src)).eval()
    a, b = torch.randint(1, 96, (1, 9)), torch.randint(1, 96, (1, 14))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(9), torch.arange(14)])[None]
    segments = torch.cat([torch.zeros(9, dtype=torch.long), torch.ones(14, dtype=torch.long)])[None]
    with torch.no_grad():
        got = ours(packed, position_ids=positions, segment_ids=segments)
        torch.testing.assert_close(got[:, :9], hf_model(a).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[:, 9:], hf_model(b).logits, atol=1e-5, rtol=0)


def test_gemma2_release_config_reads_as_the_flavor():
    """A Gemma 2 release's config.json (written before transformers had layer_types: the even layers
    slide) reads as zoo's flavor of that size, caps and window included."""
    from zoo_gpt import plugin
    from zoo_gpt.convert import from_hf_config

    release = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
               "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
               "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
               "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
               "sliding_window": 4096, "sliding_window_size": 4096, "vocab_size": 256000,
               "cache_implementation": "hybrid", "torch_dtype": "float32"}
    cfg = from_hf_config(release)
    assert cfg == plugin.gemma2_9b()
    assert [cfg.window(i) for i in range(4)] == [4096, None, 4096, None]
