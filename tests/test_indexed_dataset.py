"""Megatron indexed datasets: byte-compatible both ways with megatron-core (the oracle), and
clear errors for every kind of broken file."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from zoo.data.indexed import DTYPES, IndexedDataset, IndexedDatasetError, IndexedDatasetWriter

with warnings.catch_warnings():  # megatron-core warns that it found no GPU backends
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as mc


def _docs(dtype, n=30, seed=0):
    rng = np.random.default_rng(seed)
    hi = 120 if np.dtype(dtype).kind in "iu" else 1.0
    return [(rng.random(rng.integers(1, 50)) * hi).astype(dtype) for _ in range(n)]


def _write_with_megatron(prefix, docs, dtype) -> None:
    """Ten one-sequence documents, one document of four sequences, the rest in one document."""
    builder = mc.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs[:10]:
        builder.add_item(torch.from_numpy(d))
        builder.end_document()
    builder.add_document(torch.from_numpy(np.concatenate(docs[10:14])), [len(d) for d in docs[10:14]])
    for d in docs[14:]:
        builder.add_item(torch.from_numpy(d))
    builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_megatron_files_read_identically_here(tmp_path, code):
    dtype = DTYPES[code]
    docs = _docs(dtype)
    _write_with_megatron(tmp_path / "m", docs, dtype)
    ours, theirs = IndexedDataset(tmp_path / "m"), mc.IndexedDataset(str(tmp_path / "m"))
    assert len(ours) == len(theirs) == len(docs)
    assert ours.dtype == np.dtype(dtype)
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(docs)):
        assert np.array_equal(ours[i], theirs[i]) and np.array_equal(ours[i], docs[i])
    for a, b in zip(ours[3:9], theirs[3:9]):
        assert np.array_equal(a, b)
    assert np.array_equal(ours.get(5, 1, 2), theirs.get(5, 1, 2))
    # NumPy and negative indices read the same sequences; out of range is an IndexError.
    assert np.array_equal(ours[np.int64(7)], docs[7]) and np.array_equal(ours[-1], docs[-1])
    assert np.array_equal(ours[np.uint32(0)], docs[0])
    for bad in (len(docs), -len(docs) - 1):
        with pytest.raises(IndexError, match="out of range"):
            ours[bad]
    # A pickled dataset reopens the files (another process maps them itself).
    import pickle

    again = pickle.loads(pickle.dumps(ours))
    assert len(again) == len(docs) and np.array_equal(again[12], docs[12])


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_files_written_here_load_in_megatron_byte_for_byte(tmp_path, code):
    dtype = DTYPES[code]
    docs = _docs(dtype, seed=1)
    with IndexedDatasetWriter(tmp_path / "z", dtype=dtype) as w:
        for d in docs[:10]:
            w.add_item(d)
            w.end_document()
        w.add_document(np.concatenate(docs[10:14]), [len(d) for d in docs[10:14]])
        for d in docs[14:]:
            w.add_item(d)
        w.end_document()
    _write_with_megatron(tmp_path / "m", docs, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"z{ext}").read_bytes() == (tmp_path / f"m{ext}").read_bytes()
    theirs = mc.IndexedDataset(str(tmp_path / "z"))
    assert all(np.array_equal(theirs[i], docs[i]) for i in range(len(docs)))


def test_merge_matches_megatron_add_index(tmp_path):
    parts = [_docs(np.uint16, n=7, seed=s) for s in range(3)]
    for k, docs in enumerate(parts):
        with IndexedDatasetWriter(tmp_path / f"p{k}", dtype=np.uint16) as w:
            w.add_documents(docs)
    with IndexedDatasetWriter(tmp_path / "merged", dtype=np.uint16) as w:
        for k in range(3):
            w.merge(tmp_path / f"p{k}")
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for k in range(3):
        builder.add_index(str(tmp_path / f"p{k}"))
    builder.finalize(str(tmp_path / "m.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"m{ext}").read_bytes()


def test_multimodal_modes_round_trip(tmp_path):
    with IndexedDatasetWriter(tmp_path / "mm", dtype=np.int32, multimodal=True) as w:
        w.add_item([1, 2, 3], mode=0)
        w.add_item([4, 5], mode=1)
        w.end_document()
    theirs = mc.IndexedDataset(str(tmp_path / "mm"), multimodal=True)
    ours = IndexedDataset(tmp_path / "mm", multimodal=True)
    # (megatron-core's own sequence_modes property asserts on an array; read its index directly)
    assert ours.sequence_modes.tolist() == theirs.index.sequence_modes.tolist() == [0, 1]
    with pytest.raises(IndexedDatasetError, match="multimodal=True"):
        IndexedDataset(tmp_path / "mm")


def _good(tmp_path):
    with IndexedDatasetWriter(tmp_path / "g", dtype=np.uint16) as w:
        w.add_documents([[1, 2, 3], [4, 5]])
    return tmp_path / "g"


def test_bad_files_fail_clearly(tmp_path):
    g = _good(tmp_path)
    idx, bin_ = g.with_suffix(".idx"), g.with_suffix(".bin")
    raw_idx, raw_bin = idx.read_bytes(), bin_.read_bytes()
    bin_.write_bytes(raw_bin[:-2])
    with pytest.raises(IndexedDatasetError, match=r"g\.bin: 8 bytes but the index describes 10: truncated"):
        IndexedDataset(g)
    bin_.write_bytes(raw_bin + b"\0\0")
    with pytest.raises(IndexedDatasetError, match="longer than its index"):
        IndexedDataset(g)
    bin_.write_bytes(raw_bin)
    idx.write_bytes(b"NOTMAGIC!" + raw_idx[9:])
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: wrong magic"):
        IndexedDataset(g)
    idx.write_bytes(raw_idx[:9] + (2).to_bytes(8, "little") + raw_idx[17:])
    with pytest.raises(IndexedDatasetError, match="format version 2"):
        IndexedDataset(g)
    idx.write_bytes(raw_idx[:17] + bytes([9]) + raw_idx[18:])
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 9"):
        IndexedDataset(g)
    idx.write_bytes(raw_idx[:-8])
    with pytest.raises(IndexedDatasetError, match="need"):
        IndexedDataset(g)
    idx.write_bytes(raw_idx[:20])
    with pytest.raises(IndexedDatasetError, match="shorter than the 34-byte header"):
        IndexedDataset(g)
    # Tables that disagree with each other: every read would land elsewhere in .bin.
    n_seq = int.from_bytes(raw_idx[18:26], "little")
    lens_at, ptrs_at = 34, 34 + 4 * n_seq
    bad = bytearray(raw_idx)
    bad[lens_at:lens_at + 4] = (-3).to_bytes(4, "little", signed=True)
    idx.write_bytes(bytes(bad))
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: sequence 0 has length -3"):
        IndexedDataset(g)
    if n_seq > 1:
        bad = bytearray(raw_idx)
        bad[ptrs_at + 8:ptrs_at + 16] = (1).to_bytes(8, "little")
        idx.write_bytes(bytes(bad))
        with pytest.raises(IndexedDatasetError, match=r"g\.idx: sequence 1 starts at byte 1, but sequence 0"):
            IndexedDataset(g)
    idx.unlink()
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: file not found"):
        IndexedDataset(g)


def test_data_info_and_lint_read_megatron_datasets(tmp_path, capsys):
    """`zoo data info|lint PREFIX`: the counts megatron-core reads from the same files."""
    from zoo.cli import main

    prefix = tmp_path / "mc"
    _write_with_megatron(prefix, _docs(np.uint16), np.uint16)
    ref = mc.IndexedDataset(str(prefix))
    tokens = int(sum(len(ref[i]) for i in range(len(ref))))
    docs = len(ref.document_indices) - 1
    assert main(["data", "info", f"{prefix}.idx"]) == 0
    out = capsys.readouterr().out
    assert f"{len(ref):,} sequences in {docs:,} documents, {tokens:,} tokens of uint16" in out
    assert main(["data", "lint", str(prefix)]) == 0
    assert f"{len(ref):,} sequences read, {tokens:,} tokens, 0 problems" in capsys.readouterr().out
    prefix.with_suffix(".bin").write_bytes(prefix.with_suffix(".bin").read_bytes()[:-1])
    assert main(["data", "lint", str(prefix)]) == 1
    assert "mc.bin" in capsys.readouterr().err


def test_failed_write_leaves_nothing_that_looks_complete(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "x", dtype=np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("killed")
    assert not (tmp_path / "x.idx").exists() and not (tmp_path / "x.bin").exists()
    assert not list(tmp_path.glob(".x*"))
