"""Megatron-style log lines, and the same fields as TensorBoard / W&B scalars."""
import math
import time

import torch.distributed as dist
from torch import nn

from megalite import device
from megalite.config import Configs
from megalite.device import peak_memory_mb
from megalite.layout import RunLayout
from megalite.models.layer_drop import LayerDrop, shared_over_replicas
from megalite.models.transformer_stage import moe_states
from megalite.moe.stats import reduce_mtp_loss, reduce_step_stats
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import pad_vocab_size
from megalite.planning.flops import flops_per_iteration
from megalite.training.log_writers import ScalarWriters


def dp_bytes_sent(model: list[nn.Module]) -> int:
    """Payload bytes this rank's DP buckets have sent (reductions, ZeRO-1 param gathers)."""
    return sum(b.bytes_sent for chunk in model for b in getattr(chunk, "buckets", list)())


def log(message: str) -> None:
    """Print once per job (global rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class TrainingLogger:
    """Every --log-interval steps one line (and, with --tensorboard-dir / --wandb-project, one
    scalar each, written by the last rank) of: loss, lr, grad norm, loss scale, skipped
    steps, ms/iter, the part of it spent waiting for batches (data ms/iter), tokens/s, TFLOP/s
    per device, peak memory. `validation` adds loss and perplexity. `loss_key` names the
    logged loss; `flops` is the model FLOPs of one iteration (default: a language model's,
    whose output layer spans the padded vocabulary). MoE models add the last step's routing
    stats, read from this rank's `model` chunks; progressive layer dropping adds θ(t) and the
    share of layers computed, and its FLOPs count only the layers run.
    """

    def __init__(self, configs: Configs, layout: RunLayout, model: list[nn.Module],
                 loss_key: str = "lm loss", flops: float | None = None) -> None:
        self.configs, self.layout, self.model, self.loss_key = configs, layout, model, loss_key
        padded = pad_vocab_size(configs.model.vocab_size,
                                configs.model.make_vocab_size_divisible_by,
                                configs.parallel.tensor_model_parallel_size)
        self.flops = flops if flops is not None else flops_per_iteration(
            configs.model, layout.global_batch_size, configs.train.seq_length, padded)
        self.padded_vocab, self.task_flops = padded, flops is not None
        self.layer_drop = LayerDrop.from_configs(configs)
        self.drop_replicas = 1 if shared_over_replicas(configs) else layout.data_parallel_size
        self.flop_total, self.layer_share_total = 0.0, 0.0
        self.losses: list[float] = []
        self.grad_norm: float | None = None  # of the last step (None: not computed)
        self.skipped = self.steps = 0
        self.start, self.data_seconds = time.time(), 0.0
        self.dp_bytes_logged = dp_bytes_sent(model)
        t = configs.train
        writes = dist.get_rank() == dist.get_world_size() - 1
        self.writers = ScalarWriters(t.tensorboard_dir, t.wandb_project,
                                     {"world_size": dist.get_world_size()}) if writes \
            else ScalarWriters()

    def logs(self, iteration: int) -> bool:
        """Whether step `iteration` prints a line (every --log-interval steps, and the last)."""
        t = self.configs.train
        return iteration % t.log_interval == 0 or iteration == t.train_iters

    def start_step(self, iteration: int) -> None:
        """Before step `iteration`: the MoE layers compute the router losses that are only
        logged (coefficient 0) in the steps that print them."""
        for state in moe_states(self.model):
            state.log_router_losses = self.logs(iteration)

    def step(self, iteration: int, loss: float, stepped: bool, grad_norm: float | None,
             lr: float, loss_scale: float, data_seconds: float = 0.0) -> None:
        """One step's figures; `data_seconds`: how long it waited for its batches."""
        if math.isfinite(loss):
            self.losses.append(loss)
        self.grad_norm = grad_norm
        self.skipped += not stepped
        self.steps += 1
        self.data_seconds += data_seconds
        self._count_flops(iteration)
        if not self.logs(iteration):
            return
        t = self.configs.train
        elapsed = (time.time() - self.start) / self.steps
        moe_stats, drop_fields = self._moe_stats(), self._layer_drop_fields(iteration)
        sent = dp_bytes_sent(self.model)
        dp_bytes, self.dp_bytes_logged = (sent - self.dp_bytes_logged) / self.steps, sent
        fields = {
            self.loss_key: sum(self.losses) / len(self.losses) if self.losses else math.nan,
            "learning rate": lr,
            "grad norm": math.nan if self.grad_norm is None else self.grad_norm,
            "loss scale": loss_scale, "skipped steps": self.skipped,
            "ms per iteration": 1000 * elapsed,
            "data ms per iteration": 1000 * self.data_seconds / self.steps,
            "tokens per second": self.layout.global_batch_size * t.seq_length / elapsed,
            "TFLOP/s per device": self.flop_total / self.steps / elapsed
            / dist.get_world_size() / 1e12,
            "peak memory MB": peak_memory_mb(device.current_device()),
            "DP bytes per step": dp_bytes,
            **drop_fields, **moe_stats}
        self.writers.write(fields, iteration)
        parts = [f"iteration {iteration:6d}/{t.train_iters:6d}",
                 f"{self.loss_key} {fields[self.loss_key]:.4E}", f"lr {lr:.3E}",
                 f"grad norm {fields['grad norm']:.3f}" if self.grad_norm is not None
                 else "grad norm n/a"]
        if self.configs.precision.fp16:
            parts.append(f"loss scale {loss_scale:.1f}")
        parts += [f"{name} {value:.4g}" for name, value in moe_stats.items()]
        parts += [f"{name} {value:.4f}" for name, value in drop_fields.items()]
        parts += [f"ms/iter {fields['ms per iteration']:.0f}",
                  f"data ms/iter {fields['data ms per iteration']:.2f}",
                  f"tokens/s {fields['tokens per second']:,.0f}",
                  f"TFLOP/s/device {fields['TFLOP/s per device']:.4f}",
                  f"mem {fields['peak memory MB']:,.0f} MB",
                  f"DP MB/step {dp_bytes / 2 ** 20:.3f}", f"skipped {self.skipped}"]
        log(" | ".join(parts))
        self.losses, self.skipped, self.steps = [], 0, 0
        self.start, self.data_seconds = time.time(), 0.0
        self.flop_total, self.layer_share_total = 0.0, 0.0

    def _count_flops(self, iteration: int) -> None:
        """Add the model FLOPs of step `iteration`: with progressive layer dropping only the
        layers its microbatches ran (drawn again here from the schedule: no communication);
        a task's own FLOPs count is taken as is."""
        if self.layer_drop is None:
            self.flop_total += self.flops
            return
        shares = self.layer_drop.layer_shares(iteration - 1, self.layout.num_microbatches,
                                              self.drop_replicas)
        self.layer_share_total += sum(shares) / len(shares)
        self.flop_total += self.flops if self.task_flops else flops_per_iteration(
            self.configs.model, self.layout.global_batch_size, self.configs.train.seq_length,
            self.padded_vocab, shares)

    def _layer_drop_fields(self, iteration: int) -> dict[str, float]:
        """θ(t) of step `iteration` and the share of layers computed since the last line."""
        if self.layer_drop is None:
            return {}
        return {"pld theta": self.layer_drop.theta_at(iteration - 1),
                "layers computed": self.layer_share_total / self.steps}

    def _moe_stats(self) -> dict[str, float]:
        """The last step's multi-token-prediction loss (with --mtp-num-layers), router losses,
        dropped choices and expert imbalance (MoE models), of the global batch; collectives
        over the pipeline, data-parallel (with CP) and, under sequence parallelism, TP groups."""
        m = self.configs.model
        stats = {}
        if m.mtp_num_layers:
            stats["mtp loss"] = reduce_mtp_loss(
                moe_states(self.model), self.layout.num_microbatches, device.current_device(),
                ps.get_pipeline_model_parallel_group(),
                ps.get_data_parallel_group(with_context_parallel=True))
        if not m.num_experts:
            return stats
        return stats | reduce_step_stats(
            moe_states(self.model), m.num_layers + (m.mtp_num_layers or 0), m.num_experts,
            self.layout.num_microbatches, device.current_device(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_tensor_model_parallel_group() if self.layout.sequence_parallel else None)

    def validation(self, iteration: int, loss: float) -> None:
        perplexity = math.exp(min(20.0, loss))
        self.writers.write({f"validation {self.loss_key}": loss,
                            "validation perplexity": perplexity}, iteration)
        log(f"validation at iteration {iteration} | {self.loss_key} {loss:.4E} | "
            f"perplexity {perplexity:.3f}")

    def close(self) -> None:
        self.writers.close()
