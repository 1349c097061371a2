"""A family that exists only in the tests (no plugin, no entry point), built to exercise what the
trainer applies from a family's declarations: a conditioned model (an adaLN-style scale from a
class embedding, carried across pipeline stages beside the hidden state), an auxiliary loss, a
``max`` and a ``sum`` metric, images as the throughput unit with its own FLOPs rule, and a preview
(a PNG grid of predictions). Its data are deterministic functions of the sample index, so every
layout and every resumed run sees the same samples.

Shapes: B batch, T positions (the rows of an 8x8 image), D_in = 8 pixels per row, D hidden.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zoo import DatasetSpec, Family, MetricSpec, PipelineSpec, Throughput
from zoo.spec import BlockSpec, MLPSpec, ModelSpec, NormSpec

SIDE = 8  # images are SIDE x SIDE, one row per position
AUX_WEIGHT = 1e-2


@dataclass(kw_only=True)
class CondConfig:
    hidden_size: int = 16
    num_layers: int = 2
    num_classes: int = 4
    layer_spec: str = "cond"


SPEC = ModelSpec(blocks={"C": BlockSpec(norm=NormSpec(kind="layernorm"), mixer=None,
                                        ffn=MLPSpec(activation="gelu", gated=False, bias=True))},
                 embedding="patch_2d", positions="none", final_norm=NormSpec(kind="layernorm"), head="unpatchify")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.scale = nn.Linear(d, d)  # conditioning: how much each channel is amplified
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = self.norm(h) * (1 + self.scale(cond)[:, None, :])  # (B, T, D)
        return h + self.proj(F.gelu(self.fc(x)))


class CondModel(nn.Module):
    def __init__(self, cfg: CondConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.embed = nn.Linear(SIDE, d)
        self.cond_embed = nn.Embedding(cfg.num_classes, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, SIDE)

    def forward(self, x: torch.Tensor, label: torch.Tensor, cond: torch.Tensor | None = None) -> Any:
        """x (B, T, SIDE) -> prediction (B, T, SIDE); a later pipeline stage gets the hidden state
        in ``x`` and the conditioning vector in ``cond``, and an earlier one hands both on."""
        h = self.embed(x) if self.embed is not None else x  # (B, T, D)
        c = self.cond_embed(label) if self.cond_embed is not None else cond  # (B, D)
        for block in self.layers:
            h = block(h, c)
        if self.head is None:
            return {"x": h, "cond": c}
        return self.head(self.norm(h))


def build(cfg: CondConfig, spec: ModelSpec) -> CondModel:
    return CondModel(cfg)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    out = model(batch["x"], batch["label"], batch.get("cond"))
    if isinstance(out, dict):  # not the last pipeline stage
        return out, {}
    err = out - batch["target"]
    return err.pow(2).mean(), {
        "aux_l2": AUX_WEIGHT * out.pow(2).mean(),  # an auxiliary term: keeps predictions small
        "max_abs_err": err.detach().abs().max(),
        "samples": float(out.shape[0]),
    }


def sample(seed: int, split: str, g: int, num_classes: int = 4) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Sample ``g`` of a split: an image, its class, and the target (the image shifted by a
    class-dependent offset and mirrored), a function of (seed, split, g) only."""
    gen = torch.Generator().manual_seed((seed * 2 + (split != "train")) * 1_000_003 + g)
    x = torch.randn(SIDE, SIDE, generator=gen)
    label = g % num_classes
    return x, label, x.flip(-1) * 0.5 + (label - 1.5) * 0.3


def example_batch(cfg: CondConfig, *, batch_size: int, seq_length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    base = int(torch.randint(0, 10**6, (1,), generator=generator))
    rows = [sample(0, "train", base + i, cfg.num_classes) for i in range(batch_size)]
    return {"x": torch.stack([r[0] for r in rows]), "label": torch.tensor([r[1] for r in rows]),
            "target": torch.stack([r[2] for r in rows])}


def data(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0,
         nan_at: tuple[int, ...] = (), drop_batch: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches. ``nan_at``: training samples whose image is NaN (bad data);
    ``drop_batch``: a global batch left out of the stream (what skipping its step amounts to)."""
    mbs = run.train.micro_batch_size
    gbs = run.train.global_batch_size or mbs * dp_size
    per_rank = gbs // dp_size
    g = consumed_samples
    while True:
        src = g + gbs if drop_batch is not None and g >= drop_batch * gbs else g
        mine = src + dp_rank * per_rank
        for m in range(per_rank // mbs):
            index = [mine + m * mbs + j for j in range(mbs)]
            rows = [sample(run.train.seed, split, i, run.model.num_classes) for i in index]
            x = torch.stack([r[0] for r in rows])
            for j, i in enumerate(index):
                if split == "train" and i in nan_at:
                    x[j] = float("nan")
            yield {"x": x, "label": torch.tensor([r[1] for r in rows]), "target": torch.stack([r[2] for r in rows])}
        g += gbs


def count_images(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["x"].shape[0])


def flops_per_image(model: nn.Module, run: Any) -> float:
    """6 x matmul weights x rows per image (each Linear is applied once per row; the conditioning
    once per image, counted per row too: an upper bound is fine for a test family)."""
    return 6.0 * SIDE * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def preview(model: nn.Module, cfg: CondConfig, batch: dict[str, torch.Tensor], *, generator: torch.Generator) -> Any:
    from zoo import media

    pred = model(batch["x"][:4], batch["label"][:4])  # (N, T, SIDE)
    return media.Artifact("image", media.grid(torch.cat([batch["target"][:4], pred])[:, None].clamp(-2, 2),
                                              nrow=4, value_range=(-2.0, 2.0)))


def tiny() -> CondConfig:
    return CondConfig()


FAMILY = Family(
    name="cond", description="test family: conditioned MLP blocks", task="regression", config=CondConfig,
    flavors={"tiny": tiny}, specs={"cond": SPEC}, build=build, loss=loss, example_batch=example_batch,
    tp_plan={"layers.*.fc": "column", "layers.*.proj": "row"},
    pipeline=PipelineSpec(layers="layers", first=("embed", "cond_embed"), last=("norm", "head"), input_key="x",
                          carries=("cond",)),
    metrics=(MetricSpec(name="aux_l2", aux_loss=True), MetricSpec(name="max_abs_err", reduce="max"),
             MetricSpec(name="samples", reduce="sum")),
    throughput=Throughput(unit="images", count=count_images, flops_per_unit=flops_per_image),
    preview=preview,
    recipe={"train.seq_length": SIDE},
)

DATASET = DatasetSpec(name="cond-data", description="deterministic 8x8 regression samples", build=data, modality="images")
