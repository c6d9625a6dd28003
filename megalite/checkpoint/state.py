"""This rank's parameters and optimizer state as slices of global tensors (save), and filled
back from the slices of a checkpoint saved under any layout (load).

A rank writes, of every parameter whose distinct TP shard it is the first holder of, the flat
range it owns over data parallelism: its distributed-optimizer fragment (ZeRO-1), else an even
split of the parameter over its DP group (the DP x CP group; the expert-DP group for experts),
so the ranks of a DP group write disjoint parts in parallel. With the range go the weights
("model"), the fp32 master copy ("main", bf16/fp16 runs) and the optimizer's per-element state
("optim.exp_avg", ...); per-parameter scalars (Adam's step) go to the index. Which state keys
and scalars an optimizer has is its megalite.optimizer.kinds record's `state_keys` and
`scalar_keys`. A rank loads its whole TP-local parameter and, for the optimizer, the range of
each of its fragments.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.checkpoint.shards import ShardReader, ShardWriter
from megalite.checkpoint.slices import (box_slices, box_view, even_range, expert_placement,
                                        flat_boxes, global_shape, to_global, writes_param)
from megalite.distributed.fsdp import fsdp_shard_start
from megalite.models.sharding import full_names, is_dtensor, persistent_buffers, unwrap
from megalite.mpu import comm
from megalite.mpu import parallel_state as ps
from megalite.optimizer.distrib_optimizer import DistributedOptimizer
from megalite.optimizer.optimizer import load_portable_state_dict, portable_state_dict


def _tp() -> tuple[int, int]:
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


@dataclass(frozen=True)
class Entry:
    """One global tensor inside a local parameter or buffer: its name, its TP placement (the
    parameter, or for stacked experts one expert's slice of it), and the flat range
    [start, start + numel) it occupies in the flattened local tensor."""

    name: str
    placement: object
    start: int
    numel: int


def entries(name: str, param: torch.Tensor) -> list[Entry]:
    """The global tensors of local parameter `name`: itself, or one per stacked expert
    (megalite.moe.experts, named as looped experts are)."""
    if not hasattr(param, "expert_keys"):
        return [Entry(name, param, 0, param.numel())]
    placement = expert_placement(param)
    n = math.prod(param.shape[1:])
    return [Entry(key, placement, i * n, n) for i, key in enumerate(full_names(name, param))]


def named_parameters(model: list[nn.Module]) -> list[tuple[str, nn.Parameter, nn.Module]]:
    """(global name, parameter, its DP-wrapped chunk) of every parameter of this rank."""
    return [(name, param, chunk) for chunk in model
            for name, param in unwrap(chunk).named_parameters()]


def _dp_range(param: nn.Parameter, chunk: nn.Module) -> tuple[int, int]:
    """This rank's even share of `param` over the DP group that holds copies of it."""
    group = (ps.get_expert_data_parallel_group() if getattr(param, "expert_parallel", False)
             else getattr(chunk, "data_parallel_group", None))
    size = comm.world_size(group) if group is not None else 1
    return even_range(param.numel(), dist.get_rank(group) if size > 1 else 0, size)


def _pieces(name: str, param: torch.Tensor, start: int, end: int):
    """(entry, flat a, flat b, entry box, box's sub-box, global box) covering [start, end) of
    the flattened `param` ([a, b) in the param's flat coordinates, boxes in the entry's)."""
    tp_rank, tp = _tp()
    for entry in entries(name, param):
        lo, hi = max(start, entry.start), min(end, entry.start + entry.numel)
        shape = tuple(entry.placement.shape)
        for a, b, box in flat_boxes(shape, lo - entry.start, hi - entry.start):
            for local, glob in to_global(entry.placement, box, tp_rank, tp):
                sub = (tuple(x - y for x, y in zip(local[0], box[0])), local[1])
                yield entry, a + entry.start, b + entry.start, box, sub, glob


def local_values(param: nn.Parameter) -> tuple[torch.Tensor, int]:
    """(this rank's values of the TP-local `param`, flattened; where they start in it): the
    whole of it, or under FSDP (a DTensor sharded on dim 0 over DP) its local chunk of rows
    and the chunk's flat start. Everything below works on flat ranges."""
    if is_dtensor(param):
        return param.detach().to_local().view(-1), fsdp_shard_start(param, flat=True)
    return param.detach().view(-1), 0


def _state_kinds(optimizer) -> list[str]:
    """The checkpoint kinds of the optimizer's per-element state ("optim.exp_avg", ...)."""
    return [f"optim.{key}" for key in optimizer.kind.state_keys(optimizer.config)]


def _flat_sources(fragment, state: dict, kinds: list[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """{kind: (flat tensor, its offset in the param)} of a fragment's master copy and state."""
    sources = {kind: (state[kind.removeprefix("optim.")].view(-1), fragment.offset)
               for kind in kinds if kind.removeprefix("optim.") in state}
    if fragment.target is not None:
        sources["main"] = (fragment.main.view(-1), fragment.offset)
    return sources


@torch.no_grad()
def collect_shards(model: list[nn.Module], optimizer, writer: ShardWriter) -> None:
    """Add this rank's slices of weights and optimizer state to `writer` (host copies)."""
    tp_rank, tp = _tp()
    fragments = {id(f.model_param): f for f in optimizer.fragments}
    distributed = isinstance(optimizer, DistributedOptimizer)  # fragments split over DP
    states, kinds = optimizer.optimizer.state, _state_kinds(optimizer)
    for name, param, chunk in named_parameters(model):
        if getattr(param, "shared_embedding_copy", False) or not writes_param(param, tp_rank, tp):
            continue
        fragment = fragments.get(id(param))
        if distributed and fragment is None:
            continue
        start, end = ((fragment.offset, fragment.offset + fragment.main.numel()) if distributed
                      else _dp_range(param, chunk))
        sources = {"model": local_values(param)}  # under FSDP: the fragment's own range
        if (previous := getattr(param, "previous_version", None)) is not None:
            sources["previous"] = (previous.view(-1), 0)  # 2bw's W(t-1)
        if fragment is not None:
            state = states.get(fragment.main, {})
            sources.update(_flat_sources(fragment, state, kinds))
            scalars = {k: float(state[k]) for k in optimizer.kind.scalar_keys if k in state}
            for entry in entries(name, param) if scalars else []:
                writer.scalars[entry.name] = scalars
        for entry, a, b, box, sub, glob in _pieces(name, param, start, end):
            for kind, (flat, offset) in sources.items():
                writer.add(kind, entry.name, global_shape(entry.placement, tp), glob,
                           box_view(flat, a - offset, b - offset, box)[box_slices(sub)])
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0 and tp_rank == 0:
        for chunk in model:  # persistent buffers (the routers' expert bias): whole, replicated
            for name, buffer in persistent_buffers(unwrap(chunk)):
                writer.add("model", name, tuple(buffer.shape),
                           ((0,) * buffer.ndim, tuple(buffer.shape)), buffer)


@torch.no_grad()
def load_weights(reader: ShardReader, model: list[nn.Module]) -> None:
    """Fill every parameter and persistent buffer of this rank with its TP-local slice (any
    saved layout)."""
    tp = _tp()[1]
    for chunk in model:
        for name, param in [*unwrap(chunk).named_parameters(),
                            *persistent_buffers(unwrap(chunk))]:
            for entry in entries(name, param):
                saved = tuple(reader.entry("model", entry.name)["shape"])
                if saved != global_shape(entry.placement, tp):
                    raise ValueError(f"{reader.directory}: parameter {entry.name!r} has shape "
                                     f"{saved}, this model's is "
                                     f"{global_shape(entry.placement, tp)}")
            flat, start = local_values(param)
            targets = [("model", flat)]
            if (previous := getattr(param, "previous_version", None)) is not None:
                # 2bw's W(t-1); from a checkpoint without it, W(t-1) = W(t)
                saved = reader.has("previous", entries(name, param)[0].name)
                targets.append(("previous" if saved else "model", previous.view(-1)))
            for entry, a, b, box, sub, glob in _pieces(name, param, start, start + flat.numel()):
                for kind, out in targets:
                    reader.read_into(kind, entry.name, glob,
                                     box_view(out, a - start, b - start, box)[box_slices(sub)])


@torch.no_grad()
def load_optimizer(reader: ShardReader, model: list[nn.Module], optimizer) -> None:
    """Fill each fragment's fp32 master copy and optimizer state from the checkpoint's slices
    (any saved layout and ZeRO sharding); the per-parameter scalars from the index."""
    names = {id(param): name for name, param, _ in named_parameters(model)}
    kinds = [k for k in _state_kinds(optimizer) if k in reader.index]
    torch_optimizer = optimizer.optimizer
    order = {id(p): i for i, p in enumerate(p for g in torch_optimizer.param_groups
                                            for p in g["params"])}
    state = {}
    for fragment in optimizer.fragments:
        name = names[id(fragment.model_param)]
        start, end = fragment.offset, fragment.offset + fragment.main.numel()
        first = entries(name, fragment.model_param)[0].name
        values = {kind.removeprefix("optim."): torch.zeros_like(fragment.main)  # padding: 0
                  for kind in kinds if reader.has(kind, first)}
        targets = {f"optim.{k}": v.view(-1) for k, v in values.items()}
        if reader.has("main", first):  # fp32 masters (an fp32 param is its own master)
            targets["main"] = fragment.main.view(-1)
        elif fragment.target is not None:  # saved where the masters were the params (FSDP)
            targets["model"] = fragment.main.view(-1)
        for entry, a, b, box, sub, glob in _pieces(name, fragment.model_param, start, end):
            for kind, flat in targets.items():
                reader.read_into(kind, entry.name, glob,
                                 box_view(flat, a - start, b - start, box)[box_slices(sub)])
        scalars = reader.index["scalars"].get(first, {})
        if values:
            state[order[id(fragment.main)]] = {**{k: torch.tensor(v) for k, v in scalars.items()},
                                               **values}
    saved = portable_state_dict(torch_optimizer)
    load_portable_state_dict(torch_optimizer, {"state": state,
                                               "param_groups": saved["param_groups"]})
