"""GPT sample construction: the same samples in the same order as megatron-core's GPTDataset
(built through its BlendedMegatronDatasetBuilder) for the same data, seed, length, count and split."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

from zoo.data.gpt import build_indices, masks_and_positions, sample_tokens, split_ranges
from zoo.data.indexed import IndexedDataset, IndexedDatasetWriter

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

EOD = 0


def _corpus(path, n_docs=1000, seed=0):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, dtype=np.uint16) as w:
        for _ in range(n_docs):
            doc = rng.integers(1, 500, size=int(rng.integers(1, 12)))
            w.add_document(np.append(doc, EOD))
    return IndexedDataset(path)


def _megatron(prefix, cache, *, seq, sizes, split, seed, reset=False, eod_mask=False):
    tok = types.SimpleNamespace(eod=EOD, vocab_size=1000, pad=-1, special_tokens_dict={},
                                unique_identifiers={"class": "Stub"})
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=([str(prefix)], None), split=split,
                           path_to_cache=str(cache), tokenizer=tok, reset_position_ids=reset,
                           reset_attention_mask=False, eod_mask_loss=eod_mask, create_attention_mask=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()


@pytest.mark.parametrize(
    ("seq", "sizes", "split", "seed"),
    [
        # (megatron-core loops forever when a split is empty but samples are requested from it,
        # so every requested split here holds documents; zoo raises a ConfigError instead)
        (16, [900, 20, 2], "949,50,1", 1234),  # several epochs: a separate final epoch in train
        (32, [50, 10, 2], "80,15,5", 7),  # less than one epoch
        (8, [1500, 140, None], "90,10,0", 3),  # an empty test split
        (16, [None, None, None], "949,50,1", 5),  # one epoch, as many samples as it holds
    ],
)
def test_same_samples_in_the_same_order_as_megatron(tmp_path, seq, sizes, split, seed):
    ds = _corpus(tmp_path / "c")
    theirs = _megatron(tmp_path / "c", tmp_path / "cache", seq=seq, sizes=sizes, split=split, seed=seed)
    ranges = split_ranges(split, len(ds))
    for k, name in enumerate(("train", "valid", "test")):
        if theirs[k] is None:
            assert ranges[name] is None or sizes[k] == 0
            continue
        lo, hi = ranges[name]
        ours = build_indices(ds.sequence_lengths, np.arange(lo, hi, dtype=np.int32), seq_length=seq,
                             num_samples=sizes[k], seed=seed)
        assert np.array_equal(ours.document_index, theirs[k].document_index)
        assert np.array_equal(ours.sample_index, theirs[k].sample_index)
        assert np.array_equal(ours.shuffle_index, theirs[k].shuffle_index)
        assert len(ours) == len(theirs[k])
        for i in range(len(ours)):
            tokens, _ = sample_tokens(ds, ours, i, seq_length=seq)
            ref = theirs[k][i]
            assert np.array_equal(tokens[:-1], ref["tokens"].numpy())
            assert np.array_equal(tokens[1:], ref["labels"].numpy())


def test_masks_and_positions_match_megatron(tmp_path):
    ds = _corpus(tmp_path / "c", seed=4)
    seq = 24
    theirs = _megatron(tmp_path / "c", tmp_path / "cache", seq=seq, sizes=[60, 5, 1], split="98,1,1", seed=9,
                       reset=True, eod_mask=True)[0]
    lo, hi = split_ranges("98,1,1", len(ds))["train"]
    ours = build_indices(ds.sequence_lengths, np.arange(lo, hi, dtype=np.int32), seq_length=seq, num_samples=60, seed=9)
    for i in range(len(ours)):
        tokens, _ = sample_tokens(ds, ours, i, seq_length=seq)
        loss_mask, positions, _ = masks_and_positions(tokens[:-1], EOD, reset_position_ids=True, eod_mask_loss=True)
        ref = theirs[i]
        assert np.array_equal(loss_mask, ref["loss_mask"].numpy())
        assert np.array_equal(positions, ref["position_ids"].numpy())


def test_empty_split_is_an_error_not_a_hang():
    from zoo.errors import ConfigError

    with pytest.raises(ConfigError, match="holds 0 tokens"):
        build_indices(np.array([3, 4], np.int32), np.arange(0, 0, dtype=np.int32), seq_length=4, num_samples=5, seed=1)


@pytest.mark.parametrize(
    ("blend", "sizes"),
    [
        ("0.5 {a} 0.3 {b} 0.2 {c}", [300, 30, 10]),
        ("3 {a} 1 {b}", [200, 10, 5]),  # weights need not sum to one
        ("{a} {b} {c}", [250, 20, 10]),  # no weights: each weighs its own sample count
    ],
)
def test_blends_match_megatron(tmp_path, blend, sizes):
    from zoo.data.megatron import Source, parse_blend

    prefixes = {k: tmp_path / k for k in "abc"}
    for seed, p in enumerate(prefixes.values()):
        _corpus(p, n_docs=400 + 100 * seed, seed=seed)
    text = blend.format(**{k: str(v) for k, v in prefixes.items()})
    pairs = parse_blend(text)
    weights = [w for w, _ in pairs]
    mc_blend = ([p for _, p in pairs], None if weights[0] is None else weights)
    tok = types.SimpleNamespace(eod=EOD, vocab_size=1000, pad=-1, special_tokens_dict={}, unique_identifiers={"c": "S"})
    # (no path_to_cache: megatron-core's blended cache requires an initialised process group)
    cfg = GPTDatasetConfig(random_seed=11, sequence_length=16, blend=mc_blend, split="90,8,2", path_to_cache=None,
                           tokenizer=tok, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    run = types.SimpleNamespace(train=types.SimpleNamespace(seq_length=16, seed=11), data=types.SimpleNamespace(split="90,8,2"))
    for k, split in enumerate(("train", "valid", "test")):
        ours = Source(run, pairs, split=split, target=sizes[k], cache_dir=tmp_path / "zoo")
        assert len(ours) == len(theirs[k])
        for i in range(len(ours)):
            d, tokens = ours.sample(i)
            ref = theirs[k][i]
            assert d == int(ref["dataset_id"])
            assert np.array_equal(tokens[:-1], ref["tokens"].numpy())


def test_per_split_blends_match_megatron(tmp_path):
    from zoo.data.megatron import Source, parse_blend

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for seed, p in enumerate((a, b, c)):
        _corpus(p, n_docs=300, seed=seed)
    tok = types.SimpleNamespace(eod=EOD, vocab_size=1000, pad=-1, special_tokens_dict={}, unique_identifiers={"c": "S"})
    cfg = GPTDatasetConfig(random_seed=5, sequence_length=16, blend_per_split=[([str(a), str(b)], [0.7, 0.3]), ([str(c)], None), None],
                           path_to_cache=None, tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, create_attention_mask=False)
    sizes = [150, 20, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    run = types.SimpleNamespace(train=types.SimpleNamespace(seq_length=16, seed=5), data=types.SimpleNamespace(split="969,30,1"))
    for k, blend in enumerate((f"0.7 {a} 0.3 {b}", str(c))):
        ours = Source(run, parse_blend(blend), split=("train", "valid")[k], target=sizes[k], cache_dir=tmp_path / "z", whole=True)
        assert len(ours) == len(theirs[k])
        for i in range(len(ours)):
            assert np.array_equal(ours.sample(i)[1][:-1], theirs[k][i]["tokens"].numpy())


def test_blend_forms():
    from zoo.data.megatron import parse_blend
    from zoo.errors import ConfigError

    assert parse_blend("0.5 a 0.5 b") == [(0.5, "a"), (0.5, "b")]
    assert parse_blend("a b c") == [(None, "a"), (None, "b"), (None, "c")]
    assert parse_blend("a") == [(None, "a")]
    assert parse_blend([0.3, "x", 0.7, "y"]) == [(0.3, "x"), (0.7, "y")]
    assert parse_blend([{"path": "x", "weight": 2}, {"path": "y", "weight": 1}]) == [(2.0, "x"), (1.0, "y")]
    with pytest.raises(ConfigError, match="'a' is not a weight"):
        parse_blend("a b c d")


def test_document_fields():
    from zoo.data.megatron import document_fields

    tokens = np.array([[5, 6, EOD, 7, 8, EOD, 9]])
    f = document_fields(tokens, EOD, reset_position_ids=True, eod_mask_loss=True, segments=True)
    assert f["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert f["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 1]]
    assert f["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2]]


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 16])
@pytest.mark.parametrize(("drop_last", "extra"), [(True, 1), (False, 1), (True, 0), (False, 0)])
def test_sample_index_matches_megatron_helper(chunk, drop_last, extra):
    """The chunked NumPy build against megatron-core's C++ helper on short, empty and long
    documents (a document holding many sample starts), across chunk boundaries."""
    from megatron.core.datasets import helpers

    from zoo.data.gpt import build_document_index, build_sample_index

    rng = np.random.default_rng(chunk + 10 * extra + drop_last)
    seq = 16
    sizes = rng.choice([0, 1, 5, 15, 16, 17, 40, 200], size=300).astype(np.int32)
    tokens_per_epoch = int(sizes.sum())
    doc_index = build_document_index(np.arange(len(sizes), dtype=np.int32), 3, np.random.RandomState(1), False)
    ref = helpers.build_sample_idx(sizes, doc_index, seq, 3, tokens_per_epoch, drop_last, bool(extra))
    ours = build_sample_index(sizes, doc_index, seq, 3, tokens_per_epoch, drop_last_partial=drop_last, extra=extra,
                              chunk=chunk)
    assert ours.dtype == ref.dtype and np.array_equal(ours, ref)


def test_sample_index_wide_positions_take_the_int64_path():
    """Documents so long that a chunk's token positions overflow int32 use int64 arithmetic."""
    from megatron.core.datasets import helpers

    from zoo.data.gpt import build_sample_index

    sizes = np.array([2**30, 3, 2**30 + 7, 2**29], dtype=np.int32)
    doc_index = np.array([2, 0, 1, 3, 1, 0], dtype=np.int32)
    tokens = int(sizes[doc_index].sum())
    seq = 2**27 + 5
    ref = helpers.build_sample_idx(sizes, doc_index, seq, 1, tokens, True, True)
    assert np.array_equal(build_sample_index(sizes, doc_index, seq, 1, tokens, chunk=4), ref)
