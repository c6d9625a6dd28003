"""The one training loop: set-up, microbatched steps over TP x PP x DP, evaluation, logging,
checkpoints, SIGTERM and fault injection, for every entry script.

An entry script describes its work as a `Task` (model, batches, what to validate and log,
its own resumable state) and calls `train(configs, task)`; `pretrain(configs,
model_provider, forward_step_func, datasets_provider)` takes Megatron's provider functions
instead. Configurations are validated before any process group exists, so a bad flag ends
every rank with one line instead of a hang.
"""
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import checkpointing, device, model_state, planner, preflight
from megalite.config import Configs
from megalite.data.gpt_dataset import check_data
from megalite.data.loader import TimedIterator
from megalite.distributed import DistributedDataParallel
from megalite.distributed.fsdp import FULLY_SHARDED, shard_model
from megalite.layout import RunLayout
from megalite.log_writers import check_available
from megalite.moe import update_expert_bias
from megalite.models.stage import (build_model_chunks, finalize_model_grads,
                                   sync_shared_embedding)
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import pad_vocab_size
from megalite.optimizer import get_optimizer
from megalite.resilience import ExitSignalHandler, SkipGuard, inject_faults, parse_faults
from megalite.schedules.executor import forward_backward
from megalite.schedules.accounting import pipeline_summary
from megalite.task import Run, Task
from megalite.train_logger import TrainingLogger, log


@dataclass
class TrainResult:
    """What a run leaves: this rank's model chunks, the mean loss and the global gradient norm
    (before clipping) of each iteration."""

    model: list[torch.nn.Module]
    losses: dict[int, float]
    grad_norms: dict[int, float | None]


def log_pipeline(configs: Configs, layout: RunLayout) -> None:
    """Log what the pipeline costs: schedule, p, v, m, bubble and peak in-flight microbatches
    per rank (from the schedule's table), and a warning when m < p."""
    pp, m = layout.grid.pp, layout.num_microbatches
    if pp == 1:
        return
    log(pipeline_summary(layout.schedule.name, pp, m, layout.chunks_per_rank))
    if m < pp:
        need = layout.micro_batch_size * layout.data_parallel_size * pp
        log(f"WARNING: {m} microbatch(es) per step through {pp} pipeline stages: ranks idle "
            f"most of the step; raise --global-batch-size to at least {need} (micro batch x DP "
            f"x PP), better 4x that")


def log_model_state(configs: Configs, layout: RunLayout, model: list[torch.nn.Module]) -> None:
    """Log rank 0's model-state bytes from the planner's formula (megalite.model_state) for its
    parameters (dense ones sharded over DP x CP, experts over expert-DP)."""
    params = [p for chunk in model for p in chunk.parameters()]
    expert = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    g, precision = layout.grid, planner.precision_name(configs)
    padded = pad_vocab_size(configs.model.vocab_size, configs.model.make_vocab_size_divisible_by,
                            g.tp)
    stage = sum(p.numel() for p in params)
    root, units = planner.fsdp_units(configs.model, padded, g.tp, g.pp, 0,
                                     layout.chunks_per_rank, g.ep)
    gather = model_state.gather_bytes(precision, layout.sharding, stage, root, max(units),
                                      g.pp > 1, layout.num_microbatches)
    log(model_state.describe(precision, layout.sharding, g.dp * g.cp, g.ep,
                             layout.cpu_offload, stage - expert, expert,
                             gather))


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
    """This rank's model chunks (one, or v with interleaving), on device, wrapped for DP:
    DistributedDataParallel (no_shard, optim: megalite's grad buffer) or fully sharded
    (optim_grads, optim_grads_params: torch FSDP2, megalite.distributed.fsdp).

    `model_provider(pre_process=..., post_process=...)` builds the chunk of the current
    virtual rank (see megalite.models.stage.build_model_chunks).
    """
    chunks = build_model_chunks(model_provider)
    sync_shared_embedding(chunks)
    o = configs.optimizer
    if o.sharding in FULLY_SHARDED:
        return [shard_model(chunk, o.sharding, configs.precision.params_dtype,
                            o.optimizer_cpu_offload) for chunk in chunks]
    return [DistributedDataParallel(chunk, bucket_size=o.ddp_bucket_size,
                                    overlap_grad_reduce=o.overlap_grad_reduce,
                                    use_distributed_optimizer=o.sharding == "optim")
            for chunk in chunks]


def run_schedule(forward_step_func: Callable, data_iterator: Iterator, model: list,
                 layout: RunLayout, forward_only: bool, loss_scale: float = 1.0,
                 loss_keys: Sequence[str] | None = None) -> list[dict]:
    """All microbatches of one step through the layout's pipeline schedule; per-microbatch
    losses on the device (only `loss_keys` when given; see executor.forward_backward)."""
    return forward_backward(
        schedule=layout.schedule, forward_step_func=forward_step_func,
        data_iterator=data_iterator, model=model if len(model) > 1 else model[0],
        num_microbatches=layout.num_microbatches, seq_length=layout.seq_length,
        micro_batch_size=layout.micro_batch_size, forward_only=forward_only,
        loss_scale=loss_scale, loss_keys=loss_keys)


def train_step(forward_step_func: Callable, data_iterator: Iterator, model: list, optimizer,
               layout: RunLayout, loss_key: str = "lm loss",
               signals: ExitSignalHandler | None = None) -> tuple[float, bool, float | None]:
    """One optimizer step over all microbatches: (mean `loss_key` value on every rank, stepped,
    grad norm). The loss is the same on every rank (shared over PP, averaged over DP), so a
    NaN/Inf loss anywhere skips the step everywhere, as a non-finite grad norm does.

    The step's one host sync reads, in one transfer, the loss, the grad statistics
    (`optimizer.grad_stats`) and, with `signals`, the SIGTERM flag agreed over the world
    (`signals.stop_requested` afterwards).
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_schedule(forward_step_func, data_iterator, model, layout,
                          forward_only=False, loss_scale=optimizer.loss_scale,
                          loss_keys=(loss_key,))
    finalize_model_grads(model)
    scalars = [_mean_over_data_parallel(losses, loss_key), optimizer.grad_stats().double()]
    if signals is not None:
        scalars.append(signals.flag(device.current_device()).double())
    loss, grad_norm, found_inf, *flag = torch.cat(scalars).tolist()
    if signals is not None:
        signals.settle(flag[0])
    stepped, grad_norm = optimizer.apply(grad_norm, found_inf > 0, math.isfinite(loss))
    if stepped:
        update_expert_bias(model)  # --moe-router-enable-expert-bias (no-op without)
    return loss, stepped, grad_norm


def _mean_over_data_parallel(losses: list[dict], key: str) -> torch.Tensor:
    """Mean `key` value over this step's microbatches and the DP x CP group (visible on every
    rank; CP ranks hold equal numbers of tokens, so this is the mean over all tokens): [1]
    fp64 on the device."""
    value = torch.stack([d[key].float().reshape(()) for d in losses]).mean().reshape(1)
    value = value.to(device.current_device())
    comm.all_reduce(value, ps.get_data_parallel_group(with_context_parallel=True))
    return value.double() / ps.get_data_parallel_world_size(with_context_parallel=True)


def _sum_over_data_parallel(losses: list[dict]) -> tuple[list[str], torch.Tensor]:
    """(keys, every loss-dict value summed over this step's microbatches and the DP group,
    and averaged over CP ranks, whose values are means over their own tokens: [keys] on the
    device)."""
    keys = list(losses[0])
    sums = torch.stack([torch.stack([d[k].float().reshape(()) for k in keys])
                        for d in losses]).sum(0).to(device.current_device())
    comm.all_reduce(sums, ps.get_data_parallel_group(with_context_parallel=True))
    sums /= ps.get_context_parallel_world_size()
    return keys, sums


@torch.no_grad()
def evaluate(forward_step_func: Callable, data_iterator: Iterator, model: list,
             configs: Configs, layout: RunLayout, iters: int | None = None) -> dict[str, float]:
    """Every loss-dict value summed over `iters` (default --eval-iters) forward-only steps,
    their microbatches and the DP group: divide by iters x microbatches x DP for a mean, or
    return counts (e.g. correct predictions) to sum them exactly. Summed on the device (in
    fp64) and read by the host once."""
    for chunk in model:
        chunk.eval()
    keys, totals = [], None
    for _ in range(configs.train.eval_iters if iters is None else iters):
        losses = run_schedule(forward_step_func, data_iterator, model, layout,
                              forward_only=True, loss_keys=keys or None)  # names: learnt once
        keys, sums = _sum_over_data_parallel(losses)
        totals = sums.double() if totals is None else totals + sums.double()
    for chunk in model:
        chunk.train()
    return dict(zip(keys, totals.tolist())) if totals is not None else {}


def default_save_interval(train_iters: int) -> int:
    """--save-interval when --save is given without it: a tenth of the run, 10 to 1000 steps."""
    return max(10, min(1000, train_iters // 10))


def check_before_start(configs: Configs, layout: RunLayout) -> None:
    """Checks that need files but no process group: --save/--load directories, the load's
    metadata and files (every rank sees the same files, so every rank reports the same
    line), the optional log sinks and the fault-injection hook. Raises ValueError."""
    ckpt, m, t = configs.checkpoint, configs.model, configs.train
    if configs.data.data_path:  # missing, truncated, empty or out-of-vocabulary data
        check_data(configs.data.data_path, configs.data.split, m.vocab_size,
                   needs_train=t.train_iters > 0)
    check_available(t.tensorboard_dir, t.wandb_project)
    parse_faults(os.environ.get("MEGALITE_FAULT", ""))
    start = 0
    if ckpt.load and (meta := checkpointing.read_meta(ckpt.load)):
        checkpointing.check_compatible(meta, m, ckpt.load,
                                       configs.precision.params_dtype)
        checkpointing.verify_checkpoint(ckpt.load, meta, layout.grid.as_dict(), layout.world_size)
        start = meta["iteration"]
    saved = checkpointing.latest_iteration(ckpt.save) if ckpt.save else None
    same = ckpt.load and ckpt.save and os.path.realpath(ckpt.load) == os.path.realpath(ckpt.save)
    if saved is not None and saved > start and not same:
        raise ValueError(f"--save {ckpt.save} already holds iteration {saved}, newer than this "
                         f"run's start ({start}): pass --load {ckpt.save} to resume it, or "
                         f"another --save directory")


def _fail(error: Exception) -> None:
    """End this rank with one line (every rank reaches the same line)."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


class PretrainTask(Task):
    """The provider functions of `pretrain()` as a task."""

    def __init__(self, model_provider: Callable, forward_step_func: Callable,
                 datasets_provider: Callable, prepare: Callable | None = None,
                 check_inputs: Callable | None = None) -> None:
        self._model_provider, self._forward_step = model_provider, forward_step_func
        self._datasets_provider, self._prepare, self._check = datasets_provider, prepare, \
            check_inputs

    def check_inputs(self, configs: Configs, world_size: int) -> None:
        if self._check:
            self._check(configs)

    def prepare(self, configs: Configs) -> None:
        if self._prepare:
            self._prepare(configs)

    def model_provider(self, configs: Configs, pre_process: bool,
                       post_process: bool) -> torch.nn.Module:
        return self._model_provider(pre_process=pre_process, post_process=post_process)

    def forward_step(self, data_iterator: Iterator, model: torch.nn.Module):
        return self._forward_step(data_iterator, model)

    def batches(self, configs: Configs, layout: RunLayout, consumed: int):
        t = configs.train
        evals = t.train_iters // t.eval_interval + 1 if t.eval_interval else 0
        num_samples = (t.train_iters * layout.global_batch_size,
                       evals * t.eval_iters * layout.global_batch_size, 0)
        return self._datasets_provider(configs, num_samples, consumed)


def pretrain(configs: Configs, model_provider: Callable, forward_step_func: Callable,
             datasets_provider: Callable, prepare: Callable | None = None,
             check_inputs: Callable | None = None) -> TrainResult:
    """`train()` with Megatron's provider functions.

    check_inputs(configs): runs first, before any process group (e.g. resolve the vocabulary
      size from --tokenizer); raise ValueError/OSError for one clear line on every rank.
    prepare(configs): runs after the process grid exists, before the model is built
      (e.g. build the default corpus once and set the vocabulary size).
    model_provider(pre_process=..., post_process=...) -> this rank's model chunk.
    datasets_provider(configs, num_samples (train, valid, test), consumed_samples) ->
      (train_iterator, valid_iterator or None) yielding this DP rank's microbatches.
    """
    return train(configs, PretrainTask(model_provider, forward_step_func, datasets_provider,
                                       prepare, check_inputs))


def train(configs: Configs, task: Task) -> TrainResult:
    """Train `task` for --train-iters steps; returns the chunks and the loss of every step.

    With --load the run resumes from the newest checkpoint (weights, optimizer, RNG, consumed
    samples, the task's state). A step whose loss or grad norm is NaN/Inf on any rank is
    skipped on every rank; after --max-skipped-steps consecutive skips NonFiniteError stops
    the run (nothing saved). SIGTERM on any rank (--exit-signal-handler) ends every rank
    after the same step, with a checkpoint when --save is given.
    """
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        preflight.check_start(configs)  # before any work: outputs writable, --split trains
        task.check_inputs(configs, world)
        layout = RunLayout.from_configs(configs, world)
        check_before_start(configs, layout)
    except (ValueError, OSError) as error:
        _fail(error)
    setup_parallel(configs, layout)
    ckpt = configs.checkpoint
    try:
        task.prepare(configs)
        model = build_model(configs, functools.partial(task.model_provider, configs))
        optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model,
                                             configs.train.train_iters)
        iteration, consumed = 0, 0
        if ckpt.load:
            iteration, consumed = checkpointing.load_checkpoint(
                ckpt.load, model, optimizer, scheduler, configs.model, configs.train.seed)
            if meta := checkpointing.read_meta(ckpt.load):
                task.load_state_dict(meta.get("task", {}))
    except (ValueError, OSError) as error:  # the same files on every rank: the same line
        _fail(error)
    log(checkpointing.describe_start(ckpt.load, iteration, configs.train.train_iters))
    if not ckpt.save:
        log("no --save: this run writes no checkpoint")
    if device.device_type() == "cpu" and configs.precision.params_dtype != torch.float32:
        warning = device.reduced_precision_warning(configs.precision.params_dtype)
        if warning:
            log(warning)
    train_batches, valid_batches = task.batches(configs, layout, consumed)
    n_params = sum(p.numel() for c in model for p in c.parameters())
    log(f"model: {configs.model.num_layers} layers, hidden {configs.model.hidden_size}, "
        f"{n_params:,} parameters on rank 0 | {layout.describe()} | global batch "
        f"{layout.global_batch_size} = {layout.num_microbatches} microbatches x "
        f"{layout.micro_batch_size} x DP | {device.device_type()} + {device.backend()}")
    log_model_state(configs, layout, model)
    log_pipeline(configs, layout)
    logger = TrainingLogger(configs, layout, model, task.loss_key, task.flops(configs, layout))
    run = Run(configs, layout, task, model, optimizer, scheduler, logger, valid_batches,
              iteration, consumed)
    try:
        task.start(run)
        _train_loop(run, TimedIterator(train_batches))
        run.finish_saves()
        if run.iteration >= configs.train.train_iters:
            task.finish(run)
    finally:
        logger.close()
    return TrainResult(model, run.losses, run.grad_norms)


def _validate(run: Run) -> None:
    """The mean validation `loss_key` over --eval-iters steps (when the task has validation
    batches), then the task's own validation."""
    if run.valid_batches is not None:
        t, layout, task = run.configs.train, run.layout, run.task
        total = evaluate(task.forward_step, run.valid_batches, run.model, run.configs,
                         layout)[task.loss_key]
        run.logger.validation(run.iteration, total / (
            t.eval_iters * layout.num_microbatches * layout.data_parallel_size))
    run.task.validate(run)


def _train_loop(run: Run, train_batches: TimedIterator) -> None:
    """Steps from run.iteration to --train-iters (or an exit): validate every --eval-interval
    steps, save every --save-interval applied steps, at an exit and at the end."""
    configs, layout, task = run.configs, run.layout, run.task
    t, ckpt = configs.train, configs.checkpoint
    save_interval = ckpt.save_interval or default_save_interval(t.train_iters)
    guard, save_due = SkipGuard(t.max_skipped_steps), False
    with ExitSignalHandler(t.exit_signal_handler) as signals:
        while run.iteration < t.train_iters:
            loss, stepped, grad_norm = train_step(
                inject_faults(task.forward_step, run.iteration + 1), train_batches, run.model,
                run.optimizer, layout, task.loss_key, signals)
            run.iteration += 1
            iteration = run.iteration
            run.losses[iteration], run.grad_norms[iteration] = loss, grad_norm
            run.consumed += layout.global_batch_size
            if stepped:  # a skipped (overflowing / non-finite) step does not advance the schedule
                run.scheduler.step()
            run.logger.step(iteration, loss, stepped, grad_norm, run.scheduler.get_lr(),
                            run.optimizer.loss_scale, data_seconds=train_batches.take())
            guard.update(iteration, stepped, run.optimizer.scaler)
            if t.eval_interval and (iteration % t.eval_interval == 0 or
                                    iteration == t.train_iters):
                _validate(run)
            signalled = signals.stop_requested
            exiting = signalled or bool(t.exit_interval) and iteration % t.exit_interval == 0
            # an interval save waits for an applied step; the last one happens regardless
            save_due = save_due or iteration % save_interval == 0
            if ckpt.save and (iteration == t.train_iters or exiting or save_due and stepped):
                run.save()
            save_due = save_due and run.saved_at != iteration
            if signalled:
                log(f"exiting at iteration {iteration}: received SIGTERM")
                break
            if exiting:
                log(f"exiting at iteration {iteration} (--exit-interval {t.exit_interval})")
                break
