"""Mixture of experts: top-k router with aux/z losses, all-to-all dispatch over the
expert-parallel group, grouped local experts (see layer.py)."""
from megalite.moe.layer import MoELayer
from megalite.moe.router import TopKRouter, load_balancing_loss, topk_routing, z_loss
from megalite.moe.stats import set_aux_loss_backward_scale, step_stats

__all__ = ["MoELayer", "TopKRouter", "load_balancing_loss",
           "topk_routing", "z_loss", "set_aux_loss_backward_scale", "step_stats"]
