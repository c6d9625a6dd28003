"""Auxiliary-loss-free load balancing (DeepSeek-V3): after each optimizer step, every router's
expert bias moves toward balance by the step's token counts.

bias_e += rate * sign(mean_e' load_e' - load_e), where load is the step's choices per expert
(all microbatches, `MoEState.rows`) summed over every rank that routed tokens through the same
layer: the DP x CP group (EP ranks are DP ranks) and, with sequence parallelism, the TP
group (without it TP ranks route the same tokens). One all-reduce per group for all layers of
the rank; nothing is read by the host.
"""
import torch
from torch import nn

from megalite.moe.layer import MoELayer
from megalite.mpu import comm, parallel_state


@torch.no_grad()
def update_expert_bias(model: nn.Module | list[nn.Module]) -> None:
    """Move the expert bias of this rank's MoE layers (those with one) by the step's loads."""
    chunks = model if isinstance(model, list) else [model]
    layers = [m for chunk in chunks
              for m in getattr(chunk, "module", chunk).modules()  # DP-wrapped or not
              if isinstance(m, MoELayer) and m.router.expert_bias is not None]
    if not layers:
        return
    loads = torch.stack([layer.moe_state.rows[layer.layer_number][3:] if layer.layer_number in
                         layer.moe_state.rows else layer.router.expert_bias.new_zeros(
                             layer.num_experts) for layer in layers]).float()
    comm.all_reduce(loads, parallel_state.get_data_parallel_group(with_context_parallel=True))
    if layers[0].sequence_parallel:
        comm.all_reduce(loads, layers[0].tp_group)
    for layer, load in zip(layers, loads):
        layer.router.expert_bias += layer.bias_update_rate * torch.sign(load.mean() - load)
