"""Train a sentencepiece BPE or unigram model on plain-text files.

The model is lossless: identity normalisation, whitespace kept as is, and byte
fallback so any character (newlines included) round-trips through tokenize and
detokenize. Ids: 0 <unk>, 1 <s>, 2 </s> (end of document), 3 <pad>.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

MODEL_TYPES = ("bpe", "unigram")


def train_sentencepiece(input_files: Sequence[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", input_sentence_size: int = 1_000_000,
                        verbose: bool = False) -> str:
    """Train on the lines of `input_files` (at most `input_sentence_size` sampled lines);
    write `<model_prefix>.model` and `.vocab` and return the `.model` path."""
    import sentencepiece

    if model_type not in MODEL_TYPES:
        raise ValueError(f"--model-type {model_type}: expected one of {', '.join(MODEL_TYPES)}")
    for path in input_files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path}: no such file (expected a text file)")
    sentencepiece.SentencePieceTrainer.train(
        input=list(input_files), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type=model_type, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, byte_fallback=True, split_digits=True,
        character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        num_threads=os.cpu_count() or 1, minloglevel=0 if verbose else 2)
    return model_prefix + ".model"
