"""MoE auxiliary-loss gradients and per-step routing statistics.

The auxiliary losses of a layer are not added to the final loss (they may live on another
pipeline stage): `attach_aux_loss` ties them to the layer's output so that backward gives
them the gradient `backward_scale` (Megatron's MoEAuxLossAutoScaler); the training step sets
it to loss_scale / microbatches, the factor the executor applies to the main loss.

`StepStats` collects, per global layer, the detached aux loss, z-loss, dropped choices and
tokens per expert of every microbatch; `reduce` sums them over the pipeline and data-parallel
groups for the log line.
"""
import torch

from megalite.mpu import comm

_SCALE = {"backward": 1.0}


def set_aux_loss_backward_scale(scale: float) -> None:
    """Gradient given to every attached aux loss in backward (loss_scale / microbatches)."""
    _SCALE["backward"] = scale


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, _SCALE["backward"])


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`output` unchanged; in backward `aux_loss` (a scalar) receives `backward_scale`."""
    return _AttachAuxLoss.apply(output, aux_loss)


STAT_NAMES = ("load balancing loss", "z loss", "dropped tokens")


class StepStats:
    """Per-layer sums over this step's microbatches: [layers, 3 + E] (STAT_NAMES, then the
    tokens each expert received)."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def record(self, layer: int, aux: torch.Tensor, z: torch.Tensor, dropped: int,
               tokens_per_expert: torch.Tensor) -> None:
        row = torch.cat([torch.stack([aux.detach().float(), z.detach().float(),
                                      torch.tensor(float(dropped), device=aux.device)]),
                         tokens_per_expert.float()])
        self.rows[layer] = self.rows.get(layer, 0) + row

    def reset(self) -> None:
        self.rows.clear()

    def reduce(self, num_layers: int, num_experts: int, microbatches: int, device,
               pipeline_group, data_parallel_group) -> dict[str, float]:
        """Sum over layers (pipeline group) and DP ranks (data-parallel group): aux and z
        losses as the per-microbatch mean summed over layers (DP mean), dropped choices and
        tokens per expert as totals; imbalance = max / mean tokens per expert, worst layer."""
        table = torch.zeros(num_layers, 3 + num_experts, device=device)
        for layer, row in self.rows.items():
            table[layer] += row.to(device)
        comm.all_reduce(table, pipeline_group)
        comm.all_reduce(table, data_parallel_group)
        dp = comm.world_size(data_parallel_group)
        moe_rows = table[table[:, 3:].sum(1) > 0]
        tokens = moe_rows[:, 3:]
        imbalance = (tokens.max(1).values / tokens.mean(1)).max().item() if len(tokens) else 0.0
        return {STAT_NAMES[0]: table[:, 0].sum().item() / (microbatches * dp),
                STAT_NAMES[1]: table[:, 1].sum().item() / (microbatches * dp),
                STAT_NAMES[2]: table[:, 2].sum().item(), "expert imbalance": imbalance}


step_stats = StepStats()
