"""Token dispatch to the experts of the expert-parallel (EP) group by all-to-all, and back.

EP rank r owns experts [r * E_local, (r + 1) * E_local). `plan_dispatch` sorts this rank's
(token, choice) pairs by expert (dropping those over capacity), exchanges the per-expert
counts (all-to-all of E integers on the EP group) and reads the variable splits on the host
(the layer's one host sync: all-to-all takes them as host lists); `dispatch` sends the
permuted rows [N, h] and regroups what arrives by local expert; `combine` undoes both,
weights each row by its router weight and sums the k rows of every token.
Backward of each all-to-all is the all-to-all with the splits swapped.

With a `gather` group (TP under sequence parallelism: each TP rank routed its own tokens),
the rows received over EP are also gathered over it (variable sizes, as an all-to-all of
copies), so every TP rank runs its expert shards on the rows of all of them; `combine`
reduce-scatters the partial outputs back (the adjoint).
"""
import math
from dataclasses import dataclass

import torch

from megalite.moe.router import tokens_per_expert
from megalite.mpu import comm


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group
              ) -> torch.Tensor:
    """All-to-all of rows over `group` (autograd: backward swaps the splits); on a group of
    one rank, x itself (no copy forward or backward)."""
    if comm.world_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return comm.all_to_all_single(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return comm.all_to_all_single(grad, input_splits, output_splits, ctx.group), \
            None, None, None


@dataclass
class DispatchPlan:
    """Where this rank's rows go and what comes back.

    token_index [N]: source token of each kept (token, choice), sorted by expert;
    weights [N]: their router weights; send_splits / recv_splits: rows per EP rank (host
    lists, as all-to-all takes them); regroup [M]: received rows (ordered by source rank,
    then local expert) reordered by local expert, then source rank (None where that order is
    already by local expert: one source or one local expert); tokens_per_local_expert:
    rows each local expert gets (host list); tokens_per_expert [E]: kept choices per global
    expert from this rank; dropped []: choices over capacity; gather_splits: rows each rank of
    the gather group received over EP (host list; None without one). Tensors stay on the
    device.
    """

    token_index: torch.Tensor
    weights: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor | None
    tokens_per_local_expert: list[int]
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    gather_splits: list[int] | None = None


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Choices one expert takes from one rank's T tokens: ceil(T * k / E * factor)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def plan_dispatch(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                  capacity: int | None = None, group=None, gather=None) -> DispatchPlan:
    """indices, weights [T, k] -> the plan; exchanges counts on the EP `group` (and
    all-gathers the received counts on the `gather` group).

    With a `capacity`, each expert keeps the first `capacity` choices in token order (then
    choice order) of this rank's tokens; the rest are dropped (they add nothing to the output).
    One host sync: the row counts, read once (see below); everything else stays on the device.
    """
    num_tokens, topk = indices.shape
    flat_expert = indices.reshape(-1)
    order = torch.sort(flat_expert, stable=True).indices
    counts = tokens_per_expert(indices, num_experts)
    kept = counts if capacity is None else counts.clamp(max=capacity)
    ep = comm.world_size(group)
    local = num_experts // ep
    recv_counts = kept if ep == 1 else comm.all_to_all_single(
        kept, [local] * ep, [local] * ep, group, kind="all_to_all_counts")
    gathered = 1 if gather is None else comm.world_size(gather)
    all_counts = recv_counts if gather is None else \
        comm.all_gather_stacked(recv_counts, gather).reshape(-1)
    # The layer's one unavoidable host sync: all_to_all_single (gloo and NCCL) takes its
    # split sizes as host lists, and the experts' matmuls their row counts. Read them in one
    # transfer: rows sent to each EP rank, then rows received [gather ranks x ep, local].
    sizes = torch.cat([kept.view(ep, local).sum(1), all_counts]).tolist()
    send_splits, received = sizes[:ep], sizes[ep:]
    sources = gathered * ep
    recv = [received[src * local:(src + 1) * local] for src in range(sources)]
    if capacity is not None:
        order = _keep_within_capacity(order, flat_expert, counts, capacity, sum(send_splits))
    me = 0 if gather is None else torch.distributed.get_rank(gather)
    return DispatchPlan(
        token_index=torch.div(order, topk, rounding_mode="floor"),
        weights=weights.reshape(-1).index_select(0, order),
        send_splits=send_splits,
        recv_splits=[sum(row) for row in recv[me * ep:(me + 1) * ep]],
        regroup=None if sources == 1 or local == 1 else
        _regroup(all_counts, sources, local, sum(received)),
        tokens_per_local_expert=[sum(column) for column in zip(*recv)],
        tokens_per_expert=kept,
        dropped=counts.new_zeros(()) if capacity is None else (counts - kept).sum(),
        gather_splits=None if gather is None else
        [sum(sum(row) for row in recv[r * ep:(r + 1) * ep]) for r in range(gathered)])


def _keep_within_capacity(order: torch.Tensor, flat_expert: torch.Tensor, counts: torch.Tensor,
                          capacity: int, num_kept: int) -> torch.Tensor:
    """order [T * k] (choices sorted by expert) -> the `num_kept` of them within their expert's
    first `capacity`, in the same order (a sort, not a boolean mask: no host sync)."""
    starts = counts.cumsum(0) - counts
    index = torch.arange(order.numel(), device=order.device)
    position = index - starts[flat_expert[order]]
    dropped_last = torch.where(position < capacity, index, index + order.numel())
    return order[torch.sort(dropped_last).indices[:num_kept]]


def _regroup(recv_counts: torch.Tensor, sources: int, local: int, num_rows: int
             ) -> torch.Tensor:
    """recv_counts [sources * local] (rows from each source for each local expert) -> [M]:
    the received rows' order by local expert, then source (built on the device)."""
    segment = torch.repeat_interleave(torch.arange(sources * local, device=recv_counts.device),
                                      recv_counts, output_size=num_rows)
    by_expert = segment % local * sources + torch.div(segment, local, rounding_mode="floor")
    return torch.sort(by_expert, stable=True).indices


def dispatch(x: torch.Tensor, plan: DispatchPlan, group=None, gather=None) -> torch.Tensor:
    """Tokens [T, h] -> rows for the local experts [M, h], grouped by local expert (with a
    `gather` group: the rows of all its ranks)."""
    permuted = x.index_select(0, plan.token_index)
    received = _exchange(permuted, plan.recv_splits, plan.send_splits, group)
    if gather is not None:  # all-gather of variable sizes; backward sums the copies' grads
        mine = [received.shape[0]] * len(plan.gather_splits)
        received = _exchange(received.repeat(len(mine), 1), plan.gather_splits, mine,
                                   gather)
    return received if plan.regroup is None else received.index_select(0, plan.regroup)


def combine(y: torch.Tensor, plan: DispatchPlan, num_tokens: int, group=None, gather=None
            ) -> torch.Tensor:
    """Expert outputs [M, h] (as `dispatch` grouped them; partial sums over the `gather`
    group when given) -> [T, h]: sum over each token's kept choices of router weight x expert
    output."""
    ungrouped = y if plan.regroup is None else \
        torch.empty_like(y).index_copy(0, plan.regroup, y)
    if gather is not None:  # reduce-scatter of variable sizes
        mine = sum(plan.recv_splits)
        ungrouped = _exchange(ungrouped, [mine] * len(plan.gather_splits),
                                    plan.gather_splits, gather)
        ungrouped = ungrouped.view(len(plan.gather_splits), mine, y.shape[-1]).sum(0)
    returned = _exchange(ungrouped, plan.send_splits, plan.recv_splits, group)
    weighted = returned * plan.weights.to(returned.dtype).unsqueeze(-1)
    return weighted.new_zeros((num_tokens, y.shape[-1])).index_add_(0, plan.token_index, weighted)
