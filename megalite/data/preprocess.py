"""Tokenise documents into `<output_prefix>_<key>_document.bin/.idx` (Megatron's naming).

Inputs: JSON lines (`.json`, `.jsonl`, optionally `.gz`), read with `datasets`; any
other file is plain text with one document per paragraph (paragraphs are separated
by blank or whitespace-only lines; a document keeps its inner newlines).
Each document becomes one sequence and one document in the indexed dataset;
documents that tokenise to nothing are skipped.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.data.tokenizers import Tokenizer, build_tokenizer

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's dataset prefix for one JSON key: `<output_prefix>_<key>_document`."""
    return f"{output_prefix}_{key}_document"


def read_paragraphs(path: str) -> Iterator[str]:
    """Paragraphs of a text file, split at blank (or whitespace-only) lines."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def read_documents(path: str, json_keys: Sequence[str]) -> Iterator[dict[str, str]]:
    """Documents of one input file as {key: text}; plain text fills the first key."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: no such file (expected JSON lines or text)")
    if not path.endswith(JSON_SUFFIXES):
        return ({json_keys[0]: text} for text in read_paragraphs(path))
    import datasets

    try:
        rows = datasets.load_dataset("json", data_files=path, split="train", streaming=True)
    except StopIteration:  # what `datasets` raises for a file without a single row
        raise ValueError(f"--input {path}: no JSON lines (the file is empty)") from None
    found = list(rows.features or json_keys)  # features are None when datasets cannot infer them
    missing = [key for key in json_keys if key not in found]
    if missing:
        raise ValueError(f"--json-keys {' '.join(missing)}: not found in {path} "
                         f"(its keys: {', '.join(found)})")
    return ({key: row[key] for key in json_keys} for row in rows)


_WORKER: dict = {}


def _init_worker(tokenizer_path: str, append_eod: bool) -> None:
    _WORKER["tokenizer"] = build_tokenizer(tokenizer_path)
    _WORKER["append_eod"] = append_eod


def _encode(document: dict[str, str]) -> dict[str, np.ndarray]:
    tokenizer: Tokenizer = _WORKER["tokenizer"]
    dtype = best_dtype(tokenizer.vocab_size)
    encoded = {}
    for key, text in document.items():
        ids = tokenizer.tokenize(text or "")
        if ids and _WORKER["append_eod"]:
            ids.append(tokenizer.eod)
        encoded[key] = np.array(ids, dtype=dtype)
    return encoded


def preprocess_documents(documents: Iterable[dict[str, str]], json_keys: Sequence[str],
                         tokenizer_path: str, output_prefix: str, append_eod: bool = False,
                         workers: int = 1, total: int | None = None,
                         progress: bool = True, source: str = "the input"
                         ) -> dict[str, tuple[int, int]]:
    """Tokenise `documents` ({key: text}) with `workers` processes and write one
    indexed dataset per key. Returns {key: (documents written, tokens written)}.

    A key with no tokens in any document raises ValueError naming `source` and leaves no
    files behind."""
    tokenizer = build_tokenizer(tokenizer_path)
    dtype = best_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(output_prefix_for(output_prefix, key) + ".bin", dtype)
                for key in json_keys}
    counts = {key: [0, 0] for key in json_keys}
    pool = multiprocessing.Pool(workers, _init_worker, (tokenizer_path, append_eod)) if workers > 1 else None
    if pool is None:
        _init_worker(tokenizer_path, append_eod)
    try:
        encoded = pool.imap(_encode, documents, chunksize=64) if pool else map(_encode, documents)
        for document in tqdm(encoded, total=total, unit="docs", disable=not progress,
                             desc=f"tokenizing -> {output_prefix}"):
            for key, ids in document.items():
                if ids.size:
                    builders[key].add_item(ids)
                    builders[key].end_document()
                    counts[key][0] += 1
                    counts[key][1] += ids.size
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(output_prefix_for(output_prefix, key) + ".idx")
    empty = [key for key, (docs, _) in counts.items() if not docs]
    if empty:
        for key, ext in itertools.product(json_keys, (".bin", ".idx")):
            os.remove(output_prefix_for(output_prefix, key) + ext)
        raise ValueError(f"--input {source}: no document has text under --json-keys "
                         f"{empty[0]}; nothing written")
    return {key: (docs, tokens) for key, (docs, tokens) in counts.items()}
