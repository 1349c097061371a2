"""Data: tokenizers (`tokenizer`, with the exact byte-level BPE fast path of `bpe_cache`),
Megatron indexed datasets (`indexed`), GPT sample order and blends identical to megatron-core's
(`gpt`, `megatron`), `zoo prepare text` (`prepare`) and the embedded default corpus (`corpus`)."""

from zoo.data.gpt import GPTIndices, build_indices, split_ranges
from zoo.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from zoo.data.megatron import parse_blend
from zoo.data.prepare import PrepareError, prepare_text
from zoo.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = ["GPTIndices", "IndexedDataset", "IndexedDatasetError", "IndexedDatasetWriter", "PrepareError", "Tokenizer",
           "build_indices", "load_tokenizer", "parse_blend", "prepare_text", "split_ranges", "train_bpe"]
