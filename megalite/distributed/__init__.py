"""Data parallelism, Megatron style: a model wrapper that owns the gradients.

torch's `DistributedDataParallel` also buckets grads and overlaps their all-reduce with
backward, but it reduces `param.grad` in the parameter's own dtype and keeps the
buffer to itself. Megatron-style training needs more from that buffer, so megalite
keeps its own (`DistributedDataParallel` here, not torch's):

- fp32 main grads: with bf16/fp16 parameters, grads are accumulated over microbatches
  and reduced in fp32 (`param.main_grad`), which the optimizer's fp32 main params step
  with directly, no copy.
- one contiguous buffer per dtype: buckets are plain slices, so a bucket is one
  collective, and the optimizer can view any range of it.
- sharding for the distributed optimizer (ZeRO-1): the buffer is padded so each bucket
  splits evenly across DP ranks; buckets are reduce-scattered and each rank's optimizer
  steps only its shard, then all-gathers the params (which are views into a matching
  param buffer).
- a reducer per bucket (megalite.distributed.reducers.GradReducer): how its flat grads
  travel, the all-reduce or reduce-scatter by default; an optimizer kind may supply its own.
- explicit gradient accumulation: `no_sync()` for all but the last microbatch, and
  `finish_grad_sync()` at a point the training step chooses (before the tied-embedding
  all-reduce and the optimizer), which also works under pipeline schedules that run
  many backwards per chunk.

The fully sharded strategies (ZeRO-2 `optim_grads`, ZeRO-3 `optim_grads_params`) run on
torch's FSDP2 instead: `megalite.distributed.fsdp.shard_model` wraps a chunk with the same
step interface.
"""
from megalite.distributed.ddp import DistributedDataParallel
from megalite.distributed.grad_buffer import Bucket, GradBuffer
from megalite.distributed.reducers import GradReducer

__all__ = ["DistributedDataParallel", "GradBuffer", "Bucket", "GradReducer"]
