"""Writes what released transformers versions themselves save for one tiny LLaVA, so the key-layout
table of `zoo_vlm.convert` is tested against real files, not only against keys moved by hand.

Run once per release with that release importable (its files are checked in beside this script):

    pip install --target /tmp/tf451 --no-deps transformers==4.51.3 tokenizers==0.21.1 huggingface_hub==0.30.2
    PYTHONPATH=/tmp/tf451 python plugins/vlm/tests/data/llava_layouts/make.py
    (likewise transformers==4.55.4 tokenizers==0.21.4 huggingface_hub==0.34.4)

Each run writes ``tf<version>/``: ``save_pretrained``'s config.json and model.safetensors, the
model's in-memory ``state_dict()`` (what a custom loop's checkpoint holds), and ``expected.safetensors``
with inputs and that release's own logits and loss.
"""

from __future__ import annotations

import os

import torch
import transformers as tf
from safetensors.torch import save_file

IMAGE_ID = 39


def main() -> None:
    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=8, patch_size=4, projection_dim=16)
    text = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=40, max_position_embeddings=32)
    model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text,
                                                            image_token_index=IMAGE_ID)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the init values, so a swapped tensor shows
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, IMAGE_ID, (2, 10), generator=g)
    ids[:, 2:6] = IMAGE_ID  # four patches, widened as HF's processor does
    px = torch.randn(2, 3, 8, 8, generator=g)
    labels = torch.where(ids == IMAGE_ID, -100, ids)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=px, labels=labels)
    where = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"tf{tf.__version__}")
    model.save_pretrained(where, safe_serialization=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(where, "in_memory.safetensors"))
    save_file({"input_ids": ids, "pixel_values": px, "logits": out.logits, "loss": out.loss.reshape(1)},
              os.path.join(where, "expected.safetensors"))
    print(where, sorted(model.state_dict())[:3])


if __name__ == "__main__":
    main()
