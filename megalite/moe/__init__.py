"""Mixture of experts: top-k router with aux/z losses, all-to-all dispatch over the
expert-parallel group, grouped local experts (see layer.py), and the MoE state a model chunk
owns (stats.py)."""
from megalite.moe.layer import MoELayer
from megalite.moe.router import TopKRouter, load_balancing_loss, topk_routing, z_loss
from megalite.moe.stats import MoEState, reduce_step_stats, training_step

__all__ = ["MoELayer", "TopKRouter", "load_balancing_loss", "topk_routing", "z_loss",
           "MoEState", "reduce_step_stats", "training_step"]
