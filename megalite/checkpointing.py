"""Sharded, atomic checkpoints with exact resume and resharding to another layout.

Layout of `<dir>/iter_<N:07d>/`:
  meta.pt           iteration, consumed samples, model config, parallel layout (rank 0)
  model_pp<P>.pt    full (TP-gathered, unpadded) parameters of pipeline stage P, global names
  model_pp<P>_ep<E>.pt  the experts of EP rank E > 0 of stage P (MoE; experts by global index)
  rank_<R>.pt       per-rank optimizer (incl. distributed-optimizer shard), scaler, scheduler, RNG
`<dir>/latest_checkpointed_iteration.txt` names the newest complete iteration.

A save writes into `iter_<N>.tmp`, renames it once every rank has finished, then
replaces the marker, so an interrupted save never becomes what `--load` picks.
Because model files hold full tensors, a checkpoint loads under any TP/PP/DP layout;
optimizer and RNG state are restored only under the layout that wrote them.
"""
import dataclasses
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.models.sharding import full_state_dict, load_full_state_dict
from megalite.models.spec import stage_of
from megalite.mpu import parallel_state as ps
from megalite.mpu.random import get_rng_tracker

MARKER = "latest_checkpointed_iteration.txt"
# Fields that change parameter shapes: a mismatch makes a checkpoint unloadable.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "vocab_size", "max_position_embeddings", "num_tokentypes", "num_experts")


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of one saved iteration: <root>/iter_0000042."""
    return os.path.join(root, f"iter_{iteration:07d}")


def _layout() -> dict:
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
            **({"ep": ps.get_expert_model_parallel_world_size()}
               if ps.get_expert_model_parallel_world_size() > 1 else {})}


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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


def save_checkpoint(root: str, iteration: int, model: list[torch.nn.Module], optimizer,
                    scheduler, consumed_samples: int, model_config: ModelConfig) -> None:
    """Collective over the world: every rank writes its part, rank 0 publishes it."""
    rank = dist.get_rank()
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if ps.get_expert_data_parallel_rank() == 0:  # DP rank 0, and the other EP ranks' experts
        weights = {}
        for chunk in model:
            weights.update(full_state_dict(chunk))
        ep_rank, pp_rank = ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        if ep_rank:
            weights = {k: v for k, v in weights.items() if ".local_experts." in k}
        if ps.get_tensor_model_parallel_rank() == 0 and (weights or not ep_rank):
            torch.save(weights, os.path.join(
                tmp, f"model_pp{pp_rank:03d}" + (f"_ep{ep_rank:03d}" if ep_rank else "") + ".pt"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": _rng_state()}, os.path.join(tmp, f"rank_{rank:05d}.pt"))
    if rank == 0:
        torch.save({"iteration": iteration, "consumed_samples": consumed_samples,
                    "model_config": dataclasses.asdict(model_config), "layout": _layout()},
                   os.path.join(tmp, "meta.pt"))
    dist.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic_text(os.path.join(root, MARKER), str(iteration))
    dist.barrier()


def latest_iteration(root: str) -> int | None:
    """The iteration named by the marker, or None when `root` holds no checkpoint."""
    path = os.path.join(root, MARKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit() or not os.path.isdir(iteration_dir(root, int(text))):
        raise ValueError(f"--load {root}: {MARKER} names {text!r}, which is not a complete "
                         f"checkpoint directory")
    return int(text)


def read_meta(root: str) -> dict | None:
    """The newest checkpoint's metadata (no communication), or None."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    return torch.load(os.path.join(iteration_dir(root, iteration), "meta.pt"), weights_only=False)


def check_compatible(meta: dict, model_config: ModelConfig, root: str) -> None:
    """One clear error naming the first shape field that differs."""
    for name in SHAPE_FIELDS:
        theirs, ours = meta["model_config"].get(name), getattr(model_config, name)
        if theirs != ours:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"--load {root}: checkpoint has {name}={theirs}, this run has "
                             f"{flag} {ours}")


def load_model_weights(root: str, iteration: int, model: list[torch.nn.Module]) -> None:
    """Fill this rank's shards from the full per-stage files (any TP/PP layout)."""
    directory = iteration_dir(root, iteration)
    full: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("model_pp"):
            full.update(torch.load(os.path.join(directory, name), weights_only=True))
    load_full_state_dict(model, full)


def load_checkpoint(root: str, model: list[torch.nn.Module], optimizer, scheduler,
                    model_config: ModelConfig) -> tuple[int, int]:
    """Restore the newest checkpoint; return (iteration, consumed_samples), (0, 0) if none."""
    meta = read_meta(root)
    if meta is None:
        return 0, 0
    check_compatible(meta, model_config, root)
    iteration = meta["iteration"]
    load_model_weights(root, iteration, model)
    rank_file = os.path.join(iteration_dir(root, iteration), f"rank_{dist.get_rank():05d}.pt")
    if meta["layout"] == _layout() and os.path.exists(rank_file):
        state = torch.load(rank_file, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
    else:
        optimizer.reload_model_params()
        scheduler.step(increment=0, iteration=iteration)
        if dist.get_rank() == 0:
            print(f"loaded weights only (saved under layout {meta['layout']}, running "
                  f"{_layout()}): optimizer state and RNG start fresh", flush=True)
    return iteration, meta["consumed_samples"]


def read_full_model(root: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, full state dict of every stage) of the newest checkpoint; no communication."""
    meta = read_meta(root)
    if meta is None:
        raise FileNotFoundError(f"{root}: no {MARKER} (expected a megalite checkpoint directory)")
    directory, full = iteration_dir(root, meta["iteration"]), {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("model_pp"):
            full.update(torch.load(os.path.join(directory, name), weights_only=True))
    return meta, full


def write_weights_checkpoint(root: str, full: dict[str, torch.Tensor], model_config: ModelConfig,
                             tp: int = 1, pp: int = 1, iteration: int = 0) -> None:
    """A weights-only checkpoint (no optimizer state) split into `pp` stage files; single process.

    Loads under any layout: the files hold full tensors, sliced by each rank on load.
    """
    if model_config.num_layers % pp:
        raise ValueError(f"--target-pp ({pp}) must divide the model's {model_config.num_layers} "
                         f"layers")
    tmp, final = iteration_dir(root, iteration) + ".tmp", iteration_dir(root, iteration)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(pp)]
    for name, tensor in full.items():
        stages[stage_of(name, model_config.num_layers, pp)][name] = tensor
    for stage, weights in enumerate(stages):
        torch.save(weights, os.path.join(tmp, f"model_pp{stage:03d}.pt"))
    torch.save({"iteration": iteration, "consumed_samples": 0,
                "model_config": dataclasses.asdict(model_config),
                "layout": {"tp": tp, "pp": pp, "dp": 1, "vpp": None}},
               os.path.join(tmp, "meta.pt"))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_atomic_text(os.path.join(root, MARKER), str(iteration))
