"""The collectives megalite's layers call: one place to count bytes and bound waits.

Every function takes an explicit process group. `bytes_moved` counts the payload
bytes each collective was given (per kind), so benchmarks and tests can compare the
traffic with closed forms; `count_bytes()` scopes a fresh count.
"""
import contextlib
import math
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist

bytes_moved: Counter = Counter()


@contextlib.contextmanager
def count_bytes() -> Iterator[Counter]:
    """Yield a Counter of payload bytes per collective kind issued inside the block."""
    start = bytes_moved.copy()
    result: Counter = Counter()
    yield result
    result.update(bytes_moved)
    result.subtract(start)
    for kind in [k for k, v in result.items() if v == 0]:
        del result[kind]  # kinds that moved bytes only outside the block


def _count(kind: str, tensor: torch.Tensor) -> None:
    bytes_moved[kind] += tensor.numel() * tensor.element_size()


def world_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of `tensor` over `group`; a no-op on a group of one."""
    if world_size(group) == 1:
        return None
    _count("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Gather every rank's `tensor` into `output` [world * n0, ...] (rank order) over `group`."""
    _count("all_gather", tensor)
    return dist.all_gather_single(output, tensor.contiguous(), group=group, async_op=async_op)


def all_gather_stacked(tensor: torch.Tensor, group) -> torch.Tensor:
    """[...] per rank -> [world, ...] ordered by group rank."""
    size = world_size(group)
    out = torch.empty((size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
    all_gather_into(out, tensor.reshape(-1), group)
    return out.view((size,) + tensor.shape)


def all_gather_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    """[..., n] per rank -> [..., n * world] ordered by group rank."""
    if world_size(group) == 1:
        return tensor
    return torch.cat(all_gather_stacked(tensor, group).unbind(0), dim=-1)


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Sum `tensor` [world * n0, ...] over `group`; keep this rank's n0-slice in `output`."""
    _count("reduce_scatter", tensor)
    return dist.reduce_scatter_single(output, tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool = False):
    """Broadcast from global rank `src` over `group`; a no-op on a group of one."""
    if world_size(group) == 1:
        return None
    _count("broadcast", tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def batch_send_recv(ops: list[tuple[str, torch.Tensor, int]], group) -> list:
    """Post [("send"|"recv", tensor, global peer rank), ...] together; return the works."""
    p2p = []
    for kind, tensor, peer in ops:
        _count(kind, tensor)
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, tensor, peer, group))
    return dist.batch_isend_irecv(p2p) if p2p else []


def all_to_all_single(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      group, kind: str = "all_to_all") -> torch.Tensor:
    """Rows [sum(input_splits), ...] -> rows [sum(output_splits), ...] over `group`: this rank
    sends input_splits[i] rows to group rank i and receives output_splits[i] from it.

    Counts (under `kind`) only the bytes that leave this rank: the rows kept for itself
    travel no link.
    """
    out = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    size = world_size(group)
    if size == 1:
        out.copy_(tensor)
        return out
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    own = input_splits[dist.get_rank(group)]
    bytes_moved[kind] += (sum(input_splits) - own) * row_bytes
    dist.all_to_all_single(out, tensor.contiguous(), output_splits, input_splits, group=group)
    return out
