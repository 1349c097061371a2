"""Real shapes: every flavor builds on the meta device with the published parameter count, and
the same count as Hugging Face's model built from the exported config."""

from __future__ import annotations

import pytest
import torch
from _gpt_helpers import zoo
from transformers import AutoModelForCausalLM

from zoo_gpt import plugin
from zoo_gpt.convert import to_hf_config
from zoo_gpt.model import build, build_gemma

# Published sizes (OpenAI GPT-2 paper/model cards; Meta Llama model cards, exact counts as in
# the released checkpoints).
PUBLISHED = {
    plugin.gpt2_124m: 124_439_808,
    plugin.gpt2_355m: 354_823_168,
    plugin.gpt2_774m: 774_030_080,
    plugin.gpt2_1_5b: 1_557_611_200,
    plugin.llama3_1b: 1_235_814_400,
    plugin.llama3_3b: 3_212_749_824,
    plugin.llama3_8b: 8_030_261_248,
    plugin.llama3_70b: 70_553_706_496,
    plugin.llama2_7b: 6_738_415_616,
    # Mistral AI's and Qwen's released checkpoints (Qwen2.5's sizes)
    plugin.mistral_7b_v01: 7_241_732_096,
    plugin.mistral_7b_v03: 7_248_023_552,
    plugin.mistral_nemo_12b: 12_247_782_400,
    plugin.qwen2_0_5b: 494_032_768,
    plugin.qwen2_1_5b: 1_543_714_304,
    plugin.qwen2_3b: 3_085_938_688,
    plugin.qwen2_7b: 7_615_616_512,
    plugin.qwen2_14b: 14_770_033_664,
    plugin.qwen2_32b: 32_763_876_352,
    plugin.qwen2_72b: 72_706_203_648,
    plugin.gemma3_270m: 268_098_176,  # Google's
    plugin.gemma3_1b: 999_885_952,
    plugin.gemma2_2b: 2_614_341_888,
    plugin.gemma2_9b: 9_241_705_984,
    plugin.gemma2_27b: 27_227_128_320,
}


def _build(cfg):
    return (build_gemma if isinstance(cfg, plugin.GemmaConfig) else build)(cfg, plugin.SPECS[cfg.layer_spec])


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", list(PUBLISHED), ids=lambda f: f.__name__)
def test_meta_build_matches_published_size(flavor):
    cfg = flavor()
    with torch.device("meta"):
        ours = _build(cfg)
    assert _count(ours) == PUBLISHED[flavor]


@pytest.mark.parametrize("flavor", [plugin.gpt2_124m, plugin.llama3_1b, plugin.llama2_7b, plugin.qwen3_0_6b,
                                    plugin.qwen3_1_7b, plugin.qwen3_4b, plugin.qwen3_8b, plugin.mistral_7b_v01,
                                    plugin.mistral_nemo_12b, plugin.qwen2_0_5b, plugin.qwen2_7b, plugin.gemma3_1b,
                                    plugin.gemma3_4b, plugin.gemma3_27b, plugin.gemma2_2b, plugin.gemma2_27b],
                         ids=lambda f: f.__name__)
def test_same_count_as_hf_from_exported_config(flavor):
    cfg = flavor()
    config = to_hf_config(cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
        ours = _build(cfg)
    assert _count(hf) == _count(ours)


def test_dry_run_prints_the_count():
    out = zoo("train", "--model", "llama", "--flavor", "3-8B", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "# parameters: 8,030,261,248" in out.stdout


def test_training_flops_count_each_layers_window():
    """MFU's numerator (PaLM's 6N + 12 H T per layer): a layer with a sliding window reads its
    window of keys, not the sequence (Gemma 3 tiny: layer 0 a window of 64, layer 1 all 128)."""
    from types import SimpleNamespace

    from zoo.training.metrics import linear_weights, lm_flops_per_token

    cfg = plugin.gemma3_tiny()
    model = _build(cfg)
    run = SimpleNamespace(model=cfg, train=SimpleNamespace(seq_length=128))
    n = linear_weights(model)
    assert lm_flops_per_token(model, run) == 6 * n + 12 * cfg.hidden_size * (64 + 128)
    run.train.seq_length = 48  # shorter than the window: every layer reads the sequence
    assert lm_flops_per_token(model, run) == 6 * n + 12 * cfg.hidden_size * (48 + 48)
    llama = plugin.llama_tiny()
    run = SimpleNamespace(model=llama, train=SimpleNamespace(seq_length=128))
    assert lm_flops_per_token(_build(llama), run) == 6 * linear_weights(_build(llama)) + 12 * 128 * 2 * 128
