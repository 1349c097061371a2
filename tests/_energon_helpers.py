"""Task encoders for the Energon tests, importable by spawned workers (a test module's own
classes are too, but a helper module keeps them in one place)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from zoo.data.energon import CaptioningSample, Sample, SkipSample, TaskEncoder, stateless
from zoo.data.energon.task_encoder import default_batch


class Augment(TaskEncoder):
    """Random noise per sample (reseeded per sample), packs of 1-3 samples chosen from the
    buffer by label, batches grouped by pack length: every stateful stage at once."""

    @stateless(restore_seeds=True)
    def encode_sample(self, s: CaptioningSample) -> dict[str, Any]:
        label = int(s.caption.rsplit(" ", 1)[-1])
        if label == 9 and s.__key__.endswith("3"):
            raise SkipSample()
        x = s.image[0] + 0.01 * torch.rand(8, 8)
        return {"__key__": s.__key__, "x": x, "label": label}

    def select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        groups, cur = [], []
        for s in sorted(samples, key=lambda s: (s["label"], s["__key__"])):
            cur.append(s)
            if len(cur) == 1 + cur[0]["label"] % 3:
                groups.append(cur)
                cur = []
        return groups  # a short last group stays buffered for the next round

    @stateless
    def pack_selected_samples(self, samples: list[Any]) -> dict[str, Any]:
        return {"keys": ",".join(s["__key__"] for s in samples), "x": torch.cat([s["x"] for s in samples]),
                "n": len(samples)}

    def batch_group_criterion(self, s: dict[str, Any]) -> tuple[Any, int | None]:
        return s["n"], None

    def batch(self, samples: list[Any]) -> Any:
        return default_batch(samples)


class SkipAll(Augment):
    """Skips every sample (a loader must say so, not wait for a batch for ever)."""

    @stateless
    def encode_sample(self, s: CaptioningSample) -> dict[str, Any]:
        raise SkipSample()


class Plain(TaskEncoder):
    def encode_sample(self, s: CaptioningSample) -> dict[str, Any]:
        return {"key": s.__key__, "x": s.image}


class Faulty(TaskEncoder):
    """Hangs or kills its worker on one key (set in the environment), for the watchdog test."""

    def encode_sample(self, s: Sample) -> Sample:
        if s.__key__ == os.environ.get("ZOO_TEST_HANG_KEY"):
            time.sleep(3600)
        if s.__key__ == os.environ.get("ZOO_TEST_DIE_KEY"):
            os._exit(3)
        return s


class DigitsToCond(TaskEncoder):
    """Digits -> the test family's batches: rows of the image, the class mod 4, a target."""

    def encode_sample(self, s: CaptioningSample) -> dict[str, Any]:
        x = s.image[0] * 2 - 1
        label = int(s.caption.rsplit(" ", 1)[-1]) % 4
        return {"x": x, "label": label, "target": x.flip(-1) * 0.5 + (label - 1.5) * 0.3}

    def batch(self, samples: list[Any]) -> Any:
        return {"x": torch.stack([s["x"] for s in samples]), "label": torch.tensor([s["label"] for s in samples]),
                "target": torch.stack([s["target"] for s in samples])}


def digits_to_cond(run: Any) -> DigitsToCond:
    return DigitsToCond()


class PoisonedDigits(DigitsToCond):
    """The ``ZOO_TEST_NAN_AT``-th sample a worker encodes gets NaN pixels; its key is written to
    the file ``ZOO_TEST_NAN_LOG`` (so the test knows which sample the error must name)."""

    seen = 0

    def encode_sample(self, s: CaptioningSample) -> dict[str, Any]:
        out = super().encode_sample(s)
        PoisonedDigits.seen += 1
        if PoisonedDigits.seen == int(os.environ["ZOO_TEST_NAN_AT"]):
            out["x"] = torch.full_like(out["x"], float("nan"))
            with open(os.environ["ZOO_TEST_NAN_LOG"], "a") as f:
                f.write(s.__key__ + "\n")
        return out


def poisoned_digits(run: Any) -> PoisonedDigits:
    return PoisonedDigits()
