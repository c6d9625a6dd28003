"""The data-parallel wrapper of one model chunk: runs the chunk and reads its attributes."""
from torch import nn


class ChunkWrapper(nn.Module):
    """A module that keeps a model chunk as `.module`, forwards to it and answers attribute
    reads the wrapper lacks from it (DistributedDataParallel, FullyShardedChunk)."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)
