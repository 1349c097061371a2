"""`zoo train` on the embedded corpus: learning, exact resume (including after SIGKILL),
accumulation, precision and recomputation, validated against independent references."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _gpt_helpers import ranks, small_run, zoo

from zoo.testing import compiled_kernels, run_zoo

# zoo train's default compiled CPU kernels (tests/conftest.py switches them off for the tests that
# only compare layouts): the end-to-end LLaMA runs, the SIGKILL resume included, keep them
_compiled = pytest.fixture(scope="module", autouse=True)(compiled_kernels)


@pytest.fixture(autouse=True)
def _zoo_in_process(capsys, monkeypatch):
    """`zoo` runs in this process (no interpreter start and torch import per run); the SIGKILL
    test's killed run is still a process of its own."""
    import functools

    monkeypatch.setitem(globals(), "zoo", functools.partial(run_zoo, capsys))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _unigram_entropy(cache: Path, split: str) -> float:
    """Entropy (nats) of the split's token distribution: the best loss a context-free model can reach."""
    from zoo.data.gpt import split_ranges
    from zoo.data.indexed import IndexedDataset

    [root] = [p for p in cache.iterdir() if p.name.startswith("python-docs-")]
    ds = IndexedDataset(root / "python-docs_text_document")
    lo, hi = split_ranges("969,30,1", len(ds))[split]
    counts = np.bincount(np.concatenate([ds[i] for i in range(lo, hi)]).astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_llama_learns_far_below_unigram_entropy(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    out = zoo(*small_run(run_dir, corpus_cache, "train.steps=300", "train.micro_batch_size=16", "train.eval_interval=300",
                         "train.eval_steps=16", "logging.interval=50", "logging.tensorboard=true", "logging.plot=true"))
    assert out.returncode == 0, out.stderr
    records = _metrics(run_dir)
    entropy = _unigram_entropy(corpus_cache, "valid")
    # Measured: about 4.7 nats against an entropy of about 5.9 (2026-11-22).
    assert records[-1]["val_loss"] < entropy - 0.9, (records[-1], entropy)
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "mfu"} <= r.keys()
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # the default install has tensorboard
    assert f"TensorBoard event files in {run_dir / 'tensorboard'}" in out.stdout
    assert (run_dir / "checkpoints" / "step_00000300" / "COMPLETE").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000300"


def test_resume_is_bitwise_identical(tmp_path, corpus_cache):
    args = ("train.steps=12", "checkpoint.interval=4", "schedule.warmup_steps=3")
    full = tmp_path / "full"
    assert zoo(*small_run(full, corpus_cache, *args)).returncode == 0
    # A second run that has only the step-8 checkpoint and the metrics up to it (and a stale
    # line past it, as a crash would leave) continues to the same curve, bit for bit.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_00000008", part / "checkpoints" / "step_00000008")
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text("\n".join(lines[:9]) + "\n")
    out = zoo(*small_run(part, corpus_cache, *args, "checkpoint.resume=auto"))
    assert out.returncode == 0, out.stderr
    assert "resuming from" in out.stdout
    assert [r["loss"] for r in _metrics(part)] == [r["loss"] for r in _metrics(full)]
    assert [r["step"] for r in _metrics(part)] == list(range(1, 13))


def test_resume_after_sigkill_mid_run(tmp_path, corpus_cache):
    args = ("train.steps=30", "checkpoint.interval=5", "train.seq_length=64")
    full = tmp_path / "full"
    assert zoo(*small_run(full, corpus_cache, *args)).returncode == 0
    killed = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k != "ZOO_PLUGINS"}
    proc = subprocess.Popen([sys.executable, "-m", "zoo", *small_run(killed, corpus_cache, *args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_00000010" / "COMPLETE").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "step_00000030").exists()
    # A fresh start into a directory with checkpoints is refused rather than silently mixed.
    refused = zoo(*small_run(killed, corpus_cache, *args, "checkpoint.resume=none"))
    assert refused.returncode == 2 and "checkpoint.resume=auto" in refused.stderr
    out = zoo(*small_run(killed, corpus_cache, *args))  # resume=auto is the default
    assert out.returncode == 0, out.stderr
    assert [r["loss"] for r in _metrics(killed)] == [r["loss"] for r in _metrics(full)]
    done = zoo(*small_run(killed, corpus_cache, *args))  # rerunning a finished run does nothing
    assert done.returncode == 0 and "already trained to step 30" in done.stdout
    assert [r["loss"] for r in _metrics(killed)] == [r["loss"] for r in _metrics(full)]


def test_gradient_accumulation_matches_one_big_batch(tmp_path, corpus_cache):
    big, acc = tmp_path / "big", tmp_path / "acc"
    common = ("train.steps=3", "train.global_batch_size=8", "optimizer.grad_clip=0")
    assert zoo(*small_run(big, corpus_cache, *common)).returncode == 0  # micro 8: one pass
    assert zoo(*small_run(acc, corpus_cache, *common, "train.micro_batch_size=2")).returncode == 0  # 4 passes
    for a, b in zip(_metrics(big), _metrics(acc)):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_changes_memory_not_results(tmp_path, corpus_cache, mode):
    base, rec = tmp_path / "base", tmp_path / "rec"
    assert zoo(*small_run(base, corpus_cache, "train.steps=3")).returncode == 0
    out = zoo(*small_run(rec, corpus_cache, "train.steps=3", f"train.recompute={mode}"))
    assert out.returncode == 0, out.stderr
    for a, b in zip(_metrics(base), _metrics(rec)):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a, b)


# fp16 with fp32 parameters (the loss scale without a distributed optimizer). bf16 autocast over fp32 parameters trains as
# the reference run of test_parallel_layouts' fp32-masters test, which compares its curve.
@pytest.mark.parametrize("precision", ["fp16"])
def test_low_precision_trains(tmp_path, corpus_cache, precision):
    run_dir = tmp_path / precision
    out = zoo(*small_run(run_dir, corpus_cache, "train.steps=12", f"train.precision={precision}"))
    assert out.returncode == 0, out.stderr
    losses = [r["loss"] for r in _metrics(run_dir)]
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def test_gpt2_trains_too(tmp_path, corpus_cache):
    run_dir = tmp_path / "gpt2"
    out = zoo("train", "--model", "gpt2", "--run-dir", str(run_dir), f"data.cache_dir={corpus_cache}",
              "train.steps=15", "train.seq_length=64", "train.micro_batch_size=8", "logging.interval=5",
              "train.eval_interval=0", "logging.progress=false")
    assert out.returncode == 0, out.stderr
    losses = [r["loss"] for r in _metrics(run_dir)]
    assert losses[-1] < losses[0]


def test_resolved_config_is_written_and_reruns(tmp_path, corpus_cache):
    run_dir = tmp_path / "cfg"
    assert zoo(*small_run(run_dir, corpus_cache, "train.steps=1")).returncode == 0
    again = zoo("train", "--config", str(run_dir / "config.yaml"), "--dry-run")
    assert again.returncode == 0, again.stderr
    assert "family: llama" in again.stdout and "seq_length: 64" in again.stdout


@pytest.mark.parametrize("kind", ["bytes", "tiktoken"])
def test_named_tokenizer_trains_and_generates(tmp_path, kind):
    import base64

    spec = "bytes"
    if kind == "tiktoken":
        spec = str(tmp_path / "tiny.tiktoken")
        ranks = {bytes([b]): b for b in range(256)} | {b"th": 256, b"the": 257, b" the": 258}
        Path(spec).write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    run_dir = tmp_path / "run"
    out = zoo(*small_run(run_dir, tmp_path / "cache", "train.steps=3", f"data.tokenizer={spec}"))
    assert out.returncode == 0, out.stderr
    extra = ["--tokenizer", "bytes"] if kind == "bytes" else []
    gen = zoo("generate", "--checkpoint", str(run_dir), "--prompt", "the", "--max-new-tokens", "5", *extra)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("the")


def test_training_starts_from_hf_weights(tmp_path, corpus_cache):
    first = tmp_path / "first"
    assert zoo(*small_run(first, corpus_cache, "train.steps=40")).returncode == 0
    assert zoo("convert", "--to", "hf", str(first), str(tmp_path / "hf")).returncode == 0
    second = tmp_path / "second"
    out = zoo(*small_run(second, corpus_cache, "train.steps=2", f"checkpoint.load=hf:{tmp_path / 'hf'}"))
    assert out.returncode == 0, out.stderr
    scratch = _metrics(first)[0]["loss"]
    continued = _metrics(second)[0]["loss"]
    assert continued < scratch - 1.0, (continued, scratch)  # it starts from the trained weights
    wrong = zoo(*small_run(tmp_path / "third", corpus_cache, "train.steps=1", "model.hidden_size=64",
                           "model.head_dim=16", f"checkpoint.load=hf:{tmp_path / 'hf'}"))
    assert wrong.returncode == 1 and "has shape" in wrong.stderr and "the model expects" in wrong.stderr


def test_trains_on_megatron_indexed_data(tmp_path, corpus_cache):
    # Megatron-format files as Megatron-LM's preprocess_data.py writes them (here: copied from the
    # embedded corpus, which is stored in that format).
    assert zoo(*small_run(tmp_path / "warm", corpus_cache, "train.steps=1")).returncode == 0
    [root] = [p for p in corpus_cache.iterdir() if p.name.startswith("python-docs-")]
    data = tmp_path / "data"
    data.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copyfile(root / f"python-docs_text_document{ext}", data / f"corpus_text_document{ext}")
    run_dir = tmp_path / "run"
    out = zoo(*small_run(run_dir, corpus_cache, "train.steps=30", f"data.path={data / 'corpus_text_document'}",
                         f"data.cache_dir={tmp_path / 'idx-cache'}"))
    assert out.returncode == 0, out.stderr
    losses = [r["loss"] for r in _metrics(run_dir)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert list((tmp_path / "idx-cache").glob("*-GPTDataset-train-shuffle_index.npy"))
    prefix = data / "corpus_text_document"
    blended = zoo(*small_run(tmp_path / "blend", corpus_cache, "train.steps=3", f"data.path=0.6 {prefix} 0.4 {prefix}",
                             f"data.cache_dir={tmp_path / 'idx-cache'}"))
    assert blended.returncode == 0, blended.stderr
    documents = (f"data.path={prefix}", f"data.tokenizer={root}", "data.reset_position_ids=true",
                 "data.eod_mask_loss=true", f"data.cache_dir={tmp_path / 'idx-cache'}")
    docs = zoo(*small_run(tmp_path / "docs", corpus_cache, "train.steps=2", *documents, "data.reset_attention_mask=true"))
    assert docs.returncode == 0, docs.stderr
    # Under context parallelism the documents' segment ids travel with the ring's key/value blocks:
    # the same curve as one process, which differs measurably from attention across documents.
    docs_cp = ranks(2, *small_run(tmp_path / "docs-cp", corpus_cache, "train.steps=2", *documents,
                                  "data.reset_attention_mask=true", "parallel.cp=2"))
    assert docs_cp.returncode == 0, docs_cp.stdout + docs_cp.stderr
    across = zoo(*small_run(tmp_path / "across", corpus_cache, "train.steps=2", *documents))
    assert across.returncode == 0, across.stderr
    masked, cp, unmasked = ([r["loss"] for r in _metrics(tmp_path / d)] for d in ("docs", "docs-cp", "across"))
    assert all(abs(a - b) <= 1e-5 * a for a, b in zip(masked, cp)) and len(cp) == 2
    assert abs(masked[1] - unmasked[1]) > 1e-5 * masked[1]
    # The built-in corpus knows its tokenizer's end-of-document id: the same documents, no data.tokenizer
    builtin = zoo(*small_run(tmp_path / "builtin", corpus_cache, "train.steps=2", "data.reset_position_ids=true",
                             "data.eod_mask_loss=true", "data.reset_attention_mask=true"))
    assert builtin.returncode == 0, builtin.stderr
    assert [r["loss"] for r in _metrics(tmp_path / "builtin")] == masked
    no_eod = zoo(*small_run(tmp_path / "noeod", corpus_cache, "train.steps=1", f"data.path={prefix}",
                            "data.eod_mask_loss=true"))
    assert no_eod.returncode == 2 and "data.eod_id" in no_eod.stderr
    missing = zoo(*small_run(tmp_path / "r2", corpus_cache, "train.steps=1", f"data.path={tmp_path / 'nope'}"))
    assert missing.returncode == 1 and "nope.idx: file not found" in missing.stderr


def test_ema_weights_are_what_generate_and_export_use(tmp_path, corpus_cache):
    """With train.ema the checkpoint holds ``ema/<name>`` beside each trainable parameter;
    `zoo.load_model` and `zoo convert --to hf` take them by default (``--weights raw``: the
    parameters), and a checkpoint without them refuses ``--weights ema``."""
    from safetensors.torch import load_file

    import zoo as zoo_api
    from zoo.checkpoint.sharded import ShardedCheckpoint

    run_dir = tmp_path / "run"
    out = zoo(*small_run(run_dir, corpus_cache, "train.steps=4", "train.ema=0.5", "optimizer.lr=1e-2"))
    assert out.returncode == 0, out.stderr
    with ShardedCheckpoint(run_dir / "checkpoints" / "step_00000004") as ck:
        raw = {n: ck.full(n) for n in ck.names() if "::" not in n and "/" not in n}
        ema = {n[len("ema/"):]: ck.full(n) for n in ck.names() if n.startswith("ema/")}
    assert ema.keys() == raw.keys()  # nothing frozen: every parameter has its average
    assert all(not torch.equal(ema[n], raw[n]) for n in raw)
    for weights, expected in (("auto", ema), ("ema", ema), ("raw", raw)):
        state = zoo_api.load_model(str(run_dir), weights=weights).state_dict()
        assert all(torch.equal(state[n], expected[n]) for n in expected), weights
    for weights, expected in (("ema", ema), ("raw", raw)):
        assert zoo("convert", "--to", "hf", str(run_dir), str(tmp_path / weights), "--weights", weights).returncode == 0
        hf = load_file(tmp_path / weights / "model.safetensors")
        assert torch.equal(hf["model.embed_tokens.weight"], expected["embed.weight"]), weights
    plain = tmp_path / "plain"
    assert zoo(*small_run(plain, corpus_cache, "train.steps=1")).returncode == 0
    refused = zoo("generate", "--checkpoint", str(plain), "--prompt", "x", "--weights", "ema")
    assert refused.returncode == 1 and "holds no moving average" in refused.stderr


def test_batch_size_ramp_up_follows_megatron_and_resumes_mid_ramp_at_another_layout(tmp_path, corpus_cache):
    """`train.rampup_batch_size` (Megatron's --rampup-batch-size): each step's global batch is
    megatron-core's `RampupBatchsizeNumMicroBatchesCalculator`'s at the samples consumed before it;
    data-parallel ranks read their share of each growing batch, so two ranks follow one process's
    curve, and a checkpoint taken mid-ramp resumes on the same curve at the other layout."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    args = ("train.steps=10", "checkpoint.interval=4", "train.micro_batch_size=4", "train.global_batch_size=32",
            "train.rampup_batch_size=[8,8,64]", "optimizer.grad_clip=0.5")
    one = zoo(*small_run(tmp_path / "one", corpus_cache, *args))
    assert one.returncode == 0, one.stderr
    assert "global batch 32 (ramped up from 8 by 8 over 64 samples)" in one.stdout
    calc = RampupBatchsizeNumMicroBatchesCalculator(32, 4, 1, False, 0, 8, 8, 64)
    consumed, sizes = 0, []
    for _ in range(10):
        calc.update(consumed, consistency_check=True)
        sizes.append(calc.get_current_global_batch_size())
        consumed += sizes[-1]
    assert sizes[0] == 8 and sizes[-1] == 32 and len(set(sizes)) == 4  # the whole ramp within the run
    state = json.loads((tmp_path / "one" / "checkpoints" / "step_00000010" / "state.json").read_text())
    assert state["consumed_samples"] == consumed
    records = _metrics(tmp_path / "one")
    assert all(r["tokens_per_s"] > 0 for r in records) and len(records) == 10
    ref = [r["loss"] for r in records]
    dp2 = ranks(2, *small_run(tmp_path / "dp2", corpus_cache, *args))
    assert dp2.returncode == 0, dp2.stdout + dp2.stderr
    for a, b in zip([r["loss"] for r in _metrics(tmp_path / "dp2")], ref, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), ref
    # the step-4 checkpoint (24 samples in, batch 16 next) of one process, continued on two ranks
    cont = tmp_path / "cont"
    (cont / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "one" / "checkpoints" / "step_00000004", cont / "checkpoints" / "step_00000004")
    out = ranks(2, *small_run(cont, corpus_cache, *args))
    assert out.returncode == 0, out.stdout + out.stderr
    for a, b in zip([r["loss"] for r in _metrics(cont)], ref[4:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), ref
    # a size on the ramp the layout cannot split, and a dataset whose loader keeps its own position
    bad = zoo(*small_run(tmp_path / "bad", corpus_cache, *args[:3], "train.global_batch_size=36",
                         "train.rampup_batch_size=[6,6,64]"))
    assert bad.returncode == 2 and "reaches a global batch of 6, not a multiple of micro_batch_size*dp = 4" in bad.stderr
    energon = zoo("train", "--model", "dit", "--run-dir", str(tmp_path / "dit"), "train.steps=1",
                  "train.global_batch_size=64", "train.rampup_batch_size=[32,32,100]")
    assert energon.returncode == 2 and "train.rampup_batch_size with dataset 'digits'" in energon.stderr
