"""Saving: every rank writes the slices it owns (synchronously or in a background thread),
rank 0 merges the index and publishes; weights-only checkpoints of full tensors.
"""
import dataclasses
import os
import shutil
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from megalite.checkpoint.dirs import iteration_dir, prune_checkpoints, publish, rank_state_path
from megalite.checkpoint.files import save_state, write_json
from megalite.checkpoint.metadata import FORMAT, current_layout, params_dtype_name, save_tokenizer
from megalite.checkpoint.reducers import reducer_states
from megalite.checkpoint.rng import rng_state
from megalite.checkpoint.shards import ShardWriter, merge_index
from megalite.checkpoint.staging import AsyncStaging
from megalite.checkpoint.state import collect_shards
from megalite.config import ModelConfig
from megalite.data.tokenizers import Tokenizer
from megalite.distributed.param_tier import params_resident
from megalite.models.sharding import local_shard
from megalite.mpu import comm

STAGING = AsyncStaging()  # this rank's host buffer for --async-save, reused by every save


class PendingSave:
    """A save whose files are being written (by a background thread with --async-save, which
    reads `staging`); `finish()` waits for them on every rank and publishes the checkpoint."""

    def __init__(self, root: str, iteration: int, tmp: str, write: Callable[[], None],
                 meta: dict | None, keep_latest: int | None,
                 staging: AsyncStaging | None = None) -> None:
        self.root, self.iteration, self.tmp, self.meta = root, iteration, tmp, meta
        self.keep_latest, self.error, self.staging = keep_latest, None, staging
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True,
                                        name=f"checkpoint-save-{iteration}")
        if staging is not None:
            staging.writer = self._thread
            self._thread.start()
        else:
            self._run(write)

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as error:  # reported by finish(), on the caller's thread
            self.error = error

    def finish(self, device: torch.device) -> None:
        """Collective over the world: wait for this rank's files, agree that every rank wrote
        its own, then rank 0 writes the index and meta.json and publishes (rename + marker).
        A failure anywhere publishes nothing and raises on every rank."""
        if self.staging is not None:
            self.staging.wait()
        failed = torch.tensor([0.0 if self.error is None else 1.0], device=device)
        comm.all_reduce(failed, dist.group.WORLD, op=dist.ReduceOp.MAX)
        if self.error is not None:
            raise self.error
        if failed.item():
            raise OSError(f"save of iteration {self.iteration} to {self.root} failed on another "
                          f"rank; {self.root} keeps its last good checkpoint")
        if dist.get_rank() == 0:
            merge_index(self.tmp, dist.get_world_size())
            write_json(os.path.join(self.tmp, "meta.json"), self.meta)
            publish(self.root, self.iteration, self.tmp)
            if self.keep_latest:
                prune_checkpoints(self.root, self.keep_latest, self.iteration)
        dist.barrier()



def save(root: str, iteration: int, model: list[torch.nn.Module], optimizer,
                    scheduler, consumed_samples: int, model_config: ModelConfig,
                    task_state: dict | None = None, keep_latest: int | None = None,
                    tokenizer: Tokenizer | None = None, async_save: bool = False
                    ) -> PendingSave:
    """Collective over the world: every rank writes the slices it owns, rank 0 publishes.

    Each rank writes its slices of the weights and optimizer state straight from their
    memory (files.write_tensors: at most one bounded host buffer for device tensors), at
    once, or with `async_save` by a background thread while training goes on, from the
    rank's reusable host copy of its device tensors and in place for those in host memory
    (the next optimizer step waits for the write: staging.py); published by
    `PendingSave.finish()` (called here without `async_save`; otherwise the caller calls it
    before the next save and at the end of the run). `task_state` (JSON: the
    training task's own progress) is kept in meta.json as "task"; `tokenizer` (rank 0's
    matters) is saved beside the weights. With `keep_latest`, rank 0 then deletes all but the
    newest that many iterations.

    Raises ValueError on every rank (publishing nothing) if any rank's weights are not finite.
    """
    rank = dist.get_rank()
    device = next(model[0].parameters()).device
    with params_resident(model):  # the parameter tier's shards, read and written
        bad = torch.stack([torch.isfinite(local_shard(p)).all() for c in model
                           for p in c.parameters()]).all()
        bad = (~bad).float().reshape(1)
        comm.all_reduce(bad, dist.group.WORLD, op=dist.ReduceOp.MAX)
        if bad.item():
            raise ValueError(f"save at iteration {iteration}: the weights hold NaN/Inf; {root} "
                             f"keeps its last good checkpoint")
        tmp = iteration_dir(root, iteration) + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        writer = ShardWriter(rank)
        with optimizer.resident():  # the nvme tier's state read from its file
            collect_shards(model, optimizer, writer)
        if async_save:
            writer.tensors = STAGING.stage(writer.tensors, optimizer)
        rng, reducers = rng_state(), reducer_states(model)
        meta = None
        if rank == 0:
            meta = {"format": FORMAT, "iteration": iteration,
                    "consumed_samples": consumed_samples,
                    "model_config": dataclasses.asdict(model_config),
                    "params_dtype": params_dtype_name(model), "optimizer": optimizer.settings(),
                    "layout": current_layout(), "scheduler": scheduler.state_dict(),
                    "scaler": optimizer.scaler.state_dict() if optimizer.scaler else None,
                    **({"task": task_state} if task_state else {}),
                    **save_tokenizer(tmp, tokenizer)}

        def write() -> None:
            writer.write(tmp)
            save_state(rank_state_path(tmp, rank), {"rng": rng, "reducers": reducers})
        pending = PendingSave(root, iteration, tmp, write, meta, keep_latest,
                              STAGING if async_save else None)
        if not async_save:
            pending.finish(device)
    return pending



def write_weights_checkpoint(root: str, full: dict[str, torch.Tensor], model_config: ModelConfig,
                             tp: int = 1, pp: int = 1, iteration: int = 0,
                             tokenizer: Tokenizer | None = None) -> None:
    """A weights-only checkpoint (no optimizer state, no precision) of full tensors, with
    `tokenizer` if given; single process. Loads under any layout and precision (each rank
    reads its slices and casts them); `tp` and `pp` are only recorded."""
    if model_config.num_layers % pp:
        raise ValueError(f"--target-pp ({pp}) must divide the model's {model_config.num_layers} "
                         f"layers")
    tmp = iteration_dir(root, iteration) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    writer = ShardWriter(0)
    for name, tensor in full.items():
        writer.add("model", name, tuple(tensor.shape),
                   ((0,) * tensor.ndim, tuple(tensor.shape)), tensor)
    writer.write(tmp)
    merge_index(tmp, 1)
    write_json(os.path.join(tmp, "meta.json"), {
        "format": FORMAT, "iteration": iteration, "consumed_samples": 0,
        "model_config": dataclasses.asdict(model_config), "params_dtype": None,
        "optimizer": None, "layout": {"tp": tp, "pp": pp, "dp": 1, "vpp": None},
        **save_tokenizer(tmp, tokenizer)})
    publish(root, iteration, tmp)
