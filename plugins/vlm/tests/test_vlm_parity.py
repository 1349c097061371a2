"""CLIP and LLaVA against Hugging Face (tiny random configs, fp32): embeddings, logits and losses;
both image placeholder conventions; every LLaVA key layout of the versioned table; round trips
bitwise and an export HF loads back; bad inputs as one clear error each."""

from __future__ import annotations

import pytest
import torch
from zoo_vlm import convert
from zoo_vlm.model import build_clip, build_llava
from zoo_vlm.plugin import CLIP, LLAVA

from zoo.checkpoint.mapping import MappingError, from_external, to_external

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=8,
              patch_size=2, projection_dim=16)
IMAGE_ID = 98


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the init values, so a swapped tensor shows
    return model.eval()


@pytest.fixture(scope="module")
def hf_clip():
    import transformers as tf

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=99,
                max_position_embeddings=16, projection_dim=16, eos_token_id=5)
    return _perturbed(tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=16)))


@pytest.fixture(scope="module")
def hf_llava():
    import transformers as tf

    text = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=99, max_position_embeddings=64)
    return _perturbed(tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**VISION), text_config=text, image_token_index=IMAGE_ID)))


def _clip(hf):
    cfg = convert.clip_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    ours = from_external(convert.clip_table(cfg), sd, cfg)
    model = build_clip(cfg, CLIP).eval()
    model.load_state_dict(ours, strict=True)
    return model, cfg, sd


def _llava(hf, state=None):
    cfg = convert.llava_from_hf(hf.config.to_dict())
    sd = hf.state_dict() if state is None else state
    ours = from_external(convert.llava_import_table(cfg, list(sd)), sd, cfg)
    model = build_llava(cfg, LLAVA).eval()
    model.load_state_dict(ours, strict=True)
    return model, cfg, ours


def _texts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 99, (3, 10), generator=g)
    for row, end in enumerate((4, 9, 6)):
        ids[row, end] = 5  # the end token, where CLIP pools
        ids[row, end + 1:] = 5  # padded with it, as OpenAI's tokenizer does
    return ids


def test_clip_embeddings_logits_and_loss_match_hugging_face(hf_clip):
    model, cfg, _ = _clip(hf_clip)
    ids, px = _texts(), torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_clip(input_ids=ids, pixel_values=px, return_loss=True)
        img, txt = model.embed_images(px), model.embed_texts(ids)
        assert torch.allclose(img, ref.image_embeds, atol=1e-5, rtol=0)
        assert torch.allclose(txt, ref.text_embeds, atol=1e-5, rtol=0)
        assert torch.allclose(model.logit_scale.exp() * txt @ img.t(), ref.logits_per_text, atol=1e-5, rtol=0)
        assert abs(model(px, ids).item() - ref.loss.item()) <= 1e-5
        # Every end token early: the padding after the last one is dropped before the layers.
        short = ids.clone()
        short[1, 6:] = 5
        ref_short = hf_clip(input_ids=short, pixel_values=px).text_embeds
        assert torch.allclose(model.embed_texts(short), ref_short, atol=1e-5, rtol=0)


def test_clip_temperature_is_clamped_as_in_the_paper(hf_clip):
    model, cfg, _ = _clip(hf_clip)
    ids, px = _texts(), torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        model.logit_scale.fill_(10.0)  # exp(10) ~ 22026: clamped to 100
        img, txt = model.embed_images(px), model.embed_texts(ids)
        logits = 100.0 * txt @ img.t()
        target = torch.arange(3)
        expected = (torch.nn.functional.cross_entropy(logits, target)
                    + torch.nn.functional.cross_entropy(logits.t(), target)) / 2
        assert abs(model(px, ids).item() - expected.item()) <= 1e-5


def test_clip_weights_round_trip_bitwise(hf_clip):
    model, cfg, sd = _clip(hf_clip)
    back = to_external(convert.clip_table(cfg), model.state_dict(), cfg)
    assert back.keys() == {k for k in sd if not k.endswith("position_ids")}
    assert all(torch.equal(back[k], sd[k]) for k in back)


def test_llava_logits_and_loss_match_hugging_face_with_either_placeholder_convention(hf_llava):
    model, cfg, _ = _llava(hf_llava)
    assert cfg.image_features == 16 and cfg.feature_layers == [2]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, 24), generator=g)
    ids[:, 3:19] = IMAGE_ID  # widened as HF's processor does
    px = torch.randn(2, 3, 8, 8, generator=g)
    labels = torch.where(ids == IMAGE_ID, -100, ids)
    with torch.no_grad():
        ref = hf_llava(input_ids=ids, pixel_values=px, labels=labels)
        logits = model(ids, images=px)
        assert torch.allclose(logits, ref.logits, atol=1e-5, rtol=0)
        # One placeholder per image, widened inside the model (Megatron's convention): the same.
        one = torch.cat([ids[:, :4], ids[:, 19:]], dim=1)
        assert torch.allclose(model(one, images=px), logits, atol=1e-5, rtol=0)
        # HF shifts inside its loss; ours takes next-token labels.
        loss = model(ids[:, :-1], images=px, labels=labels[:, 1:])
        assert abs(loss.item() - ref.loss.item()) <= 1e-5
        # ... and with one placeholder the labels are widened with it (masked over the image).
        one_labels = torch.cat([labels[:, 1:4], labels[:, 19:]], dim=1)
        assert abs(model(one[:, :-1], images=px, labels=one_labels).item() - ref.loss.item()) <= 1e-5


def test_every_llava_key_layout_imports_to_the_same_weights_and_export_loads_in_hugging_face(hf_llava, tmp_path):
    import transformers as tf

    model, cfg, ours = _llava(hf_llava)
    hub = to_external(convert.llava_table(cfg), model.state_dict(), cfg)
    layouts = {}
    for name, where in convert.LLAVA_LAYOUTS.items():
        first = next(iter(convert.LLAVA_LAYOUTS.values()))
        moved = {}
        for k, v in hub.items():
            part = next(p for p in ("lm", "head", "vision", "projector") if k.startswith(first[p]))
            moved[where[part] + k[len(first[part]):]] = v
        layouts[name] = moved
        got = from_external(convert.llava_import_table(cfg, list(moved)), moved, cfg)
        assert got.keys() == ours.keys() and all(torch.equal(got[k], ours[k]) for k in ours), name
    # This transformers' own in-memory keys are one of the table's layouts.
    assert set(hf_llava.state_dict()) in [set(m) for m in layouts.values()]
    # A mix of two layouts is refused, naming the keys.
    mixed = {**layouts["transformers 5.x in memory"], "language_model.lm_head.weight": hub["language_model.lm_head.weight"]}
    with pytest.raises(MappingError, match="language_model.lm_head.weight"):
        from_external(convert.llava_import_table(cfg, list(mixed)), mixed, cfg)
    # Export (Hub layout, HF config) -> from_pretrained: the same logits.
    from zoo.checkpoint.external import export_external, import_external

    hf_llava.save_pretrained(tmp_path / "hf")
    import_external("hf", tmp_path / "hf", tmp_path / "zoo")
    export_external("hf", tmp_path / "zoo", tmp_path / "out")
    again = tf.LlavaForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 97, (1, 20))
    ids[:, 2:18] = IMAGE_ID
    px = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, pixel_values=px).logits, hf_llava(input_ids=ids, pixel_values=px).logits)


def test_bad_inputs_are_one_clear_error_each(hf_llava, hf_clip):
    model, cfg, _ = _llava(hf_llava)
    ids = torch.randint(0, 97, (1, 20))
    ids[:, 2:18] = IMAGE_ID
    with pytest.raises(ValueError, match=r"images of shape \(1, 3, 16, 16\): the vision tower takes \(B, 3, 8, 8\)"):
        model(ids, images=torch.randn(1, 3, 16, 16))
    with pytest.raises(ValueError, match=r"holds 16 image placeholder\(s\) \(model.image_token_id=98\) for 2 image"):
        model(ids, images=torch.randn(2, 3, 8, 8))  # fewer placeholders than the images need
    three = ids.clone()
    three[:, 0:2] = IMAGE_ID
    with pytest.raises(ValueError, match=r"holds 18 image placeholder\(s\) .* for 1 image\(s\) of 16 features"):
        model(three, images=torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="but no image was given"):
        model(ids)
    long = torch.randint(0, 97, (1, 60))
    long[:, 0] = IMAGE_ID
    with pytest.raises(ValueError, match=r"a sequence of 75 positions \(images included\): the language model's "
                                         r"context is 64"):
        model(long, images=torch.randn(1, 3, 8, 8))
    clip, _, _ = _clip(hf_clip)
    with pytest.raises(ValueError, match=r"a text of 20 tokens: the text tower's context is 16"):
        clip.embed_texts(torch.full((1, 20), 5))
    with pytest.raises(ValueError, match="without its end token"):
        clip.embed_texts(torch.full((1, 8), 7))


LAYOUTS = __import__("pathlib").Path(__file__).parent / "data" / "llava_layouts"


@pytest.mark.parametrize("release,file", [("tf4.51.3", "model"), ("tf4.55.4", "model"), ("tf4.55.4", "in_memory"),
                                          ("tf5.23.0", "model"), ("tf5.23.0", "in_memory")])
def test_llava_files_written_by_released_transformers_load_with_their_logits(release, file, tmp_path):
    """What transformers 4.51, 4.55 and 5.23 themselves wrote (save_pretrained, and the in-memory
    state_dict a custom loop saves; see data/llava_layouts/make.py) loads through `zoo convert`'s
    loader and reproduces the logits and loss that release computed."""
    import shutil

    from safetensors.torch import load_file

    from zoo.checkpoint.external import load

    src = LAYOUTS / release
    shutil.copy(src / "config.json", tmp_path / "config.json")
    shutil.copy(src / f"{file}.safetensors", tmp_path / "model.safetensors")
    loaded = load(tmp_path)
    assert loaded.family == "llava"
    ref = load_file(src / "expected.safetensors")
    ids = ref["input_ids"]
    labels = torch.where(ids == loaded.config.image_token_id, -100, ids)
    with torch.no_grad():
        model = loaded.model.eval()
        assert torch.allclose(model(ids, images=ref["pixel_values"]), ref["logits"], atol=1e-5, rtol=0)
        loss = model(ids[:, :-1], images=ref["pixel_values"], labels=labels[:, 1:])
        assert abs(loss.item() - ref["loss"].item()) <= 1e-5


def test_generate_fits_other_image_sizes_as_clips_image_processor_does(tmp_path):
    """`zoo generate --image`: a file of another size reaches the tower as HF's `CLIPImageProcessor`
    makes it (shorter side resized bicubic, centre crop, OpenAI's normalisation), for wide, tall,
    grey and RGBA images; one of the tower's own size is decoded as the training data is."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessor
    from zoo_vlm.data import image_tensor
    from zoo_vlm.generate import read_images
    from zoo_vlm.plugin import clip_tiny

    from zoo.data.energon.samples import decode_part

    cfg = clip_tiny()
    s = cfg.image_size
    proc = CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
    rng = np.random.default_rng(0)
    for name, mode, shape in (("wide", "RGB", (28, 45, 3)), ("tall", "RGB", (50, 31, 3)), ("grey", "L", (37, 29)),
                              ("rgba", "RGBA", (40, 40, 4)), ("exact", "RGB", (s, s, 3))):
        path = tmp_path / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
        ours = read_images([str(path)], cfg)
        theirs = proc(images=Image.open(path), return_tensors="pt").pixel_values
        assert ours.shape == (1, 3, s, s)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=name)
        if name == "exact":  # as training decodes a dataset's image
            assert torch.equal(ours[0], image_tensor(decode_part("png", path.read_bytes()), cfg, name))
