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
    import functools

    import pretrain_gpt
    from megalite.config import parse_configs
    from megalite.training import pretrain
    configs = parse_configs(argv, defaults=pretrain_gpt.DEFAULTS)
    result = pretrain(configs, functools.partial(pretrain_gpt.model_provider, configs),
                      pretrain_gpt.forward_step, pretrain_gpt.datasets_provider,
                      prepare=pretrain_gpt.prepare, check_inputs=pretrain_gpt.check_inputs)
    return result.losses
