"""GPT sample construction with Megatron's semantics, so a run moving from Megatron-LM to zoo
sees the same samples in the same order (same data, seed, sequence length, sample count, split).

Three indices, as in megatron-core's `GPTDataset`:
- document index: the split's document ids tiled over the epochs needed and shuffled with
  ``numpy.random.RandomState(seed)``; when the last epoch contributes fewer than 80% of an epoch's
  samples it is shuffled separately (``separate_final_epoch``), so a partial epoch is uniform;
- sample index: ``num_samples + 1`` rows of (position in the document index, offset); sample i
  spans tokens ``[i * seq, i * seq + seq + 1)`` of the concatenated documents, so consecutive
  samples share one token. Built here with vectorised torch CPU kernels in cache-sized chunks
  (no C++ compiled at run time);
- shuffle index: a permutation of the samples (the final partial epoch permuted on its own).

Splits follow Megatron's ``"949,50,1"`` rule: proportions normalised, document ranges
``round(begin * n)`` to ``round(end * n)``.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import numpy as np

from zoo.errors import ConfigError

SPLITS = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    values += [0.0] * (3 - len(values))
    if len(values) != 3 or sum(values) <= 0:
        raise ConfigError(f"data.split={split!r}: expected up to three non-negative proportions like 949,50,1")
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_documents: int) -> dict[str, tuple[int, int] | None]:
    """Document ranges per split (None for an empty split), rounded as Megatron rounds them."""
    bounds = [0.0]
    for w in parse_split(split):
        bounds.append(bounds[-1] + w)
    out: dict[str, tuple[int, int] | None] = {}
    for name, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:]):
        out[name] = None if hi <= lo else (int(round(lo * num_documents)), int(round(hi * num_documents)))
    return out


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int = 1) -> int:
    if num_samples is None:
        return 1
    need = num_samples * seq_length + extra
    return max(1, -(-need // tokens_per_epoch)) if tokens_per_epoch else 1


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, *, drop_last_partial: bool = True, extra: int = 1,
                       chunk: int = 1 << 18) -> np.ndarray:
    """(position in ``document_index``, offset) where each sample starts, plus one end row.

    Sample k starts at token ``k * seq`` of the concatenated documents. With the extra token it
    lies in the document j with ``ends[j-1] <= k * seq < ends[j]`` (without it, ``<`` and ``<=``
    swap: Megatron's loop keeps a start at a document's end in that document). With
    ``last[j] = ceil(ends[j] / seq)`` (resp. ``floor(ends[j] / seq) + 1``), the samples that start
    before document j ends, k's document is the number of documents with ``last[j] <= k``: a
    bincount and a cumulative sum, branch-free (a ``repeat`` by per-document counts gives the same
    column but mispredicts a branch per document).

    The work runs in chunks of documents whose buffers are allocated once and stay in cache (on a
    CPU, first-touch page faults of 80 MB temporaries cost more than the arithmetic), on torch's
    CPU kernels: its cumulative sum and gathers are 2-3x NumPy's, and its intra-op threads run
    without the GIL (threads around NumPy calls lose more to GIL hand-offs than they gain)."""
    import torch

    total = num_epochs * tokens_per_epoch
    if drop_last_partial:
        num_samples = (total - extra) // seq_length
    else:
        num_samples = -(-(total - extra) // seq_length)
    rows = num_samples + 1
    n_docs = len(document_index)
    dtype = np.int32 if max(n_docs, int(sizes.max(initial=0))) <= np.iinfo(np.int32).max else np.int64
    out = np.empty((rows, 2), dtype=dtype)
    # Chunk-relative positions (tokens from the chunk's first sample start) fit in int32 when a
    # chunk holds under 2**31 tokens; int32 halves the memory traffic of every pass.
    longest = int(sizes.max(initial=1))
    chunk = max(1, min(chunk, n_docs))
    if (longest + 2 * seq_length) * min(chunk, 1024) < 2**31:
        work = torch.int32
        chunk = max(1, min(chunk, (2**31 - 1) // (longest + 2 * seq_length)))
    else:
        work = torch.int64
    with warnings.catch_warnings():  # memory-mapped inputs are read-only: torch warns, but they are only read
        warnings.simplefilter("ignore", UserWarning)
        sizes_t = torch.as_tensor(np.asarray(sizes), dtype=work)
        documents = torch.as_tensor(np.ascontiguousarray(document_index))
    lengths, starts, ends = (torch.empty(chunk, dtype=work) for _ in range(3))
    steps = positions = offsets = torch.empty(0, dtype=work)  # grown to the most samples one chunk holds
    before = 0  # tokens before the chunk
    for a in range(0, n_docs, chunk):
        # Rows that belong to earlier chunks: starts before this chunk's first token (at it, too,
        # without the extra token).
        first = (before + seq_length - extra) // seq_length if a else 0
        if first >= rows:
            break
        m = min(chunk, n_docs - a)
        length, start, end = lengths[:m], starts[:m], ends[:m]
        torch.index_select(sizes_t, 0, documents[a:a + m], out=length)
        torch.cumsum(length, 0, dtype=work, out=end)
        tokens = int(end[-1])
        end += before - first * seq_length
        torch.sub(end, length, out=start)
        end += seq_length - extra
        last = torch.div(end, seq_length, rounding_mode="floor", out=end)  # chunk samples starting before each end
        n = min(int(last[-1]), rows - first)
        if n <= 0:  # no sample starts in this chunk
            before += tokens
            continue
        if n > len(steps):
            steps = torch.arange(0, n * seq_length, seq_length, dtype=work)
            positions, offsets = torch.empty(n, dtype=work), torch.empty(n, dtype=work)
        if n < int(last[-1]):  # the rows end inside this chunk
            last.clamp_(max=n)
        doc = torch.cumsum(torch.bincount(last, minlength=n + 1)[:n], 0, dtype=work, out=positions[:n])
        torch.index_select(start, 0, doc, out=offsets[:n])
        # The output is written by NumPy, in this thread: its first-touch page faults taken by
        # torch's two threads at once ran 3x slower (they contend for the process's memory map).
        mine = out[first:first + n]
        np.subtract(steps[:n].numpy(), offsets[:n].numpy(), out=mine[:, 1], casting="unsafe")
        np.add(doc.numpy(), a, out=mine[:, 0], casting="unsafe")
        before += tokens
    n = min(rows, (total + seq_length - extra) // seq_length)  # rows whose start lies inside the data
    if n < rows:  # the last, partial sample ends at the end of the data
        out[n:, 0] = n_docs - 1
        out[n:, 1] = int(sizes[document_index[-1]]) - extra
    out[0] = 0  # Megatron's first row, even when document 0 is empty
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass
class GPTIndices:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1


def build_indices(sizes: np.ndarray, documents: np.ndarray, *, seq_length: int, num_samples: int | None, seed: int,
                  drop_last_partial: bool = True, extra: int = 1) -> GPTIndices:
    """The three indices for the documents ``documents`` of a dataset whose lengths are ``sizes``."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    if tokens_per_epoch <= extra:
        raise ConfigError(f"the split holds {tokens_per_epoch} tokens, too few for a sample of {seq_length + extra}")
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length, extra)
    separate = False
    sans_final = 0
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
        from_final = (num_samples or 0) - sans_final
        per_epoch = (tokens_per_epoch - extra) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    doc_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(sizes, doc_index, seq_length, epochs, tokens_per_epoch,
                                      drop_last_partial=drop_last_partial, extra=extra)
    n = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else n, n, rng)
    return GPTIndices(doc_index, sample_index, shuffle_index)


def sample_tokens(dataset: object, idx: GPTIndices, i: int, *, seq_length: int, extra: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of sample ``i`` (``seq_length + extra`` of them) and the ids of the documents it spans."""
    j = int(idx.shuffle_index[i])
    (d0, o0), (d1, o1) = idx.sample_index[j], idx.sample_index[j + 1]
    parts, docs = [], []
    for d in range(int(d0), int(d1) + 1):
        doc = int(idx.document_index[d])
        start = int(o0) if d == d0 else 0
        end = int(o1) + extra if d == d1 else None
        full = dataset.get(doc)  # type: ignore[attr-defined]
        parts.append(full[start:end])
        docs.append(doc)
    tokens = np.concatenate(parts).astype(np.int64)
    return tokens, np.array(docs, dtype=np.int64)


def masks_and_positions(tokens: np.ndarray, eod: int, *, reset_position_ids: bool, eod_mask_loss: bool
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Loss mask, position ids and document boundaries (starts of documents after an EOD) of one sample."""
    loss_mask = np.ones(len(tokens), dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    eods = np.flatnonzero(tokens == eod)
    boundaries = eods[eods < len(tokens) - 1] + 1
    positions = np.arange(len(tokens), dtype=np.int64)
    if reset_position_ids:
        for b in boundaries:
            positions[b:] -= positions[b]
    return loss_mask, positions, boundaries
