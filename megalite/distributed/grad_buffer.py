"""One contiguous fp32 gradient buffer for the parameters of one dtype, split into buckets.

Layout: parameters in reverse order (the order backward produces their grads), each one a
contiguous [start, end) range of the buffer; a bucket closes once it holds at least
`bucket_size` elements (a parameter never straddles two buckets). Each parameter gets
`param.main_grad`, an fp32 view of its range.

With `shard=True` (the distributed optimizer) every bucket is padded to a multiple of
64 x DP elements so that it splits into DP equal, aligned shards; DP rank r owns shard r
of every bucket, which the reduce-scatter fills. The parameters themselves then become
views into a param buffer with the same layout, so the optimizer's updated shards are
all-gathered straight into them.
"""
import torch
import torch.distributed as dist
from torch import nn

from megalite.distributed.reducers import GradReducer, ReducerFactory, default_reducer
from megalite.mpu import comm

SHARD_ALIGNMENT = 64


class Bucket:
    """Elements [start, end) of a GradBuffer, reduced over the DP `group` by `reducer`
    (megalite.distributed.reducers: an all-reduce, or for the distributed optimizer a
    reduce-scatter that leaves the reduced values in this rank's shard only). Grads are
    divided by `mean_over` (default: the group's size) first, the DP mean. `bytes_sent`
    counts the payload bytes of its DP collectives (reductions and param all-gathers; as
    megalite.mpu.comm counts them) since it was built.
    """

    def __init__(self, params: list[nn.Parameter], grad_data: torch.Tensor,
                 param_data: torch.Tensor | None, start: int, group, reducer: GradReducer,
                 mean_over: int | None = None) -> None:
        self.params, self.grad_data, self.param_data = params, grad_data, param_data
        self.start, self.end = start, start + grad_data.numel()
        self.group, self.dp = group, comm.world_size(group)
        self.mean_over = mean_over or self.dp
        self.rank = dist.get_rank(group) if self.dp > 1 else 0
        self.reducer, self.bytes_sent = reducer, 0
        reducer.set_tensor_sizes([p.numel() for p in params])
        self.reset()

    def reset(self) -> None:
        self.pending = set(self.params)
        self.launched, self.handle = False, None

    def shard_range(self) -> tuple[int, int]:
        """This DP rank's [start, end) of the bucket, in buffer coordinates."""
        n = (self.end - self.start) // self.dp
        return self.start + self.rank * n, self.start + (self.rank + 1) * n

    def _local(self, data: torch.Tensor) -> torch.Tensor:
        lo, hi = self.shard_range()
        return data[lo - self.start:hi - self.start]

    def grad_ready(self, param: nn.Parameter) -> None:
        """Called once per synced backward for each param; the last one launches the reduction."""
        self.pending.discard(param)
        if not self.pending and not self.launched:
            self.start_grad_sync()

    def start_grad_sync(self) -> None:
        """Launch the (async) reduction on the DP group."""
        self.launched = True
        if self.mean_over > 1:
            self.grad_data.div_(self.mean_over)
        if self.dp > 1:
            with comm.count_bytes() as moved:
                self.handle = self.reducer.start(self.grad_data, self.group)
            self.bytes_sent += sum(moved.values())

    def finish_grad_sync(self) -> None:
        """Wait for the reduction, launching it first if backward did not."""
        if not self.launched:
            self.start_grad_sync()
        if self.handle is not None:
            self.reducer.wait(self.handle)
            self.handle = None

    def gather_params(self) -> None:
        """All-gather every rank's shard of the param buffer on the DP group (sharded only), in
        place: the shard is the output's own slice (gloo and NCCL read it before writing)."""
        if self.dp > 1:
            with comm.count_bytes() as moved:
                comm.all_gather_into(self.param_data, self._local(self.param_data), self.group)
            self.bytes_sent += sum(moved.values())


class GradBuffer:
    """The fp32 grads (and, sharded, the params) of `params`, all of one dtype, in buckets.

    `all_reduce_params` each get a bucket of their own that is reduced whole even when
    sharded (the tied embedding, whose grad is summed over the embedding group next). Each
    bucket's reducer is `make_reducer(sharded)`.
    """

    def __init__(self, params: list[nn.Parameter], group, bucket_size: int, shard: bool,
                 all_reduce_params: frozenset = frozenset(), mean_over: int | None = None,
                 make_reducer: ReducerFactory = default_reducer) -> None:
        dp = comm.world_size(group)
        pad = SHARD_ALIGNMENT * dp if shard else 1
        groups = _bucket_groups(params[::-1], bucket_size, all_reduce_params)
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        spans, offset = [], 0
        for members in groups:
            start = offset
            for param in members:
                self.ranges[param] = (offset, offset + param.numel())
                offset += param.numel()
            offset = -(-offset // pad) * pad
            spans.append((members, start, offset))
        device, dtype = params[0].device, params[0].dtype
        self.grad_data = torch.zeros(offset, dtype=torch.float32, device=device)
        self.param_data = torch.zeros(offset, dtype=dtype, device=device) if shard else None
        for param, (start, end) in self.ranges.items():
            param.main_grad = self.grad_data[start:end].view_as(param)
            if shard:
                self.param_data[start:end].copy_(param.data.view(-1))
                param.data = self.param_data[start:end].view_as(param)
        self.buckets = [
            Bucket(members, self.grad_data[start:end],
                   None if self.param_data is None else self.param_data[start:end], start, group,
                   make_reducer(shard and not all_reduce_params.intersection(members)),
                   mean_over=mean_over)
            for members, start, end in spans]

    def reset(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()


def _bucket_groups(params: list[nn.Parameter], bucket_size: int,
                   isolated: frozenset) -> list[list[nn.Parameter]]:
    """Split `params` (in buffer order) into buckets of >= bucket_size elements (the last may
    be smaller); each `isolated` param is a bucket of its own."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in params:
        if param in isolated:
            groups += [[param], []]
            size = 0
            continue
        groups[-1].append(param)
        size += param.numel()
        if size >= bucket_size:
            groups.append([])
            size = 0
    return [g for g in groups if g]
