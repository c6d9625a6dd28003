"""Loading: verify the files, then each rank reads only the slices of its own parameters and
optimizer fragments, under any layout and sharding strategy.
"""
import os

import torch
import torch.distributed as dist

from megalite.checkpoint.dirs import MARKER, published_dir, rank_state_path
from megalite.checkpoint.files import (CheckpointFileError, load_state, read_json,
                                       safetensors_shapes, state_files)
from megalite.checkpoint.legacy import legacy_index
from megalite.checkpoint.metadata import (LEGACY_FORMAT, check_compatible, current_layout,
                                          read_meta, restores_optimizer, restores_rng)
from megalite.checkpoint.reducers import restore_reducers
from megalite.checkpoint.rng import reseed, set_rng_state
from megalite.checkpoint.shards import INDEX, ShardReader, verify_files
from megalite.checkpoint.state import load_optimizer, load_weights
from megalite.config import ModelConfig
from megalite.distributed.param_tier import params_resident
from megalite.models.sharding import params_dtype


def checkpoint_reader(root: str, meta: dict) -> ShardReader:
    """A reader of the slices of the checkpoint `meta` describes (headers only so far)."""
    directory = published_dir(root, meta["iteration"])
    if meta["format"] == LEGACY_FORMAT:
        return ShardReader(directory, legacy_index(directory, meta))
    return ShardReader(directory, read_json(os.path.join(directory, INDEX)))



def verify(root: str, meta: dict, layout: dict, world_size: int) -> None:
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



def load(root: str, model: list[torch.nn.Module], optimizer, scheduler,
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
    verify(root, meta, layout, dist.get_world_size())
    iteration, reader = meta["iteration"], checkpoint_reader(root, meta)
    try:
        with params_resident(model, changed=True):  # the parameter tier's shards written
            load_weights(reader, model)
            optimizer.reload_model_params()
            if restores_optimizer(meta, settings):
                with optimizer.resident():  # the nvme tier's state written to its file
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
    rank_state = load_state(rank_state_path(reader.directory, dist.get_rank())) \
        if restores_rng(meta, layout) else None
    if restores_optimizer(meta, settings):
        restore_reducers(model, optimizer, rank_state.get("reducers") if rank_state else None,
                         iteration)
    if rank_state is not None:
        set_rng_state(rank_state["rng"])
    else:
        reseed(seed, iteration)
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
