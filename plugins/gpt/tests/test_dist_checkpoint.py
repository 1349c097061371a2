"""Sharded checkpoints: written per rank, read under any other layout (model and optimizer),
exact in the same layout, never half-loaded after a kill, and clear about bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _gpt_helpers import curve, ranks, small_run, zoo


@pytest.fixture(autouse=True)
def _zoo_in_process(capsys, monkeypatch):
    """Single-process `zoo` runs in this process (no interpreter start and torch import per run);
    multi-rank jobs run on forked ranks (`ranks`), and the runs a test kills are processes of their own."""
    import functools

    from zoo.testing import run_zoo

    monkeypatch.setitem(globals(), "zoo", functools.partial(run_zoo, capsys))


ARGS = ("train.steps=6", "checkpoint.interval=3", "optimizer.grad_clip=0.5", "train.global_batch_size=16",
        "train.micro_batch_size=4", "model.num_layers=4")


def _continue(tmp_path: Path, cache: Path, src: Path, name: str, nproc: int, *layout: str) -> list[float]:
    """Resume ``src``'s step-3 checkpoint under another layout; the losses of steps 4..6."""
    run = tmp_path / name
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000003")
    args = small_run(run, cache, *ARGS, *layout)
    out = ranks(nproc, *args) if nproc > 1 else zoo(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming from" in out.stdout
    return curve(run)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def test_resharding_between_layouts_continues_the_same_curve(tmp_path, corpus_cache):
    one = zoo(*small_run(tmp_path / "one", corpus_cache, *ARGS))
    assert one.returncode == 0, one.stderr
    ref = curve(tmp_path / "one")[3:]
    # Saved at tp2 x pp2 (no ZeRO): each of 4 ranks wrote its own shard file.
    out = ranks(4, *small_run(tmp_path / "tp2pp2", corpus_cache, *ARGS, "parallel.tp=2", "parallel.pp=2"))
    assert out.returncode == 0, out.stdout + out.stderr
    step3 = tmp_path / "tp2pp2" / "checkpoints" / "step_00000003"
    index = json.loads((step3 / "index.json").read_text())
    assert len(index["files"]) == 4 and index["world_size"] == 4
    # Pipeline stages keep global layer names; a TP-split matrix is stored as 2 pieces.
    pieces = index["tensors"]["layers.3.attn.qkv.weight"]["pieces"]
    assert sorted(p["offset"][0] for p in pieces) == [0, index["tensors"]["layers.3.attn.qkv.weight"]["shape"][0] // 2]
    # Same layout: bitwise.
    assert curve(tmp_path / "tp2pp2")[3:] == _continue(tmp_path, corpus_cache, tmp_path / "tp2pp2", "same", 4,
                                                        "parallel.tp=2", "parallel.pp=2")
    # Other layouts: tp1 pp1 dp2 with ZeRO-1, one process (pp2 with virtual stages: test_parallel_layouts).
    assert _close(_continue(tmp_path, corpus_cache, tmp_path / "tp2pp2", "dp2zero", 2, "parallel.zero=1"), ref)
    assert _close(_continue(tmp_path, corpus_cache, tmp_path / "tp2pp2", "single", 1), ref)
    # And the reverse: saved by dp2 with ZeRO-1 (sharded optimizer), continued at tp2 x pp2.
    out = ranks(2, *small_run(tmp_path / "zero", corpus_cache, *ARGS, "parallel.zero=1"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert _close(_continue(tmp_path, corpus_cache, tmp_path / "zero", "back", 4, "parallel.tp=2", "parallel.pp=2"), ref)


_KILLER = """
import os, signal, sys
import zoo.checkpoint.sharded as dc

point, n = sys.argv[1], int(sys.argv[2])
calls = [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "marker":  # a rank's tensors are on disk, its marker is not
    original_text = dc.atomic_write_text
    def write_text(path, text):
        if "step_00000006" in str(path) and str(path).endswith(".json") and "shards" in str(path):
            die()
        return original_text(path, text)
    dc.atomic_write_text = write_text
else:  # the n-th directory sync: after the shards, before/after COMPLETE, after the rename
    import zoo.checkpoint.model_dir as cv
    original_sync = cv._fsync_dir
    def sync(path):
        original_sync(path)
        calls[0] += 1
        if calls[0] == n:
            die()
    dc._fsync_dir = cv._fsync_dir = sync

from zoo.cli import main

sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_cache) -> list[float]:
    run = tmp_path_factory.mktemp("uninterrupted")
    out = zoo(*small_run(run, corpus_cache, *ARGS))
    assert out.returncode == 0, out.stderr
    return curve(run)


@pytest.mark.parametrize(("point", "n"), [("marker", 0), ("sync", 5), ("sync", 6), ("sync", 7), ("sync", 8)])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path, corpus_cache, uninterrupted, point, n):
    """The step-6 save is killed at one point (syncs 1-4 belong to the step-3 save). Afterwards the
    newest *complete* checkpoint is what resume=auto takes, and the rerun ends on the same curve."""
    from zoo.checkpoint import complete_checkpoints, latest

    killer = tmp_path / "killer.py"
    killer.write_text(_KILLER)
    args = small_run(tmp_path / "run", corpus_cache, *ARGS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_PLUGINS", None)
    out = subprocess.run([sys.executable, str(killer), point, str(n), *args], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == -signal.SIGKILL, out.stderr
    root = tmp_path / "run" / "checkpoints"
    done = [s for s, _ in complete_checkpoints(root)]
    assert done in ([3], [3, 6])  # the killed save either never became a checkpoint or fully did
    assert latest(root).name == f"step_{done[-1]:08d}"
    assert (n == 8) == (done == [3, 6])  # only a kill after the rename leaves step 6
    rerun = zoo(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert curve(tmp_path / "run")[-1] == uninterrupted[-1]
    assert not list(root.glob(".step_*"))  # the partial directory was cleared by the next save


def test_sigterm_saves_and_stops_then_the_same_command_continues(tmp_path, corpus_cache):
    args = small_run(tmp_path / "run", corpus_cache, "train.steps=400", "train.micro_batch_size=4")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_PLUGINS", None)
    proc = subprocess.Popen([sys.executable, "-m", "zoo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "SIGTERM: saved step" in stdout
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    from zoo.checkpoint import latest

    saved = latest(tmp_path / "run" / "checkpoints")
    assert saved is not None and int(saved.name[5:]) == steps[-1] < 400
    again = zoo(*small_run(tmp_path / "run", corpus_cache, f"train.steps={steps[-1] + 2}", "train.micro_batch_size=4"))
    assert again.returncode == 0, again.stderr
    assert f"resuming from {saved}" in again.stdout


def _checkpoint(tmp_path: Path, cache: Path) -> Path:
    out = zoo(*small_run(tmp_path / "src", cache, "train.steps=2"))
    assert out.returncode == 0, out.stderr
    return tmp_path / "src" / "checkpoints" / "step_00000002"


def test_bad_checkpoints_are_refused_clearly_and_nothing_is_overwritten(tmp_path, corpus_cache):
    good = _checkpoint(tmp_path, corpus_cache)

    def resume(path: Path, *extra: str) -> str:
        run = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        out = zoo(*small_run(run, corpus_cache, "train.steps=4", f"checkpoint.resume={path}", *extra))
        assert out.returncode != 0
        assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
        return out.stderr

    def variant(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(good, dst)
        return dst

    # Another flavor: the first tensor whose shape differs, with both shapes.
    err = resume(good, "model.hidden_size=64", "model.head_dim=16")
    assert "has shape [2048, 128] in the checkpoint (index.json), the model needs [2048, 64]" in err
    # A missing shard file.
    missing = variant("missing")
    (missing / "shards" / "rank00000.safetensors").unlink()
    assert "shard file shards/rank00000.safetensors is missing" in resume(missing)
    # A flipped byte: the checksum says so.
    corrupt = variant("corrupt")
    data = bytearray((corrupt / "shards" / "rank00000.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (corrupt / "shards" / "rank00000.safetensors").write_bytes(bytes(data))
    assert "checksum mismatch" in resume(corrupt)
    # A newer format.
    newer = variant("newer")
    meta = json.loads((newer / "zoo.json").read_text())
    (newer / "zoo.json").write_text(json.dumps({**meta, "format_version": 99}))
    assert "format version 99; this zoo reads versions up to 3" in resume(newer)
    # Not a checkpoint at all, and one of another family.
    assert "not a zoo checkpoint" in resume(tmp_path)
    other = variant("other")
    (other / "zoo.json").write_text(json.dumps({**meta, "family": "gpt2"}))
    assert "a checkpoint of 'gpt2', not 'llama'" in resume(other)
    # The good checkpoint was never touched.
    assert (good / "COMPLETE").exists() and len(list((good / "shards").iterdir())) == 3


def test_hf_export_of_a_sharded_tp_pp_checkpoint_equals_the_single_process_export(tmp_path, corpus_cache):
    from safetensors.torch import load_file

    import zoo as zoo_api
    from zoo.checkpoint.model_dir import write_model_dir

    out = ranks(4, *small_run(tmp_path / "par", corpus_cache, "train.steps=2", "parallel.tp=2", "parallel.pp=2",
                              "train.micro_batch_size=4", "model.num_layers=4", "train.global_batch_size=8"))
    assert out.returncode == 0, out.stdout + out.stderr
    ckpt = tmp_path / "par" / "checkpoints" / "step_00000002"
    assert zoo("convert", "--to", "hf", str(ckpt), str(tmp_path / "hf-par")).returncode == 0
    # The same model written by one process (format 1, one file), exported the same way.
    loaded = zoo_api.checkpoint.load(ckpt)
    meta = json.loads((ckpt / "zoo.json").read_text())
    write_model_dir(tmp_path / "one", family="llama", flavor=meta["flavor"], config=loaded.config,
                    state=loaded.model.state_dict(), tokenizer_from=ckpt)
    assert zoo("convert", "--to", "hf", str(tmp_path / "one"), str(tmp_path / "hf-one")).returncode == 0
    a, b = load_file(tmp_path / "hf-par" / "model.safetensors"), load_file(tmp_path / "hf-one" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # And back: training starts from the HF directory under tp2 x pp2 (each rank keeps only its
    # stage's tensors, sliced) exactly as one process does.
    common = ("train.steps=1", "train.micro_batch_size=4", "model.num_layers=4", "train.global_batch_size=8",
              f"checkpoint.load=hf:{tmp_path / 'hf-par'}")
    one = zoo(*small_run(tmp_path / "from-hf-1", corpus_cache, *common))
    assert one.returncode == 0, one.stderr
    par = ranks(4, *small_run(tmp_path / "from-hf-4", corpus_cache, *common, "parallel.tp=2", "parallel.pp=2"))
    assert par.returncode == 0, par.stdout + par.stderr
    assert _close(curve(tmp_path / "from-hf-4"), curve(tmp_path / "from-hf-1"))


def test_hf_import_keeps_only_the_tensors_a_stage_needs(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoo.checkpoint.external import _hf_source
    from zoo.checkpoint.mapping import from_external
    from zoo.checkpoint.tensorio import LazyTensors

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2))
    hf.save_pretrained(tmp_path / "hf")
    entry, fmt, config, _, _ = _hf_source(tmp_path / "hf")
    lazy = LazyTensors(tmp_path / "hf")
    keep = {"layers.2.attn.qkv.weight", "layers.3.mlp.fc.weight", "head.weight"}
    got = from_external(fmt.table(config), lazy, config, keep=keep)
    assert set(got) == keep  # nothing else is held, yet every HF tensor was checked as consumed
    # And only what those are made of was read from disk: q, k, v of layer 2, gate and up of layer 3, the head.
    assert sorted(lazy.read) == sorted(["model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                                        "model.layers.2.self_attn.v_proj.weight", "model.layers.3.mlp.gate_proj.weight",
                                        "model.layers.3.mlp.up_proj.weight", "lm_head.weight"])
    full = from_external(fmt.table(config), LazyTensors(tmp_path / "hf"), config)
    assert all(torch.equal(got[k], full[k]) for k in keep)


def _save_format_1(path: Path, *, run, step: int, consumed_samples: int, model_state: dict, opt_state: dict,
                   groups: list, tokenizer_dir: Path) -> None:
    """A checkpoint as zoo 0.1 wrote it (format 1): full tensors in one file per kind, loop state
    and Python/NumPy RNG states in state.json."""
    import random

    import numpy as np

    from zoo.checkpoint.model_dir import write_model_dir

    py, np_state = random.getstate(), np.random.get_state()
    state = {"step": step, "consumed_samples": consumed_samples, "optimizer_param_groups": groups, "scaler": None,
             "python_rng": [py[0], list(py[1]), py[2]], "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    write_model_dir(path, family=run.family, flavor=run.flavor, config=run.model, state=model_state,
                    extra_meta={"kind": "train", "step": step},
                    tensor_files={"optimizer.safetensors": opt_state, "rng.safetensors": {"torch": torch.get_rng_state()}},
                    files={"state.json": json.dumps(state).encode(), "config.yaml": run.to_yaml().encode()},
                    tokenizer_from=tokenizer_dir)
    (path.parent / "latest").write_text(path.name + "\n")


def test_format_1_checkpoints_still_resume(tmp_path, corpus_cache):
    """A checkpoint in the single-file format older zoo wrote (format 1) continues exactly like the
    sharded one it was made from."""
    import argparse

    from zoo.checkpoint.model_dir import read_meta
    from zoo.checkpoint.reader import read_model_state
    from zoo.checkpoint.sharded import ShardedCheckpoint
    from zoo.cli import resolve_run

    args = ("train.steps=6", "checkpoint.interval=3")
    out = zoo(*small_run(tmp_path / "v2", corpus_cache, *args))
    assert out.returncode == 0, out.stderr
    src = tmp_path / "v2" / "checkpoints" / "step_00000003"
    md = read_meta(src)
    with ShardedCheckpoint(src) as ck:
        opt = {k: ck.full(k) for k in ck.names() if "::" in k}
        rng = ck.rng(0).tensors["torch"]
    state = json.loads((src / "state.json").read_text())
    _, run = resolve_run(argparse.Namespace(config=[src / "config.yaml"], model=None, flavor=None, overrides=[],
                                            plugins=None))
    root = tmp_path / "v1" / "checkpoints"
    _save_format_1(root / "step_00000003", run=run, step=3, consumed_samples=state["consumed_samples"],
                   model_state=read_model_state(md), opt_state=opt, groups=state["optimizer_param_groups"], tokenizer_dir=src)
    v1 = root / "step_00000003"
    assert json.loads((v1 / "zoo.json").read_text())["format_version"] == 1 and (v1 / "model.safetensors").is_file()
    # Format 1 kept one RNG state; use the sharded checkpoint's so both continue from the same one.
    from safetensors.torch import save_file

    save_file({"torch": rng}, str(v1 / "rng.safetensors"))
    resumed = zoo(*small_run(tmp_path / "v1", corpus_cache, *args))
    assert resumed.returncode == 0, resumed.stderr
    assert curve(tmp_path / "v1") == curve(tmp_path / "v2")[3:]


DATA = Path(__file__).parent / "data"


def test_format_2_checkpoints_still_load_and_their_crc32_still_catches_corruption(tmp_path, capsys):
    """data/ckpt_format2 was written by zoo before CRC-32C (format 2, zlib CRC-32 pieces): a tiny
    LLaMA with AdamW state at TP=2; data/ckpt_format2_reference.safetensors holds every tensor as
    that zoo read it back. Today's reader gives the same tensors, whole and as TP=1 and TP=4
    slices read in place, and a flipped byte is still caught."""
    from safetensors.torch import load_file

    from zoo.checkpoint.sharded import ShardedCheckpoint
    from zoo.parallel.sharding import TPShard

    src = DATA / "ckpt_format2"
    assert json.loads((src / "index.json").read_text())["format_version"] == 2
    ref = load_file(str(DATA / "ckpt_format2_reference.safetensors"))
    with ShardedCheckpoint(src) as ck:
        assert set(ck.names()) == set(ref)
        for name, want in ref.items():
            assert torch.equal(ck.full(name), want), name
        w = ref["layers.0.mlp.proj.weight"]  # row-parallel: columns split
        for rank in range(4):
            into = torch.empty(w.shape[0], w.shape[1] // 4)
            got = ck.read_local("layers.0.mlp.proj.weight", into.shape, TPShard("cols", 4, rank), into=into)
            assert got is into and torch.equal(into, w[:, rank * into.shape[1]:(rank + 1) * into.shape[1]])
        gate, up = ref["layers.1.mlp.fc.weight"].chunk(2)  # [gate; up], each split by rows
        for rank in range(2):
            into = torch.empty(gate.shape[0], gate.shape[1])
            got = ck.read_local("layers.1.mlp.fc.weight", into.shape, TPShard("gated_rows", 2, rank), into=into)
            h = gate.shape[0] // 2
            assert got is into and torch.equal(into, torch.cat([gate[rank * h:(rank + 1) * h], up[rank * h:(rank + 1) * h]]))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = bad / "shards" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    with ShardedCheckpoint(bad) as ck, pytest.raises(Exception, match="checksum mismatch"):
        for name in ck.names():
            ck.full(name)
    from zoo.testing import run_zoo

    ok = run_zoo(capsys, "checkpoint", "inspect", str(src), "--verify")
    assert ok.returncode == 0 and f"all {len(ref)} tensors intact" in ok.stdout, ok.stdout
    broken = run_zoo(capsys, "checkpoint", "inspect", str(bad), "--verify")
    assert broken.returncode == 1 and "shards/rank00001.safetensors: " in broken.stdout, broken.stdout


def test_time_based_interval_and_retention(tmp_path, corpus_cache):
    # Every step takes longer than 0.0001 minutes, so each one is followed by a save; two are kept.
    out = zoo(*small_run(tmp_path / "run", corpus_cache, "train.steps=4", "checkpoint.interval_minutes=0.0001",
                         "checkpoint.keep_last=2", "checkpoint.async_save=true"))
    assert out.returncode == 0, out.stderr
    from zoo.checkpoint import complete_checkpoints

    assert [s for s, _ in complete_checkpoints(tmp_path / "run" / "checkpoints")] == [3, 4]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000004"


_STYLE = {"column": "rows", "column_gated": "gated_rows", "row": "cols", "vocab_embedding": "rows", "vocab_head": "rows"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_import_under_tp_reads_only_the_rows_of_each_shard(tmp_path, family):
    """Each TP rank's shards, read row range by row range through the mapping, equal the slices of
    the fully imported tensors; every read is a row range no larger than the shard needs."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from zoo.checkpoint.external import _hf_source
    from zoo.checkpoint.mapping import from_external
    from zoo.checkpoint.slicing import read_sliced
    from zoo.checkpoint.tensorio import LazyTensors
    from zoo.family import resolve
    from zoo.parallel.apply import _matches, tensor_parallel_plan
    from zoo.parallel.sharding import TPShard
    from zoo.registry import get_registry

    if family == "llama":
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
    else:
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16))
    hf.save_pretrained(tmp_path / "hf")
    _, fmt, config, _, _ = _hf_source(tmp_path / "hf")
    full = from_external(fmt.table(config), LazyTensors(tmp_path / "hf"), config)
    fam = get_registry().get(family).family
    with torch.device("meta"):
        model = resolve(fam.build, owner=family)(config, fam.spec_for(config))
    plan = tensor_parallel_plan(model, fam.tp_plan)[0]
    tp = 2
    for rank in range(tp):
        wanted, expected = {}, {}
        for name, t in full.items():
            style = next((_STYLE[s] for p, s in plan.items() if _matches(name.rpartition(".")[0], p)), None)
            if style == "cols" and t.dim() == 1:
                style = None  # a row-parallel layer's bias is whole on every rank
            local = list(t.shape)
            if style in ("rows", "gated_rows"):
                local[0] //= tp
            elif style == "cols":
                local[1] //= tp
            shard = TPShard(style, tp, rank) if style else None
            shape = shard.global_shape(local) if shard else tuple(local)
            cut = shard.cut if shard else (lambda x: x)
            wanted[name] = (shape, cut)
            expected[name] = cut(t)
        lazy = LazyTensors(tmp_path / "hf")
        got = read_sliced(fmt.table(config), lazy, config, wanted)
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
        # The vocabulary rows of the embedding: half of them per rank; a row-parallel weight: half
        # of its columns (GPT-2's Conv1D stores it transposed: half of its rows).
        emb = "model.embed_tokens.weight" if family == "llama" else "transformer.wte.weight"
        assert f"{emb}[{32 * rank}:{32 * rank + 32}][:, 0:32]" in lazy.read
        proj = "model.layers.0.self_attn.o_proj.weight[0:32][:, {}:{}]" if family == "llama" else \
            "transformer.h.0.attn.c_proj.weight[{}:{}][:, 0:32]"
        assert proj.format(16 * rank, 16 * rank + 16) in lazy.read, lazy.read


def test_tensor_parallel_rng_streams_are_saved_per_rank(tmp_path, corpus_cache):
    from safetensors.torch import load_file

    out = ranks(2, *small_run(tmp_path / "run", corpus_cache, "train.steps=1", "parallel.tp=2"))
    assert out.returncode == 0, out.stdout + out.stderr
    shards = tmp_path / "run" / "checkpoints" / "step_00000001" / "shards"
    streams = [load_file(shards / f"rank{r:05d}.rng.safetensors")["tp_stream"] for r in range(2)]
    for rank, state in enumerate(streams):  # Megatron's rule: seed + 2718 + TP rank (no dropout drew yet)
        assert torch.equal(state, torch.Generator().manual_seed(1234 + 2718 + rank).get_state())


def test_fsdp_trains_like_one_process_and_its_checkpoints_reshard_both_ways(tmp_path, corpus_cache, uninterrupted):
    """`parallel.fsdp=2` with `parallel.cp=2` (torch's fully_shard: parameters, gradients and Adam
    state sharded over the 2 x 2 data and context ranks, each rank writing its own pieces; ring
    attention over the context pairs) follows the single-process curve, and its step-3 checkpoint
    continues under tp2 x pp2 and in one process, each exactly as one process continues; a
    single-process checkpoint continues the same way under HSDP (`parallel.fsdp=2` on 4 data-parallel
    ranks: 2 replicas of 2 sharding ranks), whose checkpoint holds each piece once."""
    out = ranks(4, *small_run(tmp_path / "fsdp", corpus_cache, *ARGS, "parallel.fsdp=2", "parallel.cp=2"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fsdp over dp x cp = 4 ranks" in out.stdout
    assert _close(curve(tmp_path / "fsdp"), uninterrupted)
    index = json.loads((tmp_path / "fsdp" / "checkpoints" / "step_00000003" / "index.json").read_text())
    pieces = index["tensors"]["layers.0.mlp.fc.weight::exp_avg"]["pieces"]  # Adam state: one piece per rank
    rows = index["tensors"]["layers.0.mlp.fc.weight"]["shape"][0]
    assert sorted(p["offset"][0] for p in pieces) == [0, rows // 4, rows // 2, 3 * rows // 4]
    assert _close(_continue(tmp_path, corpus_cache, tmp_path / "fsdp", "tp2pp2", 4, "parallel.tp=2", "parallel.pp=2"),
                  uninterrupted[3:])
    assert _close(_continue(tmp_path, corpus_cache, tmp_path / "fsdp", "one", 1), uninterrupted[3:])
    single = tmp_path / "single"
    (single / "checkpoints").mkdir(parents=True)
    # (3 steps of the same run: the first 30 are linear warm-up, so the schedule does not depend on train.steps)
    assert zoo(*small_run(single, corpus_cache, *ARGS, "train.steps=3")).returncode == 0
    assert _close(_continue(tmp_path, corpus_cache, single, "to-hsdp", 4, "parallel.fsdp=2"), uninterrupted[3:])
    index = json.loads((tmp_path / "to-hsdp" / "checkpoints" / "step_00000006" / "index.json").read_text())
    pieces = index["tensors"]["layers.0.mlp.fc.weight::exp_avg"]["pieces"]  # written by the first replica only
    assert sorted(p["offset"][0] for p in pieces) == [0, rows // 2]


def test_tied_embeddings_load_under_tensor_parallelism(tmp_path, corpus_cache):
    """`checkpoint.load` of a model whose head is its embedding (Gemma, GPT-2, Llama 3.2), from a zoo
    checkpoint or a Hugging Face directory, under tp2: each rank takes its vocabulary rows for both
    names, and training goes on exactly as in one process (the tied head read the whole embedding for
    its shard before, and the run stopped)."""
    tied = ("model.tie_embeddings=true", "train.micro_batch_size=4", "train.global_batch_size=8")
    first = zoo(*small_run(tmp_path / "first", corpus_cache, *tied, "train.steps=1"))
    assert first.returncode == 0, first.stderr
    assert zoo("convert", "--to", "hf", str(tmp_path / "first"), str(tmp_path / "hf")).returncode == 0
    for source in (str(tmp_path / "first"), f"hf:{tmp_path / 'hf'}"):
        name = "hf" if source.startswith("hf:") else "zoo"
        common = (*tied, "train.steps=2", f"checkpoint.load={source}")
        one = zoo(*small_run(tmp_path / f"{name}-1", corpus_cache, *common))
        assert one.returncode == 0, one.stderr
        two = ranks(2, *small_run(tmp_path / f"{name}-tp2", corpus_cache, *common, "parallel.tp=2"))
        assert two.returncode == 0, two.stdout + two.stderr
        assert _close(curve(tmp_path / f"{name}-tp2"), curve(tmp_path / f"{name}-1"))
