"""Full (unsharded, unpadded) state dicts <-> this rank's TP shards.

A full state dict uses the model's own parameter names, which carry global layer
indices (`encoder.layers.7.mlp...`), so the dicts of all pipeline stages merge by key.
It is the pivot for Hugging Face import/export and for checkpoint resharding.
"""
import torch
import torch.distributed as dist
from torch import nn

from megalite.mpu import comm, parallel_state
from megalite.mpu.layers import gather_tensor_parallel, shard_tensor_parallel


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside a data-parallel wrapper (which keeps it as `.module`)."""
    return getattr(chunk, "module", chunk)


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
            out[name] = gather_tensor_parallel(param.detach(), param, group).cpu()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module | list[nn.Module], state: dict[str, torch.Tensor],
                         group=None, optional: tuple[str, ...] = ()) -> None:
    """Fill every local parameter with its TP slice of `state` (no communication).

    Parameters whose names start with one of `optional` may be absent (they keep their
    initial values); any other missing key raises one clear KeyError naming the parameter.
    """
    for chunk in _chunks(model):
        for name, param in chunk.named_parameters():
            if name not in state and name.startswith(optional):
                continue
            if name not in state:
                raise KeyError(f"state dict has no entry for parameter {name!r}")
            param.copy_(shard_tensor_parallel(state[name].to(param.dtype), param, group))


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
