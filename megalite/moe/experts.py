"""Grouped experts (--moe-grouped-gemm): a layer's local experts as two stacked weights, run
as one grouped matmul per projection over the rows sorted by expert.

weight1 [E_local, (2 x) ffn/tp, h] and weight2 [E_local, h, ffn/tp] hold, slice by slice, the
TP shards ParallelMLP's dense_h_to_4h / dense_4h_to_h would hold for each expert (SwiGLU:
[gate; up] halves). `expert_keys` names each slice as the per-expert parameter
(`{e}.dense_h_to_4h.weight`), so full state dicts, checkpoints and HF mappings see the same
names as with looped experts, and a checkpoint of one form loads into the other
(megalite.models.sharding). The matmul backend is chosen once at construction:
`torch._grouped_mm` wherever it runs for the dtype and shapes (GPUs; on the CPU, torch 2.13
runs it as one matmul per expert, with the operands the looped experts' linears use, so the
results and autograd's grads equal theirs bit for bit, with no padding: see
docs/performance.md "DeepSeek-V3 MoE block"); elsewhere (e.g. rows whose stride is not a
multiple of 16 bytes) one batched matmul over the rows padded to the busiest expert's count,
or, when padding would more than double the rows, one matmul per expert. The grouped
matmuls' backward is autograd's: it needs a grad with real strides, which MoELayer's combine
gives (a product, never an expanded tensor). Weight grads are not deferred to zero-bubble W
steps here (they are with looped experts).
"""
import functools
import itertools

import torch
from torch import nn

from megalite.mpu.mlp import ParallelMLP
from megalite.mpu.weight_grad import linear

_STACKED_ATTRIBUTES = ("tensor_model_parallel", "partition_stride", "tp_replicas")


class GroupedExperts(nn.Module):
    """forward(rows [M, h] grouped by local expert, counts (host list of E_local)) -> this TP
    rank's partial outputs [M, h]."""

    def __init__(self, experts: dict[str, ParallelMLP]) -> None:
        super().__init__()
        mlps = list(experts.values())
        self.activation = mlps[0].activation
        for name, source in (("weight1", "dense_h_to_4h"), ("weight2", "dense_4h_to_h")):
            weights = [getattr(mlp, source).weight for mlp in mlps]
            param = nn.Parameter(torch.stack([w.detach() for w in weights]))
            for attribute in _STACKED_ATTRIBUTES:
                setattr(param, attribute, getattr(weights[0], attribute))
            param.partition_dim = weights[0].partition_dim + 1
            param.expert_keys = [f"{e}.{source}.weight" for e in experts]
            self.register_parameter(name, param)
        device = self.weight1.device
        self.use_grouped_mm = grouped_mm_runs(
            device, self.weight1.dtype, tuple(self.weight1.shape[1:]),
            tuple(self.weight2.shape[1:]))

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """ParallelMLP's activation (SwiGLU on [gate; up] halves, or GeLU)."""
        return ParallelMLP.activate(self, hidden)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.use_grouped_mm:
            offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32,
                                   device=rows.device)
            hidden = torch._grouped_mm(rows, self.weight1.transpose(1, 2), offs=offsets)
            return torch._grouped_mm(self.activate(hidden), self.weight2.transpose(1, 2),
                                     offs=offsets)
        busiest = max(counts)
        if busiest * len(counts) <= 2 * rows.shape[0]:
            return self._padded(rows, counts, busiest)
        return torch.cat([linear(self.activate(linear(part, w1)), w2) for part, w1, w2
                          in zip(rows.split(counts), self.weight1, self.weight2)])

    def _padded(self, rows: torch.Tensor, counts: list[int], busiest: int) -> torch.Tensor:
        """Rows [M, h] -> [M, h] by two batched matmuls over [E_local, busiest, .] blocks."""
        (experts, dev), hidden_size = (len(counts), rows.device), rows.shape[1]
        sizes = torch.tensor(counts, device=dev)
        shift = torch.arange(experts, device=dev) * busiest - (sizes.cumsum(0) - sizes)
        slot = torch.arange(rows.shape[0], device=dev) + torch.repeat_interleave(
            shift, sizes, output_size=rows.shape[0])  # row i of expert e -> e * busiest + i
        blocks = rows.new_zeros(experts * busiest, hidden_size).index_copy(0, slot, rows)
        hidden = _BatchedLinear.apply(blocks.view(experts, busiest, hidden_size), self.weight1)
        out = _BatchedLinear.apply(self.activate(hidden), self.weight2)
        return out.reshape(experts * busiest, hidden_size).index_select(0, slot)


class _BatchedLinear(torch.autograd.Function):
    """x [E, n, in], weight [E, out, in] -> [E, n, out]; the weight grad is computed in the
    weight's own layout (autograd's, the transpose of x^T g, would be copied into it by
    AccumulateGrad: 10% of a CPU MoE step)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.bmm(x, weight.transpose(1, 2))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return torch.bmm(grad, weight), torch.bmm(grad.transpose(1, 2), x)


@functools.cache
def grouped_mm_runs(device: torch.device, dtype: torch.dtype,
                    *shapes: tuple[int, int]) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward for weights of these [out, in]
    shapes on `device` in `dtype` (tried once on a small problem, with an empty group)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        for out, inner in shapes:
            x = torch.zeros(3, inner, device=device, dtype=dtype, requires_grad=True)
            w = torch.zeros(2, out, inner, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([0, 3], device=device, dtype=torch.int32)
            out = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
            out.backward(torch.ones_like(out))  # a dense grad, as MoELayer's combine gives
    except (RuntimeError, NotImplementedError):
        return False
    return True
