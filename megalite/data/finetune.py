"""Sentence-pair classification data for BERT finetuning: read, WordPiece-encode, serve.

Examples come from a local JSONL / CSV / TSV file with configurable column names
(COLUMNS: `sentence1`, `sentence2`, `label` by default, MNLI's `premise` /
`hypothesis`), or from a `datasets` hub name (`name` or `name:config`) when online.
Encoding uses the pretrained model's own tokenizer (`BertTokenizerFast.from_pretrained`):
[CLS] A [SEP] B [SEP], token type 0 for A (with [CLS] and the first [SEP]), 1 for B,
padded to a fixed length so pipeline stages exchange [s, b, h] of one shape.
Bad input raises a one-line ValueError naming the file, column or value.
"""
import csv
import json
import os
from dataclasses import dataclass

import torch

_VOCAB_FILES = ("tokenizer.json", "vocab.txt")
# --columns presets: (first sentence, second sentence, label) column names.
COLUMNS = {"default": ("sentence1", "sentence2", "label"),
           "mnli": ("premise", "hypothesis", "label")}


@dataclass
class PairExamples:
    """Parallel lists: first sentences, second sentences (None: single-sentence task), labels."""

    first: list[str]
    second: list[str] | None
    labels: list[int]


def load_tokenizer(model_dir: str):
    """The WordPiece tokenizer of a local model directory (never the 5-token vocab_file trap)."""
    from transformers import BertTokenizerFast
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _VOCAB_FILES):
        raise ValueError(f"{model_dir}: no tokenizer ({' or '.join(_VOCAB_FILES)})")
    return BertTokenizerFast.from_pretrained(model_dir, local_files_only=True)


def read_rows(path: str) -> list[dict]:
    """Rows of a .jsonl (one object a line), .csv or .tsv (header line) file."""
    ext = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8", newline="") as f:
        if ext in (".jsonl", ".json"):
            return [_json_line(path, n, line) for n, line in enumerate(f, 1) if line.strip()]
        if ext == ".csv":
            return list(csv.DictReader(f))
        if ext == ".tsv":
            return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    raise ValueError(f"{path}: unknown data format {ext!r} (expected .jsonl, .csv or .tsv)")


def _json_line(path: str, number: int, line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None


def _hub_rows(name: str, split: str) -> list[dict]:
    import datasets
    path, _, config = name.partition(":")
    return list(datasets.load_dataset(path, config or None, split=split))


def read_pairs(source: str, num_labels: int, sentence1: str = "sentence1",
               sentence2: str | None = "sentence2", label: str = "label",
               split: str = "train") -> PairExamples:
    """Examples of a local file, else of the `datasets` hub name `source` (its `split`).

    Labels must be integers in [0, num_labels); `sentence2=None` for single sentences.
    """
    rows = read_rows(source) if os.path.isfile(source) else _hub_rows(source, split)
    wanted = [c for c in (sentence1, sentence2, label) if c is not None]
    for n, row in enumerate(rows, 1):
        missing = [c for c in wanted if c not in row]
        if missing:
            raise ValueError(f"{source}: row {n} has no column {missing[0]!r} "
                             f"(columns: {', '.join(map(str, row))})")
    labels = [_label(source, n, row[label], num_labels) for n, row in enumerate(rows, 1)]
    return PairExamples([str(r[sentence1]) for r in rows],
                        [str(r[sentence2]) for r in rows] if sentence2 else None, labels)


def _label(source: str, row: int, value, num_labels: int) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() \
            or not 0 <= int(text) < num_labels:
        raise ValueError(f"{source}: row {row}: label {value!r} is not an integer in "
                         f"[0, {num_labels})")
    return int(text)


def encode_pairs(tokenizer, examples: PairExamples, seq_length: int) -> dict[str, torch.Tensor]:
    """[CLS] A [SEP] B [SEP], truncated longest-first and padded to seq_length.

    -> input_ids, attention_mask (1 token / 0 padding), tokentype_ids [n, seq_length]; labels [n].
    """
    enc = tokenizer(examples.first, examples.second, truncation=True, max_length=seq_length,
                    padding="max_length", return_tensors="pt", return_token_type_ids=True,
                    return_attention_mask=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "tokentype_ids": enc["token_type_ids"],
            "labels": torch.tensor(examples.labels, dtype=torch.long)}
