"""Energon-format data against megatron-energon itself: datasets prepared by `energon prepare`
load in zoo with the same keys and decoded contents, datasets written by `zoo prepare` load in
megatron-energon and pass its lint, `.tar.idx` files are byte-identical; the loader restores
exactly (0, 1, 2 workers, shuffle buffer + packing + grouping), follows its documented rule for
layout changes, reads S3 through a real local S3 server, and every bad input is one clear line."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from zoo.data.energon import (
    DatasetError,
    DecodeError,
    LoaderError,
    WebDataset,
    WorkerConfig,
    get_loader,
    get_train_dataset,
    get_val_dataset,
    stateless,
)
from zoo.data.energon.dataset import make_sample
from zoo.data.energon.media import prepare_images
from zoo.data.energon.prepare import png_bytes, prepare_webdataset, write_shards

sys.path.insert(0, str(Path(__file__).parent))
from _energon_helpers import Augment, Faulty  # noqa: E402

ENERGON = shutil.which("energon") or str(Path(sys.executable).parent / "energon")


def _wc(nw: int = 0, rank: int = 0, world: int = 1) -> WorkerConfig:
    return WorkerConfig(rank=rank, world_size=world, num_workers=nw)


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("energon") / "digits"
    prepare_images(out, dataset="digits", shard_size=100)
    return out


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def _npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _pth(t: torch.Tensor) -> bytes:
    b = io.BytesIO()
    torch.save(t, b)
    return b.getvalue()


def _varied(root: Path) -> None:
    """Shards with every part kind, long (pax) names, keys in folders, a __meta__ member, a
    directory entry, ustar and GNU formats."""
    rng = np.random.default_rng(0)
    for s in range(3):
        members: list[tuple[str, bytes]] = [("__meta__/info.json", b"{}")]
        for i in range(7):
            key = f"sub{s}/" + ("long_" * 25 if i == 3 else "") + f"s{s}_{i:03d}"
            img = rng.integers(0, 255, (6, 5, 3), dtype=np.uint8)
            members += [(f"{key}.png", png_bytes(img)), (f"{key}.txt", f"caption {s} {i}".encode()),
                        (f"{key}.cls", str(i).encode()), (f"{key}.detail.json", json.dumps({"i": i, "s": [s]}).encode()),
                        (f"{key}.npy", _npy(rng.standard_normal((2, 3)).astype(np.float32))),
                        (f"{key}.pth", _pth(torch.arange(i + 1)))]
        _tar(root / f"part{s}.tar", members, fmt=[tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT][s])


def _energon_prepare(root: Path, *args: str) -> None:
    subprocess.run([ENERGON, "prepare", str(root), "--non-interactive", "--force-overwrite", "--no-progress", *args],
                   check=True, capture_output=True, timeout=300)


def _same_value(a, b) -> None:
    if isinstance(b, torch.Tensor):
        assert torch.equal(torch.as_tensor(a), b)
    elif isinstance(b, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def test_energon_prepared_dataset_loads_in_zoo_with_the_same_samples(tmp_path):
    from megatron.energon import WorkerConfig as EWC
    from megatron.energon import get_val_dataset as e_val

    root = tmp_path / "varied"
    _varied(root)
    _energon_prepare(root, "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset")
    idx = {p: p.read_bytes() for p in root.glob("*.tar.idx")}
    zoo_side = WebDataset(str(root), split_part="train")
    ours = {}
    for i in range(len(zoo_side)):
        s = make_sample(zoo_side, i, restore_key=("s", 0, i), subflavors=None)
        ours[s["__key__"]] = s
    from megatron.energon import Cooker, DefaultTaskEncoder, stateless

    class Identity(DefaultTaskEncoder):
        cookers = [Cooker(stateless(lambda s: s))]

    ds = e_val(str(root), split_part="train", batch_size=None, task_encoder=Identity(),
               worker_config=EWC(rank=0, world_size=1, num_workers=0))

    from megatron.energon import get_loader as e_loader

    theirs = {}
    for s in e_loader(ds):
        theirs[s["__key__"]] = s
    assert sorted(ours) == sorted(theirs) and len(ours) == 21
    for key, t in theirs.items():
        o = ours[key]
        parts = [k for k in t if not k.startswith("__")]
        assert sorted(parts) == sorted(k for k in o if not k.startswith("__"))
        for part in parts:
            _same_value(o[part], t[part])
    # zoo's own index of energon's tars is byte-identical, and the older .info.yaml reads the same
    prepare_webdataset(root, tar_index_only=True)
    assert {p: p.read_bytes() for p in root.glob("*.tar.idx")} == idx
    info = json.loads((root / ".nv-meta/.info.json").read_text())
    (root / ".nv-meta/.info.json").unlink()
    import yaml

    (root / ".nv-meta/.info.yaml").write_text(yaml.safe_dump(info))
    assert len(WebDataset(str(root), split_part="train")) == 21


def test_zoo_prepared_dataset_loads_in_energon_and_passes_its_lint(digits, tmp_path):
    from megatron.energon import WorkerConfig as EWC
    from megatron.energon import get_val_dataset as e_val

    copy = tmp_path / "copy"
    shutil.copytree(digits / "shards", copy / "shards")
    for p in (copy / "shards").glob("*.idx"):
        p.unlink()
    _energon_prepare(copy, "--split-ratio", "8,1,1", "--sample-type", "CaptioningSample",
                     "--field-map", '{"image": "png", "caption": "txt"}')
    for p in (digits / "shards").glob("*.tar.idx"):
        assert p.read_bytes() == (copy / "shards" / p.name).read_bytes(), p.name
    lint = subprocess.run([ENERGON, "lint", str(digits)], capture_output=True, text=True, timeout=300)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    from megatron.energon import get_loader as e_loader

    theirs = {s.__key__: s for s in e_loader(e_val(str(digits), batch_size=None,
                                                    worker_config=EWC(rank=0, world_size=1, num_workers=0)))}
    ours = {}
    for b in get_loader(get_val_dataset(str(digits), worker_config=_wc(), batch_size=None)):
        ours[b.__key__] = b
    assert sorted(ours) == sorted(theirs) and len(ours) == 200
    for key, t in theirs.items():
        assert torch.equal(ours[key].image, t.image) and ours[key].caption == t.caption


def _signature(batch) -> list:
    return [batch["keys"], [round(float(v), 6) for v in batch["x"].flatten(1).sum(1)]]


def _loader(path, nw, state=None, *, rank=0, world=1, te=None, **kw):
    ds = get_train_dataset(str(path), worker_config=_wc(nw, rank, world), batch_size=kw.pop("batch_size", 3),
                           shuffle_buffer_size=20, max_samples_per_sequence=20, packing_buffer_size=12,
                           task_encoder=te or Augment(), seed=kw.pop("seed", 5), **kw)
    ld = get_loader(ds, watchdog_timeout_seconds=120)
    if state is not None:
        ld.restore_state_rank(json.loads(json.dumps(state)))  # through JSON, as a checkpoint stores it
    return ld


@pytest.mark.parametrize("workers", [0, 1])
def test_a_task_encoder_that_skips_every_sample_is_an_error_not_a_hang(digits, workers):
    """A training stream repeats for ever: with every sample skipped no batch ever came and the
    loader spun (a DiT packing into a train.seq_length no image fits)."""
    from _energon_helpers import SkipAll

    it = iter(_loader(digits, workers, te=SkipAll()))
    with pytest.raises((DatasetError, LoaderError), match="skipped every sample of two epochs"):
        next(it)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_restore_gives_the_identical_next_50_batches(digits, workers):
    at = random.Random(workers).randint(3, 15)
    ld = _loader(digits, workers)
    it = iter(ld)
    ref = [_signature(next(it)) for _ in range(at + 50)]
    ld.close()
    ld = _loader(digits, workers)
    it = iter(ld)
    for _ in range(at):
        next(it)
    state = ld.save_state_rank()
    ld.close()
    assert len(json.dumps(state)) < 20_000  # keys and generator states, never sample data
    ld = _loader(digits, workers, state)
    it = iter(ld)
    assert [_signature(next(it)) for _ in range(50)] == ref[at:]
    ld.close()
    other = _loader(digits, workers, seed=6)  # another seed, another order
    assert _signature(next(iter(other))) != ref[0]
    other.close()


def test_layout_change_keeps_global_batches_when_global_workers_stay(digits):
    """dp2 x in-process == dp1 x 2 workers (2 global workers both), before and after a restore
    across the change; 1 global worker is refused with the rule in the message."""
    from zoo.data.energon.loader import redistribute

    ranks = [_loader(digits, 0, rank=r, world=2) for r in range(2)]
    its = [iter(ld) for ld in ranks]
    head = [_signature(next(its[r])) for _ in range(4) for r in range(2)]
    states = [ld.save_state_rank() for ld in ranks]
    tail = [_signature(next(its[r])) for _ in range(3) for r in range(2)]
    one = _loader(digits, 2)
    it = iter(one)
    assert [_signature(next(it)) for _ in range(8)] == head
    one.close()
    moved = _loader(digits, 2)
    moved.restore_state_rank(redistribute(json.loads(json.dumps(states)), _wc(2)))
    it = iter(moved)
    assert [_signature(next(it)) for _ in range(6)] == tail
    moved.close()
    with pytest.raises(LoaderError, match="ranks x workers = 2"):
        redistribute(states, _wc(0))


def test_blends_subsets_and_tiny_datasets(digits, tmp_path):
    meta = tmp_path / "meta.yaml"
    meta.write_text(f"""__module__: megatron.energon
__class__: MetadatasetV2
splits:
  train:
    blend_epochized:
      - repetitions: 2
        path: {digits}
        subset: {{range: [0, 30]}}
        subflavors: {{src: a}}
      - repetitions: 1
        path: {digits}
        subset: {{range: ["50%", end]}}
        subflavors: {{src: b}}
""")
    ds = get_train_dataset(str(meta), worker_config=_wc(), batch_size=None, shuffle_buffer_size=10,
                           max_samples_per_sequence=8, repeat=False, task_encoder=None)
    seen: dict[str, int] = {}
    for s in get_loader(ds):
        seen[s.__subflavors__["src"] + s.__key__] = seen.get(s.__subflavors__["src"] + s.__key__, 0) + 1
    a = [k for k in seen if k.startswith("a")]
    b = [k for k in seen if k.startswith("b")]
    assert len(a) == 30 and all(seen[k] == 2 for k in a)  # every sample exactly its repetitions
    assert len(b) == 700 and all(seen[k] == 1 for k in b)
    # weights: the draw frequencies follow them
    meta.write_text(meta.read_text().replace("blend_epochized", "blend").replace("repetitions: 2", "weight: 3")
                    .replace("repetitions: 1", "weight: 1"))
    ds = get_train_dataset(str(meta), worker_config=_wc(), batch_size=None, shuffle_buffer_size=10,
                           max_samples_per_sequence=8)
    it = iter(get_loader(ds))
    share = sum(next(it).__subflavors__["src"] == "a" for _ in range(2000)) / 2000
    assert 0.72 < share < 0.78
    # fewer samples than global workers: training works on every rank, validation yields each once
    tiny = tmp_path / "tiny"
    write_shards(tiny, [(f"k{i}", {"txt": b"x", "cls": b"1"}) for i in range(3)], shard_size=10)
    prepare_webdataset(tiny, split=(1, 0, 0), sample_type="TextSample", field_map={"text": "txt"})
    for r in range(4):
        it = iter(get_loader(get_train_dataset(str(tiny), worker_config=_wc(0, r, 4), batch_size=2,
                                               shuffle_buffer_size=None, max_samples_per_sequence=None)))
        assert len(next(it)["text"]) == 2
    got = [s.__key__ for r in range(4) for s in get_loader(get_val_dataset(
        str(tiny), split_part="train", worker_config=_wc(0, r, 4), batch_size=None))]
    assert sorted(got) == ["k0", "k1", "k2"]


def _keys(path, n, **kw):
    """The first ``n`` samples' (key, restore key) of a one-worker training stream, in order."""
    ds = get_train_dataset(str(path), worker_config=_wc(), batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=4, parallel_slices=3, **kw)
    it = iter(get_loader(ds))
    return [(s.__key__, tuple(s.__restore_key__)) for s in (next(it) for _ in range(n))]


def test_shuffle_over_epochs_multiplier_as_energon_defines_it(digits, tmp_path):
    """Energon's shuffle_over_epochs: k shuffles the slices of k epochs together (each sample k times
    per k epochs, a sample's second pass possibly before another's first), -1 draws slices with
    replacement, null reads in order; nested references combine by Energon's rule; a sample that
    comes round again has a new restore key (seeded hooks draw afresh); positions restore exactly."""
    from zoo.data.energon.metadataset import load_metadataset

    def meta(name: str, body: str) -> Path:
        path = tmp_path / name
        path.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n" + body)
        return path

    leaf = meta("leaf.yaml", f"    path: {digits}\n    subset: {{range: [0, 40]}}\n    shuffle_over_epochs_multiplier: 2\n")
    twice = _keys(leaf, 80)
    assert {k: [x for x, _ in twice].count(k) for k, _ in twice} == {k: 2 for k, _ in twice} and len(set(twice)) == 80
    first = [k for k, _ in twice[:40]]
    assert len(set(first)) < 40  # the two epochs are mixed: a second pass came before some first one
    once = _keys(leaf, 80, shuffle_over_epochs_multiplier=None)  # null anywhere: in order, one slice at a time
    in_order = [s.__key__ for s in get_loader(get_val_dataset(str(leaf), split_part="train", worker_config=_wc(),
                                                               batch_size=None))][:40]
    assert [k for k, _ in once] == in_order * 2
    drawn = [k for k, _ in _keys(leaf, 400, shuffle_over_epochs_multiplier=-1)]  # with replacement
    counts = [drawn.count(k) for k in set(drawn)]
    assert set(drawn) <= set(in_order) and len(set(counts)) > 2  # uneven counts: no epochs
    # Nesting (Energon's rule): products, -1 wins over numbers, null over everything.
    outer = meta("outer.yaml", f"    path: {leaf}\n    shuffle_over_epochs_multiplier: 3\n")
    assert [x.shuffle_over_epochs for x in load_metadataset(str(outer), "train")[0]] == [6]
    for value, want in (("-1", -1), ("null", None)):
        outer.write_text(outer.read_text().replace("multiplier: 3", f"multiplier: {value}").replace("multiplier: -1", f"multiplier: {value}"))
        assert [x.shuffle_over_epochs for x in load_metadataset(str(outer), "train")[0]] == [want]
    ds = get_train_dataset(str(leaf), worker_config=_wc(), batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=4, shuffle_over_epochs_multiplier=5)
    assert [x.shuffle_over_epochs for x in ds.config.leaves] == [10]
    for bad in ("0", "1.5", "-2", "many"):
        outer.write_text(f"splits:\n  train:\n    path: {leaf}\n    shuffle_over_epochs_multiplier: {bad}\n")
        with pytest.raises(DatasetError, match=r"outer\.yaml: splits\.train: shuffle_over_epochs_multiplier must be"):
            load_metadataset(str(outer), "train")
    # Exact restore with slices drawn with replacement (shuffle buffer, packing, an augmenting encoder).
    ld = _loader(digits, 1, shuffle_over_epochs_multiplier=-1)
    it = iter(ld)
    ref = [_signature(next(it)) for _ in range(30)]
    ld.close()
    ld = _loader(digits, 1, shuffle_over_epochs_multiplier=-1)
    it = iter(ld)
    for _ in range(10):
        next(it)
    state = ld.save_state_rank()
    ld.close()
    ld = _loader(digits, 1, state, shuffle_over_epochs_multiplier=-1)
    it = iter(ld)
    assert [_signature(next(it)) for _ in range(20)] == ref[10:]
    ld.close()
    with pytest.raises(LoaderError, match="shuffle_over_epochs"):  # another multiplier is another data order
        _loader(digits, 1, state, shuffle_over_epochs_multiplier=2)
    # A state saved before the passes were recorded (k = 1: the pass was the epoch) restores as it did.
    ld = _loader(digits, 0)
    it = iter(ld)
    for _ in range(7):
        next(it)
    state = ld.save_state_rank()
    want = [_signature(next(it)) for _ in range(5)]
    ld.close()
    for reader in state["workers"][0]["readers"]:
        reader["active"] = [a[:2] for a in reader["active"]]
    ld = _loader(digits, 0, state)
    it = iter(ld)
    assert [_signature(next(it)) for _ in range(5)] == want
    ld.close()


def test_worker_hang_and_death_name_the_shard_and_nothing_is_left(digits, monkeypatch):
    monkeypatch.setenv("ZOO_TEST_HANG_KEY", "digit00420")
    ds = get_train_dataset(str(digits), worker_config=_wc(1), batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, task_encoder=Faulty())
    ld = get_loader(ds, watchdog_timeout_seconds=3)
    ld.initial_timeout = 120
    with pytest.raises(LoaderError, match=r"made no batch in 3 s.*shard-000004\.tar/digit00420"):
        for _ in ld:
            pass
    assert not any(p.is_alive() for p in ld._procs)
    monkeypatch.delenv("ZOO_TEST_HANG_KEY")
    monkeypatch.setenv("ZOO_TEST_DIE_KEY", "digit00007")
    ld = get_loader(ds, watchdog_timeout_seconds=30)
    with pytest.raises(LoaderError, match=r"died with exit code 3 while reading .*shard-000000\.tar/digit00007"):
        for _ in ld:
            pass


def _corrupt_copy(digits: Path, tmp_path: Path) -> Path:
    root = tmp_path / "bad"
    shutil.copytree(digits, root)
    return root


def test_bad_inputs_are_one_line_errors_naming_the_file(digits, tmp_path):
    root = _corrupt_copy(digits, tmp_path)
    shard = root / "shards/shard-000000.tar"
    # a .tar.idx that does not match its tar
    idx = np.fromfile(str(shard) + ".idx", dtype=np.uint64)
    (root / "shards/shard-000000.tar.idx").write_bytes(np.concatenate([idx[:1], idx[2:]]).tobytes())
    with pytest.raises(DatasetError, match=r"shard-000000\.tar\.idx: indexes 99 samples but .*says 100"):
        WebDataset(str(root)).index(0)
    shifted = idx.copy()
    shifted[1] += 512
    (root / "shards/shard-000000.tar.idx").write_bytes(shifted.tobytes())
    with pytest.raises(DatasetError, match=r"shard-000000\.tar.*does not match"):
        make_sample(WebDataset(str(root)), 0, restore_key=(), subflavors=None)
    # a truncated tar: indexing fails naming it, and the metadata already there is kept
    before = {p.name: p.read_bytes() for p in (root / ".nv-meta").iterdir()}
    shard.write_bytes(shard.read_bytes()[:20_000])
    with pytest.raises(DatasetError, match=r"shard-000000\.tar: truncated"):
        prepare_webdataset(root, split=(8, 1, 1), sample_type="CaptioningSample",
                           field_map={"image": "png", "caption": "txt"}, force_overwrite=True)
    assert {p.name: p.read_bytes() for p in (root / ".nv-meta").iterdir()} == before
    with pytest.raises(DatasetError, match=r"shard-000000\.tar\.idx: ends at byte .*truncated tar"):
        WebDataset(str(root)).index(0)
    # missing split, unknown sample type, field_map naming a missing part
    good = _corrupt_copy(digits, tmp_path / "g")
    with pytest.raises(DatasetError, match="no split part 'holdout'"):
        WebDataset(str(good), split_part="holdout")
    ds_yaml = good / ".nv-meta/dataset.yaml"
    ds_yaml.write_text(ds_yaml.read_text().replace("CaptioningSample", "CaptionSample"))
    with pytest.raises(DecodeError, match=r"dataset\.yaml: unknown sample type megatron\.energon\.CaptionSample.*did you mean"):
        WebDataset(str(good))
    ds_yaml.write_text(ds_yaml.read_text().replace("CaptionSample", "CaptioningSample").replace("image: png", "image: jpg"))
    with pytest.raises(DecodeError, match=r"shard-000000\.tar/digit00000: field_map 'jpg' \(dataset\.yaml\) names no part"):
        make_sample(WebDataset(str(good)), 0, restore_key=(), subflavors=None)
    with pytest.raises(DatasetError, match="no part 'jpg' in the shards"):
        prepare_webdataset(good, split=(8, 1, 1), sample_type="CaptioningSample",
                           field_map={"image": "jpg", "caption": "txt"}, force_overwrite=True)
    # duplicate keys (within a shard, and across shards) and an undecodable image
    dup = tmp_path / "dup"
    _tar(dup / "a.tar", [("k1.txt", b"a"), ("k2.txt", b"b"), ("k1.cls", b"1")])
    with pytest.raises(DatasetError, match=r"a\.tar: key 'k1' appears twice"):
        prepare_webdataset(dup, split=(1, 0, 0), crude=True)
    _tar(dup / "a.tar", [("k1.txt", b"a")])
    _tar(dup / "b.tar", [("k1.txt", b"b")])
    with pytest.raises(DatasetError, match=r"b\.tar: key 'k1' also appears in a\.tar"):
        prepare_webdataset(dup, split=(1, 0, 0), crude=True)
    assert not (dup / ".nv-meta").exists()
    broken = tmp_path / "broken"
    _tar(broken / "a.tar", [("k1.png", b"\x89PNG not really"), ("k1.txt", b"x")])
    prepare_webdataset(broken, split=(1, 0, 0), sample_type="CaptioningSample", field_map={"image": "png", "caption": "txt"})
    with pytest.raises(DecodeError, match=r"a\.tar/k1/png: cannot decode part 'png'"):
        make_sample(WebDataset(str(broken)), 0, restore_key=(), subflavors=None)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/zoo-pwned",))


def test_pickle_parts_are_refused_then_converted_without_running_code(tmp_path):
    from zoo.data.energon.convert import convert_pickle

    root = tmp_path / "dfm"
    t5 = torch.randn(1, 4, 6).to(torch.bfloat16)
    _tar(root / "rank0-000000.tar", [("000000.pickle", pickle.dumps(t5)), ("000000.json", b"{}"),
                                     ("000001.pickle", pickle.dumps(np.arange(5))), ("000001.json", b"{}")])
    prepare_webdataset(root, split=(1, 0, 0), crude=True)
    ds = WebDataset(str(root))
    with pytest.raises(DecodeError, match=r"\.pickle part runs arbitrary code.*data\.allow_pickle=true.*zoo prepare convert-pickle"):
        make_sample(ds, 0, restore_key=(), subflavors=None)
    assert convert_pickle(root) == 2
    a = make_sample(WebDataset(str(root)), 0, restore_key=(), subflavors=None)
    assert "pickle" not in a and torch.equal(torch.from_numpy(a["pickle.npy"]), t5.float())
    assert np.array_equal(make_sample(WebDataset(str(root)), 1, restore_key=(), subflavors=None)["pickle.npy"],
                          np.arange(5))
    evil = tmp_path / "evil"
    _tar(evil / "a.tar", [("k.pickle", pickle.dumps(_Evil()))])
    before = (evil / "a.tar").read_bytes()
    with pytest.raises(DatasetError, match=r"a\.tar/k\.pickle: posix\.system is not a tensor"):
        convert_pickle(evil)
    assert (evil / "a.tar").read_bytes() == before and not Path("/tmp/zoo-pwned").exists()


def test_reads_s3_through_a_local_s3_server(digits, monkeypatch):
    import socket

    boto3 = pytest.importorskip("boto3")
    import fsspec.config
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                     "FSSPEC_S3_ENDPOINT_URL": url}.items():
            monkeypatch.setenv(k, v)
        # fsspec reads FSSPEC_* variables once, when it is first imported (in a full run, long before this
        # test); spawned loader workers import it afresh and read the variable above.
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": url})
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="data")
        for p in digits.rglob("*"):
            if p.is_file():
                client.upload_file(str(p), "data", f"digits/{p.relative_to(digits).as_posix()}")
        local = [(b.__key__, b.image) for b in get_loader(get_val_dataset(str(digits), worker_config=_wc(), batch_size=None))]
        remote = [(b.__key__, b.image) for b in get_loader(get_val_dataset("s3://data/digits", worker_config=_wc(),
                                                                          batch_size=None))]
        assert [k for k, _ in remote] == [k for k, _ in local] and len(local) == 200
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(remote, local))
    finally:
        server.stop()


def test_cli_prepare_images_and_data_info(tmp_path, capsys):
    from zoo.cli import main

    out = tmp_path / "d"
    assert main(["prepare", "images", str(out), "--dataset", "digits", "--shard-size", "300"]) == 0
    assert main(["data", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1,797 samples in 6 shards" in text and "CaptioningSample" in text and "train" in text
    assert main(["prepare", "webdataset", str(out), "--split", "8,1,1", "--crude"]) == 1  # already prepared
    assert "already prepared" in capsys.readouterr().err


def test_a_family_without_a_task_encoder_refuses_energon_data_before_writing(digits, tmp_path, capsys):
    """LLaMA's loss reads token batches; energon's default batches are collated samples (it failed
    with KeyError 'tokens' at the first step, after writing the run directory)."""
    from zoo.testing import run_zoo

    for extra in (("--dry-run",), ("--run-dir", str(tmp_path / "run"), "train.steps=1")):
        out = run_zoo(capsys, "train", "--model", "llama", f"data.path={digits}", *extra)
        assert out.returncode == 2, out.stderr
        assert "family 'llama' declares no task encoder" in out.stderr and "zoo prepare text" in out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_prepare_notes_a_split_part_left_without_a_shard(tmp_path, capsys):
    """The split divides whole shards: 4 shards at 8,1,1 leave val none (training then skips its
    validation), which the summary says; a part given no share is not noted."""
    from zoo.testing import run_zoo

    out = run_zoo(capsys, "prepare", "images", str(tmp_path / "a"), "--dataset", "digits", "--shard-size", "500")
    assert out.returncode == 0 and "  val        0 shards" in out.stdout
    assert "note: val got no shard of 4 at --split 8,1,1" in out.stdout
    out = run_zoo(capsys, "prepare", "images", str(tmp_path / "b"), "--dataset", "digits", "--shard-size", "500",
                  "--split", "10,0,0")
    assert out.returncode == 0 and "  val        0 shards" in out.stdout and "note:" not in out.stdout


def test_cli_prepare_refuses_counts_and_sizes_with_one_line_and_writes_nothing(tmp_path, capsys):
    """A count or size below 1 (zero-frame clips, no shards after creating the directory): refused
    before anything is written."""
    from zoo.testing import run_zoo

    cases = [(("video", "--num-frames", "0"), "argument --num-frames: 0: must be at least 1"),
             (("video", "--count", "-3"), "argument --count: -3: must be at least 1"),
             (("images", "--dataset", "digits", "--shard-size", "0"), "argument --shard-size: 0: must be at least 1"),
             (("images", "--dataset", "digits", "--repeat", "0"), "argument --repeat: 0: must be at least 1"),
             (("images", "--dataset", "digits", "--size", "x"), "argument --size: invalid int value: 'x'")]
    for i, (args, message) in enumerate(cases):
        out = tmp_path / f"d{i}"
        res = run_zoo(capsys, "prepare", args[0], str(out), *args[1:])
        assert res.returncode in (1, 2) and message in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and not out.exists(), args


def _fit(run_dir: str, world: int, overrides: list[str], task_encoder: str = "digits_to_cond") -> None:
    import dataclasses

    from _trainer_family import FAMILY, CondConfig

    from zoo.config import resolve
    from zoo.parallel.layout import plan
    from zoo.training.trainer import Trainer

    fam = dataclasses.replace(FAMILY, task_encoder=f"_energon_helpers:{task_encoder}")
    run = resolve(family="cond", flavor="tiny", model_cls=CondConfig, model_defaults=fam.flavors["tiny"](),
                  recipe=[("recipe of cond", fam.recipe)], overrides=overrides)
    Trainer(fam, run, plan(run, world_size=world, family=fam), run_dir=Path(run_dir)).fit()


def test_trainer_resumes_energon_data_exactly_across_a_layout_change(digits, tmp_path):
    """`data.path=DATASET`: dp2 (in-process loading) trains 6 steps; a run saved at step 3 and
    resumed under dp1 x 2 workers (the same 2 global workers) continues with the same batches."""
    from zoo.testing import run_distributed

    common = ["train.steps=6", "train.micro_batch_size=2", "train.global_batch_size=8", "logging.interval=1",
              "checkpoint.interval=3", "logging.progress=false", "train.seed=5", "train.eval_interval=0",
              f"data.path={digits}", "optimizer.lr=3e-3", "schedule.warmup_steps=0", "schedule.decay=constant"]
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    run_distributed(_fit, 2, str(ref_dir), 2, [*common, "data.num_workers=0"], timeout=240)
    run_distributed(_fit, 2, str(cut_dir), 2, [*common, "data.num_workers=0", "train.steps=3"], timeout=240)
    (saved,) = (cut_dir / "checkpoints").glob("step_*3")
    state = json.loads((saved / "state.json").read_text())["data"]
    assert len(state["ranks"]) == 2 and len(json.dumps(state)) < 30_000
    _fit(str(cut_dir), 1, [*common, "data.num_workers=2"])
    ref = [json.loads(x) for x in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (cut_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    with pytest.raises(Exception, match="ranks x workers = 2"):
        _fit(str(cut_dir), 1, [*common, "data.num_workers=0", "train.steps=9"])


def test_a_nan_sample_is_named_by_its_dataset_shard_and_key(digits, tmp_path, monkeypatch):
    """The 5th sample the loader's worker encodes has NaN pixels: with train.skip_nonfinite=0 the
    run stops at step 1 with an error that names, beside the stream position, every sample of the
    step by dataset directory, shard and key, the poisoned one among them."""
    from zoo.errors import ZooError

    log = tmp_path / "poisoned.txt"
    monkeypatch.setenv("ZOO_TEST_NAN_AT", "5")
    monkeypatch.setenv("ZOO_TEST_NAN_LOG", str(log))
    overrides = ["train.steps=3", "train.micro_batch_size=2", "train.global_batch_size=8", "logging.progress=false",
                 "train.eval_interval=0", f"data.path={digits}", "data.num_workers=1", "train.skip_nonfinite=0",
                 "train.preview=false", "logging.tensorboard=false", "logging.plot=false"]
    with pytest.raises(ZooError) as e:
        _fit(str(tmp_path / "run"), 1, overrides, task_encoder="poisoned_digits")
    (key,) = log.read_text().split()
    message = str(e.value)
    assert message.startswith("step 1: gradient norm nan") and "samples 0..7 of the train stream" in message
    names = message[message.index("train stream"):].split("(", 1)[1].rsplit(")", 1)[0].split(", ")
    assert len(names) == 8 and all(n.startswith(str(digits)) and ".tar/" in n for n in names), names
    assert any(n.endswith(f"/{key}") for n in names), (key, names)


def test_split_by_ratio_keeps_every_shard():
    """Energon's rule (split end = int(n * cumulative ratio)), except that no shard is lost when the
    float sum of the ratios falls just short of 1 (8/12 + 2/12 + 2/12 = 0.9999999999999999)."""
    from zoo.data.energon.prepare import split_by_ratio

    for n, ratio in ((3, (8, 2, 2)), (18, (8, 1, 1)), (7, (1, 1, 1)), (10, (5, 0, 0))):
        shards = [f"s{i}" for i in range(n)]
        got = split_by_ratio(shards, ratio, shuffle=False)
        assert got["train"] + got["val"] + got["test"] == shards
        assert len(got["train"]) == int(n * ratio[0] / sum(ratio))


def test_reseeded_hooks_draw_per_key_and_leave_every_generator_as_it_was(monkeypatch):
    """A ``restore_seeds`` hook draws the same numbers for the same key (and other ones for another),
    the caller's torch/numpy/random streams continue as if it never ran, and no accelerator
    generator is reseeded by the data (torch.manual_seed would queue that, a stack trace each)."""
    from zoo.data.energon import stateless
    from zoo.data.energon.task_encoder import call_hook

    class Hook:
        @stateless(restore_seeds=True)
        def encode_sample(self, _):
            return torch.rand(3), np.random.rand(), random.random()

    for name in ("cuda", "xpu", "mtia"):
        monkeypatch.setattr(getattr(torch, name), "manual_seed_all", lambda seed, name=name: pytest.fail(f"{name} reseeded"))
    hook = Hook().encode_sample
    torch.default_generator.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = torch.rand(2), np.random.rand(), random.random()
    torch.default_generator.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    a, b, c = (call_hook(hook, None, seed=7, key=k) for k in ("k1", "k1", "k2"))
    after = torch.rand(2), np.random.rand(), random.random()
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:] and not torch.equal(a[0], c[0])
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def _draw() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


class _Draws(Augment):
    """Augment's reseeded encode_sample (its noise from torch) and a reseeded packing, and the hooks
    that are not reseeded (choosing packs, grouping, batching) drawing from the caller's streams,
    each draw logged."""

    def __init__(self) -> None:
        self.log: list[tuple[float, float, float]] = []

    def select_samples_to_pack(self, samples):
        self.log.append(_draw())
        return super().select_samples_to_pack(samples)

    @stateless(restore_seeds=True)
    def pack_selected_samples(self, samples):  # reseeded too (its own draw joins the pack)
        return {**super().pack_selected_samples(samples), "r": torch.rand(1)}

    def batch_group_criterion(self, s):
        self.log.append(_draw())
        return super().batch_group_criterion(s)

    def batch(self, samples):
        self.log.append(_draw())
        return super().batch(samples)

    def encode_batch(self, batch):
        self.log.append(_draw())
        return batch


def test_hooks_not_reseeded_draw_the_callers_streams_as_if_no_reseeded_hook_ran(digits):
    """The pipeline puts the caller's torch/numpy/random states back once per batch, not around each
    reseeded call; every hook that is not reseeded must still draw exactly the caller's streams (as
    if nothing else had drawn), during a batch, after a restore from a saved state, and after it."""
    def expected(n: int) -> list[tuple[float, float, float]]:
        torch.default_generator.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        return [_draw() for _ in range(n)]

    def run(state=None) -> tuple[_Draws, list, tuple, object]:
        te = _Draws()
        ld = _loader(digits, 0, state, te=te)
        torch.default_generator.manual_seed(0)  # the caller's streams from here
        np.random.seed(0)
        random.seed(0)
        it = iter(ld)  # (with a state, the buffered samples are rebuilt through the reseeded hook)
        batches = [_signature(next(it)) for _ in range(6)]
        after = _draw()
        saved = ld.save_state_rank()
        ld.close()
        return te, batches, after, saved

    te, batches, after, saved = run()
    assert len(te.log) >= 12 and te.log + [after] == expected(len(te.log) + 1)
    te2, batches2, after2, _ = run()
    assert batches2 == batches  # the reseeded noise is the sample's own
    te3, _, after3, _ = run(saved)
    assert te3.log + [after3] == expected(len(te3.log) + 1)


def test_a_cooker_not_marked_stateless_draws_the_callers_streams(tmp_path):
    """A crude dataset's cooker is the user's code: unless marked ``@stateless`` it may draw from
    the caller's streams, so it runs on them, between reseeded encode_sample calls."""
    from zoo.data.energon import Cooker, TaskEncoder

    root = tmp_path / "varied"
    _varied(root)
    prepare_webdataset(root, split=(1, 0, 0), crude=True)
    log: list[tuple[float, float, float]] = []

    def cook(sample):
        log.append(_draw())
        return sample

    class Crude(TaskEncoder):
        cookers = (Cooker(cook=cook),)

        @stateless(restore_seeds=True)
        def encode_sample(self, s):
            return {"key": s["__key__"], "r": torch.rand(1)}

        def batch(self, samples):
            log.append(_draw())
            return [s["key"] for s in samples]

    ld = get_loader(get_train_dataset(str(root), worker_config=_wc(), batch_size=2, shuffle_buffer_size=4, max_samples_per_sequence=4,
                                      task_encoder=Crude(), seed=3))
    torch.default_generator.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    it = iter(ld)
    for _ in range(5):
        next(it)
    log.append(_draw())
    ld.close()
    torch.default_generator.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    assert len(log) >= 15 and log == [_draw() for _ in log]


_ORPHANING = """
import os, signal, sys
from zoo.data.energon import WorkerConfig, get_loader, get_train_dataset
ds = get_train_dataset(sys.argv[1], worker_config=WorkerConfig(rank=0, world_size=1, num_workers=2), batch_size=4,
                       shuffle_buffer_size=None, max_samples_per_sequence=None)
loader = get_loader(ds)
next(iter(loader))
print(" ".join(str(p.pid) for p in loader._procs), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: the workers must notice by themselves
"""


def test_workers_of_a_killed_loader_exit_by_themselves(digits):
    """Workers are forked from a server process, not from the loader's: when the loader's process
    is killed they still notice (their next full queue) and exit, leaving nothing behind."""
    import time

    from zoo.procs import alive

    out = subprocess.run([sys.executable, "-c", _ORPHANING, str(digits)], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30  # (`alive` itself: tests/test_procs.py, against /proc's states)
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
