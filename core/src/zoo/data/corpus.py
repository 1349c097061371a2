"""The embedded default corpus: documentation text that ships with Python itself.

Documents are the pydoc topics (`pydoc_data.topics`) and the docstrings of a fixed list of
standard-library modules, in a fixed order, so the corpus is the same on every machine with the same
Python. It is tokenized once (with a byte-level BPE trained on the training split, or a tokenizer the
user names) into a cache directory under a name hashed from everything that determines it, built
under a file lock so concurrent ranks build it once, and read memory-mapped.

Samples follow Megatron's GPT construction in simplified form: the split's documents are
concatenated with an end-of-document token after each, cut into samples of ``seq_length + 1``
tokens (consecutive samples share one token), and each epoch visits them in a fresh permutation
drawn from the seed. Sample ``g`` of the stream is a pure function of ``g``, so a run resumes at
any consumed-sample count exactly, and data-parallel ranks read disjoint slices of each global batch.
"""

from __future__ import annotations

import contextlib
import fcntl
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

from zoo.errors import ConfigError, UsageError
from zoo.tokenizer import Tokenizer, load_tokenizer, train_bpe

CORPUS_VERSION = 2
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


def _split_bounds(n_docs: int, split: str) -> dict[str, tuple[int, int]]:
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data.split={split!r}: expected proportions like 949,50,1") from None
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.split={split!r}: expected three non-negative proportions like 949,50,1")
    total = sum(weights)
    cuts = [0]
    for w in weights:
        cuts.append(cuts[-1] + int(round(w / total * n_docs)))
    cuts[-1] = n_docs
    return {"train": (cuts[0], cuts[1]), "valid": (cuts[1], cuts[2]), "test": (cuts[2], cuts[3])}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
        with _locked(cache_root(run) / f".python-docs-{digest}.lock"):
            if not done.exists():  # another process may have built it while we waited
                _build(run, root, tok_spec, vocab)
    tok = load_tokenizer(tok_spec) if tok_spec else load_tokenizer(root)
    if vocab is not None and tok.vocab_size > vocab:
        raise ConfigError(f"data.tokenizer has {tok.vocab_size} tokens but model.vocab_size is {vocab}")
    return root, tok


def _build(run: Any, root: Path, tok_spec: str | None, vocab: int | None) -> None:
    docs = documents()
    bounds = _split_bounds(len(docs), run.data.split)
    if tok_spec:
        tok = load_tokenizer(tok_spec)
    else:
        if vocab is None:
            raise ConfigError("the python-docs corpus trains its tokenizer to model.vocab_size; this model has none")
        lo, hi = bounds["train"]
        tok = train_bpe(docs[lo:hi], vocab)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(root)
    dtype = np.uint16 if tok.vocab_size < 65_500 else np.int32
    ids = tok.encode_batch(docs)
    lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)  # + end of document
    flat = np.fromiter((t for doc in ids for t in (*doc, tok.eod_id)), dtype=dtype, count=int(lengths.sum()))
    np.save(root / "tokens.npy.tmp.npy", flat)
    os.replace(root / "tokens.npy.tmp.npy", root / "tokens.npy")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    np.save(root / "doc_offsets.npy.tmp.npy", offsets)
    os.replace(root / "doc_offsets.npy.tmp.npy", root / "doc_offsets.npy")
    (root / "splits.json").write_text(json.dumps(bounds))
    (root / "DONE").write_text(json.dumps({"documents": len(docs), "tokens": int(flat.size)}))


class TokenStream:
    """Samples of one split as a pure function of the global sample index."""

    def __init__(self, root: Path, split: str, seq_length: int, seed: int, *, shuffle: bool) -> None:
        tokens = np.load(root / "tokens.npy", mmap_mode="r")
        offsets = np.load(root / "doc_offsets.npy")
        lo, hi = json.loads((root / "splits.json").read_text())[split]
        self.tokens = tokens[offsets[lo]:offsets[hi]]
        self.seq = seq_length
        self.per_epoch = (len(self.tokens) - 1) // seq_length
        if self.per_epoch < 1:
            raise UsageError(f"the {split} split has {len(self.tokens)} tokens, fewer than train.seq_length+1={seq_length + 1}")
        self.seed, self.shuffle = seed, shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.RandomState((self.seed + 1000003 * epoch) % 2**32)
            self._perm = (epoch, rng.permutation(self.per_epoch) if self.shuffle else np.arange(self.per_epoch))
        return self._perm[1]

    def sample(self, g: int) -> np.ndarray:
        epoch, i = divmod(g, self.per_epoch)
        start = int(self._order(epoch)[i]) * self.seq
        return np.asarray(self.tokens[start:start + self.seq + 1], dtype=np.int64)


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> Iterator[dict[str, Any]]:
    """Micro-batches for DP rank ``dp_rank``: its slice of every global batch, from ``consumed_samples`` on."""
    import torch

    root, _ = prepare(run)
    stream = TokenStream(root, split, run.train.seq_length, run.train.seed, shuffle=split == "train")
    mbs = run.train.micro_batch_size
    gbs = run.train.global_batch_size or mbs * dp_size
    per_rank = gbs // dp_size
    g = consumed_samples
    while True:
        mine = g + dp_rank * per_rank
        for m in range(per_rank // mbs):
            rows = np.stack([stream.sample(mine + m * mbs + j) for j in range(mbs)])
            t = torch.from_numpy(rows)
            yield {"tokens": t[:, :-1], "labels": t[:, 1:]}
        g += gbs


def tokenizer_dir(run: Any) -> Path | None:
    """Where the corpus's tokenizer.json lives: the cache keeps a copy of whichever tokenizer built it
    (None for the bytes tokenizer, which needs no file)."""
    if run.data.tokenizer == "bytes":
        return None
    root, _ = prepare(run)
    return root
