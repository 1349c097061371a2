"""The embedded default corpus: documentation text that ships with Python itself.

Documents are the pydoc topics (`pydoc_data.topics`) and the docstrings of a fixed list of
standard-library modules, in a fixed order, so the corpus is the same on every machine with the same
Python. It is tokenized once (with a byte-level BPE trained on the training split, or a tokenizer the
user names) into a cache directory under a name hashed from everything that determines it, built
under a file lock so concurrent ranks build it once, and read memory-mapped.

The tokenized corpus is a Megatron ``.bin/.idx`` pair (an end-of-document token after each
document), read through the same pipeline as ``data.path`` (`zoo.data.megatron`): Megatron's split
rule, sample construction and shuffling, indices cached beside it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zoo.data.gpt import split_ranges
from zoo.data.indexed import IndexedDatasetWriter, best_dtype
from zoo.data.megatron import batches, file_lock
from zoo.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from zoo.errors import ConfigError

CORPUS_VERSION = 3
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "collections",
    "colorsys", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email", "enum", "fileinput", "fnmatch", "fractions", "functools", "getopt", "gettext",
    "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "imaplib", "inspect", "io",
    "ipaddress", "itertools", "json", "keyword", "locale", "logging", "lzma", "mailbox", "math", "mimetypes",
    "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "pprint", "queue",
    "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "signal",
    "smtplib", "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile", "zoneinfo",
)


def documents() -> list[str]:
    """The corpus documents, in a fixed pseudo-random order (so every split is drawn from the
    same mix of pydoc topics and docstrings: a validation split of only the last modules'
    docstrings would measure a distribution shift, not learning)."""
    from pydoc_data.topics import topics

    docs = [topics[k].strip() for k in sorted(topics)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # a trimmed Python may lack a module; the hash records the version
                continue
            parts = [inspect.getdoc(mod) or ""]
            for attr in sorted(vars(mod)):
                obj = getattr(mod, attr, None)
                if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                    continue
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(f"{name}.{attr}\n{doc}")
            text = "\n\n".join(p for p in parts if p).strip()
            if text:
                docs.append(text)
    docs = [d for d in docs if d]
    order = np.random.RandomState(0).permutation(len(docs))
    return [docs[i] for i in order]


def cache_root(run: Any) -> Path:
    if run.data.cache_dir:
        return Path(run.data.cache_dir)
    return Path(os.environ.get("ZOO_CACHE", Path.home() / ".cache" / "zoo"))


def prepare(run: Any) -> tuple[Path, Tokenizer]:
    """Tokenize the corpus into the cache (once) and return its directory and tokenizer."""
    vocab = getattr(run.model, "vocab_size", None)
    tok_spec = run.data.tokenizer
    identity: dict[str, Any] = {"v": CORPUS_VERSION, "python": list(sys.version_info[:3]), "split": run.data.split,
                                "tokenizer": tok_spec or f"bpe-{vocab}"}
    if tok_spec and tok_spec != "bytes":  # a named tokenizer is identified by its content
        file = Path(tok_spec) / "tokenizer.json" if Path(tok_spec).is_dir() else Path(tok_spec)
        identity["tokenizer_sha"] = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None
    key = json.dumps(identity, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = cache_root(run) / f"python-docs-{digest}"
    done = root / "DONE"
    if not done.exists():
        with file_lock(cache_root(run) / f".python-docs-{digest}.lock"):
            if not done.exists():  # another process may have built it while we waited
                _build(run, root, tok_spec, vocab)
    tok = load_tokenizer(tok_spec) if tok_spec else load_tokenizer(root)
    if vocab is not None and tok.vocab_size > vocab:
        raise ConfigError(f"data.tokenizer has {tok.vocab_size} tokens but model.vocab_size is {vocab}")
    return root, tok


PREFIX = "python-docs_text_document"


def _build(run: Any, root: Path, tok_spec: str | None, vocab: int | None) -> None:
    """Tokenize the documents into a Megatron .bin/.idx pair (EOD after each) in ``root``."""
    docs = documents()
    ranges = split_ranges(run.data.split, len(docs))
    if tok_spec:
        tok = load_tokenizer(tok_spec)
    else:
        if vocab is None:
            raise ConfigError("the python-docs corpus trains its tokenizer to model.vocab_size; this model has none")
        if ranges["train"] is None:
            raise ConfigError(f"data.split={run.data.split!r} leaves no training documents to train the tokenizer on")
        lo, hi = ranges["train"]
        tok = train_bpe(docs[lo:hi], vocab)  # validation text stays unseen by the tokenizer too
    root.mkdir(parents=True, exist_ok=True)
    tok.save(root)
    with IndexedDatasetWriter(root / PREFIX, dtype=best_dtype(tok.vocab_size)) as w:
        for ids in tok.encode_batch(docs):
            w.add_document(np.append(np.asarray(ids, dtype=np.int64), tok.eod_id))
    (root / "DONE").write_text(json.dumps({"documents": len(docs)}))


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> Iterator[dict[str, Any]]:
    """Micro-batches of the corpus through the Megatron pipeline (`zoo.data.megatron`)."""
    root, tok = prepare(run)
    return batches(run, [(None, str(root / PREFIX))], split=split, dp_rank=dp_rank, dp_size=dp_size,
                   consumed_samples=consumed_samples, cache_dir=root / "index-cache", eod=tok.eod_id)


def tokenizer_dir(run: Any) -> Path | None:
    """Where the corpus's tokenizer.json lives: the cache keeps a copy of whichever tokenizer built it
    (None for the bytes tokenizer, which needs no file)."""
    if run.data.tokenizer == "bytes":
        return None
    root, _ = prepare(run)
    return root
