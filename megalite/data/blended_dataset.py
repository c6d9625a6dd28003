"""Weighted blending of several datasets, Megatron-style.

Sample i comes from the dataset whose achieved count lags its weight the most:
argmax_d(weights[d] * max(i, 1) - count[d]) (first d on ties); it takes that
dataset's next unused sample. Deterministic, and after any n samples each count
is within 1 of weights[d] * n, so dataset d needs at most ceil(weights[d] * n) + 1.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from megalite.data.index_cache import cached_indices


def samples_needed(weight: float, size: int) -> int:
    """Samples a component of normalised `weight` must provide for a blend of `size`."""
    return math.ceil(weight * size) + 1


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index [size] int16, dataset_sample_index [size] int64) for normalised weights."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    order = range(len(weights))
    for i in range(size):
        scale = max(i, 1)
        chosen = max(order, key=lambda d: weights[d] * scale - counts[d])
        dataset_index[i] = chosen
        sample_index[i] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised here)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int,
                 cache_dir: str | None = None, is_builder_rank: bool = True,
                 barrier: Callable[[], None] = lambda: None) -> None:
        if len(datasets) != len(weights) or min(weights) <= 0:
            raise ValueError(f"blending weights {list(weights)}: expected one positive weight "
                             f"per dataset ({len(datasets)} datasets)")
        self.datasets = list(datasets)
        self.weights = [w / sum(weights) for w in weights]
        description = {"kind": "BlendedDataset", "version": 1, "weights": self.weights, "size": size}
        arrays = cached_indices(
            cache_dir, description, ("dataset_index", "dataset_sample_index"),
            lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                             build_blending_indices(self.weights, size))),
            is_builder_rank, barrier)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for dataset, count in zip(self.datasets, counts):
            if count > len(dataset):
                raise ValueError(f"blend needs {count} samples from a dataset of {len(dataset)}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]
