"""The MoE state of one model chunk: the aux-loss backward scale and the step's routing stats.

The auxiliary losses of a layer are not added to the final loss (they may live on another
pipeline stage): `attach_aux_loss` ties them to the layer's output so that backward gives
them the gradient `MoEState.backward_scale` (Megatron's MoEAuxLossAutoScaler). For the
training step it runs, the executor sets it to loss_scale / microbatches, the factor it
applies to the main loss (`training_step`); outside a step it is 1.0 (a plain backward).

`MoEState.mtp_loss` sums the step's multi-token-prediction losses (the last stage's) for
the log line (`reduce_mtp_loss`). `MoEState.rows` collects, per global layer, the detached
aux loss, z-loss, dropped choices and tokens per expert of every microbatch of the step;
`reduce_step_stats` sums those of a rank's chunks over the pipeline, data-parallel (with CP)
and, under sequence parallelism, TP groups for the log line. Router losses with coefficient 0
are only logged: the layers compute them while `MoEState.log_router_losses` (the training
loop clears it for the steps that print no line; their rows hold NaN there).
"""
import contextlib
from collections.abc import Iterator

import torch

from megalite.mpu import comm

STAT_NAMES = ("load balancing loss", "z loss", "dropped tokens")


class MoEState:
    """Owned by a model chunk and handed to its MoE layers at construction.

    backward_scale: the gradient every attached aux loss gets in backward.
    rows: per global layer, sums over this step's microbatches [3 + E] (STAT_NAMES, then the
    tokens each expert received).
    log_router_losses: whether the layers compute router losses that are only logged.
    """

    def __init__(self) -> None:
        self.backward_scale = 1.0
        self.log_router_losses = True
        self.rows: dict[int, torch.Tensor] = {}
        self.mtp_loss: torch.Tensor | None = None  # sum of this step's multi-token losses

    def record_mtp_loss(self, loss: torch.Tensor) -> None:
        """Add one microbatch's multi-token-prediction loss (detached, on the device)."""
        loss = loss.detach().float()
        self.mtp_loss = loss if self.mtp_loss is None else self.mtp_loss + loss

    def record(self, layer: int, losses: tuple[torch.Tensor, torch.Tensor] | None,
               dropped: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        """Add one microbatch's router losses (aux, z: scalars; None where they were not
        computed: NaN), dropped choices and tokens_per_expert [E] (all on the device: nothing
        is read by the host until `reduce_step_stats`)."""
        aux, z = losses if losses is not None else \
            2 * [torch.full((), float("nan"), device=dropped.device)]
        row = torch.cat([torch.stack([aux.detach().float(), z.detach().float(), dropped.float()]),
                         tokens_per_expert.float()])
        self.rows[layer] = self.rows.get(layer, 0) + row


@contextlib.contextmanager
def training_step(states: list[MoEState], backward_scale: float) -> Iterator[None]:
    """One training step: the stats start empty and the aux losses get `backward_scale` in
    backward (loss_scale / microbatches); 1.0 again after the step."""
    for state in states:
        state.rows.clear()
        state.mtp_loss = None
        state.backward_scale = backward_scale
    try:
        yield
    finally:
        for state in states:
            state.backward_scale = 1.0


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, aux_loss, state):
        ctx.save_for_backward(aux_loss)
        ctx.state = state
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.state.backward_scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, state: MoEState
                    ) -> torch.Tensor:
    """`output` unchanged; in backward `aux_loss` (a scalar) receives `state.backward_scale`."""
    return _AttachAuxLoss.apply(output, aux_loss, state)


def reduce_step_stats(states: list[MoEState], num_layers: int, num_experts: int,
                      microbatches: int, device, pipeline_group, data_parallel_group,
                      sequence_group=None) -> dict[str, float]:
    """This step's stats of the whole global batch, the same on every rank: a rank's chunks
    summed over layers (pipeline group) and over the ranks that routed other tokens
    (data-parallel group, with CP ranks; `sequence_group`: the TP group under sequence
    parallelism, None without it, when TP ranks route the same tokens). Aux and z losses:
    each rank's is its shard's share of the mean, so the mean over those ranks and
    microbatches, summed over layers (Megatron averages them over TP x CP and DP); dropped
    choices and tokens per expert: totals; imbalance = max / mean of the total tokens per
    expert, worst layer (0 without MoE layers). One host read, of the four results."""
    table = torch.zeros(num_layers, 3 + num_experts, device=device)
    for state in states:
        for layer, row in state.rows.items():
            table[layer] += row.to(device)
    for group in (pipeline_group, data_parallel_group, sequence_group):
        comm.all_reduce(table, group)  # no-op for None
    shards = comm.world_size(data_parallel_group) * comm.world_size(sequence_group)
    tokens = table[:, 3:]
    ratio = tokens.max(1).values / tokens.mean(1)  # NaN for dense layers (no tokens)
    imbalance = torch.where(tokens.sum(1) > 0, ratio, 0.0).max()
    aux, z, dropped, imbalance = torch.cat([table[:, :3].sum(0), imbalance.reshape(1)]).tolist()
    return {STAT_NAMES[0]: aux / (microbatches * shards),
            STAT_NAMES[1]: z / (microbatches * shards),
            STAT_NAMES[2]: dropped, "expert imbalance": imbalance}


def reduce_mtp_loss(states: list[MoEState], microbatches: int, device, pipeline_group,
                    data_parallel_group) -> float:
    """This step's multi-token-prediction loss: the mean over microbatches and DP ranks of
    the loss the last stage recorded (sums over the pipeline and data-parallel groups; one
    host read)."""
    total = torch.zeros(1, device=device)
    for state in states:
        if state.mtp_loss is not None:
            total += state.mtp_loss.to(device)
    comm.all_reduce(total, pipeline_group)
    comm.all_reduce(total, data_parallel_group)
    return total.item() / (microbatches * comm.world_size(data_parallel_group))
