"""Horovod's PyTorch API on torch.distributed: change `import horovod.torch as hvd` to
`import megalite.horovod as hvd` and the script runs unchanged, started by torchrun, srun or
tools/horovodrun. See docs/lightning_horovod.md for what maps to what and what is refused.
"""
from megalite.horovod.basics import (cross_rank, cross_size, cuda_built, gloo_built,
                                     gloo_enabled, init, is_homogeneous, is_initialized,
                                     local_rank, local_size, mpi_built, mpi_enabled,
                                     mpi_threads_supported, nccl_built, rank, rocm_built,
                                     size)
from megalite.horovod.compression import Compression
from megalite.horovod.functions import (allgather_object, broadcast_object,
                                        broadcast_optimizer_state, broadcast_parameters)
from megalite.horovod.fusion import count_collectives
from megalite.horovod.ops import (allgather, allgather_async, allreduce, allreduce_,
                                  allreduce_async, allreduce_async_, barrier, broadcast,
                                  broadcast_, broadcast_async, broadcast_async_,
                                  grouped_allreduce, grouped_allreduce_, join, poll,
                                  shutdown, synchronize)
from megalite.horovod.optimizer import DistributedOptimizer
from megalite.horovod.protocol import Adasum, Average, Max, Min, Product, Sum

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "poll", "synchronize", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "Compression", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "count_collectives",
]
