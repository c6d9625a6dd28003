"""Data-parallel microbatch samplers (megalite.data.loader collates their batches).

`PretrainingSampler` follows Megatron's MegatronPretrainingSampler: the indices
consumed_samples, consumed_samples + 1, ... are cut into global chunks of
micro_batch_size * data_parallel_size; DP rank d takes slice
[d * micro_batch_size, (d + 1) * micro_batch_size) of each chunk. An incomplete
last chunk is dropped. Resuming with consumed_samples = k continues exactly where
a sampler that had yielded k samples over all ranks stopped.

`EpochSampler` does the same over epochs of a dataset shuffled per epoch (finetuning):
the order of each epoch follows from the seed and the epoch, so consumed_samples alone
places a resumed run inside the right epoch.
"""
from __future__ import annotations

from collections.abc import Iterator

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


class EpochSampler:
    """PretrainingSampler's slicing over endless epochs: epoch e (from 1) visits the first
    `samples_per_epoch` rows of randperm(total_samples) seeded with seed + e."""

    def __init__(self, total_samples: int, samples_per_epoch: int, consumed_samples: int,
                 micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                 seed: int) -> None:
        if samples_per_epoch % (micro_batch_size * data_parallel_size) or \
                not 0 < samples_per_epoch <= total_samples:
            raise ValueError(f"sampler: {samples_per_epoch} samples per epoch must be whole "
                             f"chunks of micro_batch_size x data_parallel_size and at most "
                             f"the {total_samples} samples")
        self.total_samples, self.samples_per_epoch, self.seed = \
            total_samples, samples_per_epoch, seed
        self.consumed_samples, self.micro_batch_size = consumed_samples, micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size

    def __iter__(self) -> Iterator[torch.Tensor]:
        epoch, offset = divmod(self.consumed_samples, self.samples_per_epoch)
        while True:
            epoch += 1
            order = torch.randperm(self.total_samples,
                                   generator=torch.Generator().manual_seed(self.seed + epoch))
            for positions in PretrainingSampler(self.samples_per_epoch, offset,
                                                self.micro_batch_size, self.data_parallel_rank,
                                                self.data_parallel_size):
                yield order[positions]
            offset = 0


def row_batches(data: dict[str, torch.Tensor], sampler) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of the rows of `data` (tensors of equal length) that `sampler` yields."""
    for rows in sampler:
        yield {k: v[rows] for k, v in data.items()}
