"""Sharded, atomic, pickle-free checkpoints with exact resume and resharding to another layout.

Layout of `<dir>/iter_<N:07d>/`:
  meta.json                   iteration, consumed samples, the whole model config, parameter
                              dtype, optimizer settings, parallel layout, the training
                              task's small JSON state if any (rank 0)
  model_pp<P>.safetensors     full (TP-gathered, unpadded) parameters of pipeline stage P,
                              global names: readable by any safetensors tool
  model_pp<P>_ep<E>.safetensors  the experts of EP rank E > 0 of stage P (MoE; experts by
                              global index)
  rank_<R>.json/.safetensors  per-rank optimizer (incl. distributed-optimizer shard), loss
                              scaler, scheduler and RNG states (checkpoint_io: JSON + tensors)
  tokenizer/                  the tokenizer the model was trained with, when the run had one
                              (Tokenizer.save: a sentencepiece .model or a transformers
                              tokenizer directory); meta.json names it
`<dir>/latest_checkpointed_iteration.txt` names the newest complete iteration.

Nothing is unpickled. A save writes into `iter_<N>.tmp`, fsyncs every file and directory,
checks on every rank that the weights are finite, renames the directory once every rank
has finished (an older copy of the same iteration is moved aside first and deleted only
after the new one is in place) and then replaces the marker, so an interrupted save never
becomes what `--load` picks. Because model files hold full tensors, a checkpoint loads
under any TP/PP/DP layout; optimizer and RNG state are restored only under the layout and
optimizer settings that wrote them (otherwise the weights are loaded and the optimizer
starts fresh, with one printed line). `verify_checkpoint` checks, with no communication,
that every file the run needs exists and is complete, so every rank reports the same
error line.
"""
import dataclasses
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megalite.checkpoint_args import differences_error, model_differences
from megalite.checkpoint_io import (CheckpointFileError, fsync_dir, load_state, read_json,
                                    read_tensors, safetensors_shapes, save_state, state_files,
                                    write_json, write_tensors)
from megalite.config import ModelConfig
from megalite.data.tokenizers import Tokenizer
from megalite.device import current_device, device_type
from megalite.models.sharding import (copy_tp_local, full_state_dict, is_fully_sharded,
                                      local_shard, local_value, params_dtype,
                                      persistent_buffers, unwrap)
from megalite.models.spec import stage_of
from megalite.mpu import comm
from megalite.mpu import parallel_state as ps
from megalite.mpu.random import get_rng_tracker

MARKER = "latest_checkpointed_iteration.txt"
FORMAT = 2


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of one saved iteration: <root>/iter_0000042."""
    return os.path.join(root, f"iter_{iteration:07d}")


def _published_dir(root: str, iteration: int) -> str:
    """iter_N, or its previous copy if a re-save of N stopped between its two renames."""
    final = iteration_dir(root, iteration)
    return final if os.path.isdir(final) or not os.path.isdir(final + ".old") else final + ".old"


def model_file(directory: str, pp_rank: int, ep_rank: int = 0) -> str:
    """Stage `pp_rank`'s weights; for EP rank > 0 only its experts (the rest is in EP rank 0's)."""
    ep = f"_ep{ep_rank:03d}" if ep_rank else ""
    return os.path.join(directory, f"model_pp{pp_rank:03d}{ep}.safetensors")


def model_files(directory: str, layout: dict) -> list[str]:
    """Every model file of a checkpoint saved under `layout` (its "pp" and optional "ep")."""
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


def save_checkpoint(root: str, iteration: int, model: list[torch.nn.Module], optimizer,
                    scheduler, consumed_samples: int, model_config: ModelConfig,
                    task_state: dict | None = None, keep_latest: int | None = None,
                    tokenizer: Tokenizer | None = None) -> None:
    """Collective over the world: every rank writes its part, rank 0 publishes it.

    `task_state` (JSON: the training task's own progress) is kept in meta.json as "task";
    `tokenizer` (rank 0's matters) is saved beside the weights. With `keep_latest`, rank 0
    then deletes all but the newest that many iterations.

    Raises ValueError on every rank (publishing nothing) if any rank's weights are not finite.
    """
    rank = dist.get_rank()
    tmp = iteration_dir(root, iteration) + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    finite = bool(torch.stack([torch.isfinite(local_shard(p)).all().to(current_device())
                               for c in model for p in c.parameters()]).all())  # one sync
    ep_rank = ps.get_expert_model_parallel_rank()
    # DP rank 0 writes, and the other EP ranks' experts; fully sharded weights are gathered
    # over DP on every rank first
    if ps.get_expert_data_parallel_rank() == 0 or any(map(is_fully_sharded, model)):
        weights = {}
        for chunk in model:
            weights.update(full_state_dict(chunk))
        if ep_rank:
            weights = {k: v for k, v in weights.items() if ".local_experts." in k}
        if ps.get_expert_data_parallel_rank() == ps.get_tensor_model_parallel_rank() == 0 \
                and finite:
            write_tensors(model_file(tmp, ps.get_pipeline_model_parallel_rank(), ep_rank),
                          weights)
    if finite:
        save_state(rank_state_path(tmp, rank), {
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": _rng_state()})
    if rank == 0 and finite:
        write_json(os.path.join(tmp, "meta.json"), {
            "format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
            "model_config": dataclasses.asdict(model_config),
            "params_dtype": _params_dtype(model), "optimizer": optimizer.settings(),
            "layout": current_layout(), **({"task": task_state} if task_state else {}),
            **_save_tokenizer(tmp, tokenizer)})
    bad = torch.tensor([0.0 if finite else 1.0], device=current_device())
    comm.all_reduce(bad, dist.group.WORLD, op=dist.ReduceOp.MAX)
    if bad.item():
        raise ValueError(f"save at iteration {iteration}: the weights hold NaN/Inf; {root} "
                         f"keeps its last good checkpoint")
    if rank == 0:
        _publish(root, iteration, tmp)
        if keep_latest:
            prune_checkpoints(root, keep_latest, iteration)
    dist.barrier()


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
    if meta.get("format") != FORMAT:
        raise CheckpointFileError(f"{root}: checkpoint format {meta.get('format')}, expected "
                                  f"{FORMAT} (written by another megalite version)")
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


def restores_optimizer(meta: dict, optimizer_settings: dict, layout: dict) -> bool:
    """Whether the per-rank optimizer/RNG files apply: same layout and optimizer settings."""
    return meta.get("optimizer") == optimizer_settings and meta["layout"] == layout


def verify_checkpoint(root: str, meta: dict, layout: dict, world_size: int,
                      optimizer_settings: dict) -> None:
    """Every file the load needs exists and is complete (headers only, no communication):
    the model file of every saved stage and, when the optimizer state applies, every
    rank's state. Raises CheckpointFileError naming the first bad file."""
    directory = _published_dir(root, meta["iteration"])
    for path in model_files(directory, meta["layout"]):
        safetensors_shapes(path)
    if restores_optimizer(meta, optimizer_settings, layout):
        for rank in range(world_size):
            json_path, tensor_path = state_files(rank_state_path(directory, rank))
            read_json(json_path)
            safetensors_shapes(tensor_path)


def read_model_weights(root: str, meta: dict) -> dict[str, torch.Tensor]:
    """The full state dict of every stage of the checkpoint `meta` describes."""
    directory, full = _published_dir(root, meta["iteration"]), {}
    for path in model_files(directory, meta["layout"]):
        full.update(read_tensors(path))
    return full


@torch.no_grad()
def load_model_weights(root: str, meta: dict, model: list[torch.nn.Module]) -> None:
    """Fill this rank's shards from the full per-stage files (any TP/PP layout)."""
    full = read_model_weights(root, meta)
    directory = _published_dir(root, meta["iteration"])
    for chunk in map(unwrap, model):
        for name, param in [*chunk.named_parameters(), *persistent_buffers(chunk)]:
            try:
                copy_tp_local(param, local_value(full, name, param))
            except KeyError as error:
                raise CheckpointFileError(f"{directory}: no model file holds parameter "
                                          f"{error.args[0]!r}") from None
            except ValueError as error:
                raise CheckpointFileError(f"{directory}: parameter {name!r}: {error}") from None


def load_checkpoint(root: str, model: list[torch.nn.Module], optimizer, scheduler,
                    model_config: ModelConfig) -> tuple[int, int]:
    """Restore the newest checkpoint; return (iteration, consumed_samples), (0, 0) if none."""
    meta = read_meta(root)
    if meta is None:
        return 0, 0
    check_compatible(meta, model_config, root, params_dtype(model[0]))
    layout, settings = current_layout(), optimizer.settings()
    verify_checkpoint(root, meta, layout, dist.get_world_size(), settings)
    iteration = meta["iteration"]
    load_model_weights(root, meta, model)
    if restores_optimizer(meta, settings, layout):
        path = rank_state_path(_published_dir(root, iteration), dist.get_rank())
        state = load_state(path)
        try:
            optimizer.load_state_dict(state["optimizer"])
        except ValueError as error:
            raise CheckpointFileError(f"{path}.safetensors: {error}") from None
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
    else:
        optimizer.reload_model_params()
        scheduler.step(increment=0, iteration=iteration)
        if dist.get_rank() == 0:
            print(f"loaded weights only (saved under layout {meta['layout']} with optimizer "
                  f"{meta.get('optimizer')}, running {layout} with {settings}): optimizer state "
                  f"and RNG start fresh", flush=True)
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
    """A weights-only checkpoint (no optimizer state, no precision) split into `pp` stage
    files, with `tokenizer` if given; single process. Loads under any layout and precision:
    the files hold full tensors, sliced (and cast) by each rank on load."""
    if model_config.num_layers % pp:
        raise ValueError(f"--target-pp ({pp}) must divide the model's {model_config.num_layers} "
                         f"layers")
    tmp = iteration_dir(root, iteration) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(pp)]
    for name, tensor in full.items():
        stages[stage_of(name, model_config.num_layers, pp)][name] = tensor
    for stage, weights in enumerate(stages):
        write_tensors(model_file(tmp, stage), weights)
    write_json(os.path.join(tmp, "meta.json"), {
        "format": FORMAT, "iteration": iteration, "consumed_samples": 0,
        "model_config": dataclasses.asdict(model_config), "params_dtype": None,
        "optimizer": None, "layout": {"tp": tp, "pp": pp, "dp": 1, "vpp": None},
        **_save_tokenizer(tmp, tokenizer)})
    _publish(root, iteration, tmp)
