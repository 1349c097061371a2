"""Files zoo writes keep the user's permissions: what the umask gives a plain ``open`` (0644 under
umask 022, 0640 under 027) and directories what it gives ``mkdir``, so prepared datasets, configs,
metrics and checkpoints on a shared cluster are readable by the team. Atomic writes (temporary
file + rename) used to leave everything at mkstemp's 0600."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


def _zoo_with_umask(umask: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ZOO_PLUGINS"}
    return subprocess.run([sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=600, env=env,
                          preexec_fn=lambda: os.umask(umask))


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_prepare_and_train_outputs_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "words " * (i % 7)}) + "\n" for i in range(200)))
    data = tmp_path / "data"
    data.mkdir(mode=dir_mode)
    out = _zoo_with_umask(umask, "prepare", "text", "--input", str(corpus), "--output-prefix", str(data / "c"),
                          "--train-bpe", "300", "--append-eod", "--quiet")
    assert out.returncode == 0, out.stderr
    prepared = _modes(data)
    assert {"c_text_document.bin", "c_text_document.idx", "c_tokenizer.json"} <= prepared.keys()
    assert all(mode == (dir_mode if (data / name).is_dir() else file_mode) for name, mode in prepared.items()), prepared

    run = tmp_path / "run"
    out = _zoo_with_umask(umask, "train", "--model", "mixer", "--run-dir", str(run), "train.steps=2",
                          "checkpoint.interval=1", "logging.progress=false", "train.eval_interval=0")
    assert out.returncode == 0, out.stderr
    written = _modes(run)
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "checkpoints/latest", "checkpoints/step_00000002/zoo.json",
                 "checkpoints/step_00000002/index.json", "checkpoints/step_00000002/state.json",
                 "checkpoints/step_00000002/COMPLETE", "checkpoints/step_00000002/shards/rank00000.safetensors"):
        assert written[name] == file_mode, (name, oct(written[name]))
    for name, mode in written.items():
        assert mode == (dir_mode if (run / name).is_dir() else file_mode), (name, oct(mode))
