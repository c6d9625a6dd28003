"""GPT pretraining samples: (seq_length + 1)-token windows over shuffled documents.

As in Megatron-LM's GPTDataset, the documents (sequences of the indexed dataset) of
one split are shuffled per epoch with `seed` and concatenated over as many epochs
as the requested samples need; sample j is tokens [j * seq_length, (j + 1) * seq_length]
(inclusive) of that stream, so windows cross document boundaries and consecutive
windows share one token; the order of the samples is shuffled with the same seed.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from megalite.data.blended_dataset import BlendedDataset, samples_needed
from megalite.data.index_cache import cached_indices
from megalite.data.indexed_dataset import IndexedDataset

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def _index_dtype(bound: int) -> type:
    return np.int32 if bound < 2**31 else np.int64


def split_ratios(split: str) -> list[float]:
    """The train, valid, test ratios of a string like "969,30,1" (missing ones 0)."""
    try:
        ratios = [float(r) for r in split.replace("/", ",").split(",")]
    except ValueError:
        ratios = []
    if not 1 <= len(ratios) <= 3 or not all(map(math.isfinite, ratios)) or min(ratios) < 0 \
            or sum(ratios) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative ratios like "
                         f"'969,30,1'")
    return ratios + [0.0] * (3 - len(ratios))


def check_split(split: str, needs_train: bool) -> None:
    """ValueError (one line) for a malformed --split, or one with no train share when
    `needs_train`; needs no data."""
    if split_ratios(split)[0] == 0 and needs_train:
        raise ValueError(f"--split {split}: the train ratio is 0, so there is nothing to train "
                         f"on (give the train split a share, e.g. 969,30,1)")


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """[begin, end) document ranges of train/valid/test for a ratio string like "969,30,1"."""
    ratios = split_ratios(split)
    bounds = [0] + [int(round(float(c) * num_documents)) for c in np.cumsum(ratios) / sum(ratios)]
    return list(zip(bounds[:-1], bounds[1:]))


def build_sample_index(sizes: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """[num_samples, 2]: (position in the document index, token offset) where each sample
    starts, for documents of `sizes` tokens concatenated in document-index order."""
    ends = np.cumsum(sizes, dtype=np.int64)
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - sizes[position])
    return np.stack([position, offset], axis=1).astype(_index_dtype(len(sizes)))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """document_index [epochs * len(documents)] (a seeded permutation of `documents` per
    epoch), sample_index [num_samples, 2] and shuffle_index [num_samples].
    The documents must hold at least one token."""
    tokens_per_epoch = int(sizes[documents].sum())
    num_epochs = math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)
    rng = np.random.default_rng(seed)
    document_index = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)])
    document_index = document_index.astype(_index_dtype(len(sizes)))
    sample_index = build_sample_index(sizes[document_index], seq_length, num_samples)
    shuffle_index = rng.permutation(num_samples).astype(_index_dtype(num_samples))
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


class GPTDataset:
    """`num_samples` samples {"tokens": int64 [seq_length + 1]} from the sequences of
    documents [begin, end) = `document_range` of an IndexedDataset."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int,
                 num_samples: int, seed: int, cache_dir: str | None = None,
                 is_builder_rank: bool = True, barrier: Callable[[], None] = lambda: None) -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        first, last = (int(indexed.document_indices[b]) for b in document_range)
        documents, tokens = np.arange(first, last), int(indexed.sizes[first:last].sum())
        if tokens == 0:
            raise ValueError(f"{indexed.prefix}: documents {document_range[0]}..{document_range[1] - 1} "
                             f"hold no tokens; expected some for GPT samples")
        description = {
            "kind": "GPTDataset", "version": 1, "prefix": os.path.realpath(indexed.prefix),
            "num_sequences": len(indexed), "sequences": [first, last], "tokens": tokens,
            "seq_length": seq_length,
            "num_samples": num_samples, "seed": seed,
        }
        arrays = cached_indices(
            cache_dir, description, INDEX_NAMES,
            lambda: build_gpt_indices(indexed.sizes, documents, seq_length, num_samples, seed),
            is_builder_rank, barrier)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        position, offset = (int(v) for v in self.sample_index[self.shuffle_index[idx]])
        parts, needed = [], self.seq_length + 1
        while needed:
            sequence = int(self.document_index[position])
            part = self.indexed.get(sequence, offset, min(needed, int(self.indexed.sizes[sequence]) - offset))
            parts.append(part)
            needed -= len(part)
            position, offset = position + 1, 0
        return {"tokens": np.concatenate(parts).astype(np.int64)}


def parse_data_path(data_path: list[str]) -> tuple[list[float], list[str]]:
    """([weights], [prefixes]) from [prefix] or [w1, prefix1, w2, prefix2, ...]."""
    if len(data_path) == 1:
        return [1.0], list(data_path)
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        weights = []
    if len(data_path) % 2 or len(weights) != len(data_path) // 2 or min(weights, default=0) <= 0:
        raise ValueError(f"--data-path {' '.join(data_path)}: expected PREFIX or "
                         f"WEIGHT PREFIX [WEIGHT PREFIX ...] with positive weights")
    return [w / sum(weights) for w in weights], list(data_path[1::2])


def check_data(data_path: list[str], split: str, vocab_size: int, needs_train: bool) -> None:
    """Before training (no process group): every prefix opens, holds documents, has training
    documents under `split` (when `needs_train`) and only token ids < `vocab_size`.
    Raises ValueError / FileNotFoundError naming the file or flag."""
    for prefix in parse_data_path(data_path)[1]:
        indexed = IndexedDataset(prefix)
        if indexed.num_documents == 0 or not indexed.sizes.sum():
            raise ValueError(f"{prefix}.idx: the dataset is empty (no documents with tokens)")
        begin, end = split_document_ranges(indexed.num_documents, split)[0]
        if needs_train and begin == end:
            raise ValueError(f"--split {split}: the train split of {prefix} has no documents "
                             f"(of {indexed.num_documents})")
        if np.iinfo(indexed.dtype).max >= vocab_size and (top := indexed.max_token()) >= vocab_size:
            raise ValueError(f"{prefix}.bin: token id {top} >= vocabulary size {vocab_size} "
                             f"(--vocab-size / --tokenizer does not match the data)")


def build_gpt_datasets(data_path: list[str], split: str, seq_length: int,
                       num_samples: tuple[int, int, int], seed: int, cache_dir: str | None,
                       is_builder_rank: bool = True, barrier: Callable[[], None] = lambda: None):
    """(train, valid, test) GPTDatasets (BlendedDataset over several prefixes); a split
    with no documents or no requested samples is None. Index caches go to `cache_dir`,
    built by the rank with `is_builder_rank` while the others wait in `barrier()`."""
    weights, prefixes = parse_data_path(data_path)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    ranges = [split_document_ranges(ds.num_documents, split) for ds in indexed]
    cache = dict(cache_dir=cache_dir, is_builder_rank=is_builder_rank, barrier=barrier)
    splits = []
    for s, (name, size) in enumerate(zip(("train", "valid", "test"), num_samples)):
        empty = [prefix for prefix, r in zip(prefixes, ranges) if r[s][0] == r[s][1]]
        if size == 0 or len(empty) == len(prefixes):
            splits.append(None)
        elif empty:
            raise ValueError(f"--split {split}: the {name} split of {empty[0]} has no documents "
                             f"(each blended dataset needs some for every used split)")
        elif len(prefixes) == 1:
            splits.append(GPTDataset(indexed[0], ranges[0][s], seq_length, size, seed, **cache))
        else:
            parts = [GPTDataset(ds, r[s], seq_length, samples_needed(w, size), seed, **cache)
                     for ds, r, w in zip(indexed, ranges, weights)]
            splits.append(BlendedDataset(parts, weights, size, **cache))
    return tuple(splits)
