"""Data-parallel microbatch samplers and the iterator that collates their batches.

`PretrainingSampler` follows Megatron's MegatronPretrainingSampler: the indices
consumed_samples, consumed_samples + 1, ... are cut into global chunks of
micro_batch_size * data_parallel_size; DP rank d takes slice
[d * micro_batch_size, (d + 1) * micro_batch_size) of each chunk. An incomplete
last chunk is dropped. Resuming with consumed_samples = k continues exactly where
a sampler that had yielded k samples over all ranks stopped.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


class PretrainingSampler:
    """Yields lists of micro_batch_size sample indices for one data-parallel rank."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if total_samples <= 0 or micro_batch_size <= 0 or consumed_samples < 0:
            raise ValueError(f"sampler: expected total_samples > 0, micro_batch_size > 0, "
                             f"consumed_samples >= 0; got {total_samples}, {micro_batch_size}, "
                             f"{consumed_samples}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"sampler: data_parallel_rank {data_parallel_rank} outside "
                             f"[0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_chunk = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return max(self.total_samples - self.consumed_samples, 0) // self.global_chunk

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for start in range(first, first + len(self) * self.global_chunk, self.global_chunk):
            yield list(range(start, start + self.micro_batch_size))


def batch_iterator(dataset, sampler) -> Iterator[dict[str, torch.Tensor]]:
    """Batches {"tokens": int64 tensor [micro_batch_size, seq_length + 1]} of `dataset`
    samples in the order `sampler` yields their indices."""
    for indices in sampler:
        tokens = np.stack([dataset[i]["tokens"] for i in indices])
        yield {"tokens": torch.from_numpy(tokens.astype(np.int64))}
