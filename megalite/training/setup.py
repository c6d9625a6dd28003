"""Run set-up: the process grid, the model chunks wrapped by the sharding strategy, and the
start-up lines about the pipeline and the model state.
"""
from collections.abc import Callable

import torch

from megalite import device
from megalite.config import Configs
from megalite.distributed import DistributedDataParallel
from megalite.distributed.finalize import sync_shared_embedding
from megalite.distributed.fsdp import shard_model
from megalite.layout import RunLayout
from megalite.models.stage import build_model_chunks
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import pad_vocab_size
from megalite.optimizer.kinds import optimizer_kind
from megalite.planning import params as param_counts
from megalite.planning import planner, state_bytes
from megalite.schedules.accounting import pipeline_summary
from megalite.schedules.tables import step_alignment
from megalite.config.sharding import sharding_strategy
from megalite.training.logger import log


def log_pipeline(configs: Configs, layout: RunLayout) -> None:
    """Log what the pipeline costs: schedule, p, v, m, bubble and peak in-flight microbatches
    per rank (from the schedule's table; 2bw: with the flags that make its stages meet at each
    step's end), and a warning when m < p."""
    pp, m = layout.grid.pp, layout.num_microbatches
    if pp == 1:
        return
    log(pipeline_summary(layout.schedule.name, pp, m, layout.chunks_per_rank,
                         step_alignment(configs) if layout.schedule.across_steps else ()))
    if m < pp:
        need = layout.micro_batch_size * layout.data_parallel_size * pp
        log(f"WARNING: {m} microbatch(es) per step through {pp} pipeline stages: ranks idle "
            f"most of the step; raise --global-batch-size to at least {need} (micro batch x DP "
            f"x PP), better 4x that")



def log_model_state(configs: Configs, layout: RunLayout, model: list[torch.nn.Module]) -> None:
    """Log rank 0's model-state bytes from the planner's formula (megalite.planning.state_bytes)
    for its parameters (dense ones sharded over DP x CP, experts over expert-DP) and, with
    --save, what a checkpoint save writes and adds to host memory (megalite.planning.planner)."""
    params = [p for chunk in model for p in chunk.parameters()]
    expert = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    g, precision = layout.grid, planner.precision_name(configs)
    padded = pad_vocab_size(configs.model.vocab_size, configs.model.make_vocab_size_divisible_by,
                            g.tp)
    stage = sum(p.numel() for p in params)
    root, units = param_counts.fsdp_units(configs.model, padded, g.tp, g.pp, 0,
                                     layout.chunks_per_rank, g.ep)
    gather = state_bytes.gather_bytes(precision, layout.sharding, stage, root, max(units),
                                      g.pp > 1, layout.num_microbatches)
    log(state_bytes.describe(precision, layout.sharding, g.dp * g.cp, g.ep,
                             layout.cpu_offload, stage - expert, expert,
                             gather, configs.optimizer, layout.param_tier))
    if layout.param_tier == "cpu" and device.device_type() == "cpu":
        log("--param-offload-device cpu on a CPU machine: the parameters are host memory "
            "already; the tier moves them between uses and saves nothing")
    if configs.checkpoint.save:
        per_param, weights = planner.checkpoint_bytes_per_param(
            precision, configs.optimizer, layout.schedule.weight_versions)
        shard = planner.checkpoint_shard_bytes(per_param, stage - expert, expert, g.dp * g.cp,
                                               g.ep)
        extra = planner.save_host_bytes(shard, weights / per_param,
                                        configs.checkpoint.async_save,
                                        device.device_type() == "cuda", layout.cpu_offload)
        log(f"checkpoint save per rank: {shard / 2 ** 20:,.1f} MiB written, + "
            f"{extra / 2 ** 20:,.1f} MiB of host memory while saving"
            f"{' (asynchronous)' if configs.checkpoint.async_save else ''}")


def describe_optimizer(configs: Configs, model: list[torch.nn.Module]) -> str:
    """The start line of the optimizer: its name, the sharding strategy and rank 0's DP
    reduction bytes per step (megalite.mpu.comm's count) in each stage of its buckets'
    reducers, naming the stage the run starts in (1-bit family: warm-up, compressed)."""
    o = configs.optimizer
    buckets = [b for chunk in model for b in getattr(chunk, "buckets", list)() if b.dp > 1]
    per_stage: dict[str, int] = {}
    for bucket in buckets:
        for stage, sent in bucket.reducer.stage_bytes(bucket.end - bucket.start,
                                                      bucket.dp).items():
            per_stage[stage] = per_stage.get(stage, 0) + sent
    line = f"optimizer {o.optimizer} | sharding {o.sharding}"
    if not buckets:
        return line
    stages = ", ".join(f"{stage + ' ' if stage else ''}{sent / 2 ** 20:.3g} MiB"
                       for stage, sent in per_stage.items())
    start = buckets[0].reducer.stage()
    return line + f" | DP reduction per step: {stages}" + (f" | now in {start}" if start else "")


def setup_parallel(configs: Configs, layout: RunLayout) -> None:
    """Join the job, build the process grid of the layout and seed the RNG streams."""
    timeout_s = configs.parallel.distributed_timeout_minutes * 60
    device.init_distributed(timeout_s=timeout_s)
    device.set_tf32(configs.precision.tf32)
    if configs.precision.deterministic_mode:
        device.use_deterministic_kernels()
    initialize_model_parallel(grid=layout.grid, timeout_s=timeout_s)
    model_parallel_seed(configs.train.seed, ps.get_tensor_model_parallel_rank(),
                        ps.get_pipeline_model_parallel_rank())



def build_model(configs: Configs, model_provider: Callable) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or v with interleaving), on device, wrapped for DP as the
    sharding strategy's record says: fully sharded by torch FSDP2 (megalite.distributed.fsdp)
    or DistributedDataParallel (megalite's grad buffer, its buckets' grads reduced by the
    optimizer kind's reducer).

    `model_provider(pre_process=..., post_process=...)` builds the chunk of the current
    virtual rank (see megalite.models.stage.build_model_chunks).
    """
    chunks = build_model_chunks(model_provider)
    sync_shared_embedding(chunks)
    o = configs.optimizer
    strategy = sharding_strategy(o.sharding)
    if strategy.fsdp:
        return [shard_model(chunk, strategy.name, configs.precision.params_dtype,
                            o.offload_device == "cpu", o.param_offload_device,
                            o.offload_nvme_path) for chunk in chunks]
    # progressive layer dropping: a replica's dropped layers get no grads, so buckets would
    # become ready in a different order on each replica; all are reduced after backward
    overlap = o.overlap_grad_reduce and not configs.train.progressive_layer_drop
    kind = optimizer_kind(o.optimizer)
    return [DistributedDataParallel(chunk, bucket_size=o.ddp_bucket_size,
                                    overlap_grad_reduce=overlap,
                                    use_distributed_optimizer=strategy.shards_optimizer,
                                    make_reducer=kind.make_reducer(o),
                                    replicas_apart=kind.replicas_apart)
            for chunk in chunks]
