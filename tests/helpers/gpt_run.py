"""Tiny end-to-end GPT runs shared by the training tests: data on disk and a rank-pool task."""
import os

import numpy as np

from megalite.data.indexed_dataset import IndexedDatasetBuilder

VOCAB = 97


def make_dataset(directory: str, documents: int = 200, seed: int = 0) -> str:
    """Random-token documents of 5-60 tokens as a .bin/.idx pair; returns the prefix."""
    prefix = os.path.join(directory, "tiny_text_document")
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_item(rng.integers(0, VOCAB, rng.integers(5, 60)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def make_sp_model(directory: str) -> str:
    """A 300-piece sentencepiece model (its ids cover the tiny dataset's 0..96); its path."""
    from megalite.data.tokenizer_training import train_sentencepiece
    text = os.path.join(directory, "corpus.txt")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), 5)) for _ in range(300)]
    with open(text, "w") as f:
        f.write("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    return train_sentencepiece([text], os.path.join(directory, "sp"), 300)


def tiny_args(prefix: str, save: str, iters: int, *extra: str) -> list[str]:
    """Flags of a 4-layer, hidden-32 GPT on `prefix`, dropout on (RNG state matters),
    bitwise-repeatable on CUDA too (--deterministic-mode)."""
    return ["--data-path", prefix, "--vocab-size", str(VOCAB), "--num-layers", "4",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(iters), "--eval-interval", "0",
            "--log-interval", "1000", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
            "--lr-warmup-iters", "1", "--save", save, "--data-cache-dir",
            os.path.join(os.path.dirname(prefix), "cache"), "--deterministic-mode", *extra]


def train(argv: list[str]) -> dict[int, float]:
    """Run pretrain_gpt in this (already distributed) process; the loss of each iteration."""
    from megalite.tasks import gpt as pretrain_gpt
    return pretrain_gpt.run(argv).losses


def train_with_grad_norms(argv: list[str]) -> tuple[dict[int, float], dict[int, float | None]]:
    """Like `train`: the loss and the global gradient norm (before clipping) of each
    iteration."""
    from megalite.tasks import gpt as pretrain_gpt
    result = pretrain_gpt.run(argv)
    return result.losses, result.grad_norms
