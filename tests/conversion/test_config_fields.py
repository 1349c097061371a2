"""Every field of every config class zoo reads is accounted for, configs are read and written by
their libraries, and the conversions users hit first (a top-1 Mixtral, a Mamba-2 saved by
transformers 5, bad input) hold."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import zoo
from zoo.checkpoint.external import _formats, import_external
from zoo.checkpoint.fields import FieldTable, class_fields
from zoo.checkpoint.tensorio import CheckpointError
from zoo.errors import UsageError, ZooError


def _tables():
    out = {}
    for fmt_name in ("hf", "diffusers"):
        for _, fmt in _formats(fmt_name):
            for name, table in fmt.fields.items():
                out[name] = (fmt_name, table)
    return out


def _library_class(fmt_name: str, name: str) -> type:
    import diffusers
    import transformers

    return getattr(transformers if fmt_name == "hf" else diffusers, name)


@pytest.mark.parametrize("name", sorted(_tables()))
def test_every_field_of_the_installed_config_class_is_accounted_for(name):
    fmt_name, table = _tables()[name]
    assert table.unaccounted(_library_class(fmt_name, name)) == [], (
        f"{name} has fields zoo's table does not name: map them, list them as inert, or fix their values")


def test_every_architecture_zoo_converts_declares_its_tables():
    for fmt_name in ("hf", "diffusers"):
        for _, fmt in _formats(fmt_name):
            assert fmt.fields, f"{fmt.architectures}: no field table"


def test_a_field_added_to_a_config_class_fails_the_table_test():
    """A release that adds a field (here: a made-up router option on Mixtral's class) is caught."""
    from transformers import MixtralConfig

    table = _tables()["MixtralConfig"][1]
    newer = dataclasses.make_dataclass("MixtralConfig", [("router_temperature", float, dataclasses.field(default=1.0))],
                                       bases=(MixtralConfig,))
    assert table.unaccounted(newer) == ["router_temperature"]
    assert "router_temperature" in class_fields(newer)


def test_a_table_cannot_name_a_field_twice():
    with pytest.raises(ValueError, match="both mapped and inert"):
        FieldTable(config_class="X", mapped=("a",), inert=("a",))


def _save(model, path):
    model.save_pretrained(path)
    return path


def test_top1_mixtral_converts_to_transformers_logits(tmp_path):
    """num_experts_per_tok=1: transformers renormalises the one gate to 1.0; zoo did not (8e-2 off)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    for kv in (2, 1):  # GQA and MQA
        hf = MixtralForCausalLM._from_config(MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv, num_local_experts=4, num_experts_per_tok=1), experts_implementation="eager").eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.2)
        src = _save(hf, tmp_path / f"hf{kv}")
        ours = zoo.load_model(str(src)).eval()
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-5


def test_gemma2_sliding_layers_rotate_with_the_scaled_table(tmp_path):
    """Gemma 2 has one RoPE table for every layer, linear scaling included; zoo rotated its sliding
    layers with an unscaled table of the same base (Gemma 3's rule), 0.19 off (a slow parity draw)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = zoo.load_model(str(_save(hf, tmp_path / "hf"))).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-5


def test_a_tied_config_whose_file_stores_another_head_computes_with_that_head(tmp_path):
    """transformers' rule (and what 5.0 wrote for Mamba): a config that ties the head while the file
    stores a different one is not tied; zoo read the embedding as the head, silently (Gemma,
    whose releases always tie, likewise)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, tie_word_embeddings=False)).eval()
    src = _save(hf, tmp_path / "hf")
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, "tie_word_embeddings": True}))
    theirs = AutoModelForCausalLM.from_pretrained(src).eval()
    assert theirs.lm_head.weight.data_ptr() != theirs.model.embed_tokens.weight.data_ptr()
    ours = zoo.load_model(str(src)).eval()
    assert not ours.cfg.tie_embeddings
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-5

    from transformers import Gemma2Config, Gemma2ForCausalLM

    g = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    gsrc = _save(g, tmp_path / "gemma")
    from safetensors.torch import load_file, save_file

    sd = load_file(gsrc / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
    save_file(sd, gsrc / "model.safetensors", metadata={"format": "pt"})
    theirs = AutoModelForCausalLM.from_pretrained(gsrc).eval()
    ours = zoo.load_model(str(gsrc)).eval()
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-5


def test_gemma3_image_text_logits_are_not_capped_whatever_its_text_config_says(tmp_path):
    """Gemma3ForConditionalGeneration's head applies no final_logit_softcapping (transformers caps in
    Gemma3ForCausalLM only); zoo capped its language model's logits (a parity draw: 0.25 off)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.5)
    vision = dict(hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                     mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = zoo.load_model(str(_save(hf, tmp_path / "hf"))).eval()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - hf(input_ids=tokens).logits).abs().max() <= 1e-5


def test_mamba2_saved_by_transformers_5_with_an_infinite_time_step_limit_reads(tmp_path):
    """transformers 5 writes infinity as {"__float__": "Infinity"}; the hand parser failed on it."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    hf = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=8, num_heads=4,
                                        head_dim=8, n_groups=1, chunk_size=8)).eval()
    src = _save(hf, tmp_path / "hf")
    assert "__float__" in (src / "config.json").read_text()
    ours = zoo.load_model(str(src)).eval()
    assert ours.cfg.dt_max == float("inf")
    tokens = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-5


def test_export_writes_the_config_its_library_writes(tmp_path):
    """`zoo convert --to hf` saves transformers' own config object: the file equals what
    save_pretrained of that object writes, and AutoConfig reads it to the same values."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2))
    import_external("hf", _save(hf, tmp_path / "hf"), tmp_path / "zoo")
    from zoo.checkpoint import export_external

    export_external("hf", tmp_path / "zoo", tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    again = AutoConfig.from_pretrained(tmp_path / "back")
    assert type(again).__name__ == "LlamaConfig" and written["model_type"] == "llama"
    for key in ("hidden_size", "num_key_value_heads", "intermediate_size", "rope_parameters", "rms_norm_eps"):
        assert getattr(again, key) == getattr(hf.config, key)


def test_bad_configs_are_one_line_and_write_nothing(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2))
    src = _save(hf, tmp_path / "hf")
    doc = json.loads((src / "config.json").read_text())
    cases = [
        ({**doc, "architectures": ["FalconForCausalLM"], "model_type": "falcon"}, UsageError, "unsupported architecture"),
        ({**doc, "mlp_bias": True}, ZooError, r"LlamaConfig.mlp_bias=True changes the computation"),
        ({**doc, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, ZooError,
         "rope_type='yarn' is not computed by zoo"),
        ({**doc, "hidden_size": 48}, CheckpointError, "do config.json and the weights belong together"),
        ({**doc, "model_type": "no-such-type"}, CheckpointError, "transformers cannot read it"),
    ]
    for i, (bad, error, message) in enumerate(cases):
        (src / "config.json").write_text(json.dumps(bad))
        with pytest.raises(error, match=message) as info:
            import_external("hf", src, tmp_path / f"out{i}")
        assert "\n" not in str(info.value)
        assert not (tmp_path / f"out{i}").exists()


def test_docs_show_every_table_as_declared():
    """docs/conversion.md's field table is the declared one (a table changed without its docs fails)."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "conversion.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2:5] for line in doc.splitlines()
            if line.startswith("| `")}
    for name, (_, table) in _tables().items():
        assert name in rows, f"docs/conversion.md has no row for {name}"
        mapped, inert, fixed = (cell.strip() for cell in rows[name])
        assert mapped == ", ".join(f"`{f}`" for f in table.mapped), name
        assert inert == ", ".join(f"`{f}`" for f in table.inert), name
        assert fixed == "; ".join(f"`{k}` = " + " or ".join(repr(v) for v in vals) for k, vals in table.fixed.items()), name
