"""Token dispatch to the experts of the expert-parallel (EP) group by all-to-all, and back.

EP rank r owns experts [r * E_local, (r + 1) * E_local). `plan_dispatch` sorts this rank's
(token, choice) pairs by expert (dropping those over capacity), exchanges the per-expert
counts (all-to-all of E integers on the EP group) and fixes the variable splits; `dispatch`
sends the permuted rows [N, h] and regroups what arrives by local expert; `combine`
undoes both, weights each row by its router weight and sums the k rows of every token.
Backward of each all-to-all is the all-to-all with the splits swapped.
"""
import math
from dataclasses import dataclass

import torch

from megalite.mpu import comm


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
    """Where this rank's rows go and what comes back (all sizes host-side lists).

    token_index [N]: source token of each kept (token, choice), sorted by expert;
    weights [N]: their router weights; send_splits / recv_splits: rows per EP rank;
    regroup [M]: received rows (ordered by source rank, then local expert) reordered by
    local expert, then source rank; tokens_per_local_expert: rows each local expert gets;
    tokens_per_expert [E]: kept choices per global expert from this rank; dropped: choices
    over capacity.
    """

    token_index: torch.Tensor
    weights: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor
    tokens_per_local_expert: list[int]
    tokens_per_expert: torch.Tensor
    dropped: int


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Choices one expert takes from one rank's T tokens: ceil(T * k / E * factor)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def plan_dispatch(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                  capacity: int | None = None, group=None) -> DispatchPlan:
    """indices, weights [T, k] -> the plan; exchanges counts on the EP `group`.

    With a `capacity`, each expert keeps the first `capacity` choices in token order (then
    choice order) of this rank's tokens; the rest are dropped (they add nothing to the output).
    """
    num_tokens, topk = indices.shape
    flat_expert = indices.reshape(-1)
    order = torch.sort(flat_expert, stable=True).indices
    counts = torch.bincount(flat_expert, minlength=num_experts)
    dropped = 0
    if capacity is not None:
        starts = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
        keep = position < capacity
        dropped = int((~keep).sum())
        order, counts = order[keep], counts.clamp(max=capacity)
    ep = comm.world_size(group)
    local = num_experts // ep
    recv_counts = comm.all_to_all_single(counts, [local] * ep, [local] * ep, group,
                                         kind="all_to_all_counts").view(ep, local)
    recv = recv_counts.tolist()
    starts = recv_counts.reshape(-1).cumsum(0) - recv_counts.reshape(-1)
    starts = starts.view(ep, local).tolist()
    regroup = [torch.arange(starts[src][e], starts[src][e] + recv[src][e])
               for e in range(local) for src in range(ep)]
    return DispatchPlan(
        token_index=torch.div(order, topk, rounding_mode="floor"),
        weights=weights.reshape(-1)[order],
        send_splits=counts.view(ep, local).sum(1).tolist(),
        recv_splits=[sum(row) for row in recv],
        regroup=torch.cat(regroup).to(indices.device) if regroup else
        torch.zeros(0, dtype=torch.long, device=indices.device),
        tokens_per_local_expert=recv_counts.sum(0).tolist(),
        tokens_per_expert=counts, dropped=dropped)


def dispatch(x: torch.Tensor, plan: DispatchPlan, group=None) -> torch.Tensor:
    """Tokens [T, h] -> rows for the local experts [M, h], grouped by local expert."""
    permuted = x.index_select(0, plan.token_index)
    received = _AllToAll.apply(permuted, plan.recv_splits, plan.send_splits, group)
    return received.index_select(0, plan.regroup)


def combine(y: torch.Tensor, plan: DispatchPlan, num_tokens: int, group=None) -> torch.Tensor:
    """Expert outputs [M, h] (as `dispatch` grouped them) -> [T, h]: sum over each token's
    kept choices of router weight x expert output."""
    ungrouped = torch.empty_like(y).index_copy(0, plan.regroup, y)
    returned = _AllToAll.apply(ungrouped, plan.send_splits, plan.recv_splits, group)
    weighted = returned * plan.weights.to(returned.dtype).unsqueeze(-1)
    out = weighted.new_zeros((num_tokens, y.shape[-1]))
    return out.index_add(0, plan.token_index, weighted)
