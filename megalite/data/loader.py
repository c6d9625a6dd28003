"""The input pipeline: batches built off the main thread and moved to the device, and a clock
of the time the training loop waits for them.

`token_batches` runs a torch DataLoader over a megalite batch sampler (PretrainingSampler:
lists of sample indices), so the samples and their order are the sampler's, whatever the
number of worker processes; each worker keeps one batch ready (prefetch_factor 1). On CUDA
the batches are pinned and copied with non_blocking, so the host does not wait for the copy.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from megalite import device


def collate_tokens(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Samples {"tokens": [seq_length + 1]} -> {"tokens": int64 tensor [batch, seq_length + 1]}."""
    return {"tokens": torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))}


def default_num_workers() -> int:
    """--num-workers when not given: 1 on CUDA; 0 on the CPU, where a worker process competes
    with the compute threads for the cores (measured: docs/performance.md "Input pipeline")."""
    return 1 if device.device_type() == "cuda" else 0


def token_batches(dataset, batch_sampler: Iterable[list[int]], num_workers: int,
                  target: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """{"tokens": int64 [micro_batch_size, seq_length + 1]} on `target`: the `dataset` samples
    whose indices `batch_sampler` yields, in its order, collated by `num_workers` processes
    (0: in this thread). The loader's own generator leaves torch's global RNG untouched (a
    resumed run's dropout masks depend on it)."""
    loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_tokens,
                        num_workers=num_workers, prefetch_factor=1 if num_workers else None,
                        pin_memory=target.type == "cuda", generator=torch.Generator())
    for batch in loader:
        yield {name: tensor.to(target, non_blocking=True) for name, tensor in batch.items()}


class TimedIterator:
    """An iterator that adds up the seconds its `next` takes (for the batches: the time the
    loop waits for data); `take()` returns them and starts again from 0."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator, self.seconds = iterator, 0.0

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
