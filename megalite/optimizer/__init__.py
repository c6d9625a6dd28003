"""Optimizers: fp32 main params (mixed precision), fp16 loss scaling, global-norm clipping,
the distributed (ZeRO-1) optimizer and the learning-rate schedule.

One training step, in this order (megalite.training.loop.train_step):

    for chunk in model: chunk.zero_grad_buffer()          # DistributedDataParallel
    optimizer.zero_grad()
    forward_backward(..., loss_scale=optimizer.loss_scale)  # executor scales the loss
    finalize_model_grads(model)   # megalite.distributed.finalize: DP mean in main_grad,
                                  # TP-partial grads summed, tied embedding grads summed
    stepped, grad_norm = optimizer.step(loss_is_finite)   # False: overflow / NaN, skipped
    if stepped: scheduler.step()

`optimizer.step()` unscales and checks for inf/NaN (fp16), clips by the global norm
(`clip_grad` > 0), steps the fp32 main params and copies them back (all-gathering the
params with the distributed optimizer). It is `grad_stats()` (device [norm, found inf]),
one host read, then `apply(norm, found_inf, loss_is_finite)`: the training step reads the
grad statistics and its loss in one transfer, its one host sync. Checkpoints save each
fragment's fp32 main params and torch optimizer state as slices of the global parameters
(megalite.checkpoint.state: `Fragment.offset` places a fragment in its parameter), the
scaler's and the scheduler's `state_dict()`; `optimizer.state_dict()` is this rank's state
as one tree, loadable under the same layout only.
"""
from torch import nn

from megalite.config import sharding
from megalite.config import OptimizerConfig, PrecisionConfig
from megalite.optimizer.distrib_optimizer import DistributedOptimizer, FullyShardedOptimizer
from megalite.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.optimizer.kinds import OPTIMIZER_KINDS, OptimizerKind, optimizer_kind
from megalite.optimizer.optimizer import MixedPrecisionOptimizer, optimizer_settings
from megalite.optimizer.scheduler import OptimizerParamScheduler, check_decay_iters

# The class stepping each megalite.config.sharding.ShardingStrategy's `optimizer`.
OPTIMIZER_CLASSES: dict[str, type[MixedPrecisionOptimizer]] = {
    sharding.MIXED_PRECISION: MixedPrecisionOptimizer,
    sharding.DISTRIBUTED: DistributedOptimizer,
    sharding.FULLY_SHARDED: FullyShardedOptimizer}


def get_optimizer(opt_config: OptimizerConfig, precision: PrecisionConfig,
                  model_chunks: nn.Module | list[nn.Module], train_iters: int | None = None
                  ) -> tuple[MixedPrecisionOptimizer, OptimizerParamScheduler]:
    """The optimizer for this rank's wrapped chunks (DistributedDataParallel, or shard_model
    for the FSDP2 strategies): the class of the sharding strategy's record stepping the
    torch optimizer of --optimizer's record (megalite.optimizer.kinds); and its LR scheduler
    (decaying over --lr-decay-iters, default `train_iters`)."""
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    for chunk in chunks:
        if not hasattr(chunk, "strategy"):
            raise TypeError("get_optimizer: wrap each model chunk in megalite.distributed."
                            "DistributedDataParallel (or megalite.distributed.fsdp.shard_model) "
                            "first")
        if chunk.strategy.name != opt_config.sharding:
            raise ValueError(f"get_optimizer: the chunk is wrapped for sharding "
                             f"{chunk.strategy.name!r}, but --data-parallel-sharding-strategy / "
                             f"--use-distributed-optimizer ask for {opt_config.sharding!r}")
    cls = OPTIMIZER_CLASSES[sharding.sharding_strategy(opt_config.sharding).optimizer]
    optimizer = cls(chunks, opt_config, precision)
    return optimizer, OptimizerParamScheduler.from_config(optimizer, opt_config, train_iters)


__all__ = ["get_optimizer", "optimizer_settings", "MixedPrecisionOptimizer", "DistributedOptimizer",
           "FullyShardedOptimizer", "OptimizerParamScheduler", "check_decay_iters", "DynamicGradScaler",
           "ConstantGradScaler", "OPTIMIZER_CLASSES", "OPTIMIZER_KINDS", "OptimizerKind",
           "optimizer_kind"]
