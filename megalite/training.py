"""The training loop: set-up, microbatched steps over TP x PP x DP, evaluation, logging, checkpoints.

`pretrain(configs, model_provider, forward_step_func, datasets_provider)` is what the
entry scripts call. Configurations are validated before any process group exists, so a
bad flag ends every rank with one line instead of a hang.
"""
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import checkpointing, device, moe
from megalite.config import Configs
from megalite.data.gpt_dataset import parse_data_path
from megalite.data.indexed_dataset import IndexedDataset
from megalite.distributed import DistributedDataParallel
from megalite.metrics import flops_per_iteration, peak_memory_mb
from megalite.models.stage import (build_model_chunks, finalize_model_grads,
                                   sync_shared_embedding)
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.attention import check_attention_partition
from megalite.moe import check_expert_partition
from megalite.mpu.layers import pad_vocab_size
from megalite.optimizer import get_optimizer
from megalite.optimizer.scheduler import check_decay_iters
from megalite.schedules import get_forward_backward_func


@dataclass(frozen=True)
class RunShape:
    """Sizes derived from the configs and the world size."""

    data_parallel_size: int
    global_batch_size: int
    num_microbatches: int


@dataclass
class TrainResult:
    """What a run leaves: this rank's model chunks and the mean loss of each iteration."""

    model: list[torch.nn.Module]
    losses: dict[int, float]


def validate_configs(configs: Configs, world_size: int) -> RunShape:
    """Check every cross-flag constraint; raise ValueError with one line naming the flag."""
    p, m, t = configs.parallel, configs.model, configs.train
    dp = ps.validate_sizes(world_size, p.tensor_model_parallel_size,
                           p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size)
    if p.data_parallel_size is not None and p.data_parallel_size != dp:
        raise ValueError(f"--dp {p.data_parallel_size} does not match world size {world_size} / "
                         f"(TP {p.tensor_model_parallel_size} x PP "
                         f"{p.pipeline_model_parallel_size}) = {dp}")
    chunks = p.pipeline_model_parallel_size * (p.virtual_pipeline_model_parallel_size or 1)
    if m.num_layers % chunks:
        raise ValueError(f"--num-layers ({m.num_layers}) must be divisible by --pp x --vpp "
                         f"({chunks})")
    check_attention_partition(m.num_attention_heads, m.query_groups, p.tensor_model_parallel_size)
    if m.num_experts is not None or p.expert_model_parallel_size > 1:
        check_expert_partition(m.num_experts or 1, m.moe_router_topk,
                               p.expert_model_parallel_size, dp)
    if m.ffn_hidden_size % p.tensor_model_parallel_size:
        raise ValueError(f"--ffn-hidden-size ({m.ffn_hidden_size}) must be divisible by --tp "
                         f"({p.tensor_model_parallel_size})")
    if t.seq_length > m.max_position_embeddings:
        raise ValueError(f"--seq-length ({t.seq_length}) exceeds --max-position-embeddings "
                         f"({m.max_position_embeddings})")
    global_batch = t.global_batch_size or t.micro_batch_size * dp
    if global_batch % (t.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size ({global_batch}) must be divisible by "
                         f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})")
    for prefix in parse_data_path(configs.data.data_path)[1] if configs.data.data_path else []:
        IndexedDataset(prefix)  # missing, truncated or foreign files fail here, with the name
    o = configs.optimizer
    check_decay_iters(o.lr_decay_style, o.lr_warmup_iters, o.lr_decay_iters or t.train_iters)
    microbatches = global_batch // (t.micro_batch_size * dp)
    if p.virtual_pipeline_model_parallel_size and microbatches % p.pipeline_model_parallel_size:
        raise ValueError(f"interleaved schedule: microbatches per step ({microbatches} = "
                         f"--global-batch-size / (--micro-batch-size x DP)) must be a multiple "
                         f"of --pp ({p.pipeline_model_parallel_size})")
    return RunShape(dp, global_batch, microbatches)


def log(message: str) -> None:
    """Print once per job (global rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def setup_parallel(configs: Configs) -> None:
    """Join the job, build the process grid and seed the RNG streams."""
    p = configs.parallel
    device.init_distributed(timeout_s=p.distributed_timeout_minutes * 60)
    initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                              p.virtual_pipeline_model_parallel_size,
                              p.expert_model_parallel_size)
    model_parallel_seed(configs.train.seed, ps.get_tensor_model_parallel_rank(),
                        ps.get_pipeline_model_parallel_rank())


def build_model(configs: Configs, model_provider: Callable) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or v with interleaving), on device, wrapped for DP.

    `model_provider(pre_process=..., post_process=...)` builds the chunk of the current
    virtual rank (see megalite.models.stage.build_model_chunks).
    """
    chunks = build_model_chunks(model_provider)
    sync_shared_embedding(chunks)
    o = configs.optimizer
    return [DistributedDataParallel(chunk, bucket_size=o.ddp_bucket_size,
                                    overlap_grad_reduce=o.overlap_grad_reduce,
                                    use_distributed_optimizer=o.use_distributed_optimizer)
            for chunk in chunks]


def run_schedule(forward_step_func: Callable, data_iterator: Iterator, model: list,
                 configs: Configs, shape: RunShape, forward_only: bool,
                 loss_scale: float = 1.0) -> list[dict]:
    """All microbatches of one step through the grid's pipeline schedule; per-microbatch losses."""
    return get_forward_backward_func(configs.parallel.pipeline_schedule)(
        forward_step_func=forward_step_func, data_iterator=data_iterator,
        model=model if len(model) > 1 else model[0], num_microbatches=shape.num_microbatches,
        seq_length=configs.train.seq_length, micro_batch_size=configs.train.micro_batch_size,
        forward_only=forward_only, loss_scale=loss_scale)


def train_step(forward_step_func: Callable, data_iterator: Iterator, model: list, optimizer,
               configs: Configs, shape: RunShape, loss_key: str = "lm loss"
               ) -> tuple[float, bool, float | None]:
    """One optimizer step over all microbatches: (mean `loss_key` value on every rank, stepped,
    grad norm)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    moe.step_stats.reset()
    moe.set_aux_loss_backward_scale(optimizer.loss_scale / shape.num_microbatches)
    losses = run_schedule(forward_step_func, data_iterator, model, configs, shape,
                          forward_only=False, loss_scale=optimizer.loss_scale)
    moe.set_aux_loss_backward_scale(1.0)  # plain backward() outside a step: the loss as is
    finalize_model_grads(model)
    stepped, grad_norm = optimizer.step()
    return _mean_over_data_parallel(losses, loss_key), stepped, grad_norm


def _mean_over_data_parallel(losses: list[dict], key: str) -> float:
    """Mean `key` value over this step's microbatches and the DP group (visible on every rank)."""
    value = torch.stack([d[key].float().reshape(()) for d in losses]).mean().reshape(1)
    value = value.to(device.current_device())
    comm.all_reduce(value, ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()


def _sum_over_data_parallel(losses: list[dict]) -> dict[str, float]:
    """Every loss-dict value summed over this step's microbatches and the DP group."""
    keys = list(losses[0])
    sums = torch.stack([torch.stack([d[k].float().reshape(()) for k in keys])
                        for d in losses]).sum(0).to(device.current_device())
    comm.all_reduce(sums, ps.get_data_parallel_group())
    return dict(zip(keys, sums.tolist()))


@torch.no_grad()
def evaluate(forward_step_func: Callable, data_iterator: Iterator, model: list,
             configs: Configs, shape: RunShape, iters: int | None = None) -> dict[str, float]:
    """Every loss-dict value summed over `iters` (default --eval-iters) forward-only steps,
    their microbatches and the DP group: divide by iters x microbatches x DP for a mean, or
    return counts (e.g. correct predictions) to sum them exactly."""
    for chunk in model:
        chunk.eval()
    totals: dict[str, float] = {}
    for _ in range(configs.train.eval_iters if iters is None else iters):
        losses = run_schedule(forward_step_func, data_iterator, model, configs, shape,
                              forward_only=True)
        for key, value in _sum_over_data_parallel(losses).items():
            totals[key] = totals.get(key, 0.0) + value
    for chunk in model:
        chunk.train()
    return totals


class TrainingLogger:
    """Megatron-style log lines: loss, lr, grad norm, loss scale, tokens/s, TFLOP/s, memory.

    `loss_key` names the logged loss; `flops` is the model FLOPs of one iteration (default:
    a language model's, whose output layer spans the padded vocabulary).
    """

    def __init__(self, configs: Configs, shape: RunShape, loss_key: str = "lm loss",
                 flops: float | None = None) -> None:
        self.configs, self.shape, self.loss_key = configs, shape, loss_key
        padded = pad_vocab_size(configs.model.vocab_size, configs.model.make_vocab_size_divisible_by,
                                configs.parallel.tensor_model_parallel_size)
        self.flops = flops if flops is not None else flops_per_iteration(
            configs.model, shape.global_batch_size, configs.train.seq_length, padded)
        self.losses: list[float] = []
        self.skipped = 0
        self.start = time.time()
        self.writer = None
        if configs.train.tensorboard_dir and dist.get_rank() == dist.get_world_size() - 1:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ValueError("--tensorboard-dir needs the 'tensorboard' package "
                                 "(pip install tensorboard)") from error
            self.writer = SummaryWriter(configs.train.tensorboard_dir)

    def step(self, iteration: int, loss: float, stepped: bool, grad_norm: float | None,
             lr: float, loss_scale: float) -> None:
        self.losses.append(loss)
        self.skipped += not stepped
        if self.writer:
            self.writer.add_scalar(self.loss_key, loss, iteration)
            self.writer.add_scalar("learning rate", lr, iteration)
        if iteration % self.configs.train.log_interval and iteration != self.configs.train.train_iters:
            return
        elapsed = (time.time() - self.start) / len(self.losses)
        tokens = self.shape.global_batch_size * self.configs.train.seq_length / elapsed
        tflops = self.flops / elapsed / dist.get_world_size() / 1e12
        parts = [f"iteration {iteration:6d}/{self.configs.train.train_iters:6d}",
                 f"{self.loss_key} {sum(self.losses) / len(self.losses):.4E}", f"lr {lr:.3E}",
                 f"grad norm {grad_norm:.3f}" if grad_norm is not None else "grad norm n/a"]
        if self.configs.precision.fp16:
            parts.append(f"loss scale {loss_scale:.1f}")
        if self.configs.model.num_experts:
            parts += [f"{name} {value:.4g}" for name, value in moe.step_stats.reduce(
                self.configs.model.num_layers, self.configs.model.num_experts,
                self.shape.num_microbatches, device.current_device(),
                ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()).items()]
        parts += [f"ms/iter {1000 * elapsed:.0f}", f"tokens/s {tokens:,.0f}",
                  f"TFLOP/s/device {tflops:.4f}",
                  f"mem {peak_memory_mb(device.current_device()):,.0f} MB",
                  f"skipped {self.skipped}"]
        log(" | ".join(parts))
        self.losses, self.skipped, self.start = [], 0, time.time()


def pretrain(configs: Configs, model_provider: Callable, forward_step_func: Callable,
             datasets_provider: Callable, prepare: Callable | None = None) -> TrainResult:
    """Train `configs.train.train_iters` steps; returns the chunks and the loss of every step.

    prepare(configs): runs after the process grid exists, before the model is built
      (e.g. build the default corpus once and set the vocabulary size).
    datasets_provider(configs, num_samples (train, valid, test), consumed_samples) ->
      (train_iterator, valid_iterator or None) yielding this DP rank's microbatches.
    """
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        shape = validate_configs(configs, world)
        if configs.checkpoint.load:
            meta = checkpointing.read_meta(configs.checkpoint.load)
            if meta:
                checkpointing.check_compatible(meta, configs.model, configs.checkpoint.load)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    setup_parallel(configs)
    if prepare:
        prepare(configs)
    model = build_model(configs, model_provider)
    optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model,
                                         configs.train.train_iters)
    iteration, consumed = 0, 0
    if configs.checkpoint.load:
        iteration, consumed = checkpointing.load_checkpoint(
            configs.checkpoint.load, model, optimizer, scheduler, configs.model)
        log(f"resumed from {configs.checkpoint.load} at iteration {iteration}")
    t = configs.train
    evals = t.train_iters // t.eval_interval + 1 if t.eval_interval else 0
    num_samples = (t.train_iters * shape.global_batch_size,
                   evals * t.eval_iters * shape.global_batch_size, 0)
    train_iter, valid_iter = datasets_provider(configs, num_samples, consumed)
    n_params = sum(p.numel() for c in model for p in c.parameters())
    log(f"model: {configs.model.num_layers} layers, hidden {configs.model.hidden_size}, "
        f"{n_params:,} parameters on rank 0 | world {world} = TP "
        f"{configs.parallel.tensor_model_parallel_size} x PP "
        f"{configs.parallel.pipeline_model_parallel_size} x DP {shape.data_parallel_size} | "
        f"global batch {shape.global_batch_size} = {shape.num_microbatches} microbatches x "
        f"{t.micro_batch_size} x DP | {device.device_type()} + {device.backend()}")
    logger = TrainingLogger(configs, shape)
    ckpt = configs.checkpoint
    losses: dict[int, float] = {}
    while iteration < t.train_iters:
        loss, stepped, grad_norm = train_step(forward_step_func, train_iter, model, optimizer,
                                              configs, shape)
        iteration += 1
        losses[iteration] = loss
        consumed += shape.global_batch_size
        if stepped:  # a skipped (overflowing) fp16 step does not advance the schedule
            scheduler.step()
        logger.step(iteration, loss, stepped, grad_norm, scheduler.get_lr(), optimizer.loss_scale)
        if valid_iter is not None and t.eval_interval and (
                iteration % t.eval_interval == 0 or iteration == t.train_iters):
            val = evaluate(forward_step_func, valid_iter, model, configs, shape)["lm loss"] / (
                t.eval_iters * shape.num_microbatches * shape.data_parallel_size)
            log(f"validation at iteration {iteration} | lm loss {val:.4E} | "
                f"perplexity {math.exp(min(20.0, val)):.3f}")
        exiting = bool(t.exit_interval) and iteration % t.exit_interval == 0
        if ckpt.save and (iteration == t.train_iters or exiting or
                          (ckpt.save_interval and iteration % ckpt.save_interval == 0)):
            checkpointing.save_checkpoint(ckpt.save, iteration, model, optimizer, scheduler,
                                          consumed, configs.model)
            log(f"saved checkpoint to {ckpt.save} at iteration {iteration}")
        if exiting:
            log(f"exiting at iteration {iteration} (--exit-interval {t.exit_interval})")
            break
    return TrainResult(model, losses)
