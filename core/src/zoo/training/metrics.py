"""What a run reports: metrics.jsonl (kept consistent with the checkpoint on resume), TensorBoard
event files, validation previews, the loss curve; and the throughput arithmetic behind
``<unit>/s`` and model FLOPs utilisation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.config import RunConfig
from zoo.io import atomic_write_text

# How each throughput unit is printed.
UNIT_LABELS = {"tokens": "tok/s", "images": "img/s", "frames": "frames/s", "samples": "samples/s"}

_PEAK: dict[tuple[str, str], float] = {}


def count_tokens(batch: Mapping[str, Any]) -> int:
    """The default unit count: the elements of the batch's ``tokens`` (or ``input_ids``)."""
    for key in ("tokens", "input_ids"):
        value = batch.get(key)
        if value is not None and hasattr(value, "numel"):
            return int(value.numel())
    return 0


def linear_weights(model: torch.nn.Module) -> int:
    """Elements of every `nn.Linear` weight, each counted once (a tied head counts once)."""
    from torch import nn

    seen, n = set(), 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            n += mod.weight.numel()
    return n


@dataclass(frozen=True)
class LayerFlops:
    """Training FLOPs (forward and backward) of one `zoo.nn.layers.TransformerLayer`, kept as
    numbers so a per-batch count holds no module: 6 x weights per position plus PaLM's 12 x
    (heads x head_dim) x t per query for the scores and values."""

    qkv: int  # the fused q|k|v projection's weights
    rest: int  # every other matmul weight (output projection, MLP)
    width: int  # heads x head_dim

    @classmethod
    def of(cls, layer: torch.nn.Module) -> LayerFlops:
        qkv = layer.attn.qkv.weight.numel()
        return cls(qkv=qkv, rest=linear_weights(layer) - qkv, width=layer.attn.h * layer.attn.hd)

    def __call__(self, t: int, kept: int | None = None) -> float:
        """Over t positions; with ``kept`` only that many outputs are needed (a pooled token, the
        answer positions: `zoo.nn.layers.run_layers(keep=)`). q|k|v still runs on all t: keys and
        values need every position, and one GEMM for q, k and v beats splitting the dropped queries out."""
        k = t if kept is None else kept
        return 6.0 * (self.qkv * t + self.rest * k) + 12.0 * self.width * t * k


def work_of(throughput: Any, model: torch.nn.Module, run: RunConfig, *, owner: str
            ) -> Callable[[Mapping[str, Any]], tuple[int, float]]:
    """``batch -> (units, training FLOPs)`` for a family's `zoo.family.Throughput`, set up once on
    the model built on the meta device."""
    from zoo.family import resolve

    count = resolve(throughput.count, owner=owner) if throughput.count else count_tokens
    if throughput.flops_of_batch:
        of_batch = resolve(throughput.flops_of_batch, owner=owner)(model, run)
        return lambda batch: (count(batch), float(of_batch(batch)))
    per_unit = float((resolve(throughput.flops_per_unit, owner=owner) if throughput.flops_per_unit
                      else lm_flops_per_token)(model, run))

    def work(batch: Mapping[str, Any]) -> tuple[int, float]:
        n = count(batch)
        return n, n * per_unit

    return work


def log_fields(record: Mapping[str, Any], family: Any) -> dict[str, str]:
    """What a metrics record shows on the log line: loss, lr, throughput, MFU, the family's
    metrics, validation loss, and the per-phase timers' detail."""
    from zoo.training.instruments import Instruments

    unit = family.throughput.unit
    fields = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.3g}",
              UNIT_LABELS.get(unit, f"{unit}/s"): f"{record[unit + '_per_s']:,.0f}", "mfu": f"{record['mfu']:.1%}"}
    fields.update({m.name: f"{record[m.name]:.4g}" for m in family.metrics if m.name in record})
    if "val_loss" in record:
        fields["val"] = f"{record['val_loss']:.4f}"
    if "loss_scale" in record:  # fp16 (Megatron's line shows it too)
        fields["loss scale"] = f"{record['loss_scale']:g}"
    if record.get("skipped_steps"):
        fields["skipped"] = str(record["skipped_steps"])
    if detail := Instruments.detail(record):
        fields["time"] = detail
    return fields


def lm_flops_per_token(model: torch.nn.Module, run: RunConfig) -> float:
    """Training FLOPs per token: 6 x (weights used in matmuls) + attention (PaLM, Chowdhery et al.
    2022 app. B). Counts every `nn.Linear` weight once (a tied head counts once, embedding lookups
    are free) and adds ``12 * hidden * seq`` per layer for the attention scores and values when the
    config names ``num_layers`` and ``hidden_size``; a layer whose config ``window(layer)`` names a
    sliding window reads ``min(seq, window)`` keys a query instead of ``seq``."""
    n = linear_weights(model)
    cfg = run.model
    attn = 0.0
    if isinstance(getattr(cfg, "num_layers", None), int) and isinstance(getattr(cfg, "hidden_size", None), int):
        seq = run.train.seq_length
        window = getattr(cfg, "window", None)
        keys = [min(seq, w) if callable(window) and (w := window(i)) is not None else seq for i in range(cfg.num_layers)]
        attn = 12.0 * cfg.hidden_size * sum(keys)
    return 6.0 * n + attn


def measured_peak_flops(device: str, dtype: Any) -> float:
    """GEMM throughput measured on this device (the denominator of MFU), cached per process."""
    import torch

    from zoo import kernels

    mm = functools.partial(kernels.active().call, "mm")  # the product the run computes with

    key = (device, str(dtype))
    if key in _PEAK:
        return _PEAK[key]
    n = 1024 if device == "cpu" else 8192
    if device == "cpu":
        # A dtype the CPU has no instructions for (bf16 without AVX-512 BF16 or AMX) runs through
        # torch's scalar fallback at well under 1 GFLOP/s, where ten 1024^3 products would take a
        # minute: a 256^3 product that is that slow is measurement enough.
        a = torch.randn(256, 256, dtype=dtype)
        mm(a, a)  # a first product also wakes the thread pool
        t = time.perf_counter()
        mm(a, a)
        rate = 2 * 256**3 / (time.perf_counter() - t)
        if 2 * n**3 / rate > 2.0:
            _PEAK[key] = rate
            return rate
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device == "cpu":
        # as a layer's weight (N, K) is read: oneDNN's product takes b^T's rows as they lie. In b's
        # own layout every timed product would first transpose b, and the peak would read low
        b = b.t()
    for _ in range(2):
        mm(a, b)
    reps, best = 10 if device == "cpu" else 20, float("inf")  # best of many: one GEMM on a shared VM varies
    # and on a CPU for at least 0.25 s: some BLAS libraries ramp up over their first products, and a
    # peak read too low puts the logged MFU above 100%
    spent, i = 0.0, 0
    while i < reps or (device == "cpu" and spent < 0.25 and i < 200):
        i += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        mm(a, b)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
        spent += time.perf_counter() - t
    _PEAK[key] = 2 * n**3 / best
    return _PEAK[key]


def _after_earlier_event_files(tb_dir: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and a file's name starts with
    the second its writer started, then host and pid: a file of a run begun in this same second
    (a restart within it) could sort after this run's by pid, and its points would outlive the purge.
    Waits for the second after it then (at most 2 s; a name from a clock further ahead is left)."""
    latest = 0
    for f in tb_dir.glob("events.out.tfevents.*"):
        with contextlib.suppress(IndexError, ValueError):
            latest = max(latest, int(f.name.split(".")[3]))
    now = time.time()
    if int(now) <= latest <= now + 1:
        time.sleep(latest + 1 - now)


class MetricsLog:
    """metrics.jsonl, TensorBoard and previews of one run (written by global rank 0 only)."""

    def __init__(self, run_dir: Path, *, resume_step: int, tensorboard: bool) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        if resume_step and self.path.exists():
            # Lines written after the checkpoint we resume from belong to a run that died.
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rec = json.loads(line)
                    if rec.get("step", 0) <= resume_step:
                        self.records.append(rec)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.tb: Any = None
        self.tb_dir: Path | None = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except (ImportError, RuntimeError):  # tensorboard is optional for zoo-core
                self.tb = None
            else:
                self.tb_dir = run_dir / "tensorboard"
                # TensorBoard drops the earlier files' points from this step on, as metrics.jsonl
                # does above: a resumed run's from a run that died, a fresh start's (step 1) all
                _after_earlier_event_files(self.tb_dir)
                self.tb = SummaryWriter(str(self.tb_dir), purge_step=resume_step + 1)

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])

    def preview(self, artifact: Any, step: int) -> Path:
        """Write a validation preview to ``samples/step_N.*`` and TensorBoard."""
        from zoo import media

        path = media.save(artifact, self.run_dir / "samples" / f"step_{step:08d}")
        if self.tb is not None:
            if artifact.kind == "text":
                self.tb.add_text("preview", artifact.data, step)
            elif artifact.kind == "image":
                self.tb.add_image("preview", artifact.data, step, dataformats="HWC")
            else:  # a video as a strip of frames (TensorBoard's own video summary needs moviepy)
                import numpy as np

                frames = artifact.data[:: max(1, len(artifact.data) // 8)]
                self.tb.add_image("preview", np.concatenate(list(frames), axis=1), step, dataformats="HWC")
        return path

    def close(self, *, plot: Path | None, title: str, log_scale: bool) -> str | None:
        """Close the files; draw the loss curve at ``plot``. Returns a note when no plot was drawn."""
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if plot is None:
            return None
        from zoo.training.plot import loss_curve

        steps = [r["step"] for r in self.records]
        return loss_curve(plot, steps, [r["loss"] for r in self.records],
                          [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r],
                          title=title, log_scale=log_scale)


__all__ = ["UNIT_LABELS", "LayerFlops", "MetricsLog", "count_tokens", "linear_weights", "lm_flops_per_token", "log_fields",
           "measured_peak_flops", "work_of"]
