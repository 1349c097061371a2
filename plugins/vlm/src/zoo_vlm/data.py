"""VLM data: Energon image-text samples -> CLIP and LLaVA batches, through the core's loader.

`CLIPTaskEncoder` turns a `CaptioningSample` into a normalised image and its caption's token ids
(end token appended, padded with it to the text context). `LlavaTaskEncoder` turns a `VQASample`
into the prompt (the model's ``prompt_template`` around the question), the answer and the end
token, with the image placeholder widened to the image's feature count (HF's processor
convention: every row has its final length before the model, which pipeline stages need), the
loss on the answer only. A text that does not fit is an error naming the sample, never cut.

Built-in datasets (no download): ``digits-captions`` and ``digits-vqa``, scikit-learn's digits
prepared by `zoo.data.energon.media.prepare_images` into the cache on first use, each with a
byte-level BPE trained on the digits' texts (``tokenizer.json`` beside the shards; ``<image>`` id 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo.data.energon.task_encoder import TaskEncoder, stateless
from zoo.data.tokenizer import Tokenizer, load_tokenizer
from zoo.errors import ConfigError
from zoo_vlm.plugin import CLIPConfig, LlavaConfig, VisionFields

IMAGE_TOKEN = "<image>"
# OpenAI CLIP's normalisation (its image processor's image_mean / image_std).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MEAN, _STD = (torch.tensor(v)[:, None, None] for v in (CLIP_MEAN, CLIP_STD))


def image_tensor(image: torch.Tensor, cfg: VisionFields, where: str) -> torch.Tensor:
    """A decoded image (C, H, W) in [0, 1] -> the tower's input, normalised as CLIP's processor."""
    x = image.float()
    if x.dim() != 3:
        raise ValueError(f"{where}: an image of shape {tuple(x.shape)}, expected (channels, height, width)")
    if x.shape[0] == 1 and cfg.num_channels == 3:
        x = x.expand(3, -1, -1)  # grey as RGB
    if tuple(x.shape) != (cfg.num_channels, cfg.image_size, cfg.image_size):
        raise ValueError(f"{where}: a {x.shape[0]}x{x.shape[1]}x{x.shape[2]} image, the vision tower takes "
                         f"{cfg.num_channels}x{cfg.image_size}x{cfg.image_size} (model.num_channels, model.image_size)")
    if cfg.num_channels == 3:
        return (x - _MEAN) / _STD  # (a new, contiguous tensor)
    return x.contiguous()


class CLIPTaskEncoder(TaskEncoder):
    def __init__(self, cfg: CLIPConfig, tokenizer: Tokenizer) -> None:
        self.cfg, self.tok = cfg, tokenizer

    def text_ids(self, text: str, where: str) -> torch.Tensor:
        end = self.tok.eod_id if self.cfg.eos_token_id is None else self.cfg.eos_token_id
        ids = [*self.tok.encode(text), end]
        ctx = self.cfg.max_seq_length
        if len(ids) > ctx:
            raise ValueError(f"{where}: a text of {len(ids)} tokens (end token included), the text tower's context is "
                             f"{ctx} (model.max_seq_length)")
        return torch.tensor(ids + [end] * (ctx - len(ids)))

    @stateless
    def encode_sample(self, sample: Any) -> dict[str, torch.Tensor]:
        where = f"sample {sample.__key__}"
        caption = getattr(sample, "caption", None)
        if caption is None:
            raise ValueError(f"{where}: CLIP trains on CaptioningSample (image + caption), got {type(sample).__name__}")
        return {"images": image_tensor(sample.image, self.cfg, where), "tokens": self.text_ids(caption, where)}


class LlavaTaskEncoder(TaskEncoder):
    def __init__(self, cfg: LlavaConfig, tokenizer: Tokenizer, *, seq_length: int) -> None:
        self.cfg, self.tok, self.seq_length = cfg, tokenizer, seq_length
        image_id = tokenizer._tok.token_to_id(IMAGE_TOKEN) if tokenizer._tok is not None else None  # type: ignore[attr-defined]
        if image_id != cfg.image_token_id:
            raise ConfigError(f"the tokenizer ({tokenizer.source}) gives {IMAGE_TOKEN} the id {image_id}, the model "
                              f"takes {cfg.image_token_id} (model.image_token_id)")

    def prompt_ids(self, question: str) -> list[int]:
        """The prompt's ids, its one image placeholder left unwidened."""
        return self.tok.encode(self.cfg.prompt_template.format(question=question))

    @stateless
    def encode_sample(self, sample: Any) -> dict[str, torch.Tensor]:
        where = f"sample {sample.__key__}"
        question, answers = getattr(sample, "context", None), getattr(sample, "answers", None)
        if question is None or not answers:
            raise ValueError(f"{where}: LLaVA trains on VQASample (image, context, answers), got "
                             f"{type(sample).__name__}{' without answers' if question is not None else ''}")
        image = image_tensor(sample.image, self.cfg, where)
        answer = answers if isinstance(answers, str) else answers[0]
        prompt = self.prompt_ids(question)
        image_id, f = self.cfg.image_token_id, self.cfg.image_features
        if prompt.count(image_id) != 1:
            raise ValueError(f"{where}: the prompt holds {prompt.count(image_id)} image placeholders for 1 image "
                             f"(model.prompt_template={self.cfg.prompt_template!r})")
        at = prompt.index(image_id)
        prompt = prompt[:at] + [image_id] * f + prompt[at + 1:]
        target = [*self.tok.encode(" " + answer), self.tok.eod_id]
        ids = prompt + target
        if len(ids) - 1 > self.seq_length:
            raise ValueError(f"{where}: {len(ids) - 1} positions (the image's {f} features included), more than "
                             f"train.seq_length={self.seq_length}")
        pad = self.seq_length + 1 - len(ids)
        ids = torch.tensor(ids + [self.tok.eod_id] * pad)
        loss_mask = torch.zeros(self.seq_length)
        loss_mask[len(prompt) - 1: len(prompt) - 1 + len(target)] = 1  # positions predicting the answer
        return {"images": image, "tokens": ids[:-1], "labels": ids[1:],
                "loss_mask": loss_mask}


def tokenizer_for(run: Any) -> Tokenizer:
    """data.tokenizer, else the dataset's own ``tokenizer.json`` (the built-in ones have one)."""
    source = run.data.tokenizer or (Path(run.data.path) if run.data.path and (Path(run.data.path) / "tokenizer.json")
                                    .is_file() else None)
    if source is None:
        raise ConfigError(f"data.path={run.data.path}: no tokenizer.json beside the dataset; set data.tokenizer "
                          "(a tokenizer directory or tokenizer.json)")
    tok = load_tokenizer(source)
    if tok.vocab_size > run.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens, model.vocab_size is {run.model.vocab_size}")
    return tok


def clip_task_encoder(run: Any) -> CLIPTaskEncoder:
    return CLIPTaskEncoder(run.model, tokenizer_for(run))


def llava_task_encoder(run: Any) -> LlavaTaskEncoder:
    return LlavaTaskEncoder(run.model, tokenizer_for(run), seq_length=run.train.seq_length)


# ------------------------------------------------------------------------------ built-in data


def digit_texts() -> list[str]:
    """Every text the built-in datasets and their prompts hold (the tokenizer's training text)."""
    from zoo.data.energon.prepare import DIGIT_NAMES

    template = LlavaConfig.__dataclass_fields__["prompt_template"].default
    texts = [template.format(question="What digit is this?")]
    for d, name in enumerate(DIGIT_NAMES):
        texts += [f"a handwritten {d}", f"a {d}", f" {name}", f"the digit {name}"]
    return texts


def _make(sample_type: str) -> Any:
    def make(out: Path) -> None:
        from zoo.data.energon.media import prepare_images
        from zoo.data.tokenizer import train_bpe

        prepare_images(out, dataset="digits", sample_type=sample_type, force_overwrite=True)
        train_bpe(digit_texts() * 4, 512, special_tokens=[IMAGE_TOKEN]).save(out)
    return make


def _cached(run: Any, sample_type: str) -> Path:
    from zoo.data.corpus import cache_root
    from zoo.data.energon.training import prepared_once

    name = {"CaptioningSample": "energon-digits-captions-v1", "VQASample": "energon-digits-vqa-v1"}[sample_type]
    return prepared_once(cache_root(run), name, _make(sample_type))


def build_captions(run: Any, **kw: Any) -> Any:
    from zoo.data.energon.training import build_cached

    return build_cached(run, "energon-digits-captions-v1", _make("CaptioningSample"), **kw)


def build_vqa(run: Any, **kw: Any) -> Any:
    from zoo.data.energon.training import build_cached

    return build_cached(run, "energon-digits-vqa-v1", _make("VQASample"), **kw)


def captions_tokenizer(run: Any) -> Path:
    return _cached(run, "CaptioningSample")


def vqa_tokenizer(run: Any) -> Path:
    return _cached(run, "VQASample")


__all__ = ["CLIPTaskEncoder", "LlavaTaskEncoder", "build_captions", "build_vqa", "captions_tokenizer",
           "clip_task_encoder", "digit_texts", "image_tensor", "llava_task_encoder", "tokenizer_for", "vqa_tokenizer"]
