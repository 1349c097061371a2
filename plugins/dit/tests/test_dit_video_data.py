"""The built-in video data: moving-digit clips, their captions and direction measure, the fixed-seed
text encoder, and the prepared crude Energon dataset feeding the video DiT's loss."""

from __future__ import annotations

import numpy as np
import torch


def test_clips_move_as_captioned_and_the_measure_reads_it():
    from zoo_dit.moving_digits import caption, clips, direction_of

    seen = set()
    for clip, digit, direction in clips(100, frames=8, size=16, seed=1):
        assert clip.shape == (8, 16, 16) and clip.min() >= 0 and clip.max() <= 1
        assert direction_of(clip) == direction  # the measure the samples are judged by
        assert np.isclose(clip[0].sum(), clip[-1].sum())  # the same digit, whole, in every frame
        seen.add(direction)
        assert caption(digit, direction) == f"a {digit} moving {direction}"
    assert seen == {"left", "right", "up", "down"}
    flipped = next(clips(1, seed=1))
    assert direction_of(flipped[0][::-1]) != flipped[2]  # played backwards, it goes the other way


def test_the_quality_judge_reads_real_clips_and_catches_wrong_captions():
    from zoo_dit.moving_digits import clips, judge

    real = list(clips(60, seed=2))
    stacked = np.stack([c for c, _, _ in real])
    digits, directions = [d for _, d, _ in real], [r for _, _, r in real]
    right = judge(stacked, digits, directions)
    assert right["digit"] >= 0.9 and right["direction"] == 1.0, right
    wrong = judge(stacked, [(d + 1) % 10 for d in digits], [{"left": "right", "right": "left", "up": "down",
                                                            "down": "up"}[r] for r in directions])
    assert wrong["digit"] <= 0.2 and wrong["direction"] == 0.0, wrong


def test_default_text_encoder_is_the_same_everywhere_and_keeps_true_lengths():
    from zoo.data.encoders import TextEncoder

    a, b = TextEncoder(), TextEncoder()
    ea = a(["a 3 moving right", "a 1 moving up"])
    eb = b(["a 3 moving right"])
    assert ea[0].shape == (len("a 3 moving right") + 1, 64)  # bytes + end of sequence, no padding
    assert ea[1].shape == (len("a 1 moving up") + 1, 64)
    assert np.array_equal(ea[0], eb[0])
    assert not np.allclose(ea[0][:3], ea[1][:3])  # different captions, different embeddings


def test_moving_digits_dataset_feeds_the_video_dit(tmp_path):
    from zoo_dit.data import DiTTaskEncoder, prepare_moving_digits
    from zoo_dit.diffusion import loss
    from zoo_dit.model import build
    from zoo_dit.plugin import DIT_VIDEO, video_tiny

    from zoo.data.energon import WorkerConfig, get_loader, get_train_dataset

    out = tmp_path / "mv"
    out.mkdir()
    prepare_moving_digits(out, n=60)
    cfg = video_tiny()
    te = DiTTaskEncoder(cfg, seq_length=2048, packing=False)
    ds = get_train_dataset(str(out), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), batch_size=4,
                           shuffle_buffer_size=10, max_samples_per_sequence=10, task_encoder=te)
    batch = next(iter(get_loader(ds)))
    assert batch["latents"].shape == (4, 4 * 4 * 4, 2 * 4 * 4)  # 8 frames of 16x16 in patches of 2x4x4
    assert batch["context"].shape[-1] == 64 and batch["context_segment_ids"].shape == batch["context"].shape[:2]
    value, _ = loss(build(cfg, DIT_VIDEO), batch)
    assert torch.isfinite(value)


def test_zoo_prepare_video_writes_the_declared_clip_source_and_refuses_bad_options(tmp_path, capsys):
    """`zoo prepare video` finds moving digits through the dataset's declared clip source: what it
    writes decodes to the source's own clips and captions; an unknown dataset, and a canvas the
    digit cannot cross, are one line each and write nothing."""
    import io
    import json
    import tarfile

    from zoo_dit.moving_digits import source

    from zoo.testing import run_zoo

    out = tmp_path / "mv"
    res = run_zoo(capsys, "prepare", "video", str(out), "--count", "20", "--num-frames", "4", "--size", "12",
                  "--split", "1,0,0")
    assert res.returncode == 0, res.stderr
    want = list(source(20, frames=4, size=12))
    seen = set()
    for shard in sorted(out.rglob("*.tar")):  # read as plain tar members: key.npy, key.txt
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, ext = m.name.partition(".")
                data = tar.extractfile(m).read()
                clip, text, info = want[int(key)]
                if ext == "npy":
                    pixels = np.load(io.BytesIO(data), allow_pickle=False)
                    assert pixels.shape == (1, 4, 12, 12) and np.array_equal(pixels[0], clip * 2 - 1), key
                    seen.add(int(key))
                elif ext == "txt":
                    assert data.decode() == text, key
                elif ext == "json":
                    assert {k: v for k, v in json.loads(data).items() if k in info} == info, key
    assert seen == set(range(20))

    for i, (args, message) in enumerate([(("--dataset", "moving-digit"), "did you mean moving-digits"),
                                         (("--size", "8", "--count", "4"), "--size 8: the 8 x 8 digit needs")]):
        bad = tmp_path / f"bad{i}"
        res = run_zoo(capsys, "prepare", "video", str(bad), *args)
        assert res.returncode in (1, 2) and message in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and not bad.exists(), args


def test_train_and_generate_a_clip_from_a_prompt(tmp_path, capsys):
    import functools

    from PIL import Image
    from zoo_dit.data import prepare_moving_digits

    from zoo.testing import run_zoo

    data = tmp_path / "mv"
    data.mkdir()
    prepare_moving_digits(data, n=60)
    zoo = functools.partial(run_zoo, capsys)  # in this process: no interpreter start per command

    run = tmp_path / "run"
    out = zoo("train", "--model", "dit-video", "--run-dir", str(run), f"data.path={data}", "train.steps=1",
              "train.eval_interval=0", "train.micro_batch_size=4", "logging.progress=false", "logging.tensorboard=false",
              "logging.plot=false")
    assert out.returncode == 0, out.stderr
    out = zoo("generate", "--checkpoint", str(run), "--prompt", "a 3 moving right", "--num_steps", "2",
              "--num-video-frames", "8", "--video_save_path", str(tmp_path / "clip.gif"))
    assert out.returncode == 0, out.stderr
    with Image.open(tmp_path / "clip.gif") as gif:
        assert gif.n_frames == 8
    bad = zoo("generate", "--checkpoint", str(run), "--class", "3", "--output", str(tmp_path / "x.gif"))
    assert bad.returncode == 2 and "text-conditional" in bad.stderr and not (tmp_path / "x.gif").exists()


def test_dfm_layout_pickled_text_is_refused_until_opted_in_or_converted(tmp_path, capsys):
    """DFM's own datasets: ``.pth`` latents ``[1, C, T, H, W]`` and ``.pickle`` T5 embeddings. The
    pickle is refused (one line naming the part and both ways out), then read with the opt-in, and
    after `zoo prepare convert-pickle` without it; a sample with no text embeddings is one line too."""
    import io
    import pickle
    import subprocess

    from zoo.cli import main
    from zoo.data.energon.prepare import prepare_webdataset, write_shards

    def dfm(text: bool):
        for k in range(24):
            buf = io.BytesIO()
            torch.save(torch.randn(1, 1, 2, 8, 8), buf)
            parts = {"pth": buf.getvalue(), "json": b'{"caption": "a clip"}'}
            if text:
                parts["pickle"] = pickle.dumps(np.random.default_rng(k).standard_normal((5, 64)).astype(np.float32))
            yield f"clip{k:03d}", parts

    def zoo(*args):  # in this process: no interpreter start per call
        capsys.readouterr()
        rc = main(list(args))
        return subprocess.CompletedProcess(args, rc, "", capsys.readouterr().err)

    def train(data, *extra):
        return zoo("train", "--model", "dit-video", "--run-dir", str(tmp_path / f"run-{data.name}-{len(extra)}"),
                   f"data.path={data}", "train.steps=1", "train.micro_batch_size=4", "train.eval_interval=0",
                   "model.num_frames=2", *extra)

    for name, text in (("dfm", True), ("notext", False)):
        write_shards(tmp_path / name, dfm(text), shard_size=8)
        prepare_webdataset(tmp_path / name, split=(1, 0, 0), crude=True)
    refused = train(tmp_path / "dfm")
    err = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0 and ".pickle part runs arbitrary code" in err and "data.allow_pickle=true" in err \
        and "zoo prepare convert-pickle" in err and "/clip0" in err, refused.stderr
    assert train(tmp_path / "dfm", "data.allow_pickle=true").returncode == 0
    conv = zoo("prepare", "convert-pickle", str(tmp_path / "dfm"))
    assert conv.returncode == 0, conv.stderr
    assert train(tmp_path / "dfm").returncode == 0  # .npy now: no code runs, no opt-in needed
    missing = train(tmp_path / "notext")
    assert missing.returncode != 0 and "the model is text-conditioned (model.text_dim=64) and the sample has no " \
        "text embeddings" in missing.stderr.strip().splitlines()[-1]
