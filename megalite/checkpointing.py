"""Distributed, atomic, pickle-free checkpoints: every rank writes the slices it owns, and a
load reshards weights and optimizer state to any layout.

Layout of `<dir>/iter_<N:07d>/`:
  meta.json                   iteration, consumed samples, the whole model config, parameter
                              dtype, optimizer settings, scheduler and loss-scaler states,
                              parallel layout, the training task's small JSON state (rank 0)
  index.json                  per global tensor (by kind: "model", "main", "optim.exp_avg", ...)
                              its global shape, dtype and which file holds which slice
                              (megalite.checkpoint_shards); per-parameter scalars (Adam's step)
  shard_<R>.safetensors/.json the slices rank R owns (megalite.checkpoint_state): its TP shard,
                              its DP share (its ZeRO-1 fragment, or an even split over DP),
                              its stage's and its experts' parameters under their global names
  rank_<R>.json/.safetensors  rank R's RNG states (checkpoint_io: JSON + tensors)
  tokenizer/                  the tokenizer the model was trained with, when the run had one
                              (Tokenizer.save: a sentencepiece .model or a transformers
                              tokenizer directory); meta.json names it
`<dir>/latest_checkpointed_iteration.txt` names the newest complete iteration.

Nothing is unpickled. A save checks on every rank that the weights are finite, copies each
rank's slices to the host, writes them into `iter_<N>.tmp` (in a background thread with
--async-save: `PendingSave`), fsyncs every file and directory, and once every rank has
finished rank 0 writes the index, renames the directory (an older copy of the same iteration
is moved aside first and deleted only after the new one is in place) and then replaces the
marker, so an interrupted save never becomes what `--load` picks. A load reads, on each
rank, only the slices of its own parameters and optimizer fragments, under any TP/PP/VPP/
DP/CP/EP layout and ZeRO sharding; RNG states apply under the saved layout only (else
re-seeded, one line). Format-2 checkpoints (full tensors per stage) load their weights.
`verify_checkpoint` checks, with no communication, that every file the run needs exists and
is complete, so every rank reports the same error line.
"""
import dataclasses
import os
import random
import re
import shutil
import threading
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

from megalite.checkpoint_args import differences_error, model_differences
from megalite.checkpoint_io import (CheckpointFileError, fsync_dir, load_state, read_json,
                                    safetensors_shapes, save_state, state_files, write_json)
from megalite.checkpoint_shards import INDEX, ShardReader, ShardWriter, merge_index, verify_files
from megalite.checkpoint_state import collect_shards, load_optimizer, load_weights
from megalite.config import ModelConfig
from megalite.data.tokenizers import Tokenizer
from megalite.device import device_type
from megalite.models.sharding import local_shard, params_dtype
from megalite.mpu import comm
from megalite.mpu import parallel_state as ps
from megalite.mpu.random import get_rng_tracker, model_parallel_seed

MARKER = "latest_checkpointed_iteration.txt"
FORMAT = 3
LEGACY_FORMAT = 2  # full tensors per pipeline stage; its weights still load


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of one saved iteration: <root>/iter_0000042."""
    return os.path.join(root, f"iter_{iteration:07d}")


def _published_dir(root: str, iteration: int) -> str:
    """iter_N, or its previous copy if a re-save of N stopped between its two renames."""
    final = iteration_dir(root, iteration)
    return final if os.path.isdir(final) or not os.path.isdir(final + ".old") else final + ".old"


def model_file(directory: str, pp_rank: int, ep_rank: int = 0) -> str:
    """A format-2 checkpoint's weights of stage `pp_rank`; for EP rank > 0 only its experts."""
    ep = f"_ep{ep_rank:03d}" if ep_rank else ""
    return os.path.join(directory, f"model_pp{pp_rank:03d}{ep}.safetensors")


def model_files(directory: str, layout: dict) -> list[str]:
    """Every model file of a format-2 checkpoint saved under `layout` ("pp", optional "ep")."""
    return [model_file(directory, stage, ep_rank) for stage in range(layout["pp"])
            for ep_rank in range(layout.get("ep", 1))]


def rank_state_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}")


def current_layout() -> dict:
    """The running grid's layout as checkpoints record it (a single process: all ones)."""
    return (ps.get_grid() or ps.GridLayout(1, 1, 1)).as_dict()


def _rng_state() -> dict:
    """Python's, numpy's and the CPU generator's states, and under "device_type" the type of
    the device whose states follow: its default generator's ("cuda", on GPUs) and the
    model-parallel tracker's streams."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "cpu": torch.get_rng_state(), "device_type": get_rng_tracker().device_type,
             "tracker": get_rng_tracker().get_states()}
    if device_type() == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore `_rng_state()`. From a run on another device type (a checkpoint moved between
    CPU and GPU) only Python's and numpy's states: torch's generators keep their seeding from
    --seed, and rank 0 says so in one line."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    saved = state.get("device_type", "cpu")  # checkpoints before the tag come from CPU runs
    if saved != get_rng_tracker().device_type:
        if dist.get_rank() == 0:
            print(f"checkpoint RNG states are from a {saved} run, this run is on "
                  f"{get_rng_tracker().device_type}: torch's RNG streams start from --seed",
                  flush=True)
        return
    torch.set_rng_state(state["cpu"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomic_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def _params_dtype(model: list[torch.nn.Module]) -> str:
    return str(params_dtype(model[0])).removeprefix("torch.")


def _publish(root: str, iteration: int, tmp: str) -> None:
    """Move the complete `tmp` to iter_N (keeping any old iter_N until then) and mark it."""
    final = iteration_dir(root, iteration)
    fsync_dir(tmp)
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    _write_atomic_text(os.path.join(root, MARKER), str(iteration))
    shutil.rmtree(old, ignore_errors=True)


def _save_tokenizer(directory: str, tokenizer: Tokenizer | None) -> dict:
    """Write `tokenizer` into `directory`/tokenizer; the meta.json entry naming it."""
    if tokenizer is None:
        return {}
    path = tokenizer.save(os.path.join(directory, "tokenizer"))
    return {"tokenizer": os.path.relpath(path, directory)}


def checkpoint_tokenizer(root: str, meta: dict) -> str | None:
    """The path of the tokenizer saved with the checkpoint `meta` describes, or None."""
    name = meta.get("tokenizer")
    return name and os.path.join(_published_dir(root, meta["iteration"]), name)


class PendingSave:
    """A save whose files are being written (by a background thread with --async-save);
    `finish()` waits for them on every rank and publishes the checkpoint."""

    def __init__(self, root: str, iteration: int, tmp: str, write: Callable[[], None],
                 meta: dict | None, keep_latest: int | None, background: bool) -> None:
        self.root, self.iteration, self.tmp, self.meta = root, iteration, tmp, meta
        self.keep_latest, self.error = keep_latest, None
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True,
                                        name=f"checkpoint-save-{iteration}")
        if background:
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
        if self._thread.ident is not None:
            self._thread.join()
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
            _publish(self.root, self.iteration, self.tmp)
            if self.keep_latest:
                prune_checkpoints(self.root, self.keep_latest, self.iteration)
        dist.barrier()


def save_checkpoint(root: str, iteration: int, model: list[torch.nn.Module], optimizer,
                    scheduler, consumed_samples: int, model_config: ModelConfig,
                    task_state: dict | None = None, keep_latest: int | None = None,
                    tokenizer: Tokenizer | None = None, async_save: bool = False
                    ) -> PendingSave:
    """Collective over the world: every rank writes the slices it owns, rank 0 publishes.

    Each rank copies its slices of the weights and optimizer state to the host; the files are
    written at once, or with `async_save` by a background thread while training goes on, and
    published by `PendingSave.finish()` (called here without `async_save`; otherwise the
    caller calls it before the next save and at the end of the run). `task_state` (JSON: the
    training task's own progress) is kept in meta.json as "task"; `tokenizer` (rank 0's
    matters) is saved beside the weights. With `keep_latest`, rank 0 then deletes all but the
    newest that many iterations.

    Raises ValueError on every rank (publishing nothing) if any rank's weights are not finite.
    """
    rank = dist.get_rank()
    device = next(model[0].parameters()).device
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
    collect_shards(model, optimizer, writer)
    rng = _rng_state()
    meta = None
    if rank == 0:
        meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
                "model_config": dataclasses.asdict(model_config),
                "params_dtype": _params_dtype(model), "optimizer": optimizer.settings(),
                "layout": current_layout(), "scheduler": scheduler.state_dict(),
                "scaler": optimizer.scaler.state_dict() if optimizer.scaler else None,
                **({"task": task_state} if task_state else {}),
                **_save_tokenizer(tmp, tokenizer)}

    def write() -> None:
        writer.write(tmp)
        save_state(rank_state_path(tmp, rank), {"rng": rng})
    pending = PendingSave(root, iteration, tmp, write, meta, keep_latest, async_save)
    if not async_save:
        pending.finish(device)
    return pending


def prune_checkpoints(root: str, keep: int, written: int) -> list[int]:
    """Delete every published iteration of `root` but the newest `keep` and `written` (the
    one just saved); return the deleted iterations."""
    saved = sorted(int(name[5:]) for name in os.listdir(root)
                   if re.fullmatch(r"iter_\d{7}", name))
    doomed = [i for i in saved[:-keep] if i != written]
    for i in doomed:
        shutil.rmtree(iteration_dir(root, i))
    return doomed


def latest_iteration(root: str) -> int | None:
    """The iteration named by the marker, or None when `root` holds no checkpoint."""
    path = os.path.join(root, MARKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit() or not os.path.isdir(_published_dir(root, int(text))):
        raise ValueError(f"--load {root}: {MARKER} names {text!r}, which is not a complete "
                         f"checkpoint directory")
    return int(text)


def mark_latest(root: str, iteration: int) -> None:
    """Make the saved `iteration` the one `--load` picks (one process; no communication)."""
    if not os.path.isdir(_published_dir(root, iteration)):
        raise ValueError(f"{root}: no checkpoint of iteration {iteration}")
    _write_atomic_text(os.path.join(root, MARKER), str(iteration))


def describe_start(load: str | None, iteration: int, train_iters: int) -> str:
    """What a run starts from, in words: scratch, a resumed iteration, or one that already
    reached --train-iters."""
    if load is None or latest_iteration(load) is None:
        return f"starting from scratch ({f'no checkpoint in {load} yet' if load else 'no --load'})"
    if iteration >= train_iters:
        return (f"{load} is at iteration {iteration}, --train-iters is {train_iters}: nothing "
                f"left to do (raise --train-iters to train on)")
    return f"resumed from {load} at iteration {iteration}"


def read_meta(root: str, iteration: int | None = None) -> dict | None:
    """The metadata of the newest (or the given) checkpoint (no communication), or None."""
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        return None
    meta = read_json(os.path.join(_published_dir(root, iteration), "meta.json"))
    if meta.get("format") not in (LEGACY_FORMAT, FORMAT):
        raise CheckpointFileError(f"{root}: checkpoint format {meta.get('format')}, expected "
                                  f"{FORMAT} or {LEGACY_FORMAT} (written by another megalite "
                                  f"version)")
    return meta


def check_compatible(meta: dict, model_config: ModelConfig, root: str,
                     params_dtype: torch.dtype | None = None) -> None:
    """One clear error naming every model field (and the precision) that differs.

    Every ModelConfig field must match except RESUMABLE_MODEL_FIELDS (floats at float32
    precision, see megalite.checkpoint_args). A weights-only checkpoint
    (tools/convert_checkpoint.py) has no precision and loads under any.
    """
    differences = model_differences(meta["model_config"], model_config)
    theirs = meta.get("params_dtype")
    ours = str(params_dtype).removeprefix("torch.") if params_dtype is not None else None
    if theirs and ours and theirs != ours:
        differences.append(f"checkpoint was trained with {theirs} parameters, this run uses "
                           f"{ours} (use the same --bf16/--fp16, or make a weights-only copy "
                           f"with tools/convert_checkpoint.py --direction reshard)")
    if differences:
        raise differences_error(root, differences)


def restores_optimizer(meta: dict, optimizer_settings: dict) -> bool:
    """Whether the saved optimizer state applies: the same optimizer (any layout and ZeRO
    sharding; a weights-only or format-2 checkpoint has none)."""
    saved = meta.get("optimizer")
    return meta.get("format") == FORMAT and saved is not None \
        and saved["optimizer"] == optimizer_settings["optimizer"]


def restores_rng(meta: dict, layout: dict) -> bool:
    """Whether the per-rank RNG states apply: the run's layout is the saved one."""
    return meta.get("format") == FORMAT and meta.get("optimizer") is not None \
        and meta["layout"] == layout


def _legacy_index(directory: str, meta: dict) -> dict:
    """The index of a format-2 checkpoint: its per-stage model files hold full tensors."""
    model = {}
    for path in model_files(directory, meta["layout"]):
        safetensors_shapes(path)
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shape = piece.get_shape()
                model[key] = {"shape": shape, "dtype": _SAFETENSORS_DTYPES[piece.get_dtype()],
                              "pieces": [[os.path.basename(path), key, [0] * len(shape), shape]]}
    return {"model": model, "scalars": {}}


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
                       "I64": "int64", "I32": "int32"}


def checkpoint_reader(root: str, meta: dict) -> ShardReader:
    """A reader of the slices of the checkpoint `meta` describes (headers only so far)."""
    directory = _published_dir(root, meta["iteration"])
    if meta["format"] == LEGACY_FORMAT:
        return ShardReader(directory, _legacy_index(directory, meta))
    return ShardReader(directory, read_json(os.path.join(directory, INDEX)))


def verify_checkpoint(root: str, meta: dict, layout: dict, world_size: int) -> None:
    """Every file the load needs exists and is complete (headers only, no communication):
    every shard file the index names and, when the RNG states apply, every rank's. Raises
    CheckpointFileError naming the first bad file, the same on every rank."""
    reader = checkpoint_reader(root, meta)
    verify_files(reader.directory, reader.index)
    if restores_rng(meta, layout):
        for rank in range(world_size):
            json_path, tensor_path = state_files(rank_state_path(reader.directory, rank))
            read_json(json_path)
            safetensors_shapes(tensor_path)


def read_model_weights(root: str, meta: dict) -> dict[str, torch.Tensor]:
    """The full, unpadded weights of the checkpoint `meta` describes (one process)."""
    reader = checkpoint_reader(root, meta)
    return {name: reader.read_full("model", name) for name in reader.index["model"]}


def _reseed(seed: int, iteration: int) -> None:
    """Deterministic RNG streams for a resume under another layout: --seed + iteration."""
    random.seed(seed + iteration)
    np.random.seed(seed + iteration)
    model_parallel_seed(seed + iteration, ps.get_tensor_model_parallel_rank(),
                        ps.get_pipeline_model_parallel_rank())


def load_checkpoint(root: str, model: list[torch.nn.Module], optimizer, scheduler,
                    model_config: ModelConfig, seed: int = 0) -> tuple[int, int]:
    """Restore the newest checkpoint, saved under any layout and ZeRO sharding; return
    (iteration, consumed_samples), (0, 0) if none. Each rank reads only the slices of its own
    parameters and optimizer fragments. RNG states are restored under the saved layout, else
    re-seeded from `seed` + iteration (one line)."""
    meta = read_meta(root)
    if meta is None:
        return 0, 0
    check_compatible(meta, model_config, root, params_dtype(model[0]))
    layout, settings = current_layout(), optimizer.settings()
    verify_checkpoint(root, meta, layout, dist.get_world_size())
    iteration, reader = meta["iteration"], checkpoint_reader(root, meta)
    try:
        load_weights(reader, model)
        optimizer.reload_model_params()
        if restores_optimizer(meta, settings):
            load_optimizer(reader, model, optimizer)
    except ValueError as error:
        raise CheckpointFileError(str(error)) from None
    if restores_optimizer(meta, settings):
        scheduler.load_state_dict(meta["scheduler"])
        if optimizer.scaler is not None and meta["scaler"] is not None:
            optimizer.scaler.load_state_dict(meta["scaler"])
    else:
        scheduler.step(increment=0, iteration=iteration)
        if dist.get_rank() == 0:
            print(f"loaded weights only (checkpoint optimizer {meta.get('optimizer')}, this run "
                  f"{settings}): the optimizer state starts fresh", flush=True)
    if restores_rng(meta, layout):
        _set_rng_state(load_state(rank_state_path(reader.directory, dist.get_rank()))["rng"])
    else:
        _reseed(seed, iteration)
        if dist.get_rank() == 0:
            print(f"checkpoint saved under layout {meta['layout']}, this run is {layout}: RNG "
                  f"streams re-seeded from --seed + iteration ({seed} + {iteration})", flush=True)
    return iteration, meta["consumed_samples"]


def read_full_model(root: str, iteration: int | None = None
                    ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, full state dict of every stage) of the newest (or the given) checkpoint; no
    communication."""
    meta = read_meta(root, iteration)
    if meta is None:
        raise FileNotFoundError(f"{root}: no {MARKER} (expected a megalite checkpoint directory)")
    return meta, read_model_weights(root, meta)


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
        **_save_tokenizer(tmp, tokenizer)})
    _publish(root, iteration, tmp)
