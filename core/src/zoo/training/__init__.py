"""Training: the `Trainer` (`trainer`), the optimizer side (`optim`: schedule, parameter rules,
optimizer state), the moving average of the weights (`ema`), activation recomputation
(`recompute`), metrics and throughput (`metrics`), the progress display (`progress`), the loss
plot (`plot`) and preemption (`run_control`).

`zoo.nn` imports `recompute` (its primitives register their recipes there), so this package's
names are exported lazily: importing `zoo.nn.recompute` does not import the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Trainer": "zoo.training.trainer", "EMA": "zoo.training.ema", "ParamRules": "zoo.training.optim",
            "lr_at": "zoo.training.optim", "param_groups": "zoo.training.optim", "MetricsLog": "zoo.training.metrics"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zoo.training' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
