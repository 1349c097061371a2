"""Exact, faster encoding for byte-level BPE tokenizers (GPT-2, tiktoken, Llama 3 style).

A byte-level BPE encodes each pre-tokenized piece on its own, so the ids of a text are the
concatenation of the ids of its pieces. `CachedBPE` splits the text with Python's ``re`` (one C
call per document), looks each piece up in a bounded dictionary and runs the tokenizer's own BPE
model only for pieces it has not seen: on natural text most pieces repeat (Zipf), and the Rust
tokenizer's per-document overhead (offsets, token strings, an Encoding object) is skipped.

The result must equal ``tokenizer.encode(text).ids`` exactly, so:
- the split pattern is the tokenizer's own, with ``\\p{L}``, ``\\p{N}``, ``\\s`` replaced by character
  classes read from the tokenizers library's regex engine itself (Oniguruma, whose Unicode version
  differs from Python's), cached on disk per tokenizers version;
- only configurations whose behaviour is fully reproduced get a fast path (no normalizer, no
  truncation or padding, BPE without dropout, a ByteLevel or Split+ByteLevel pre-tokenizer);
  any other tokenizer keeps the library path;
- a document that contains an added token's text, that is empty, or whose pieces do not cover it
  goes through the library.
Tests compare against the library on every Unicode code point and on whole corpora.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

# The split pattern of the tokenizers library's ByteLevel pre-tokenizer (use_regex=True): GPT-2's.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CLASSES = {"L": r"\p{L}", "N": r"\p{N}", "s": r"\s"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies use it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _ranges(codepoints: list[int]) -> list[list[int]]:
    """Sorted code points as ``[first, last]`` runs."""
    out: list[list[int]] = []
    for c in codepoints:
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def _body(ranges: list[list[int]], limit: int = 0x10FFFF) -> str:
    """A character-class body for Python's re, keeping code points up to ``limit``."""
    parts = []
    for lo, hi in ranges:
        if lo > limit:
            break
        hi = min(hi, limit)
        parts.append(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}")
    return "".join(parts)


def _engine_classes_uncached() -> dict[str, list[list[int]]]:
    from tokenizers import Regex, pre_tokenizers

    codepoints = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]  # no surrogates in UTF-8
    text = "".join(map(chr, codepoints))
    out = {}
    for name, cls in _CLASSES.items():
        # "removed" keeps what does not match, with character offsets: members are the rest.
        outside = pre_tokenizers.Split(Regex(cls + "+"), behavior="removed").pre_tokenize_str(text)
        member = [True] * len(codepoints)
        for _, (start, end) in outside:
            member[start:end] = [False] * (end - start)
        out[name] = _ranges([c for c, m in zip(codepoints, member) if m])
    return out


@functools.cache
def engine_classes() -> dict[str, list[list[int]]]:
    """``\\p{L}``, ``\\p{N}`` and ``\\s`` as the tokenizers library's regex engine defines them, as
    code-point runs (about 2 s to read off all code points; then cached under ``$XDG_CACHE_HOME/zoo``)."""
    import tokenizers

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zoo"
    path = base / f"regex-classes-tokenizers-{tokenizers.__version__}.json"
    try:
        data = json.loads(path.read_text())
        if set(data) == set(_CLASSES):
            return data
    except (OSError, ValueError):
        pass
    data = _engine_classes_uncached()
    try:  # a cache we cannot write only costs the 2 s again
        base.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass
    return data


def translate(pattern: str, classes: dict[str, str]) -> str | None:
    """The tokenizer's (Oniguruma) pattern in Python's re syntax, or None if it uses a construct
    not translated here (other Unicode properties, ``\\S`` inside brackets, ...)."""
    out, i, depth = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1: i + 2]
            if nxt == "p":
                m = re.match(r"\\p\{(\w+)\}", pattern[i:])
                if not m or m.group(1) not in ("L", "N"):
                    return None
                body = classes[m.group(1)]
                out.append(body if depth else f"[{body}]")
                i += m.end()
                continue
            if nxt == "s":
                out.append(classes["s"] if depth else f"[{classes['s']}]")
            elif nxt == "S":
                if depth:
                    return None
                out.append(f"[^{classes['s']}]")
            elif nxt in ("P", "w", "W", "d", "D", "b", "B", "h", "H", "X", "R", "K", "G", "z", "Z", "A"):
                return None  # engine-dependent meaning
            else:
                out.append(pattern[i: i + 2])
            i += 2
            continue
        if c == "[":
            if depth:
                return None  # nested classes and POSIX brackets differ between the engines
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


class CachedBPE:
    """Encodes like ``tokenizer.encode(text).ids``; ``encode`` returns None where the library must."""

    # Bounded memory: the cache is emptied when it holds this many pieces (about 15 MB of Python
    # objects; on natural text and code the most frequent 65k pieces are nearly all of them).
    MAX_PIECES = 1 << 16
    LARGE = 1 << 20  # characters above which a document's pieces are not listed at once

    def __init__(self, tokenizer: Any, patterns: list[re.Pattern[str]], prefix_space: bool,
                 around: tuple[list[int], list[int]], added: list[str]) -> None:
        self._model = tokenizer.model
        self._bmp, self._all = patterns
        self._astral = re.compile("[\U00010000-\U0010ffff]").search
        self._prefix_space = prefix_space
        self._before, self._after = around
        self._added = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))).search if added else None
        self._bytes = bytes_to_unicode()
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> CachedBPE | None:
        """A fast path for ``tokenizer`` (a ``tokenizers.Tokenizer``), or None when its
        configuration is not one reproduced exactly here."""
        spec = json.loads(tokenizer.to_str())
        model = spec.get("model") or {}
        if spec.get("truncation") or spec.get("padding") or spec.get("normalizer") is not None:
            return None
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
            return None
        pre = spec.get("pre_tokenizer") or {}
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
            pattern, prefix_space = GPT2_PATTERN, bool(pre.get("add_prefix_space"))
        elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
            split, byte_level = pre["pretokenizers"]
            if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
                    or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
                    or byte_level.get("add_prefix_space")):
                return None
            if "Regex" in split.get("pattern", {}):
                pattern = split["pattern"]["Regex"]
            elif "String" in split.get("pattern", {}):
                pattern = re.escape(split["pattern"]["String"])
            else:
                return None
            prefix_space = False
        else:
            return None
        # Python's re tests a class with astral code points range by range, but one within the BMP
        # through a bitmap (6x faster here): texts without astral characters use the BMP pattern.
        classes = engine_classes()
        translated = [translate(pattern, {k: _body(v, limit) for k, v in classes.items()}) for limit in (0xFFFF, 0x10FFFF)]
        if None in translated:
            return None
        try:
            compiled = [re.compile(p) for p in translated]  # type: ignore[arg-type]
        except re.error:
            return None
        added = [t["content"] for t in spec.get("added_tokens", []) if t.get("content")]
        # What the post-processor puts around a sequence (a BOS, say), read off two probes.
        probes = ("a", "b c")
        plain = [tokenizer.encode(p, add_special_tokens=False).ids for p in probes]
        full = [tokenizer.encode(p).ids for p in probes]
        for k in range(len(full[0]) - len(plain[0]) + 1):
            if full[0][k: k + len(plain[0])] == plain[0]:
                around = (full[0][:k], full[0][k + len(plain[0]):])
                break
        else:
            return None
        if full[1] != around[0] + plain[1] + around[1]:
            return None
        return cls(tokenizer, compiled, prefix_space, around, added)

    def _piece(self, piece: str) -> tuple[int, ...]:
        mapped = "".join([self._bytes[b] for b in piece.encode("utf-8")])
        ids = tuple(t.id for t in self._model.tokenize(mapped))
        if len(self._cache) >= self.MAX_PIECES:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> list[int] | None:
        if not text or (self._added is not None and self._added(text)):
            return None
        if self._prefix_space and text[0] != " ":
            text = " " + text
        pattern = self._all if self._astral(text) else self._bmp
        # The pieces must cover the text (a pattern that skips characters: the library knows what
        # to do). A large document is split lazily: a list of its pieces would weigh ~60 bytes each.
        if len(text) > self.LARGE:
            if sum(m.end() - m.start() for m in pattern.finditer(text)) != len(text):
                return None
            pieces: Any = map(re.Match.group, pattern.finditer(text))
        else:
            pieces = pattern.findall(text)
            if len("".join(pieces)) != len(text):
                return None
        ids = list(self._before)
        get, extend = self._cache.get, ids.extend
        try:
            for piece in pieces:
                found = get(piece)
                extend(found if found is not None else self._piece(piece))
        except UnicodeEncodeError:  # a lone surrogate: let the library report it
            return None
        extend(self._after)
        return ids
