"""Every format zoo reads, fuzzed (tests/reliability/_fuzz.py): each case loads or fails with one
`zoo: error:` line naming the file, exit code 1 or 2, in seconds, without allocating what a
corrupt header declares.

CI runs ``ZOO_FUZZ_CASES`` (default 24) cases per target; the documented full run is
``ZOO_FUZZ_CASES=100 python -m pytest -q tests/reliability/test_fuzz.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from _fuzz import Target, fuzz, summary

CASES = int(os.environ.get("ZOO_FUZZ_CASES", "24"))
SEED = int(os.environ.get("ZOO_FUZZ_SEED", "0"))

TRAIN = ["train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2", "logging.interval=1",
         "train.eval_interval=0", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
         "model.num_layers=1"]


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory, corpus_cache) -> dict[str, Path]:
    """One valid artefact of each kind, made by zoo itself (and a config file)."""
    from zoo.cli import main
    from zoo.data.energon.prepare import png_bytes, prepare_webdataset, write_shards
    from zoo.data.indexed import IndexedDatasetWriter

    base = tmp_path_factory.mktemp("fuzz-artefacts")
    rng = np.random.default_rng(0)
    # Megatron .bin/.idx: 30 documents of 1-3 sequences.
    (base / "megatron").mkdir()
    with IndexedDatasetWriter(base / "megatron" / "text", dtype=np.uint16) as w:
        for _ in range(30):
            doc = rng.integers(0, 60000, size=int(rng.integers(1, 50)))
            cut = sorted(rng.choice(np.arange(1, max(len(doc), 2)), size=min(2, len(doc) - 1), replace=False)) if len(doc) > 2 else []
            lens = np.diff([0, *cut, len(doc)])
            w.add_document(doc, lengths=lens.tolist())
    # Energon: 12 captioned 8x8 images in 3 shards, split 8/2/2.
    energon = base / "energon"
    samples = [(f"s{i:03d}", {"png": png_bytes(rng.integers(0, 255, (8, 8), dtype=np.uint8)),
                              "txt": f"digit {i % 10}".encode()}) for i in range(12)]
    write_shards(energon, samples, shard_size=5)
    prepare_webdataset(energon, split=(8, 2, 2), sample_type="CaptioningSample",
                       field_map={"image": "png", "caption": "txt"})
    (base / "meta").mkdir()
    (base / "meta" / "blend.yaml").write_text(f"""__module__: megatron.energon
__class__: MetadatasetV2
splits:
  train:
    blend:
      - weight: 2
        path: {energon}
        subflavors: {{src: a}}
      - weight: 1
        path: {energon}
        subset: {{range: [0, 4]}}
  val:
    path: {energon}
""")
    # A zoo checkpoint of a 1-layer LLaMA, and its Hugging Face export in two safetensors shards.
    run = base / "run"
    assert main(["train", "--model", "llama", "--run-dir", str(run), f"data.cache_dir={corpus_cache}", *TRAIN,
                 "train.steps=1", "checkpoint.interval=1"]) == 0
    ckpt = run / "checkpoints" / "step_00000001"
    assert main(["convert", "--to", "hf", str(ckpt), str(base / "hf"), "--max-shard-size", "2MB"]) == 0
    (base / "config").mkdir()
    (base / "config" / "run.yaml").write_text("model:\n  num_layers: 2\n  hidden_size: 64\noptimizer:\n  lr: 0.001\n"
                                              "train:\n  steps: 10\n  seq_length: 64\n")
    return {"megatron": base / "megatron", "energon": energon, "meta": base / "meta", "ckpt": ckpt,
            "hf": base / "hf", "config": base / "config", "cache": corpus_cache}


def targets(a: dict[str, Path]) -> list[Target]:
    cache = a["cache"]

    def resume(copy: Path, scratch: Path) -> list[str]:
        return ["train", "--model", "llama", "--run-dir", str(scratch / "run"), f"data.cache_dir={cache}", *TRAIN,
                "train.steps=2", "checkpoint.interval=0", f"checkpoint.resume={copy}"]

    def lint(copy: Path, scratch: Path) -> list[str]:
        return ["data", "lint", str(copy)]

    hf_files = sorted(p.name for p in a["hf"].glob("*.safetensors"))
    out = [
        Target("Megatron .idx", a["megatron"], "text.idx", lambda c, s: ["data", "lint", str(c / "text")]),
        Target("Megatron .bin", a["megatron"], "text.bin", lambda c, s: ["data", "lint", str(c / "text")],
               names=("text.idx",)),
        Target("Energon .tar shard", a["energon"], "shards/shard-000001.tar", lint),
        Target("Energon .tar.idx", a["energon"], "shards/shard-000001.tar.idx", lint,
               names=("shard-000001.tar",)),
        Target("Energon .nv-meta/.info.json", a["energon"], ".nv-meta/.info.json", lint, text=True),
        Target("Energon .nv-meta/split.yaml", a["energon"], ".nv-meta/split.yaml", lint, text=True),
        Target("Energon .nv-meta/dataset.yaml", a["energon"], ".nv-meta/dataset.yaml", lint, text=True),
        Target("metadataset YAML", a["meta"], "blend.yaml", lambda c, s: ["data", "info", str(c / "blend.yaml")],
               text=True),
        Target("HF config.json", a["hf"], "config.json",
               lambda c, s: ["convert", "--from", "hf", str(c), str(s / "out")], text=True),
        Target("HF model.safetensors.index.json", a["hf"], "model.safetensors.index.json",
               lambda c, s: ["convert", "--from", "hf", str(c), str(s / "out")], text=True),
        Target("HF safetensors shard", a["hf"], hf_files[0],
               lambda c, s: ["convert", "--from", "hf", str(c), str(s / "out")]),
        Target("checkpoint zoo.json", a["ckpt"], "zoo.json", resume, text=True),
        Target("checkpoint index.json", a["ckpt"], "index.json", resume, text=True),
        Target("checkpoint state.json", a["ckpt"], "state.json", resume, text=True),
        Target("checkpoint shard safetensors", a["ckpt"], "shards/rank00000.safetensors", resume,
               names=("index.json",)),
        Target("checkpoint shard marker", a["ckpt"], "shards/rank00000.json", resume, text=True),
        Target("config YAML (--config)", a["config"], "run.yaml",
               lambda c, s: ["train", "--model", "llama", "--config", str(c / "run.yaml"), "--dry-run"], text=True),
    ]
    return out


def test_every_format_survives_the_fuzzer(artefacts, tmp_path, capsys):
    outcomes = fuzz(targets(artefacts), CASES, tmp_path / "case", seed=SEED)
    report = summary(outcomes)
    bad = [o for o in outcomes if o.problems]
    with capsys.disabled():
        print("\n" + report)
    (Path(os.environ.get("ZOO_FUZZ_REPORT", tmp_path / "fuzz.json"))).write_text(json.dumps(
        [o.__dict__ for o in outcomes], indent=1))
    detail = "\n".join(f"{o.target} / {o.case}: {'; '.join(o.problems)} | {o.line[:300]}" for o in bad)
    if os.environ.get("ZOO_FUZZ_FAILURES"):
        Path(os.environ["ZOO_FUZZ_FAILURES"]).write_text(detail)
    assert not bad, "\n".join(detail.splitlines()[:40]) + \
        f"\n{len(bad)} of {len(outcomes)} cases failed\n" + report


def test_data_info_shows_a_metadataset_blend(artefacts, capsys):
    """The fuzzer's metadataset target, unmodified: each leaf with its normalised weight and the
    samples its subset leaves (split 8,2,2 of 3 shards: train 2 shards, 10 samples, val none; range [0, 4] keeps 4)."""
    from zoo.cli import main

    assert main(["data", "info", str(artefacts["meta"] / "blend.yaml")]) == 0
    lines = [x.split() for x in capsys.readouterr().out.splitlines() if x.strip().startswith(("weight", "repetitions"))]
    assert [(x[1], x[2]) for x in lines] == [("0.667", "10"), ("0.333", "4"), ("1", "0")]
