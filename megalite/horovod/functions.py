"""Horovod's helpers on the collectives: broadcast a model's parameters, an optimizer's state,
any picklable object; all-gather objects."""
import dataclasses
import io
import pickle
from collections.abc import Iterable

import torch
from torch.utils._pytree import tree_map_only

from megalite.horovod import ops
from megalite.horovod.basics import topology


def broadcast_parameters(params: dict | Iterable, root_rank: int = 0) -> None:
    """Overwrite every tensor of `params` with rank `root_rank`'s, in place.

    `params`: a state_dict, named_parameters() pairs, or a list of tensors (every rank passes
    the same ones, in the same order; a dict is taken in key order, as Horovod does).
    """
    if isinstance(params, dict):
        tensors = [t for _, t in sorted(params.items())]
    else:
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"megalite.horovod.broadcast_parameters: expected tensors, got "
                             f"{type(tensor).__name__}")
    handles = [ops.broadcast_async_(t, root_rank) for t in tensors]
    for handle in handles:
        ops.synchronize(handle)


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor sits in a broadcast optimizer state: its shape and dtype."""

    shape: tuple
    dtype: torch.dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state and hyper-parameters rank `root_rank`'s.

    The state_dict's structure travels as one pickled object, its tensors by broadcast; the
    other ranks load it (an empty state, before the first step, stays empty).
    """
    state = optimizer.state_dict() if topology().rank == root_rank else None
    tensors: list[torch.Tensor] = []

    def slot(tensor: torch.Tensor) -> _TensorSlot:
        tensors.append(tensor)
        return _TensorSlot(tuple(tensor.shape), tensor.dtype)
    skeleton = broadcast_object(tree_map_only(torch.Tensor, slot, state), root_rank)
    if topology().rank != root_rank:
        state = tree_map_only(_TensorSlot, lambda s: torch.empty(s.shape, dtype=s.dtype),
                              skeleton)
        tensors.clear()
        tree_map_only(torch.Tensor, tensors.append, state)
    broadcast_parameters(tensors, root_rank)
    if topology().rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None) -> object:
    """Rank `root_rank`'s `obj` (pickled), on every rank."""
    payload = _pickled(obj) if topology().rank == root_rank else torch.empty(0, dtype=torch.uint8)
    length = ops.broadcast(torch.tensor([payload.numel()]), root_rank)
    if topology().rank != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    return pickle.loads(ops.broadcast_(payload, root_rank).numpy().tobytes())


def allgather_object(obj: object, name: str | None = None) -> list:
    """Every rank's `obj` (pickled), in rank order."""
    payload = _pickled(obj)
    lengths = ops.allgather(torch.tensor([payload.numel()])).tolist()
    gathered = ops.allgather(payload)
    return [pickle.loads(part.numpy().tobytes()) for part in gathered.split(lengths)]


def _pickled(obj: object) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
