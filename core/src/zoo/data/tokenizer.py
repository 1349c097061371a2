"""Tokenizers: a byte-level BPE trained locally with the `tokenizers` library, a Hugging Face
tokenizer directory or ``tokenizer.json`` the user names, GPT-2's ``vocab.json`` + ``merges.txt``
(Megatron-LM's ``GPT2BPETokenizer``), a tiktoken ranks file, or raw bytes."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from zoo.data.bpe_cache import bytes_to_unicode
from zoo.errors import UsageError

EOD = "<|endoftext|>"


class Tokenizer:
    """The small interface zoo needs: encode, decode, vocabulary size, end-of-document id."""

    def __init__(self, backend: object | None, *, eod_id: int, vocab_size: int, source: str) -> None:
        self._tok = backend  # a tokenizers.Tokenizer, or None for bytes
        self.eod_id = eod_id
        self.vocab_size = vocab_size
        self.source = source

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` (None for bytes)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text).ids  # type: ignore[attr-defined]

    @functools.cached_property
    def _fast(self) -> Any:
        """`zoo.data.bpe_cache.CachedBPE` for this tokenizer, or None where it does not apply."""
        from zoo.data.bpe_cache import CachedBPE

        return CachedBPE.for_tokenizer(self._tok)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Bulk encoding (``zoo prepare``): the same ids as ``encode``, through the exact piece cache
        of `zoo.data.bpe_cache` where the tokenizer's configuration allows it."""
        if self._tok is None:
            return [self.encode(t) for t in texts]
        if self._fast is None:
            return [e.ids for e in self._tok.encode_batch(list(texts))]  # type: ignore[attr-defined]
        out = [self._fast.encode(t) for t in texts]
        missing = [i for i, ids in enumerate(out) if ids is None]
        if missing:
            for i, e in zip(missing, self._tok.encode_batch([texts[i] for i in missing])):  # type: ignore[attr-defined]
                out[i] = e.ids
        return out  # type: ignore[return-value]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._tok is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` (bytes tokenizers need no file)."""
        if self._tok is not None:
            self._tok.save(str(directory / "tokenizer.json"))  # type: ignore[attr-defined]


def train_bpe(texts: Iterable[str], vocab_size: int, *, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on ``texts``; deterministic for the same input.
    The end-of-document token has id 0, ``special_tokens`` (a VLM's ``<image>``) the next ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise UsageError(f"a byte-level BPE needs a vocabulary above 257 tokens, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD, *special_tokens], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return Tokenizer(tok, eod_id=tok.token_to_id(EOD), vocab_size=tok.get_vocab_size(), source="bpe")


# The pre-tokenisation pattern of tiktoken's cl100k_base (also Llama 3's); a ranks file does not
# record its pattern, so this is the one assumed.
TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_by_ranks(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Merge ``token``'s bytes using only ranks below ``max_rank``: what remains are its two parents."""
    parts = [bytes([b]) for b in token]
    while True:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


def load_tiktoken(path: Path) -> Tokenizer:
    """A tiktoken ranks file (``base64-token rank`` per line) as a byte-level BPE with its merges."""
    import base64

    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text(encoding="ascii", errors="strict").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise UsageError(f"{path}:{n}: not a tiktoken ranks line ('<base64 token> <rank>')") from None
    enc = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _split_by_ranks(ranks, token, rank)
            if len(parts) != 2:
                raise UsageError(f"{path}: token of rank {rank} cannot be built from lower-ranked tokens")
            merges.append((text(parts[0]), text(parts[1])))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TIKTOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD])
    return Tokenizer(tok, eod_id=tok.token_to_id(EOD), vocab_size=tok.get_vocab_size(), source=str(path))


def load_gpt2_bpe(vocab_file: str | os.PathLike[str], merges_file: str | os.PathLike[str]) -> Tokenizer:
    """GPT-2's byte-level BPE from its two files (``vocab.json``: token -> id, ``merges.txt``: one
    merge per line by priority), as Hugging Face's GPT-2 tokenizer reads them and Megatron-LM's
    ``GPT2BPETokenizer`` uses them: GPT-2's pre-tokenizing regex, no prefix space, ``<|endoftext|>``
    the end-of-document token (it must be in the vocabulary)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    for what, f in (("vocabulary", vocab_file), ("merges", merges_file)):
        if not Path(f).is_file():
            raise UsageError(f"{f}: GPT-2 BPE {what} file not found")
    try:
        bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
    except Exception as e:  # tokenizers raises its own exception type for malformed files
        raise UsageError(f"{vocab_file} + {merges_file}: not a readable GPT-2 vocab.json and merges.txt ({e})") from None
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOD) is None:
        raise UsageError(f"{vocab_file}: no end-of-document token {EOD} in the vocabulary")
    tok.add_special_tokens([EOD])  # (its vocabulary id: never split when it appears in a text)
    return Tokenizer(tok, eod_id=tok.token_to_id(EOD), vocab_size=tok.get_vocab_size(), source=str(vocab_file))


def tokenizer_path(spec: str | os.PathLike[str]) -> Path:
    """``spec`` as a path, a zoo run directory read as its newest checkpoint (which holds the run's
    tokenizer): ``data.tokenizer=runs/llama-tiny`` fine-tunes with the tokenizer that run trained."""
    path = Path(spec)
    latest = path / "checkpoints" / "latest"
    if path.is_dir() and not (path / "tokenizer.json").is_file() and latest.is_file():
        return path / "checkpoints" / latest.read_text().strip()
    return path


def load_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """``"bytes"``, a directory holding ``tokenizer.json`` (or GPT-2's ``vocab.json`` and
    ``merges.txt``; a zoo run directory: its newest checkpoint's), a ``tokenizer.json`` file, or a
    tiktoken ranks file (``*.tiktoken``)."""
    if str(spec) == "bytes":
        return Tokenizer(None, eod_id=0, vocab_size=256, source="bytes")
    path = tokenizer_path(spec)
    if path.is_file() and path.suffix == ".tiktoken":
        return load_tiktoken(path)
    if path.is_dir() and not (path / "tokenizer.json").is_file() and (path / "vocab.json").is_file() \
            and (path / "merges.txt").is_file():
        return load_gpt2_bpe(path / "vocab.json", path / "merges.txt")
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            f"tokenizer {str(spec)!r}: not found; give 'bytes', a local Hugging Face tokenizer directory (tokenizer.json, "
            "or vocab.json and merges.txt), a tokenizer.json file or a .tiktoken ranks file (nothing is downloaded)"
        )
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type for malformed files
        raise UsageError(f"{file}: not a readable tokenizer.json ({e})") from None
    eod = None
    for candidate in (EOD, "</s>", "<|end_of_text|>", "<eos>", "[SEP]"):
        eod = tok.token_to_id(candidate)
        if eod is not None:
            break
    if eod is None:
        raise UsageError(f"{file}: no end-of-document token ({EOD}, </s>, <|end_of_text|>, <eos>)")
    return Tokenizer(tok, eod_id=eod, vocab_size=tok.get_vocab_size(), source=str(file))
