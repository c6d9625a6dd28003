"""Full (unsharded, unpadded) state dicts <-> this rank's TP shards.

A full state dict uses the model's own parameter names, which carry global layer
indices (`encoder.layers.7.mlp...`), so the dicts of all pipeline stages merge by key.
It is the pivot for Hugging Face import/export and for checkpoint resharding. Stacked
expert weights (`expert_keys`, megalite.moe.experts) appear as one entry per expert, under
the names looped experts have; persistent buffers (the routers' expert bias) are entries too.
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

from megalite.mpu import comm, parallel_state
from megalite.mpu.layers import gather_tensor_parallel, shard_tensor_parallel


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside a data-parallel wrapper (which keeps it as `.module`)."""
    return getattr(chunk, "module", chunk)


def is_dtensor(value) -> bool:
    """Whether `value` is a DTensor (a fully sharded parameter, megalite.distributed.fsdp),
    without importing torch.distributed.tensor (0.7 s of every start-up) where nothing has:
    no DTensor exists then."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def gather_data_parallel(param: torch.Tensor) -> torch.Tensor:
    """The TP-local tensor of `param`: all-gathered over its DP group when fully sharded (a
    DTensor, megalite.distributed.fsdp), else `param` itself."""
    return param.full_tensor() if is_dtensor(param) else param


@torch.no_grad()
def copy_tp_local(param: torch.Tensor, value: torch.Tensor) -> None:
    """Fill `param` with the TP-local tensor `value` (when fully sharded: this rank's DP shard
    of it; no communication)."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor
        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                  param.placements, src_data_rank=None)
    param.copy_(value)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `param`: the local DP shard when fully sharded, else `param`."""
    return param.to_local() if is_dtensor(param) else param


def params_dtype(chunk: nn.Module) -> torch.dtype:
    """The dtype the chunk computes in (fully sharded chunks keep fp32 masters)."""
    return getattr(chunk, "param_dtype", None) or next(chunk.parameters()).dtype


def _chunks(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return [unwrap(c) for c in (model if isinstance(model, list) else [model])]


def full_state_dict(model: nn.Module | list[nn.Module], group=None,
                    skip_shared_copies: bool = True) -> dict[str, torch.Tensor]:
    """Gather this stage's parameters over TP (collective on the TP group); CPU tensors.

    The last stage's copy of the tied embedding is left out unless `skip_shared_copies` is False.
    """
    out = {}
    for chunk in _chunks(model):
        for name, param in chunk.named_parameters():
            if skip_shared_copies and getattr(param, "shared_embedding_copy", False):
                continue
            full = gather_tensor_parallel(gather_data_parallel(param.detach()), param,
                                          group).cpu()
            if hasattr(param, "expert_keys"):  # one entry per expert, each its own storage
                out.update((key, expert.clone()) for key, expert in
                           zip(full_names(name, param), full.unbind(0)))
            else:
                out[name] = full
        out.update((name, buffer.detach().cpu()) for name, buffer in persistent_buffers(chunk))
    return out


def persistent_buffers(chunk: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (e.g. routers' expert_bias; not rotary tables)."""
    params = {name for name, _ in chunk.named_parameters()}
    return [(name, value) for name, value in chunk.state_dict(keep_vars=True).items()
            if name not in params]


def full_names(name: str, param: torch.Tensor) -> list[str]:
    """The full state dict's names for parameter `name`: itself, or one per stacked expert."""
    keys = getattr(param, "expert_keys", None)
    return [name] if keys is None else [f"{name.rsplit('.', 1)[0]}.{key}" for key in keys]


def local_value(state: dict[str, torch.Tensor], name: str, param: torch.Tensor, group=None
                ) -> torch.Tensor:
    """This rank's TP slice of parameter (or buffer) `name` from a full state dict (stacked
    experts from their per-expert entries); KeyError naming the first missing entry."""
    keys = full_names(name, param)
    missing = [key for key in keys if key not in state]
    if missing:
        raise KeyError(missing[0])
    full = torch.stack([state[key] for key in keys]) if keys != [name] else state[name]
    return shard_tensor_parallel(full.to(param.dtype), param, group)


@torch.no_grad()
def load_full_state_dict(model: nn.Module | list[nn.Module], state: dict[str, torch.Tensor],
                         group=None, optional: tuple[str, ...] = ()) -> None:
    """Fill every local parameter and persistent buffer with its TP slice of `state` (no
    communication).

    Entries whose names start with one of `optional` may be absent (they keep their
    initial values); any other missing key raises one clear KeyError naming the parameter.
    """
    for chunk in _chunks(model):
        for name, param in [*chunk.named_parameters(), *persistent_buffers(chunk)]:
            try:
                copy_tp_local(param, local_value(state, name, param, group))
            except KeyError as error:
                if name.startswith(optional):
                    continue
                raise KeyError(f"state dict has no entry for parameter {error.args[0]!r}") \
                    from None


def gather_pipeline_state_dict(state: dict[str, torch.Tensor], group=None
                               ) -> dict[str, torch.Tensor]:
    """Merge every pipeline stage's full state dict (all_gather_object on the PP group).

    Each rank passes its stage's `full_state_dict`; every rank gets the whole model's.
    """
    group = parallel_state.get_pipeline_model_parallel_group() if group is None else group
    if comm.world_size(group) == 1:
        return dict(state)
    stages: list = [None] * comm.world_size(group)
    dist.all_gather_object(stages, state, group=group)
    return {k: v for stage in stages for k, v in stage.items()}
