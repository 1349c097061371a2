"""Entry point of the plugin: declarations only. zoo imports this for `zoo list`, so no torch here."""

from __future__ import annotations

from dataclasses import dataclass

from zoo import DatasetSpec, Family, hookimpl
from zoo.spec import BlockSpec, MixerSpec, MLPSpec, ModelSpec, NormSpec


@dataclass(frozen=True, kw_only=True)
class CausalTokenMixSpec(MixerSpec):
    """Mixing across positions by a learned lower-triangular matrix (our own spec type)."""

    bias: bool = True


@dataclass(kw_only=True)
class MixerConfig:
    vocab_size: int = 256  # bytes
    hidden_size: int = 64
    num_layers: int = 2
    max_seq_length: int = 64  # token mixing has one weight per (target, source) position pair
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    layer_spec: str = "mixer"


MIXER = ModelSpec(
    blocks={
        "X": BlockSpec(
            norm=NormSpec(kind="layernorm"),
            mixer=CausalTokenMixSpec(),
            ffn=MLPSpec(activation="gelu", gated=False, bias=True),
        )
    },
    embedding="token",
    positions="none",  # the mixing matrix is position-aware by construction
    final_norm=NormSpec(kind="layernorm"),
    head="lm",
)


def tiny() -> MixerConfig:
    return MixerConfig()


def small() -> MixerConfig:
    return MixerConfig(hidden_size=256, num_layers=6, max_seq_length=256)


@hookimpl
def zoo_families() -> list[Family]:
    return [
        Family(
            name="mixer",
            aliases=("causal-mixer",),
            description="causal MLP-Mixer byte-level language model (third-party example)",
            task="causal_lm",
            config=MixerConfig,
            flavors={"tiny": tiny, "small": small},
            specs={"mixer": MIXER},
            build="acme_mixer.model:build",
            loss="acme_mixer.model:loss",
            example_batch="acme_mixer.model:example_batch",
            default_dataset="acme-pydoc-bytes",
            recipe={"train.seq_length": 64, "train.micro_batch_size": 16, "optimizer.lr": 3e-3,
                    "optimizer.weight_decay": 0.0, "schedule.warmup_steps": 10, "train.steps": 150,
                    "train.eval_interval": 50},
        )
    ]


@hookimpl
def zoo_datasets() -> list[DatasetSpec]:
    return [
        DatasetSpec(
            name="acme-pydoc-bytes",
            description="bytes of Python's own pydoc topics (ships with CPython: no download)",
            build="acme_mixer.data:build",
        )
    ]
