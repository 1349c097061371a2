"""The exact piece cache of `zoo.bpe_cache` against the `tokenizers` library itself: every Unicode
code point, class boundaries, contractions under case folding, added tokens, post-processors that
add tokens, a prefix space, tiktoken's pattern, the cache bound, and the configurations it must
leave to the library."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as hf_models

from zoo.data.bpe_cache import CachedBPE, engine_classes, translate
from zoo.data.tokenizer import EOD, TIKTOKEN_PATTERN, Tokenizer, train_bpe

# Contractions are frequent enough here for the BPE to learn them as tokens: a split that misses
# one changes the ids.
CONTRACTIONS = "We're sure they've said I'm here, we'll see, he'd know it's John's, you're 'RE' 'S " * 40


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [CONTRACTIONS] + [topics[k] for k in sorted(topics)]


def _every_code_point() -> list[str]:
    """All code points (no surrogates) in chunks, and the same chunks interleaved with letters,
    digits, spaces and apostrophes so every class meets every other at a piece boundary."""
    chars = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    chunks = [chars[i:i + 1500] for i in range(0, len(chars), 1500)]
    mixed = []
    for ch in chunks[:60] + chunks[60::23]:
        mixed.append(" ".join(ch[i:i + 3] for i in range(0, len(ch), 3)))
        mixed.append("'s" + "'S a1 ".join(ch[i:i + 2] for i in range(0, len(ch), 2)))
    return chunks + mixed


EDGES = ["'ſ 'K 'S 'RE 'Ll \u00a0x \x1cy \x85z 12345 ½³ Ⅷ ٣٤ 一二 \u2028z  \n\n  a", " lead", "trail  ", "\r\n\r\n",
         "emoji 😀😀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 letters", "x" * 5000, "tab\tand\u3000ideographic space"]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _corpus()


def _trained(corpus: list[str], pre, post=None) -> HFTokenizer:
    tok = HFTokenizer(hf_models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=[EOD, "<|begin_of_text|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if post is not None:
        tok.post_processor = post(tok)
    return tok


def _assert_exact(tok: HFTokenizer, texts: list[str]) -> int:
    fast = CachedBPE.for_tokenizer(tok)
    assert fast is not None
    fast_paths = 0
    for text in texts:
        ids = fast.encode(text)
        if ids is not None:
            fast_paths += 1
            assert ids == tok.encode(text).ids, repr(text[:80])
    return fast_paths


def test_gpt2_byte_level_exact_on_every_code_point(corpus):
    tok = train_bpe(corpus, 2000)._tok
    texts = corpus + _every_code_point() + EDGES
    assert _assert_exact(tok, texts) == len(texts)  # none of these needs the library


@pytest.mark.parametrize("variant", ["tiktoken_with_bos", "prefix_space", "byte_level_post"])
def test_other_byte_level_configurations_exact(corpus, variant):
    if variant == "tiktoken_with_bos":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(TIKTOKEN_PATTERN), behavior="isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        post = lambda t: processors.TemplateProcessing(  # noqa: E731
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", t.token_to_id("<|begin_of_text|>"))])
    elif variant == "prefix_space":
        pre, post = pre_tokenizers.ByteLevel(add_prefix_space=True), None
    else:
        pre, post = pre_tokenizers.ByteLevel(add_prefix_space=False), lambda t: processors.ByteLevel(trim_offsets=True)
    tok = _trained(corpus, pre, post)
    texts = corpus[:80] + _every_code_point()[::4] + EDGES
    assert _assert_exact(tok, texts) == len(texts)
    if variant == "tiktoken_with_bos":
        assert CachedBPE.for_tokenizer(tok).encode("hi")[0] == tok.token_to_id("<|begin_of_text|>")


def test_added_tokens_and_empty_text_go_to_the_library(corpus):
    hf = train_bpe(corpus, 1000)._tok
    fast = CachedBPE.for_tokenizer(hf)
    assert fast.encode(f"one {EOD} two") is None and fast.encode("") is None
    tok = Tokenizer(hf, eod_id=hf.token_to_id(EOD), vocab_size=hf.get_vocab_size(), source="test")
    texts = [f"one {EOD} two", "", "plain text", EOD]
    assert tok.encode_batch(texts) == [hf.encode(t).ids for t in texts]


def test_configurations_not_reproduced_are_refused(corpus):
    tok = train_bpe(corpus, 500)._tok
    assert CachedBPE.for_tokenizer(tok) is not None
    with_normalizer = HFTokenizer.from_str(tok.to_str())
    with_normalizer.normalizer = normalizers.NFKC()
    assert CachedBPE.for_tokenizer(with_normalizer) is None
    spec = json.loads(tok.to_str())
    spec["model"]["dropout"] = 0.1
    assert CachedBPE.for_tokenizer(HFTokenizer.from_str(json.dumps(spec))) is None
    marks = _trained(corpus[:20], pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{L}+\p{M}*|\s+|."), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    assert CachedBPE.for_tokenizer(marks) is None  # \p{M} is not translated
    bodies = {"L": "a-z", "N": "0-9", "s": " "}
    assert translate(r"[^\s\p{L}]+|\p{N}", bodies) == "[^ a-z]+|[0-9]"
    assert translate(r"[\S]", bodies) is None and translate(r"[[:alpha:]]", bodies) is None


def test_cache_is_bounded_and_stays_exact(corpus, monkeypatch):
    tok = train_bpe(corpus, 1000)._tok
    fast = CachedBPE.for_tokenizer(tok)
    monkeypatch.setattr(CachedBPE, "MAX_PIECES", 50)
    for text in corpus[:40]:
        assert fast.encode(text) == tok.encode(text).ids
        assert len(fast._cache) <= 50


def test_engine_classes_match_the_engine_and_are_cached_on_disk(tmp_path, monkeypatch):
    from tokenizers import pre_tokenizers as pt

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine_classes.cache_clear()
    try:
        classes = engine_classes()
        files = list((tmp_path / "zoo").glob("regex-classes-tokenizers-*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text()) == classes
        engine_classes.cache_clear()
        assert engine_classes() == classes  # read back
    finally:
        engine_classes.cache_clear()
    # Spot checks against the engine directly, one code point at a time.
    for name, pattern in (("L", r"\p{L}"), ("N", r"\p{N}"), ("s", r"\s")):
        members = {c for lo, hi in classes[name] for c in range(lo, hi + 1)}
        for cp in (0x41, 0x1C, 0x85, 0xA0, 0x17F, 0x2167, 0x3000, 0x4E00, 0x1D518, 0x1F600, 0x10FFFD):
            matched = pt.Split(Regex(pattern), behavior="removed").pre_tokenize_str(chr(cp)) == []
            assert (cp in members) == matched, (name, hex(cp))


def test_large_documents_split_lazily_stay_exact(corpus, monkeypatch):
    tok = train_bpe(corpus, 1000)._tok
    fast = CachedBPE.for_tokenizer(tok)
    monkeypatch.setattr(CachedBPE, "LARGE", 100)  # every document below takes the lazy path
    for text in corpus[:30] + EDGES + _every_code_point()[:3]:
        assert fast.encode(text) == tok.encode(text).ids
