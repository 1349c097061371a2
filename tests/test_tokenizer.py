"""Tokenizers: tiktoken ranks files against hand-derived merges, a locally trained BPE against
transformers' fast tokenizer reading the same file, bytes."""

from __future__ import annotations

import base64

import pytest

from zoo.data.tokenizer import load_tokenizer, train_bpe
from zoo.errors import UsageError


def _ranks_file(path, extra: dict[bytes, int]) -> None:
    ranks = {bytes([b]): b for b in range(256)} | extra
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))


def test_tiktoken_file_merges_by_rank(tmp_path):
    f = tmp_path / "tiny.tiktoken"
    _ranks_file(f, {b"ab": 256, b"cd": 257, b"abcd": 258, b"abc": 259})
    tok = load_tokenizer(f)
    # By hand: "abcd" merges ab (256) and cd (257), then abcd (258); "abab" stops at ab, ab.
    assert tok.encode("abcd") == [258]
    assert tok.encode("abab") == [256, 256]
    assert tok.encode("abc") == [259]
    assert tok.encode(" ab") == [32, 256]  # the space joins the word, as in cl100k's pattern
    assert tok.encode("x1") == [ord("x"), ord("1")]
    for text in ["abcd abab", "héllo wörld\n\n", "tabs\tand  spaces"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eod_id == 260 and tok.vocab_size == 261


def test_tiktoken_file_errors_name_the_line(tmp_path):
    f = tmp_path / "bad.tiktoken"
    f.write_text("YQ== 0\nnot-a-line\n")
    with pytest.raises(UsageError, match=r"bad.tiktoken:2: not a tiktoken ranks line"):
        load_tokenizer(f)


def test_trained_bpe_matches_transformers_reading_the_same_file(tmp_path):
    from transformers import PreTrainedTokenizerFast

    texts = ["def add(a, b):\n    return a + b\n", "The with statement is used to wrap a block."] * 20
    tok = train_bpe(texts, 300)
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    sample = "def with(a):\n    return the block"
    assert again.encode(sample) == tok.encode(sample) == ref.encode(sample)
    assert again.decode(again.encode(sample)) == sample
    assert train_bpe(texts, 300).encode(sample) == tok.encode(sample)  # deterministic


def test_bytes_and_missing():
    tok = load_tokenizer("bytes")
    assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    with pytest.raises(UsageError, match="not found; give 'bytes'"):
        load_tokenizer("/nonexistent/tok")
