"""Autograd mappings into and out of the tensor-parallel region (Shoeybi et al. 2019).

copy_to (f): identity forward, all-reduce backward.   reduce_from (g): the converse.
scatter_to: keep this rank's slice of the last dim; backward all-gathers it.
gather_from: all-gather the last dim; backward keeps this rank's slice.
Sequence parallelism (Korthikanti et al. 2022) works on the first (sequence) dim of
[s, b, h]: scatter_to_sequence_parallel_region keeps this rank's [s/t, b, h] (backward
all-gathers), gather_from_sequence_parallel_region all-gathers [s, b, h] (backward
reduce-scatters the partial grads, or splits whole ones),
reduce_scatter_to_sequence_parallel_region sums partial [s, b, h] and keeps [s/t, b, h]
(backward all-gathers).
All collectives run on the tensor-parallel group (or the `group` given).
"""
import torch

from megalite.mpu import comm, parallel_state


def _tp_group(group):
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group)
    return x


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = comm.world_size(group)
    if size == 1:
        return x
    rank = torch.distributed.get_rank(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    rank, size = torch.distributed.get_rank(group), comm.world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism: sequence length {x.shape[0]} is not divisible "
                         f"by the tensor-parallel size {size}")
    return x.chunk(size, dim=0)[rank].contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((comm.world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather_into(out, x.contiguous(), group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // comm.world_size(group),) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x.contiguous(), group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_last_dim(grad.contiguous(), ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_last_dim(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, partial_grads):
        ctx.group, ctx.partial_grads = group, partial_grads
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grads:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


def _apply(fn, x: torch.Tensor, group, *args) -> torch.Tensor:
    group = _tp_group(group)
    if comm.world_size(group) == 1:
        return x
    return fn.apply(x, group, *args)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce of the grad backward (on the TP group)."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: all-reduce forward (on the TP group), identity backward."""
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[..., n] -> this rank's [..., n/tp]; backward all-gathers (on the TP group)."""
    return _apply(_ScatterToRegion, x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[..., n/tp] -> [..., n] all-gathered (on the TP group); backward keeps the slice."""
    return _apply(_GatherFromRegion, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[s, ...] -> this rank's [s/t, ...] (contiguous slice); backward all-gathers on the TP
    group."""
    return _apply(_ScatterToSequenceRegion, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """[s/t, ...] -> [s, ...] all-gathered on the TP group. Backward reduce-scatters when the
    consumer is tensor-parallel (each rank's grad a partial sum), else (a replicated
    consumer: every rank's grad is whole) keeps this rank's slice."""
    return _apply(_GatherFromSequenceRegion, x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Partial sums [s, ...] -> this rank's [s/t, ...] of their sum (reduce-scatter on the TP
    group); backward all-gathers."""
    return _apply(_ReduceScatterToSequenceRegion, x, group)
