"""The data-parallel model wrapper: grads into bucketed fp32 buffers, reduced during backward."""
import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megalite.distributed.grad_buffer import Bucket, GradBuffer
from megalite.distributed.reducers import ReducerFactory, default_reducer
from megalite.distributed.wrapper import ChunkWrapper
from megalite.models.stage import shared_embedding_params
from megalite.mpu import comm, parallel_state
from megalite.config.sharding import NO_SHARD, OPTIM


class DistributedDataParallel(ChunkWrapper):
    """Wrap one model chunk: its grads accumulate into `param.main_grad` (fp32, one contiguous
    buffer per param dtype), averaged over the DP x CP group bucket by bucket.

    A post-accumulate-grad hook adds each `param.grad` into `main_grad` and frees it; with
    `overlap_grad_reduce` a bucket's reduction is launched (async) as soon as its last grad
    arrives (under a split backward, when the last W step of the bucket's weights lands).
    Inside `no_sync()` grads only accumulate. `finish_grad_sync()` waits for every
    bucket (launching those not yet launched); `zero_grad_buffer()` starts the next step.
    With `use_distributed_optimizer` (strategy optim, else no_shard) buckets are padded and
    reduce-scattered (see GradBuffer). `make_reducer` gives each bucket its reducer
    (megalite.distributed.reducers; an optimizer kind may supply its own).
    Expert parameters (`expert_parallel`, MoE) get buffers of their own, reduced over the
    expert-data-parallel group only (their other DP ranks hold other experts), still divided
    by the full DP size: each expert's grad already sums the tokens of its whole EP group.
    With `replicas_apart`, parameters that are replicas of others get buckets of their own:
    the TP-replicated ones (TP > 1; neither split over TP nor summed over it afterwards:
    norms, biases of row-parallel layers) a grad buffer, the tied embedding (first and last
    stage) a bucket. A reducer whose result depends on the whole bucket (the 1-bit
    compression's chunks and pieces) then gives the replicas the same values.
    Calls and unknown attributes (`set_input_tensor`, `config`, ...) go to the wrapped module.
    """

    def __init__(self, module: nn.Module, bucket_size: int = 40_000_000,
                 overlap_grad_reduce: bool = True, use_distributed_optimizer: bool = False,
                 data_parallel_group=None, make_reducer: ReducerFactory = default_reducer,
                 replicas_apart: bool = False) -> None:
        super().__init__()
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.strategy = OPTIM if use_distributed_optimizer else NO_SHARD
        self.data_parallel_group = (parallel_state.get_data_parallel_group(
                                        with_context_parallel=True)
                                    if data_parallel_group is None else data_parallel_group)
        params = [p for p in module.parameters() if p.requires_grad]
        tied = frozenset(shared_embedding_params(module)) \
            if use_distributed_optimizer or replicas_apart else frozenset()
        expert_group = parallel_state.get_expert_data_parallel_group()
        apart = replicas_apart and parallel_state.get_tensor_model_parallel_world_size() > 1
        by_kind: dict[tuple[torch.dtype, bool, bool], list[nn.Parameter]] = {}
        for param in params:
            expert = getattr(param, "expert_parallel", False)
            by_kind.setdefault((param.dtype, expert, apart and tp_replicated(param)),
                               []).append(param)
        dp = comm.world_size(self.data_parallel_group)
        self.grad_buffers = [GradBuffer(same_kind, expert_group if expert
                                        else self.data_parallel_group, bucket_size,
                                        use_distributed_optimizer, tied, mean_over=dp,
                                        make_reducer=make_reducer)
                             for (_, expert, _), same_kind in by_kind.items()]
        self._bucket_of: dict[nn.Parameter, Bucket] = {
            p: bucket for bucket in self.buckets() for p in bucket.params}
        self._sync = True
        # The hooks live in autograd's C++ state, out of reach of Python's cycle collector: a
        # hook holding this wrapper would keep it, its model and its groups alive for good.
        hook = _weak_hook(self)
        for param in params:
            param.register_post_accumulate_grad_hook(hook)

    def _accumulate(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:  # weight grad deferred to a W step (megalite.mpu.weight_grad)
            return
        if grad.dtype != param.main_grad.dtype and grad.device.type == "cpu":
            grad = grad.float()  # a mixed-dtype add_ is unvectorized on CPU (about 3x slower)
        param.main_grad.add_(grad)
        param.grad = None
        if self._sync and self.overlap_grad_reduce:
            self._bucket_of[param].grad_ready(param)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate grads (all but the last microbatch)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def buckets(self) -> list[Bucket]:
        return [bucket for buffer in self.grad_buffers for bucket in buffer.buckets]

    def finish_grad_sync(self) -> None:
        """Complete every bucket's DP reduction; main_grad then holds the DP mean
        (sharded: only in this rank's shards)."""
        for bucket in self.buckets():
            bucket.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad and re-arm the buckets for the next step."""
        for buffer in self.grad_buffers:
            buffer.reset()
        for param in self._bucket_of:
            param.grad = None


def tp_replicated(param: nn.Parameter) -> bool:
    """Whether `param` holds the same values and grads on every TP rank (neither split over TP
    nor holding a part of its grad that TP sums afterwards)."""
    return not (getattr(param, "tensor_model_parallel", False)
                or getattr(param, "tp_grad_partial", False))


def _weak_hook(ddp: DistributedDataParallel) -> Callable[[nn.Parameter], None]:
    """`ddp._accumulate` through a weak reference (the param's hook must not own the wrapper)."""
    ref = weakref.ref(ddp)

    def hook(param: nn.Parameter) -> None:
        wrapper = ref()
        if wrapper is not None:
            wrapper._accumulate(param)
    return hook
