"""Checkpoints: zoo model directories (`model_dir`), sharded training checkpoints that reshard
to any layout (`sharded`, `state`), reading either format (`reader`), a model's weights and a run's
starting weights (`weights`), conversion to and from external formats with declarative mapping
tables (`external`, `mapping`, `slicing`), safetensors I/O (`tensorio`) and RNG states (`rng`)."""

from zoo.checkpoint.external import ExternalFormat, Loaded, export_external, import_external, load, load_model
from zoo.checkpoint.files import FileFormat
from zoo.checkpoint.mapping import (
    Fuse,
    Ignore,
    MappingError,
    MappingTable,
    Rename,
    Split,
    StackExperts,
    Tie,
    Transpose,
    from_external,
    to_external,
)
from zoo.checkpoint.model_dir import ModelDir, read_meta, write_model_dir
from zoo.checkpoint.sharded import ShardedCheckpoint
from zoo.checkpoint.state import (
    Checkpoint,
    Stateful,
    TrainState,
    complete_checkpoints,
    latest,
    resolve_checkpoint,
    save,
)
from zoo.checkpoint.tensorio import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "ExternalFormat", "FileFormat", "Fuse", "Ignore", "Loaded", "MappingError", "MappingTable",
           "ModelDir", "Rename", "ShardedCheckpoint", "Split", "StackExperts", "Stateful", "Tie", "TrainState",
           "Transpose", "complete_checkpoints", "export_external", "from_external", "import_external", "latest", "load",
           "load_model", "read_meta", "resolve_checkpoint", "save", "to_external", "write_model_dir"]
