"""`MegaliteModule`: any megalite Task (megalite.training.Task) as a LightningModule, trained
with manual optimization by `MegaliteStrategy`: Lightning's batch is one step's microbatches
and its step is megalite's (megalite.training.loop.training_iteration: the pipeline schedule,
DP reduction, clipping, NaN skips, the LR schedule), so the numbers are the entry scripts'.
"""
import functools

import pytorch_lightning as pl
import torch

from megalite.config import Configs
from megalite.data.loader import TimedIterator
from megalite.models.layer_drop import LayerDrop, shared_over_replicas
from megalite.mpu import parallel_state as ps
from megalite.schedules.tables import schedule_kind
from megalite.training import Run, Task
from megalite.training.loop import training_iteration, validate
from megalite.training.resilience import SkipGuard
from megalite.lightning.data import MegaliteDataModule


def lightning_configs(configs: Configs) -> Configs:
    """An entry script's configs for Lightning: Lightning's ModelCheckpoint and ckpt_path
    decide saving and resuming, so --save/--load stay only where given on the command line
    (--load: the weights to start from, e.g. a converted SmolLM2)."""
    ckpt = configs.checkpoint
    ckpt.save = ckpt.save if "save" in configs.explicit else None
    ckpt.load = ckpt.load if "load" in configs.explicit else None
    if ckpt.async_save:
        raise ValueError("--async-save: under Lightning a checkpoint is written when "
                         "ModelCheckpoint asks for it; drop the flag")
    if schedule_kind(configs.parallel.pipeline_schedule).across_steps:
        raise ValueError("--pipeline-schedule 2bw: its pipeline drains before saves and "
                         "evaluations megalite's loop schedules, which Lightning's callbacks "
                         "decide; use 1f1b (or run pretrain_gpt.py)")
    return configs


class MegaliteModule(pl.LightningModule):
    """A megalite task under Lightning's Trainer (with `MegaliteStrategy`).

    Logged each step: `loss` (the task's loss_key, the mean over DP), `grad_norm` (before
    clipping; absent on a skipped step) and `lr`; at validation points `valid_loss` when the
    task has a valid stream. Runs until Trainer(max_steps) or the task's --train-iters
    (BERT: --epochs); validates every Trainer(val_check_interval) steps, or every
    --eval-interval when that is left at its default.
    """

    def __init__(self, task: Task, configs: Configs) -> None:
        super().__init__()
        self.automatic_optimization = False  # megalite's step applies the optimizer
        self.task, self.configs = task, configs
        self.layout, self.run = None, None  # set by MegaliteStrategy
        self.chunks = torch.nn.ModuleList()

    def attach(self, run: Run) -> None:
        """Take the run MegaliteStrategy built: its chunks become this module's children."""
        self.run, self.chunks = run, torch.nn.ModuleList(run.model)
        configs = run.configs
        self.guard = SkipGuard(configs.train.max_skipped_steps)
        self.layer_drop = LayerDrop.from_configs(configs)
        self.replica = 0 if shared_over_replicas(configs) else ps.get_data_parallel_rank()
        trainer = self.trainer
        if trainer.val_check_interval == 1.0:  # Lightning's default: the task's --eval-interval
            if configs.train.eval_interval:
                trainer.val_check_interval = configs.train.eval_interval
            else:
                trainer.limit_val_batches = 0  # a run that validates nowhere

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Lightning zeroes the module's grads before training and validating; megalite's
        live in buffers the optimizer holds views of (DDP buckets, FSDP grad shards): zero
        them, never drop them."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    def configure_optimizers(self):
        """megalite's optimizer for the flags (built with the model by MegaliteStrategy)."""
        return self.run.optimizer

    def train_dataloader(self):
        return self._data.train_dataloader()

    def val_dataloader(self):
        return self._data.val_dataloader()

    @functools.cached_property
    def _data(self) -> MegaliteDataModule:
        return MegaliteDataModule(self)

    def on_train_start(self) -> None:
        self.task.start(self.run)

    def training_step(self, batch: list, batch_idx: int) -> None:
        """One megalite step over `batch`, this step's microbatches."""
        run = self.run
        self.optimizers().step(closure=functools.partial(
            training_iteration, run, TimedIterator(iter(batch)), self.guard, self.layer_drop,
            self.replica))
        grad_norm = run.grad_norms[run.iteration]
        self.log_value("loss", run.losses[run.iteration], prog_bar=True)
        if grad_norm is not None:
            self.log_value("grad_norm", grad_norm)
        self.log_value("lr", run.scheduler.get_lr())
        if run.iteration >= self.configs.train.train_iters:
            self.trainer.should_stop = True

    def validation_step(self, batch: int, batch_idx: int) -> None:
        """A validation point: megalite's validation of the run (not in the sanity check)."""
        if self.trainer.sanity_checking:
            return
        with torch.inference_mode(False):
            loss = validate(self.run)
        if loss is not None:
            self.log_value("valid_loss", loss)
        self.log_validation()

    def log_value(self, name: str, value: float, prog_bar: bool = False) -> None:
        """Log a value that is the same on every rank (a step's: the global batch's)."""
        self.log(name, value, prog_bar=prog_bar, batch_size=self.run.layout.global_batch_size)

    def log_validation(self) -> None:
        """What a task adds to a validation point's log (subclasses)."""

    def on_train_end(self) -> None:
        if self.run.iteration >= self.configs.train.train_iters:
            self.task.finish(self.run)
        self.run.logger.close()
