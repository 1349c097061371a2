"""Tokenizers: a byte-level BPE trained locally with the `tokenizers` library, a Hugging Face
tokenizer directory or ``tokenizer.json`` the user names, or raw bytes."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from zoo.errors import UsageError

EOD = "<|endoftext|>"


class Tokenizer:
    """The small interface zoo needs: encode, decode, vocabulary size, end-of-document id."""

    def __init__(self, backend: object | None, *, eod_id: int, vocab_size: int, source: str) -> None:
        self._tok = backend  # a tokenizers.Tokenizer, or None for bytes
        self.eod_id = eod_id
        self.vocab_size = vocab_size
        self.source = source

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text).ids  # type: ignore[attr-defined]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tok is None:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts))]  # type: ignore[attr-defined]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._tok is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` (bytes tokenizers need no file)."""
        if self._tok is not None:
            self._tok.save(str(directory / "tokenizer.json"))  # type: ignore[attr-defined]


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on ``texts``; deterministic for the same input."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise UsageError(f"a byte-level BPE needs a vocabulary above 257 tokens, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return Tokenizer(tok, eod_id=tok.token_to_id(EOD), vocab_size=tok.get_vocab_size(), source="bpe")


def load_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """``"bytes"``, a directory holding ``tokenizer.json``, or a ``tokenizer.json`` file."""
    if str(spec) == "bytes":
        return Tokenizer(None, eod_id=0, vocab_size=256, source="bytes")
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            f"tokenizer {str(spec)!r}: not found; give 'bytes', a Hugging Face tokenizer directory or a tokenizer.json file"
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
