"""The data-parallel sharding strategies (`--data-parallel-sharding-strategy`), one record each.

A `ShardingStrategy` says, as data, everything the rest of megalite needs to know about a
strategy: what it shards over DP x CP (experts: expert-DP), how a model chunk is wrapped
(megalite's bucketed gradient buffer, megalite.distributed.ddp, or torch FSDP2's
`fully_shard`, megalite.distributed.fsdp), which megalite.optimizer class steps it, what it
allows (a split backward, an offload tier) and its model-state bytes per parameter (the
ZeRO rule). Training, the optimizer, the layout checks, the planner and the DP wrappers read
these fields; none of them branches on a strategy's name. Adding a strategy that runs on the
existing wrappers and optimizer classes is one record in STRATEGIES.

A leaf (no megalite imports), like megalite.placement: megalite.config reads the names for
the parser's choices and help, and megalite.config sits below megalite.distributed and
megalite.optimizer (tests/test_imports.py), so the records hold data only. The behaviour
each field selects lives where it runs: `fsdp` picks the wrapper (megalite.training.setup),
`optimizer` the class (megalite.optimizer.OPTIMIZER_CLASSES), `sharded` the bucket's
reduction (megalite.distributed.reducers.default_reducer) and the planner's bytes.
"""
from dataclasses import dataclass

PARAMS, GRADS, OPTIMIZER = "params", "grads", "optimizer"  # the model-state components
COMPONENTS = (PARAMS, GRADS, OPTIMIZER)

# megalite.optimizer classes a strategy is stepped by (keys of OPTIMIZER_CLASSES there)
MIXED_PRECISION = "mixed_precision"  # every parameter, fp32 masters (MixedPrecisionOptimizer)
DISTRIBUTED = "distributed"          # this rank's shard of the grad buffer (ZeRO-1)
FULLY_SHARDED = "fully_sharded"      # FSDP2's sharded parameters, in place


@dataclass(frozen=True)
class ShardingStrategy:
    """One data-parallel sharding strategy, as data (see the module docstring)."""

    name: str                     # --data-parallel-sharding-strategy
    sharded: tuple[str, ...]      # COMPONENTS split over the DP ranks (the ZeRO rule)
    fsdp: bool                    # wrapped by torch FSDP2 fully_shard, else megalite's grad buffer
    optimizer: str                # MIXED_PRECISION, DISTRIBUTED or FULLY_SHARDED
    split_backward: bool          # zb-h1 / zbv (weight grads deferred past the backward) run
    offload: bool                 # --optimizer-cpu-offload is allowed
    summary: str                  # for --help

    @property
    def shards_optimizer(self) -> bool:
        return OPTIMIZER in self.sharded

    @property
    def reshard_after_forward(self) -> bool:
        """Parameters sharded between forward and backward too (ZeRO-3)."""
        return PARAMS in self.sharded

    @property
    def held_sharded(self) -> tuple[str, ...]:
        """What a rank holds sharded between steps: under FSDP2 the sharded parameter is the
        fp32 master and the grads stay reduce-scattered, so every component; on the grad
        buffer what the strategy shards."""
        return COMPONENTS if self.fsdp else self.sharded

    @property
    def offloaded(self) -> tuple[str, ...]:
        """What --optimizer-cpu-offload moves to host memory: the optimizer (fp32 masters and
        state), and under FSDP2 (CPUOffloadPolicy) the sharded parameters and grads too."""
        return COMPONENTS if self.fsdp else (OPTIMIZER,)

    def bytes_per_param(self, params: float, grads: float, optimizer: float, n: int,
                        held: bool = False) -> dict[str, float]:
        """The ZeRO rule: bytes per parameter of each component on one rank, those this
        strategy shards (`held`: holds sharded between steps) over `n` ranks divided by n.
        E.g. optim of (2, 2, 12) over n: {params: 2, grads: 2, optimizer: 12 / n}."""
        split = self.held_sharded if held else self.sharded
        return {name: size / n if name in split else size
                for name, size in zip(COMPONENTS, (params, grads, optimizer))}


NO_SHARD = ShardingStrategy(
    "no_shard", sharded=(), fsdp=False, optimizer=MIXED_PRECISION,
    split_backward=True, offload=False, summary="DDP")
OPTIM = ShardingStrategy(
    "optim", sharded=(OPTIMIZER,), fsdp=False, optimizer=DISTRIBUTED,
    split_backward=True, offload=True, summary="ZeRO-1, the distributed optimizer")
OPTIM_GRADS = ShardingStrategy(
    "optim_grads", sharded=(GRADS, OPTIMIZER), fsdp=True, optimizer=FULLY_SHARDED,
    split_backward=False, offload=True, summary="ZeRO-2; FSDP2")
OPTIM_GRADS_PARAMS = ShardingStrategy(
    "optim_grads_params", sharded=COMPONENTS, fsdp=True, optimizer=FULLY_SHARDED,
    split_backward=False, offload=True, summary="ZeRO-3; FSDP2")
STRATEGIES = (NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS)
STRATEGY_NAMES = tuple(s.name for s in STRATEGIES)


def sharding_strategy(name: str) -> ShardingStrategy:
    """The record named `name`; ValueError (one line naming the flag) for an unknown one."""
    for strategy in STRATEGIES:
        if strategy.name == name:
            return strategy
    raise ValueError(f"--data-parallel-sharding-strategy must be one of "
                     f"{', '.join(STRATEGY_NAMES)} (got {name!r})")
