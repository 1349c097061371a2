"""`zoo prepare text`: tokenize JSONL / text corpora into Megatron ``.bin/.idx`` files, in parallel.

Work is cut into chunks (byte ranges of uncompressed JSONL files aligned to line starts; whole
files for ``.gz`` and plain text), and each worker tokenizes its chunks and writes its own partial
``.bin/.idx`` pair, streaming, so memory does not grow with the input. The parts are then
concatenated in input order by the kernel (``copy_file_range``), so tokens never travel through one
Python process, and the result is byte-identical for any worker count.

Inputs: ``.jsonl``/``.json`` (one JSON object per line; ``--json-keys`` picks the fields), the same
gzip-compressed (``.gz``), ``.txt`` files (each file one document), or directories of them.
Bad lines (malformed JSON, a missing key, non-UTF-8 bytes) stop the run with the file and line
(``--on-error fail``) or are skipped and counted (``--on-error skip``).
"""

from __future__ import annotations

import functools
import gzip
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zoo.data.indexed import IndexedDatasetWriter, best_dtype
from zoo.errors import UsageError, ZooError, suggest

CHUNK_BYTES = 8 << 20
BATCH_CHARS = 1 << 20  # a worker's peak memory is about one batch's token ids (or one larger document)
SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt", ".txt.gz")


class PrepareError(ZooError):
    """A bad input line under --on-error fail."""


@dataclass(frozen=True)
class Chunk:
    path: str
    start: int  # byte range for uncompressed JSONL; (0, -1) for whole files
    end: int


def find_inputs(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
            if not found:
                raise UsageError(f"{p}: no {', '.join(SUFFIXES)} files in this directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"{p}: no such file or directory")
    return out


def plan_chunks(files: Sequence[Path], chunk_bytes: int | None = None) -> list[Chunk]:
    chunk_bytes = chunk_bytes or CHUNK_BYTES  # read at call time, so it can be tuned (and tested)
    chunks = []
    for f in files:
        size = f.stat().st_size
        if f.name.endswith((".gz", ".txt")) or size <= chunk_bytes:
            chunks.append(Chunk(str(f), 0, -1))
            continue
        with open(f, "rb") as fh:
            start = 0
            while start < size:
                fh.seek(min(start + chunk_bytes, size))
                fh.readline()  # move to the next line start so no line is split
                end = min(fh.tell(), size)
                chunks.append(Chunk(str(f), start, end))
                start = end
    return chunks


def _lines(chunk: Chunk) -> Iterator[tuple[int, bytes]]:
    """(byte offset, raw line) of the chunk."""
    if chunk.path.endswith(".gz"):
        with gzip.open(chunk.path, "rb") as fh:
            offset = 0
            for line in fh:
                yield offset, line
                offset += len(line)
        return
    with open(chunk.path, "rb") as fh:
        fh.seek(chunk.start)
        offset = chunk.start
        while chunk.end < 0 or offset < chunk.end:
            line = fh.readline()
            if not line:
                break
            yield offset, line
            offset += len(line)


def line_number(path: str, offset: int) -> int:
    """1-based line of a byte offset (computed only when reporting an error)."""
    opener = gzip.open if path.endswith(".gz") else open
    n, seen = 1, 0
    with opener(path, "rb") as fh:
        for line in fh:
            if seen + len(line) > offset:
                return n
            seen += len(line)
            n += 1
    return n


def _texts(chunk: Chunk, keys: Sequence[str], on_error: str, stats: dict[str, int]) -> Iterator[list[str]]:
    """One list of texts (one per key) per document of the chunk."""
    if chunk.path.endswith((".txt", ".txt.gz")):
        opener = gzip.open if chunk.path.endswith(".gz") else open
        with opener(chunk.path, "rb") as fh:
            raw = fh.read()
        try:
            yield [raw.decode("utf-8")] * len(keys)
        except UnicodeDecodeError as e:
            _bad(chunk.path, e.start, f"not UTF-8 ({e.reason})", on_error, stats, whole_file=True)
        return
    for offset, raw in _lines(chunk):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            _bad(chunk.path, offset, f"not UTF-8 ({e.reason})", on_error, stats)
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            _bad(chunk.path, offset, f"malformed JSON ({e.msg})", on_error, stats)
            continue
        if not isinstance(obj, dict):
            _bad(chunk.path, offset, "a JSON line must be an object", on_error, stats)
            continue
        missing = [k for k in keys if not isinstance(obj.get(k), str)]
        if missing:
            _bad(chunk.path, offset, f"no string field {missing[0]!r}", on_error, stats)
            continue
        yield [obj[k] for k in keys]


def _bad(path: str, offset: int, what: str, on_error: str, stats: dict[str, int], whole_file: bool = False) -> None:
    if on_error == "fail":
        where = path if whole_file else f"{path}:{line_number(path, offset)}"
        raise PrepareError(f"{where}: {what} (use --on-error skip to skip such lines)")
    stats["skipped"] += 1


@functools.lru_cache(maxsize=1)
def _tokenizer(spec: str) -> Any:
    """One tokenizer per worker process, so its piece cache lives across chunks."""
    from zoo.data.tokenizer import load_tokenizer

    return load_tokenizer(spec)


def _worker(args: tuple[int, Chunk, str, list[str], bool, str, str, int]) -> dict[str, int]:
    i, chunk, tok_spec, keys, append_eod, on_error, out_dir, batch_docs = args
    tok = _tokenizer(tok_spec)
    dtype = best_dtype(tok.vocab_size)
    stats = {"docs": 0, "tokens": 0, "skipped": 0}
    writers = {k: IndexedDatasetWriter(Path(out_dir) / f"part{i:06d}_{k}", dtype=dtype) for k in keys}
    try:
        batch: list[list[str]] = []
        held = 0  # characters in the batch: a batch is bounded in size, not only in documents

        def flush() -> None:
            nonlocal held
            held = 0
            for col, key in enumerate(keys):
                for ids in tok.encode_batch([doc[col] for doc in batch]):
                    if append_eod:
                        ids.append(tok.eod_id)
                    writers[key].add_document(np.array(ids, dtype=dtype))
                    if col == 0:
                        stats["tokens"] += len(ids)
            stats["docs"] += len(batch)
            batch.clear()

        for doc in _texts(chunk, keys, on_error, stats):
            batch.append(doc)
            held += sum(map(len, doc))
            if len(batch) >= batch_docs or held >= BATCH_CHARS:
                flush()
        flush()
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return stats


def _concat(parts: Sequence[Path], prefix: Path, dtype: Any) -> None:
    """Concatenate finalized parts: kernel-side byte copies for the .bin, index arrays for the .idx."""
    with IndexedDatasetWriter(prefix, dtype=dtype) as w:
        for part in parts:
            w.merge(part)


# Megatron-LM's tools/preprocess_data.py names its tokenizer by --tokenizer-type; zoo reads the kind
# from the files themselves. The types with a reading here, and what each needs:
MEGATRON_TOKENIZERS = {
    "HuggingFaceTokenizer": "--tokenizer-model DIR (a local tokenizer directory or tokenizer.json)",
    "GPT2BPETokenizer": "--vocab-file vocab.json --merge-file merges.txt",
    "TikTokenizer": "--tokenizer-model FILE.tiktoken",
}
# The others Megatron knows: zoo takes their tokenizer once saved as a tokenizer.json
_SAVE_AS_JSON = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "BertWordPieceLowerCase",
                 "BertWordPieceCase", "MultimodalTokenizer", "NullTokenizer")


def check_megatron_tokenizer(kind: str | None, tokenizer: str | None, vocab_file: str | None,
                             merge_file: str | None) -> None:
    """Check Megatron's tokenizer arguments against each other (one clear line where they disagree):
    ``kind`` its --tokenizer-type, ``tokenizer`` --tokenizer / --tokenizer-model, and GPT-2's two
    files. zoo needs no type (the files say it); a type given must be the files' kind."""
    if kind is not None and kind not in MEGATRON_TOKENIZERS:
        if kind in _SAVE_AS_JSON:
            raise UsageError(f"--tokenizer-type {kind}: zoo reads Hugging Face tokenizers (tokenizer.json, or vocab.json "
                             "and merges.txt), .tiktoken ranks files and 'bytes'; save this one as tokenizer.json (with "
                             "transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) and give --tokenizer DIR")
        raise UsageError(f"--tokenizer-type {kind}: unknown{suggest(kind, [*MEGATRON_TOKENIZERS, *_SAVE_AS_JSON])}; "
                         f"zoo reads {', '.join(MEGATRON_TOKENIZERS)}")
    files = vocab_file is not None or merge_file is not None
    if files and (vocab_file is None or merge_file is None):
        raise UsageError("GPT-2 BPE: give both --vocab-file and --merge-file")
    if files and tokenizer:
        raise UsageError("give either --tokenizer (--tokenizer-model) or --vocab-file and --merge-file, not both")
    if kind == "GPT2BPETokenizer" and not files and not (tokenizer and Path(tokenizer, "merges.txt").is_file()):
        raise UsageError(f"--tokenizer-type GPT2BPETokenizer needs {MEGATRON_TOKENIZERS[kind]}")
    if kind in ("HuggingFaceTokenizer", "TikTokenizer"):
        if files or not tokenizer:
            raise UsageError(f"--tokenizer-type {kind} needs {MEGATRON_TOKENIZERS[kind]}")
        if (kind == "TikTokenizer") != tokenizer.endswith(".tiktoken"):
            raise UsageError(f"--tokenizer-type {kind}, but {tokenizer} is "
                             f"{'a .tiktoken ranks file' if kind != 'TikTokenizer' else 'not a .tiktoken ranks file'}")


def prepare_text(*, inputs: Sequence[str], output_prefix: str, tokenizer: str | None, json_keys: Sequence[str],
                 append_eod: bool, workers: int, on_error: str, train_bpe_vocab: int | None = None,
                 progress: bool = True, vocab_file: str | None = None, merge_file: str | None = None,
                 batch_docs: int = 256) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``<output_prefix>_<key>_document.{bin,idx}`` for each of ``json_keys``.
    The tokenizer: ``tokenizer`` (see `zoo.data.tokenizer.load_tokenizer`), GPT-2's ``vocab_file`` and
    ``merge_file``, or a BPE of ``train_bpe_vocab`` tokens trained on the input first. ``batch_docs``:
    documents a worker hands its tokenizer at once (speed only: the output never depends on it)."""
    from zoo.data.tokenizer import load_gpt2_bpe, load_tokenizer, train_bpe

    files = find_inputs(inputs)
    out_prefix = Path(output_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_prefix.parent, prefix=f".{out_prefix.name}.prepare-"))
    try:
        if train_bpe_vocab:
            stats0 = {"docs": 0, "tokens": 0, "skipped": 0}
            texts = (doc[0] for c in plan_chunks(files) for doc in _texts(c, json_keys[:1], on_error, stats0))
            train_bpe(texts, train_bpe_vocab).save(tmp)
            tokenizer = str(tmp / "tokenizer.json")
        elif vocab_file is not None and merge_file is not None:  # one file for the workers to read
            load_gpt2_bpe(vocab_file, merge_file).save(tmp)
            tokenizer = str(tmp / "tokenizer.json")
        if not tokenizer:
            raise UsageError("zoo prepare text: give --tokenizer (HF dir, tokenizer.json, .tiktoken, bytes), --vocab-file and "
                             "--merge-file (GPT-2's), or --train-bpe N")
        tok = load_tokenizer(tokenizer)
        tok.encode_batch(["warm-up"])  # reads the regex classes once (and caches them on disk) before the workers
        chunks = plan_chunks(files)
        ctx = mp.get_context("spawn")
        jobs = [(i, c, tokenizer, list(json_keys), append_eod, on_error, str(tmp), batch_docs) for i, c in enumerate(chunks)]
        t0 = time.perf_counter()
        totals = {"docs": 0, "tokens": 0, "skipped": 0}
        env_before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # processes give the parallelism
        try:
            if workers <= 1:
                results = iter(map(_worker, jobs))
                pool = None
            else:
                pool = ctx.Pool(workers)
                results = pool.imap(_worker, jobs)  # in order: the output order is the input order
            for n, stats in enumerate(results, start=1):
                for k in totals:
                    totals[k] += stats[k]
                if progress:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    print(f"\rprepare: {n}/{len(chunks)} chunks, {totals['docs']:,} docs ({totals['docs'] / dt:,.0f}/s), "
                          f"{totals['tokens']:,} tokens ({totals['tokens'] / dt:,.0f}/s)", end="", file=sys.stderr, flush=True)
            if pool is not None:
                pool.close()
                pool.join()
        finally:
            if env_before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = env_before
        if progress:
            print(file=sys.stderr)
        if totals["docs"] == 0:
            raise UsageError(f"no documents found in {', '.join(map(str, files))} (empty corpus)")
        outputs = []
        for key in json_keys:
            prefix = Path(f"{output_prefix}_{key}_document")
            _concat([tmp / f"part{i:06d}_{key}" for i in range(len(chunks))], prefix, best_dtype(tok.vocab_size))
            outputs.append(str(prefix))
        if train_bpe_vocab:
            shutil.copyfile(tmp / "tokenizer.json", Path(f"{output_prefix}_tokenizer.json"))
        totals["seconds"] = time.perf_counter() - t0
        totals["outputs"] = outputs
        return totals
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

