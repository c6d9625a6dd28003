"""Mixture of experts: top-k router with aux/z losses (and DeepSeek-V3's group-limited,
bias-balanced routing: router.py, balancing.py), all-to-all dispatch over the expert-parallel
group (dispatcher.py), looped or grouped local experts (layer.py, experts.py), and the MoE
state a model chunk owns (stats.py)."""
from megalite.moe.balancing import update_expert_bias
from megalite.moe.layer import MoELayer
from megalite.moe.router import TopKRouter, load_balancing_loss, topk_routing, z_loss
from megalite.moe.stats import MoEState, reduce_step_stats, training_step

__all__ = ["MoELayer", "TopKRouter", "load_balancing_loss", "topk_routing", "z_loss",
           "MoEState", "reduce_step_stats", "training_step", "update_expert_bias"]
