"""Generation: KV-cached decoding equals uncached decoding, greedy decoding equals HF `generate`
on the same converted weights, sampling filters follow their definitions, bad input is clear."""

from __future__ import annotations

import pytest
import torch
from _gpt_helpers import small_run, zoo
from transformers import (
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

import zoo as zoo_api
from zoo.nn.sampling import filter_logits, generate_tokens


@pytest.fixture(autouse=True)
def _zoo_in_process(capsys, monkeypatch):
    """Single-process `zoo` runs in this process (no interpreter start and torch import per run);
    torchrun jobs and the runs a test kills are processes of their own."""
    import functools

    from zoo.testing import run_zoo

    monkeypatch.setitem(globals(), "zoo", functools.partial(run_zoo, capsys))


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


HF = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                  max_position_embeddings=64)),  # the cache holds normed keys
    # a window of 6: the 27 positions decoded reach far past it, the cached queries see only its keys
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=6)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
    # soft-capped scores (decoding steps take the written-out path) and logits
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6,
        attn_logit_softcapping=0.1, final_logit_softcapping=0.5)),
    "qwen2-window": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=6,
        max_window_layers=1)),
}


@pytest.mark.parametrize("arch", list(HF))
def test_greedy_equals_hf_generate_and_cache_equals_no_cache(arch, tmp_path):
    torch.manual_seed(1)
    hf = _perturbed(HF[arch]())
    hf.save_pretrained(tmp_path / "hf")
    ours = zoo_api.load_model(str(tmp_path / "hf"))
    prompt = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    expected = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                           attention_mask=torch.ones_like(prompt), pad_token_id=0)
    cached = generate_tokens(ours, prompt=prompt, max_new_tokens=20, context=64, temperature=0.0)
    uncached = generate_tokens(ours, prompt=prompt, max_new_tokens=20, context=64, temperature=0.0, use_cache=False)
    assert torch.equal(cached, expected)
    assert torch.equal(uncached, cached)


@pytest.mark.parametrize("prompt_len", [3, 9])
def test_windowed_layers_cache_only_their_window(prompt_len, tmp_path):
    """A sliding-window layer's cache holds window - 1 positions (Gemma 3's local layer: 5 for a
    window of 6; its global layer the whole context) and decoding with it samples exactly what
    recomputing the whole sequence does, from prompts shorter and longer than the window."""
    hf = _perturbed(HF["gemma3"]())
    hf.save_pretrained(tmp_path / "hf")
    ours = zoo_api.load_model(str(tmp_path / "hf"))
    cache = ours.new_cache(2, 64)
    assert [k.shape[2] for k in cache.k] == [5, 64]
    prompt = torch.randint(0, 96, (2, prompt_len), generator=torch.Generator().manual_seed(4))
    kw = dict(prompt=prompt, max_new_tokens=30, context=64, temperature=0.8, top_k=30, seed=5)
    assert torch.equal(generate_tokens(ours, **kw), generate_tokens(ours, use_cache=False, **kw))


def test_bf16_load_holds_half_the_bytes_and_is_as_accurate_as_hf_in_bf16(tmp_path):
    """`zoo.load_model(dtype=torch.bfloat16)` (what `zoo generate --dtype bf16` runs): bf16
    parameters, RoPE's frequencies float32; under bf16 autocast its logits over 1,500 positions are
    as close to the float32 model's as HF's own bf16 model's (`from_pretrained(torch_dtype=...)`)."""
    torch.manual_seed(1)
    hf = _perturbed(LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=2048)))
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 96, (1, 1500), generator=torch.Generator().manual_seed(2))
    half = zoo_api.load_model(str(tmp_path / "hf"), dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in half.parameters()) and half.rotary.inv_freq.dtype == torch.float32
    with torch.no_grad():
        ref = hf(ids).logits
        theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16).eval()(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = half(ids)
    err, err_hf = (ours.float() - ref).abs().max().item(), (theirs.float() - ref).abs().max().item()
    assert 0 < err <= 2 * err_hf, (err, err_hf)


def test_sampling_with_cache_equals_without(tmp_path):
    hf = _perturbed(HF["llama"]())
    hf.save_pretrained(tmp_path / "hf")
    ours = zoo_api.load_model(str(tmp_path / "hf"))
    prompt = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(prompt=prompt, max_new_tokens=25, context=64, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    a = generate_tokens(ours, **kw)
    b = generate_tokens(ours, use_cache=False, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, generate_tokens(ours, **{**kw, "seed": 8}))  # the seed matters


def test_filters_follow_their_definitions():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=None))
    assert kept.tolist() == [[True, True, False, False, False]]
    # top-p 0.8: the smallest prefix whose mass reaches 0.8 is 0.5 + 0.2 + 0.15 = 0.85.
    kept = torch.isfinite(filter_logits(logits, top_k=None, top_p=0.8))
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits.flip(-1), top_k=None, top_p=0.5))  # order does not matter
    assert kept.tolist() == [[False, False, False, False, True]]


def test_generate_cli_on_a_trained_checkpoint(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    assert zoo(*small_run(run_dir, corpus_cache, "train.steps=5")).returncode == 0
    a = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "The import statement", "--greedy",
            "--max-new-tokens", "12")
    b = zoo("generate", "--checkpoint", str(run_dir / "checkpoints" / "step_00000005"), "--prompt",
            "The import statement", "--greedy", "--max-new-tokens", "12", "--no-cache", "--device", "cpu")
    assert a.returncode == 0, a.stderr
    assert a.stdout.startswith("The import statement") and a.stdout == b.stdout
    for dtype in ("bf16", "fp16"):  # parameters in half precision, under autocast
        half = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "The import statement", "--greedy",
                   "--max-new-tokens", "12", "--dtype", dtype)
        assert half.returncode == 0 and half.stdout.startswith("The import statement"), half.stderr
    too_long = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "word " * 400)
    assert too_long.returncode == 2
    assert "the model's context is 256" in too_long.stderr and "Traceback" not in too_long.stderr
    # a text the context ends early: what it has, and a line saying why it is shorter than asked
    near = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "word " * 100, "--greedy",
               "--max-new-tokens", "200")
    assert near.returncode == 0 and near.stdout.startswith("word "), near.stderr
    assert "of the 200 new tokens asked: the model's context ends at 256 positions" in near.stderr
    if not torch.cuda.is_available():  # (tests/test_cuda.py runs --device cuda where there is a GPU)
        no_gpu = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "x", "--device", "cuda")
        assert no_gpu.returncode == 2 and "--device=cuda but no CUDA device is available" in no_gpu.stderr
    missing = zoo("generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "x")
    assert missing.returncode == 1 and "no such checkpoint" in missing.stderr
    # settings outside their meaning are refused, not decoded greedily or left unfiltered
    for flag, value, message in (("--temperature", "-1", "temperature=-1 must be at least 0"),
                                 ("--top-p", "1.5", "top_p=1.5 must be in (0, 1]"),
                                 ("--top-p", "0", "top_p=0 must be in (0, 1]"),
                                 ("--top-k", "-1", "top_k=-1 must be at least 0"),
                                 ("--max-new-tokens", "0", "argument --max-new-tokens: 0: must be at least 1")):
        bad = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "x", flag, value)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, (flag, bad.stderr)


def test_convert_cli_round_trip(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    assert zoo(*small_run(run_dir, corpus_cache, "train.steps=2")).returncode == 0
    out = zoo("convert", "--to", "hf", str(run_dir), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = zoo_api.load_model(str(run_dir / "checkpoints" / "step_00000002")).eval()
    ids = torch.tensor([tok.encode("def f(x): return x")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=0)
    back = zoo("convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr
    again = zoo("convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "back"))
    assert again.returncode == 2 and "nothing was overwritten" in again.stderr
    both = zoo("convert", "--to", "hf", "--from", "hf", "a", "b")
    assert both.returncode == 2 and "exactly one of" in both.stderr
