"""Tokenise JSON lines or plain text into Megatron-style indexed datasets.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer tokenizer.model --output-prefix data/corpus --append-eod --workers 4

writes data/corpus_text_document.bin/.idx (one per --json-keys key). Files ending in
.json/.jsonl(.gz) are JSON lines; any other file is plain text with one document per
blank-line-separated paragraph (the whole text goes to the first --json-keys key).
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSON lines (.json/.jsonl[.gz]) or a text file")
    parser.add_argument("--output-prefix", required=True,
                        help="writes <output-prefix>_<key>_document.bin/.idx")
    parser.add_argument("--tokenizer", required=True,
                        help="sentencepiece .model file or local Hugging Face tokenizer directory")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenise")
    parser.add_argument("--append-eod", action="store_true",
                        help="append the end-of-document token to each document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: expected a positive number")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megalite.data.preprocess import output_prefix_for, preprocess_documents, read_documents

    try:
        documents = read_documents(args.input, args.json_keys)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        counts = preprocess_documents(documents, args.json_keys, args.tokenizer, args.output_prefix,
                                      args.append_eod, args.workers, source=args.input)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"preprocess_data: {error}")
    for key, (docs, tokens) in counts.items():
        print(f"{output_prefix_for(args.output_prefix, key)}: {docs} documents, {tokens} tokens")


if __name__ == "__main__":
    main()
