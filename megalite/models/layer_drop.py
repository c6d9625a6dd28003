"""Progressive layer dropping (PLD: Zhang & He 2020, arXiv 2010.13369; DeepSpeed's
`progressive_layer_drop`): Pre-LN layers skipped at random, more often the deeper they are and
the longer training has run.

After t completed steps θ(t) = (1 - θ̄) e^(-γt) + θ̄ (DeepSpeed's ProgressiveLayerDrop), and layer
l = 1..L is kept with p_l(t) = 1 - (l/L)(1 - θ(t)). A kept layer's two residual branches
(attention, MLP) are scaled by 1/p_l, as the paper's Algorithm 1 does (the layer's expected
output is then its output without dropping); a dropped layer is the identity: it runs no
forward and no backward.

Decisions: for each (step, microbatch, DP replica) one draw of L uniforms u [L] (float64) from a
CPU generator seeded with `decision_seed(seed, t, microbatch, replica)`; layer l is kept when
u_l < p_l(t). Every TP and CP rank of a replica and every pipeline stage draws the same vector
(each stage reads its own layers), and a resumed run draws the same again. Replicas draw
their own, except where per-layer collectives span the DP ranks (fully sharded DP, ZeRO-2/3:
FSDP gathers and reduce-scatters each layer; expert parallelism: each MoE layer's all-to-all):
there every replica uses replica 0's draw (`shared_over_replicas`).
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config import Configs
from megalite.config.sharding import sharding_strategy
from megalite.models.spec import TransformerSpec


def decision_seed(seed: int, step: int, microbatch: int, replica: int) -> int:
    """The generator seed of one draw (a 63-bit mix of the four integers)."""
    mixed = seed
    for value in (step, microbatch, replica):
        mixed = (mixed * 1_000_003 + value + 1) % (2 ** 63 - 25)
    return mixed


@dataclass(frozen=True)
class LayerDrop:
    """The schedule of one run: θ̄ (`theta`), γ (`gamma`), the run's `seed`, L layers."""

    theta: float
    gamma: float
    seed: int
    num_layers: int

    @classmethod
    def from_configs(cls, configs: Configs) -> "LayerDrop | None":
        t = configs.train
        if not t.progressive_layer_drop:
            return None
        return cls(t.pld_theta, t.pld_gamma, t.seed, configs.model.num_layers)

    def theta_at(self, step: int) -> float:
        """θ(t) after `step` completed steps."""
        return (1.0 - self.theta) * math.exp(-self.gamma * step) + self.theta

    def keep_probabilities(self, step: int) -> list[float]:
        """p_l(t) of the layers l = 1..L (global layer index l - 1)."""
        drop = 1.0 - self.theta_at(step)
        return [1.0 - (layer / self.num_layers) * drop for layer in range(1, self.num_layers + 1)]

    def decisions(self, step: int, microbatch: int, replica: int) -> list[bool]:
        """Whether each global layer 0..L-1 runs in this microbatch of this replica."""
        generator = torch.Generator().manual_seed(decision_seed(self.seed, step, microbatch,
                                                                replica))
        draws = torch.rand(self.num_layers, generator=generator, dtype=torch.float64).tolist()
        return [u < p for u, p in zip(draws, self.keep_probabilities(step))]

    def layer_shares(self, step: int, microbatches: int, replicas: int) -> list[float]:
        """Per global layer, the share of the step's (microbatch, replica) pairs it ran in."""
        counts = [0] * self.num_layers
        for replica in range(replicas):
            for microbatch in range(microbatches):
                for layer, kept in enumerate(self.decisions(step, microbatch, replica)):
                    counts[layer] += kept
        return [count / (microbatches * replicas) for count in counts]


def shared_over_replicas(configs: Configs) -> bool:
    """Whether every DP replica uses replica 0's decisions (see the module docstring)."""
    return sharding_strategy(configs.optimizer.sharding).fsdp or \
        configs.parallel.expert_model_parallel_size > 1


def check_layer_drop(configs: Configs) -> None:
    """One ValueError line for flags PLD cannot run with."""
    t = configs.train
    if not t.progressive_layer_drop:
        return
    if not 0.0 < t.pld_theta <= 1.0:
        raise ValueError(f"--pld-theta {t.pld_theta}: expected 0 < theta <= 1 (the keep "
                         f"probability the last layer tends to)")
    if t.pld_gamma < 0.0:
        raise ValueError(f"--pld-gamma {t.pld_gamma}: expected >= 0")
    if TransformerSpec.from_config(configs.model).post_norm:
        raise ValueError("--progressive-layer-drop: needs Pre-LN layers (GPT, Llama); this "
                         "model's layers are Post-LN (BERT)")


class LayerDropState:
    """The dropping state of one layer stack (a ParallelTransformer), set by the training loop
    (`schedule`, `replica`, `step`: completed steps) and by the executor before each forward
    (`microbatch`). Inactive (every layer runs, unscaled) while `schedule` is None."""

    def __init__(self) -> None:
        self.schedule: LayerDrop | None = None
        self.replica = self.step = self.microbatch = 0

    def residual_scales(self) -> dict[int, float] | None:
        """Global layer number -> 1/p_l of the layers kept in this microbatch; None inactive."""
        if self.schedule is None:
            return None
        kept = self.schedule.decisions(self.step, self.microbatch, self.replica)
        probabilities = self.schedule.keep_probabilities(self.step)
        return {layer: 1.0 / p for layer, (run, p) in enumerate(zip(kept, probabilities)) if run}


def layer_drop_states(model: nn.Module | list[nn.Module]) -> list[LayerDropState]:
    """The LayerDropStates of the layer stacks in `model` (a chunk or a list of chunks)."""
    chunks = model if isinstance(model, list) else [model]
    return [module.layer_drop for chunk in chunks for module in chunk.modules()
            if isinstance(getattr(module, "layer_drop", None), LayerDropState)]


def start_layer_drop(model: list[nn.Module], schedule: LayerDrop | None, replica: int,
                     step: int) -> None:
    """Set every layer stack of `model` for the step after `step` completed ones."""
    for state in layer_drop_states(model):
        state.schedule, state.replica, state.step = schedule, replica, step
