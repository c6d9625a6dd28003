"""Horovod's collectives on torch.distributed: allreduce, allgather and broadcast (returning a
new tensor, in place `*_`, or asynchronous `*_async` with `poll`/`synchronize`), `join` and
`barrier`. They run on all ranks of the group `init()` joined (gloo on CPU, NCCL on GPUs),
staging tensors on that group's device; all-reduces go through Tensor Fusion
(megalite.horovod.fusion), the others are sent at once. Each is announced by a control round
(megalite.horovod.protocol) so that ranks that have called `join()` take part.
"""
import math

import torch

from megalite.horovod import basics, fusion, protocol
from megalite.horovod.basics import topology
from megalite.horovod.compression import Compression
from megalite.horovod.fusion import Handle
from megalite.horovod.protocol import Adasum, Average, Sum
from megalite.mpu import comm

ADASUM_REFUSED = ("megalite.horovod: op=hvd.Adasum is not supported (its pairwise "
                  "projections have no torch.distributed collective); use op=hvd.Average or "
                  "hvd.Sum")


def reduce_op(average: bool | None, op: int | None) -> int:
    """Horovod's op resolution: `op`, else the deprecated `average` flag, else Average."""
    if op is None:
        return Sum if average is False else Average
    if average is not None:
        raise ValueError("megalite.horovod.allreduce: give op= or the deprecated average=, "
                         "not both")
    if op == Adasum:
        raise NotImplementedError(ADASUM_REFUSED)
    if op not in protocol.REDUCE_OPS:
        raise ValueError(f"megalite.horovod.allreduce: op={op!r}: expected hvd.Average, "
                         f"hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


def all_ranks(process_set) -> None:
    if process_set is not None:
        raise NotImplementedError("megalite.horovod: process sets are not supported; every "
                                  "collective runs on all ranks (drop process_set=)")


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Reduce `tensor` over all ranks in place, asynchronously; `name` is accepted and unused
    (ranks match collectives by order)."""
    all_ranks(process_set)
    return fusion.submit_allreduce(tensor, tensor, reduce_op(average, op), prescale_factor,
                                   postscale_factor)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Reduce `tensor` over all ranks into a new tensor, asynchronously."""
    all_ranks(process_set)
    output = torch.empty_like(tensor, requires_grad=False)
    return fusion.submit_allreduce(tensor, output, reduce_op(average, op), prescale_factor,
                                   postscale_factor)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=None) -> torch.Tensor:
    """The reduction (Average by default) of `tensor` over all ranks, a new tensor (not
    differentiable); `compression` squeezes it on the wire."""
    compressed, ctx = compression.compress(tensor)
    reduced = synchronize(allreduce_async(compressed, average, name, op, prescale_factor,
                                          postscale_factor, process_set))
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression=Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=None) -> list[torch.Tensor]:
    """`allreduce` of each tensor, submitted together so that they fuse."""
    packed = [compression.compress(t) for t in tensors]
    handles = [allreduce_async(t, average, name, op, prescale_factor, postscale_factor,
                               process_set) for t, _ in packed]
    return [compression.decompress(synchronize(h), ctx) for h, (_, ctx) in zip(handles, packed)]


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set=None) -> list[torch.Tensor]:
    """`allreduce_` of each tensor, submitted together so that they fuse."""
    handles = [allreduce_async_(t, average, name, op, prescale_factor, postscale_factor,
                                process_set) for t in tensors]
    return [synchronize(h) for h in handles]


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set=None) -> Handle:
    """Concatenate every rank's `tensor` along dim 0, in rank order, asynchronously; the first
    dimension may differ between ranks, the others may not."""
    all_ranks(process_set)
    fusion.flush()  # collectives start in the order they were submitted
    topo = topology()
    rows = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    row_shape, row_numel = rows.shape[1:], math.prod(rows.shape[1:])
    descriptor = protocol.Descriptor("allgather", rows.dtype, row_numel)
    protocol.announce(descriptor).active_ranks(descriptor)  # the row counts come next
    counts = protocol.gather_row_counts(rows.shape[0])
    most = max(counts)
    padded = torch.zeros(most * row_numel, dtype=rows.dtype, device=topo.device)
    padded[:rows.numel()] = rows.reshape(-1)
    gathered = torch.empty(topo.size * most * row_numel, dtype=rows.dtype, device=topo.device)
    fusion.log("allgather", 1, padded)
    work = comm.all_gather_into(gathered, padded, topo.group, async_op=True)

    def finish() -> torch.Tensor:
        per_rank = gathered.view(topo.size, most * row_numel)
        parts = [per_rank[r, :count * row_numel] for r, count in enumerate(counts)]
        return torch.cat(parts).view(sum(counts), *row_shape).to(tensor.device)
    return fusion.launched(None, [work], finish)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set=None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order."""
    return synchronize(allgather_async(tensor, name, process_set))


def _broadcast_into(tensor: torch.Tensor, root_rank: int) -> Handle:
    """Overwrite `tensor` with global rank `root_rank`'s, asynchronously."""
    topo = topology()
    if not 0 <= root_rank < topo.size:
        raise ValueError(f"megalite.horovod.broadcast: root_rank={root_rank}: expected a rank "
                         f"in [0, {topo.size})")
    fusion.flush()
    target = tensor.detach()
    staged = target if target.device == topo.device and target.is_contiguous() else \
        target.to(topo.device).contiguous()
    descriptor = protocol.Descriptor("broadcast", staged.dtype, staged.numel(), root=root_rank)
    announcement = protocol.announce(descriptor)
    fusion.log("broadcast", 1, staged)
    work = comm.broadcast(staged, root_rank, topo.group, async_op=True)

    def finish() -> torch.Tensor:
        announcement.active_ranks(descriptor)
        if staged is not target:
            target.copy_(staged)
        return tensor
    return fusion.launched(None, [announcement.work, work], finish)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set=None) -> Handle:
    """Overwrite `tensor` with rank `root_rank`'s, asynchronously."""
    all_ranks(process_set)
    return _broadcast_into(tensor, root_rank)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set=None) -> Handle:
    """Rank `root_rank`'s `tensor`, as a new tensor on every rank, asynchronously."""
    all_ranks(process_set)
    return _broadcast_into(tensor.detach().clone(), root_rank)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set=None) -> torch.Tensor:
    """Overwrite `tensor` with rank `root_rank`'s; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set=None) -> torch.Tensor:
    """Rank `root_rank`'s `tensor`, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def shutdown() -> None:
    """Drop the fusion buffer and the layout; leave the default group if `init()` joined it
    (call `init()` again to continue)."""
    fusion.reset()
    basics.leave()


def poll(handle: Handle) -> bool:
    """Whether the asynchronous operation of `handle` has completed."""
    return handle.poll()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for the asynchronous operation of `handle`; its output tensor."""
    return handle.wait()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the other ranks' collectives (contributing
    zeros, or the reduction's identity) until every rank has joined; the rank that joined last.

    An Average over the ranks still active divides by their number. `device` is accepted and
    unused: buffers go on the group's device.
    """
    topo = topology()
    fusion.flush()
    if topo.size == 1:
        return 0
    joined_at = protocol.rounds
    protocol.serve_until_all_joined()
    last = torch.tensor([joined_at * topo.size + topo.rank], device=topo.device)
    comm.all_reduce(last, topo.group, op=torch.distributed.ReduceOp.MAX)
    return int(last.item()) % topo.size


def barrier(process_set=None) -> None:
    """Wait until every rank (joined ones included) gets here."""
    allreduce(torch.zeros(1, device=topology().device), op=Sum, process_set=process_set)
