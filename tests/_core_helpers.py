"""Helpers for the core tests: fake plugin distributions and running the real `zoo` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zoo.testing.plugins import entry_points_under, fake_distribution

REPO = Path(__file__).resolve().parents[1]


def plugin_module(family: str, *, aliases: tuple[str, ...] = (), flavors: str = '{"tiny": tiny}', body: str = "") -> str:
    """Source of a light plugin module declaring one family (its model lives in ``<pkg>_model``)."""
    return f'''
from dataclasses import dataclass
from zoo import Family, hookimpl
from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec

@dataclass(kw_only=True)
class Config:
    vocab_size: int = 32
    hidden_size: int = 16
    num_layers: int = 2
    num_heads: int = 2
    layer_spec: str = "dense"

SPEC = ModelSpec(
    blocks={{"A": BlockSpec(norm=NormSpec(kind="rmsnorm"), mixer=AttentionSpec(causal=True, bias=False, positions="rope"),
                           ffn=MLPSpec(activation="silu", gated=True, bias=False))}},
    embedding="token", positions="none", final_norm=NormSpec(kind="rmsnorm"), head="lm",
)

def tiny():
    return Config()

FAMILY = Family(
    name={family!r}, aliases={aliases!r}, description="test family", task="causal_lm", config=Config,
    flavors={flavors}, specs={{"dense": SPEC}},
    build=__name__ + "_model:build", loss=__name__ + "_model:loss", example_batch=__name__ + "_model:example_batch",
)

{body}

def zoo_families():
    return [FAMILY]
'''


MODEL_MODULE = '''
import torch
from torch import nn
import torch.nn.functional as F

class Tiny(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_layers))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)
    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)

def build(cfg, spec):
    return Tiny(cfg)

def loss(model, batch):
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()), {}

def example_batch(cfg, *, batch_size, seq_length, generator):
    t = torch.randint(0, cfg.vocab_size, (batch_size, seq_length + 1), generator=generator)
    return {"tokens": t[:, :-1], "labels": t[:, 1:]}
'''


def add_family_dist(root: Path, dist: str, pkg: str, family: str, *, version: str = "1.0", entry: str | None = None,
                    **kwargs: object) -> None:
    fake_distribution(
        root, dist, version, plugins={entry or family: pkg},
        files={f"{pkg}.py": plugin_module(family, **kwargs), f"{pkg}_model.py": MODEL_MODULE},
    )


def registry_of(root: Path, only: str | None = None):
    from zoo.registry import load_registry

    return load_registry(entry_points_under(root), only=only)


def run_zoo(*args: str, env: dict[str, str] | None = None, path: Path | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed `zoo` as a user would (a fresh process); ``path`` is prepended to PYTHONPATH."""
    full = {**os.environ, **(env or {})}
    full.pop("ZOO_PLUGINS", None) if env is None or "ZOO_PLUGINS" not in env else None
    if path is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(path), full.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "zoo", *args], capture_output=True, text=True, env=full, timeout=timeout, cwd=cwd
    )
