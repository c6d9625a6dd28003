"""The one training loop: microbatched steps over TP x PP x DP, evaluation, logging,
checkpoints, SIGTERM and fault injection, for every task.

A task (megalite.training.task.Task: model, batches, what to validate and log, its own
resumable state) runs with `train(configs, task)`. Configurations are validated before any
process group exists, so a bad flag ends every rank with one line instead of a hang.
"""
import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import checkpoint, device
from megalite.checkpoint.saving import STAGING
from megalite.config import Configs
from megalite.data.loader import TimedIterator
from megalite.distributed.finalize import finalize_model_grads
from megalite.layout import RunLayout
from megalite.models.layer_drop import LayerDrop, shared_over_replicas, start_layer_drop
from megalite.moe import update_expert_bias
from megalite.mpu import comm
from megalite.mpu import parallel_state as ps
from megalite.mpu.random import weights_loaded_next
from megalite.optimizer import get_optimizer
from megalite.optimizer.weight_versions import WeightVersions
from megalite.schedules.executor import InFlight, forward_backward
from megalite.schedules.tables import step_alignment
from megalite.training import checks
from megalite.training.checks import StartError, check_before_start
from megalite.training.logger import TrainingLogger, log
from megalite.training.resilience import ExitSignalHandler, SkipGuard, inject_faults
from megalite.training.setup import (build_model, describe_optimizer, log_model_state,
                                     log_pipeline, setup_parallel)
from megalite.training.task import Run, Task


@dataclass
class TrainResult:
    """What a run leaves: this rank's model chunks, the mean loss and the global gradient norm
    (before clipping) of each iteration, the validation loss of each validation."""

    model: list[torch.nn.Module]
    losses: dict[int, float]
    grad_norms: dict[int, float | None]
    validation_losses: dict[int, float]



def run_schedule(forward_step_func: Callable, data_iterator: Iterator, model: list,
                 layout: RunLayout, forward_only: bool, loss_scale: float = 1.0,
                 loss_keys: Sequence[str] | None = None,
                 in_flight: InFlight | None = None) -> list[dict]:
    """All microbatches of one step through the layout's pipeline schedule; per-microbatch
    losses on the device (only `loss_keys` when given; `in_flight`: 2bw's state carried
    between steps; see executor.forward_backward)."""
    return forward_backward(
        schedule=layout.schedule, forward_step_func=forward_step_func,
        data_iterator=data_iterator, model=model if len(model) > 1 else model[0],
        num_microbatches=layout.num_microbatches, seq_length=layout.seq_length,
        micro_batch_size=layout.micro_batch_size, forward_only=forward_only,
        loss_scale=loss_scale, loss_keys=loss_keys, in_flight=in_flight)



def train_step(forward_step_func: Callable, data_iterator: Iterator, model: list, optimizer,
               layout: RunLayout, loss_key: str = "lm loss",
               signals: ExitSignalHandler | None = None, in_flight: InFlight | None = None
               ) -> tuple[float, bool, float | None]:
    """One optimizer step over all microbatches: (mean `loss_key` value on every rank, stepped,
    grad norm). The loss is the same on every rank (shared over PP, averaged over DP), so a
    NaN/Inf loss anywhere skips the step everywhere, as a non-finite grad norm does.

    The step's one host sync reads, in one transfer, the loss, the grad statistics
    (`optimizer.grad_stats`) and, with `signals`, the SIGTERM flag agreed over the world
    (`signals.stop_requested` afterwards). With 2bw (`in_flight`) the step's microbatches
    run on the previous weights and the update moves the current ones (WeightVersions); a
    step that is not `in_flight.aligned` reduces nothing across the stages (see
    `_unaligned_scalars`) and returns (NaN, stepped, None): its loss and grad norm come with
    the next aligned step, in `in_flight.resolved`.
    """
    unaligned = in_flight is not None and not in_flight.aligned
    if unaligned and (optimizer.clip_grad > 0 or optimizer.scaler is not None):
        raise ValueError("2bw: a step whose stages do not meet (InFlight.aligned False) "
                         "cannot clip or scale the loss (step_alignment)")
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_schedule(forward_step_func, data_iterator, model, layout,
                          forward_only=False, loss_scale=optimizer.loss_scale,
                          loss_keys=(loss_key,), in_flight=in_flight)
    finalize_model_grads(model)
    if signals is not None:
        signals.settle_posted()
    if unaligned:
        loss, grad_norm, found_inf = _unaligned_scalars(losses, loss_key, optimizer,
                                                        in_flight.pending, signals)
    else:
        scalars = [_mean_over_data_parallel(losses, loss_key), optimizer.grad_stats().double()]
        if signals is not None:
            scalars.append(signals.flag(device.current_device()).double())
        pending = in_flight.pending if in_flight is not None else []
        if pending:  # the loss (last stage) and stage grad norm^2 of the unaligned steps
            scalars.append(_sum_over_stages(torch.stack(pending)).flatten())
        loss, grad_norm, found_inf, *rest = torch.cat(scalars).tolist()
        if signals is not None:
            signals.settle(rest.pop(0))
        if in_flight is not None:
            in_flight.resolved = [(a, math.sqrt(b) if math.isfinite(a) else None)
                                  for a, b in zip(rest[::2], rest[1::2])]
            pending.clear()
    versions = in_flight.versions if in_flight is not None else None
    if versions is not None:  # an --async-save writer may still read the buffer W(t+1) takes
        STAGING.wait()
    with versions.update() if versions is not None else contextlib.nullcontext():
        stepped, grad_norm = optimizer.apply(grad_norm, found_inf > 0, math.isfinite(loss))
    if stepped:
        update_expert_bias(model)  # --moe-router-enable-expert-bias (no-op without)
    return (math.nan, stepped, None) if unaligned else (loss, stepped, grad_norm)


def _unaligned_scalars(losses: list[dict], loss_key: str, optimizer, pending: list,
                       signals: ExitSignalHandler | None) -> tuple[float, float, float]:
    """A 2bw step whose stages do not meet: (loss, grad norm, found inf) of this stage only,
    reduced over its DP and TP ranks; the loss is the DP mean on the last stage, 0 elsewhere
    (a NaN/Inf loss makes every stage's grads non-finite: each skips the step). Appends the
    loss and the stage's grad norm^2 ([2] on the device) to `pending` for the next aligned
    step, and posts the SIGTERM flag (`signals.post_flag`), settled by the next step."""
    loss = _mean_over_data_parallel(losses, loss_key) if losses else \
        torch.zeros(1, dtype=torch.float64, device=device.current_device())
    stats = optimizer.grad_stats(within_stage=True).double()
    pending.append(torch.cat([loss, stats[:1] ** 2]))
    if signals is not None:
        signals.post_flag(device.current_device())
    loss_value, grad_norm, found_inf = torch.cat([loss, stats]).tolist()
    return loss_value, grad_norm, found_inf


def _sum_over_stages(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over the pipeline group (one rank per stage), in place."""
    comm.all_reduce(values, ps.get_pipeline_model_parallel_group())
    return values


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



def train(configs: Configs, task: Task) -> TrainResult:
    """Train `task` for --train-iters steps; returns the chunks and the loss of every step.

    With --load the run resumes from the newest checkpoint (weights, optimizer, RNG, consumed
    samples, the task's state). A step whose loss or grad norm is NaN/Inf on any rank is
    skipped on every rank; after --max-skipped-steps consecutive skips NonFiniteError stops
    the run (nothing saved). SIGTERM on any rank (--exit-signal-handler) ends every rank
    after the same step, with a checkpoint when --save is given. A run that cannot start (bad
    flags, files or data) raises StartError with one line, the same on every rank.
    """
    layout = start_parallel(configs, task)
    run = start_run(configs, task, layout)
    train_batches, run.valid_batches = task.batches(configs, layout, run.consumed)
    start_logging(run)
    try:
        task.start(run)
        _train_loop(run, TimedIterator(train_batches))
        run.finish_saves()
        if run.iteration >= configs.train.train_iters:
            task.finish(run)
    finally:
        run.logger.close()
        run.close_tiers()
    return TrainResult(run.model, run.losses, run.grad_norms, run.validation_losses)



def start_parallel(configs: Configs, task: Task) -> RunLayout:
    """Check the flags, outputs and the task's inputs, then build the process grid of the
    run's layout (StartError: one line, the same on every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        checks.check_start(configs, task.output_dirs(configs))  # outputs writable, --split
        task.check_inputs(configs, world)
        layout = RunLayout.from_configs(configs, world)
        check_before_start(configs, layout)
    except (ValueError, OSError) as error:
        raise StartError(str(error)) from None
    setup_parallel(configs, layout)
    return layout



def start_run(configs: Configs, task: Task, layout: RunLayout) -> Run:
    """On the process grid: the task's model chunks (wrapped for DP), optimizer and scheduler,
    resumed from --load when given (its weights are not drawn first: the load fills every
    parameter, and the draws use a private generator); the Run has no logger or validation
    batches yet."""
    ckpt = configs.checkpoint
    try:
        task.prepare(configs)
        loading = bool(ckpt.load) and checkpoint.read_meta(ckpt.load) is not None
        with weights_loaded_next() if loading else contextlib.nullcontext():  # all loaded
            model = build_model(configs, functools.partial(task.model_provider, configs))
        optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model,
                                             configs.train.train_iters)
        in_flight = InFlight(WeightVersions(model, optimizer)) \
            if layout.schedule.across_steps else None  # before a load fills both versions
        iteration, consumed = 0, 0
        if ckpt.load:
            iteration, consumed = checkpoint.load(
                ckpt.load, model, optimizer, scheduler, configs.model, configs.train.seed)
            if meta := checkpoint.read_meta(ckpt.load):
                task.load_state_dict(meta.get("task", {}))
    except (ValueError, OSError) as error:  # the same files on every rank: the same line
        raise StartError(str(error)) from None
    log(checkpoint.describe_start(ckpt.load, iteration, configs.train.train_iters))
    if not ckpt.save:
        log("no --save: this run writes no checkpoint")
    if device.device_type() == "cpu" and configs.precision.params_dtype != torch.float32:
        warning = device.reduced_precision_warning(configs.precision.params_dtype)
        if warning:
            log(warning)
    return Run(configs, layout, task, model, optimizer, scheduler, None, None, iteration,
               consumed, in_flight=in_flight)



def start_logging(run: Run) -> None:
    """Log the model, layout, model state and pipeline; give the run its TrainingLogger."""
    configs, layout, model = run.configs, run.layout, run.model
    n_params = sum(p.numel() for c in model for p in c.parameters())
    log(f"model: {configs.model.num_layers} layers, hidden {configs.model.hidden_size}, "
        f"{n_params:,} parameters on rank 0 | {layout.describe()} | global batch "
        f"{layout.global_batch_size} = {layout.num_microbatches} microbatches x "
        f"{layout.micro_batch_size} x DP | {device.device_type()} + {device.backend()}")
    log_model_state(configs, layout, model)
    log(describe_optimizer(configs, model))
    log_pipeline(configs, layout)
    run.logger = TrainingLogger(configs, layout, model, run.task.loss_key,
                                run.task.flops(configs, layout))



def validate(run: Run) -> float | None:
    """The mean validation `loss_key` over --eval-iters steps (when the task has validation
    batches; returned, else None), then the task's own validation."""
    loss = None
    if run.valid_batches is not None:
        t, layout, task = run.configs.train, run.layout, run.task
        total = evaluate(task.forward_step, run.valid_batches, run.model, run.configs,
                         layout)[task.loss_key]
        loss = total / (t.eval_iters * layout.num_microbatches * layout.data_parallel_size)
        run.logger.validation(run.iteration, loss)
        run.validation_losses[run.iteration] = loss
    run.task.validate(run)
    return loss



def training_iteration(run: Run, batches: TimedIterator, guard: SkipGuard,
                       layer_drop: LayerDrop | None = None, replica: int = 0,
                       signals: ExitSignalHandler | None = None) -> bool:
    """One iteration of `run` over the next step's microbatches from `batches`: the step
    (skipped on NaN/Inf), its loss and grad norm recorded, the schedule advanced, the log
    line, the skip guard updated (NonFiniteError after too many). Returns whether it stepped.
    With 2bw the step runs with `run.in_flight` (its `drain` set by the caller)."""
    layout, task, in_flight = run.layout, run.task, run.in_flight
    if layer_drop is not None:
        start_layer_drop(run.model, layer_drop, replica, run.iteration)
    run.logger.start_step(run.iteration + 1)
    loss, stepped, grad_norm = train_step(
        inject_faults(task.forward_step, run.iteration + 1), batches, run.model,
        run.optimizer, layout, task.loss_key, signals, in_flight)
    run.iteration += 1
    run.consumed += layout.global_batch_size
    if stepped:  # a skipped (overflowing / non-finite) step does not advance the schedule
        run.scheduler.step()
    step = (run.iteration, stepped, run.scheduler.get_lr(), run.optimizer.loss_scale,
            batches.take())
    if in_flight is not None and not in_flight.aligned:  # recorded at the next aligned step
        in_flight.unrecorded.append(step)
    else:
        if in_flight is not None:
            for values, earlier in zip(in_flight.resolved, in_flight.unrecorded, strict=True):
                _record(run, *values, *earlier)
            in_flight.unrecorded.clear()
        _record(run, loss, grad_norm, *step)
    guard.update(run.iteration, stepped, run.optimizer.scaler)
    return stepped


def _record(run: Run, loss: float, grad_norm: float | None, iteration: int, stepped: bool,
            lr: float, loss_scale: float, data_seconds: float) -> None:
    """Step `iteration`'s loss and grad norm in the run, and its figures in the logger."""
    run.losses[iteration], run.grad_norms[iteration] = loss, grad_norm
    run.logger.step(iteration, loss, stepped, grad_norm, lr, loss_scale, data_seconds)


def _train_loop(run: Run, train_batches: TimedIterator) -> None:
    """Steps from run.iteration to --train-iters (or an exit): validate every --eval-interval
    steps, save every --save-interval applied steps, at an exit and at the end. With 2bw
    (`run.in_flight`) the pipeline drains at the steps before those, and SIGTERM, known after
    a step, ends the run one (draining) step later; the stages meet (`InFlight.aligned`) only
    at log and draining steps unless `step_alignment` names a flag that needs every step (in
    between, SIGTERM is known a step later still)."""
    configs, in_flight = run.configs, run.in_flight
    t, ckpt = configs.train, configs.checkpoint
    save_interval = ckpt.save_interval or default_save_interval(t.train_iters)
    guard, save_due = SkipGuard(t.max_skipped_steps), False
    layer_drop = LayerDrop.from_configs(configs)
    replica = 0 if shared_over_replicas(configs) else ps.get_data_parallel_rank()
    aligns = bool(step_alignment(configs))  # 2bw: the stages meet at every step's end
    with ExitSignalHandler(t.exit_signal_handler) as signals:
        while run.iteration < t.train_iters:
            if in_flight is not None:
                in_flight.drain = _drains(run.iteration + 1, t, ckpt.save and save_interval,
                                          save_due, signals.stop_requested)
                in_flight.aligned = in_flight.drain or aligns or \
                    (run.iteration + 1) % t.log_interval == 0
            stepped = training_iteration(run, train_batches, guard, layer_drop, replica,
                                         signals)
            iteration = run.iteration
            if t.eval_interval and (iteration % t.eval_interval == 0 or
                                    iteration == t.train_iters):
                validate(run)
            signalled = signals.stop_requested and not (in_flight and in_flight.running)
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


def _drains(iteration: int, t, save_interval: int | None, save_due: bool,
            stop_requested: bool) -> bool:
    """Whether 2bw's pipeline empties at the end of step `iteration`: the last step, an
    evaluation, an exit or a save follows it, or SIGTERM came during the previous step."""
    return (iteration == t.train_iters or stop_requested or
            bool(t.eval_interval) and iteration % t.eval_interval == 0 or
            bool(t.exit_interval) and iteration % t.exit_interval == 0 or
            bool(save_interval) and (save_due or iteration % save_interval == 0))
