"""Train a sentencepiece BPE or unigram tokenizer on text files.

    python tools/train_tokenizer.py --input corpus.txt --model-prefix tok --vocab-size 8000

writes tok.model and tok.vocab (ids 0 <unk>, 1 <s>, 2 </s> = end of document, 3 <pad>).
Each input line is one training sentence.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    from megalite.data.tokenizer_training import MODEL_TYPES, train_sentencepiece

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="text files, one sentence a line")
    parser.add_argument("--model-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument("--input-sentence-size", type=int, default=1_000_000,
                        help="sample at most this many lines for training")
    args = parser.parse_args(argv)
    try:
        path = train_sentencepiece(args.input, args.model_prefix, args.vocab_size, args.model_type,
                                   args.input_sentence_size, verbose=True)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"train_tokenizer: {error}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
