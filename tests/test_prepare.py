"""`zoo prepare text`: the result equals a sequential reference written by megatron-core's own
builder (the design of Megatron-LM's preprocess_data.py), for any worker count; inputs of every
kind; bad lines reported with file and line, or skipped and counted."""

from __future__ import annotations

import gzip
import json
import warnings

import numpy as np
import pytest
import torch
from _core_helpers import run_zoo

from zoo.data.indexed import IndexedDataset
from zoo.data.prepare import prepare_text
from zoo.data.tokenizer import load_tokenizer, train_bpe
from zoo.errors import UsageError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def _docs(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "über", "naïve"]
    return [{"text": " ".join(rng.choice(words, size=int(rng.integers(1, 40)))), "title": f"doc {i}"} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_bpe([x["text"] for x in _docs(200)], 300).save(d)
    return d


def _reference(docs, tok_dir, prefix, key="text"):
    """Megatron's design: tokenize sequentially, one process writing through IndexedDatasetBuilder."""
    tok = load_tokenizer(tok_dir)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.tensor([*tok.encode(d[key]), tok.eod_id]), [len(tok.encode(d[key])) + 1])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("workers", [1, 3])
def test_output_equals_megatron_reference_for_any_worker_count(tmp_path, tokenizer_dir, workers, monkeypatch):
    import zoo.data.prepare as prep

    monkeypatch.setattr(prep, "CHUNK_BYTES", 4096)  # many chunks even for a small file
    docs = _docs(600)
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    chunks = prep.plan_chunks([src])
    assert len(chunks) > 5 and all(c.end - c.start <= 4096 + 1000 for c in chunks)
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]]  # contiguous, no line split twice
    totals = prepare_text(inputs=[str(src)], output_prefix=str(tmp_path / "out"), tokenizer=str(tokenizer_dir),
                          json_keys=["text", "title"], append_eod=True, workers=workers, on_error="fail", progress=False)
    assert totals["docs"] == 600
    _reference(docs, tokenizer_dir, tmp_path / "ref")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out_text_document{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    _reference(docs, tokenizer_dir, tmp_path / "ref_title", key="title")
    assert (tmp_path / "out_title_document.bin").read_bytes() == (tmp_path / "ref_title.bin").read_bytes()


def test_gzip_text_and_directories(tmp_path, tokenizer_dir):
    docs = _docs(30)
    d = tmp_path / "in"
    d.mkdir()
    with gzip.open(d / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(x) + "\n" for x in docs[:20])
    (d / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs[20:]))
    (d / "c.txt").write_text("a whole file is one document")
    (d / "ignored.csv").write_text("x,y")
    prepare_text(inputs=[str(d)], output_prefix=str(tmp_path / "o"), tokenizer=str(tokenizer_dir), json_keys=["text"],
                 append_eod=False, workers=2, on_error="fail", progress=False)
    ds = IndexedDataset(tmp_path / "o_text_document")
    tok = load_tokenizer(tokenizer_dir)
    expected = [x["text"] for x in docs] + ["a whole file is one document"]
    assert len(ds) == len(expected)
    assert all(tok.decode(ds[i]) == t for i, t in enumerate(expected))


def test_bad_lines_fail_with_file_and_line_or_are_skipped(tmp_path, tokenizer_dir):
    good = json.dumps({"text": "alpha beta"})
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join([good.encode(), b"{not json", good.encode(), json.dumps({"body": "x"}).encode(),
                                b'{"text": "\xff\xfe"}', good.encode()]) + b"\n")
    with pytest.raises(Exception, match=r"bad.jsonl:2: malformed JSON"):
        prepare_text(inputs=[str(src)], output_prefix=str(tmp_path / "f"), tokenizer=str(tokenizer_dir),
                     json_keys=["text"], append_eod=True, workers=1, on_error="fail", progress=False)
    assert not (tmp_path / "f_text_document.idx").exists()
    totals = prepare_text(inputs=[str(src)], output_prefix=str(tmp_path / "s"), tokenizer=str(tokenizer_dir),
                          json_keys=["text"], append_eod=True, workers=1, on_error="skip", progress=False)
    assert totals["docs"] == 3 and totals["skipped"] == 3
    out = run_zoo("prepare", "text", "--input", str(src), "--output-prefix", str(tmp_path / "c"), "--tokenizer",
                  str(tokenizer_dir), "--quiet")
    assert out.returncode == 1 and "bad.jsonl:2: malformed JSON" in out.stderr
    fixed = tmp_path / "missing.jsonl"
    fixed.write_text(good + "\n" + json.dumps({"body": "x"}) + "\n")
    out = run_zoo("prepare", "text", "--input", str(fixed), "--output-prefix", str(tmp_path / "m"), "--tokenizer",
                  str(tokenizer_dir), "--quiet")
    assert out.returncode == 1 and "missing.jsonl:2: no string field 'text'" in out.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UsageError, match="no documents found"):
        prepare_text(inputs=[str(empty)], output_prefix=str(tmp_path / "e"), tokenizer="bytes", json_keys=["text"],
                     append_eod=True, workers=1, on_error="fail", progress=False)


def test_cli_trains_bpe_and_the_result_trains(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in _docs(300)))
    out = run_zoo("prepare", "text", "--input", str(src), "--output-prefix", str(tmp_path / "p"), "--train-bpe", "400",
                  "--append-eod", "--workers", "2", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "300 documents" in out.stdout
    assert (tmp_path / "p_tokenizer.json").is_file()
    run = run_zoo("train", "--model", "llama", "--run-dir", str(tmp_path / "run"), f"data.path={tmp_path / 'p_text_document'}",
                  "train.steps=3", "train.seq_length=32", "train.micro_batch_size=4", "train.eval_interval=0",
                  "model.vocab_size=512", "logging.progress=false")
    assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """GPT-2's two tokenizer files (vocab.json, merges.txt), of a byte-level BPE trained here."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2-files")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([x["text"] for x in _docs(200)] + ["It's the naïve café's 3 über-tests!"], vocab_size=400,
                            special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    return d


def test_megatrons_preprocess_command_runs_as_written(tmp_path, gpt2_files):
    """Megatron-LM's tools/preprocess_data.py flags (the seeds' command): GPT2BPETokenizer from
    vocab.json + merges.txt gives the ids of transformers' own GPT-2 tokenizer reading the same
    files, written as megatron-core's builder writes them; the tokenizer type is checked against
    the files, in one line."""
    from transformers import GPT2Tokenizer

    docs = _docs(120) + [{"text": "It's  the naïve café's <|endoftext|> 3 über-tests!\n\n\tdone", "title": "x"}]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    vocab, merges = str(gpt2_files / "vocab.json"), str(gpt2_files / "merges.txt")
    out = run_zoo("prepare", "text", "--input", str(src), "--output-prefix", str(tmp_path / "meg"), "--tokenizer-type",
                  "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--json-keys", "text",
                  "--workers", "2", "--chunk-size", "7", "--append-eod", "--quiet")
    assert out.returncode == 0, out.stderr
    ref = GPT2Tokenizer(vocab, merges)  # transformers' Python implementation of GPT-2's BPE
    eod = ref.convert_tokens_to_ids("<|endoftext|>")
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for d in docs:
        ids = ref.encode(d["text"]) + [eod]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(str(tmp_path / "ref.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"meg_text_document{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    # a directory holding the two files (a Hugging Face GPT-2 directory without tokenizer.json)
    out = run_zoo("prepare", "text", "--input", str(src), "--output-prefix", str(tmp_path / "dir"), "--tokenizer-type",
                  "HuggingFaceTokenizer", "--tokenizer-model", str(gpt2_files), "--append-eod", "--quiet")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "dir_text_document.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    for args, message in [
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"], "save this one as tokenizer.json"),
        (["--tokenizer-type", "GPT2BPETokenizr", "--vocab-file", vocab, "--merge-file", merges],
         "did you mean GPT2BPETokenizer"),
        (["--tokenizer-type", "GPT2BPETokenizer"], "needs --vocab-file vocab.json --merge-file merges.txt"),
        (["--vocab-file", vocab], "give both --vocab-file and --merge-file"),
        (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(gpt2_files)], "is not a .tiktoken ranks file"),
        (["--tokenizer-model", "gpt2"], "'gpt2': not found"),
        (["--train-bpe", "300", "--vocab-file", vocab, "--merge-file", merges], "--train-bpe trains the tokenizer"),
        (["--vocab-file", str(tmp_path / "c.jsonl"), "--merge-file", merges], "not a readable GPT-2 vocab.json"),
    ]:
        out = run_zoo("prepare", "text", "--input", str(src), "--output-prefix", str(tmp_path / "bad"), *args, "--quiet")
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, \
            (args, out.stderr)
    assert not list(tmp_path.glob("bad*"))
