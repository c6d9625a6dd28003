"""The interface between an entry script and the one training loop (megalite.training.train).

A `Task` says what to build, what to feed it, what to check at validation points and at
the end, and which small JSON state of its own a checkpoint must carry so that a resumed
run continues exactly. The loop hands every hook the `Run` in progress.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megalite import checkpoint
from megalite.config import Configs
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.distributed.param_tier import close_param_tiers
from megalite.layout import RunLayout
from megalite.training.logger import TrainingLogger, log


class Task:
    """What a task (megalite.tasks) gives `train()`: model_provider, forward_step and batches
    are required; the other hooks default to nothing."""

    loss_key = "lm loss"  # the loss-dict entry averaged per step, logged and validated

    def output_dirs(self, configs: Configs) -> dict[str, str | None]:
        """{flag: directory} the task writes besides --save (checked writable at start)."""
        return {}

    def check_inputs(self, configs: Configs, world_size: int) -> None:
        """Before any process group: read the inputs, fill derived configs; raise
        ValueError/OSError for one line on every rank."""

    def prepare(self, configs: Configs) -> None:
        """After the process grid exists, before the model is built."""

    def model_provider(self, configs: Configs, pre_process: bool,
                       post_process: bool) -> torch.nn.Module:
        """The model chunk of the current (virtual) pipeline rank."""
        raise NotImplementedError

    def forward_step(self, data_iterator: Iterator, model: torch.nn.Module
                     ) -> tuple[torch.Tensor, Callable]:
        """One microbatch: (output, loss_func); loss_func(output) -> (loss, {name: value})."""
        raise NotImplementedError

    def batches(self, configs: Configs, layout: RunLayout, consumed: int
                ) -> tuple[Iterator, Iterator | None]:
        """(train, valid) iterators of this DP rank's microbatches, train starting after
        `consumed` samples; the loop logs the mean `loss_key` over --eval-iters valid steps
        at every validation point (none: valid is None)."""
        raise NotImplementedError

    def flops(self, configs: Configs, layout: RunLayout) -> float | None:
        """Model FLOPs of one iteration for the throughput log (None: a language model's)."""
        return None

    def start(self, run: Run) -> None:
        """Before the first step; run.iteration > 0 when resumed (load_state_dict done).
        Weights set here must be followed by run.optimizer.reload_model_params()."""

    def validate(self, run: Run) -> None:
        """At every validation point: every --eval-interval steps and after the last."""

    def finish(self, run: Run) -> None:
        """After the last step (not after an early exit)."""

    def state_dict(self) -> dict:
        """The task's own progress as small JSON, saved with every checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what state_dict() returned when the loaded checkpoint was saved."""


@dataclass
class Run:
    """A run in progress, as the loop keeps it and the task's hooks see it."""

    configs: Configs
    layout: RunLayout
    task: Task
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    logger: TrainingLogger | None  # set by start_logging
    valid_batches: Iterator | None
    iteration: int = 0
    consumed: int = 0  # training samples over all DP ranks
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float | None] = field(default_factory=dict)  # None: step skipped
    validation_losses: dict[int, float] = field(default_factory=dict)  # by iteration
    saved_at: int | None = None
    pending_save: Any = None  # checkpoint.PendingSave of an --async-save in flight
    in_flight: Any = None  # 2bw: the executor's InFlight carried between steps (else None)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        """--tokenizer, read once (on rank 0, the rank that saves it with each checkpoint)."""
        path = self.configs.data.tokenizer
        return build_tokenizer(path) if path and dist.get_rank() == 0 else None

    def save(self) -> None:
        """Checkpoint this iteration with the task's state to --save (once per iteration;
        collective over the world)."""
        root = self.configs.checkpoint.save
        if self.saved_at == self.iteration:
            return
        self.finish_saves()
        ckpt = self.configs.checkpoint
        pending = checkpoint.save(
            root, self.iteration, self.model, self.optimizer, self.scheduler, self.consumed,
            self.configs.model, self.task.state_dict(), ckpt.keep_latest_checkpoints,
            self.tokenizer, ckpt.async_save)
        if ckpt.async_save:
            self.pending_save = pending
            log(f"saving checkpoint to {root} at iteration {self.iteration} in the background")
        else:
            log(f"saved checkpoint to {root} at iteration {self.iteration}")
        self.saved_at = self.iteration

    def close_tiers(self) -> None:
        """Remove the offload tiers' scratch files now, not when FSDP2's reference cycles
        are collected: the parameters come back to the device, the optimizer steps no more."""
        close_param_tiers(self.model)
        self.optimizer.close()

    def finish_saves(self) -> None:
        """Wait for an --async-save in flight and publish it (collective over the world)."""
        if self.pending_save is not None:
            pending, self.pending_save = self.pending_save, None
            pending.finish(next(self.model[0].parameters()).device)
            log(f"saved checkpoint to {pending.root} at iteration {pending.iteration}")
