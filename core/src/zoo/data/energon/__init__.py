"""Energon-format multimodal data: WebDataset `.tar` shards with `.nv-meta/` and `.tar.idx`,
read, written (`zoo prepare webdataset|images|convert-pickle`) and loaded with Energon's API
(`get_train_dataset`, `get_val_dataset`, `get_loader`, `WorkerConfig`, task encoders, sample
types), with exact, cheap save/restore of the loader position.

Modules: `tar` (shards and `.tar.idx`), `storage` (local or fsspec paths), `dataset` (a prepared
dataset's metadata and samples), `samples` (sample types, part decoding), `metadataset` (blend
YAML), `task_encoder` (hooks), `pipeline` (one worker's savable stages), `loader` (workers,
watchdog, state), `prepare` / `convert` (writing), `training` (the trainer's dataset).
"""

import importlib
from typing import Any

# Loaded on first use (PEP 562): `zoo --help` and `zoo prepare` do not import torch.
_WHERE = {
    "DatasetError": "dataset", "WebDataset": "dataset", "is_dataset": "dataset",
    "EnergonDataset": "loader", "Loader": "loader", "LoaderError": "loader", "WorkerConfig": "loader",
    "get_loader": "loader", "get_savable_loader": "loader", "get_train_dataset": "loader", "get_val_dataset": "loader",
    "CaptioningSample": "samples", "DecodeError": "samples", "ImageClassificationSample": "samples",
    "ImageSample": "samples", "InterleavedSample": "samples", "MultiChoiceVQASample": "samples", "Sample": "samples",
    "TextSample": "samples", "VidQASample": "samples", "VQASample": "samples", "basic_sample_keys": "samples",
    "Cooker": "task_encoder", "DefaultTaskEncoder": "task_encoder", "SkipSample": "task_encoder",
    "TaskEncoder": "task_encoder", "cooker": "task_encoder", "stateless": "task_encoder",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'zoo.data.energon' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zoo.data.energon.{_WHERE[name]}"), name)


__all__ = sorted(_WHERE)
