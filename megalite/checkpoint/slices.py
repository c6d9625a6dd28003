"""Which slice of which global tensor a rank's local tensor is: the one place that maps a
parameter's placement (TP shard with its stride and replicas, vocabulary padding, DP/ZeRO
range; the pipeline stage and the experts are in the global names already) to boxes of the
full, unpadded tensors a distributed checkpoint stores.

A box is (offsets, lengths), one entry per dim. A rank's view of a parameter is its TP-local
tensor; the optimizer updates one contiguous flat range [a, b) of it (all of it without
ZeRO, the bucket shard with the distributed optimizer; a dim-0 chunk of it under FSDP is such
a range too). `flat_boxes` splits a flat range into boxes that are each contiguous in it, and
`to_global` maps a TP-local box to boxes of the global tensor.
"""
import math
from types import SimpleNamespace

import torch
from torch import nn

Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_slices(box: Box) -> tuple[slice, ...]:
    """The index of `box` in a tensor: tensor[box_slices(box)]."""
    return tuple(slice(o, o + n) for o, n in zip(*box))


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[int, int, Box]]:
    """[(a, b, box)]: the flat range [start, end) of a tensor of `shape` as boxes, each the
    contiguous flat range [a, b) (a partial first row, whole rows, a partial last row, per
    dim)."""
    if start >= end:
        return []
    if not shape:
        return [(0, 1, ((), ()))]
    if len(shape) == 1:
        return [(start, end, ((start,), (end - start,)))]
    inner = math.prod(shape[1:])
    first, last = -(-start // inner), end // inner  # the whole rows [first, last)

    def in_row(row: int, a: int, b: int) -> list[tuple[int, int, Box]]:
        return [(row * inner + x, row * inner + y, ((row, *o), (1, *n)))
                for x, y, (o, n) in flat_boxes(shape[1:], a - row * inner, b - row * inner)]
    if first > last:  # inside one row
        return in_row(last, start, end)
    head = in_row(first - 1, start, first * inner) if start < first * inner else []
    body = [(first * inner, last * inner, ((first,) + (0,) * (len(shape) - 1),
                                           (last - first, *shape[1:])))] if last > first else []
    tail = in_row(last, last * inner, end) if end > last * inner else []
    return head + body + tail


def _tp_split(param: nn.Parameter, tp_size: int) -> tuple[int, int, int]:
    """(shards, partition dim, stride) of `param` over `tp_size` ranks ((1, 0, 1): whole)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return 1, 0, 1
    return tp_size // param.tp_replicas, param.partition_dim, param.partition_stride


def global_shape(param: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    """The shape of the full, unpadded tensor of which `param` is this rank's TP shard."""
    shards, dim, _ = _tp_split(param, tp_size)
    shape = list(param.shape)
    if shape:
        shape[dim] *= shards
        shape[0] = getattr(param, "unpadded_rows", None) or shape[0]
    return tuple(shape)


def expert_placement(param: nn.Parameter) -> SimpleNamespace:
    """The TP placement of one expert's slice [i] of a stacked expert weight
    (megalite.moe.experts): the stacked one's, one dim less."""
    return SimpleNamespace(shape=tuple(param.shape[1:]), partition_dim=param.partition_dim - 1,
                           **{k: getattr(param, k) for k in (
                               "tensor_model_parallel", "partition_stride", "tp_replicas")})


def writes_param(param: nn.Parameter, tp_rank: int, tp_size: int) -> bool:
    """Whether this TP rank writes `param`: the first holder of each distinct shard."""
    shards, _, _ = _tp_split(param, tp_size)
    return tp_rank % (tp_size // shards) == 0


def to_global(param: nn.Parameter, box: Box, tp_rank: int, tp_size: int
              ) -> list[tuple[Box, Box]]:
    """[(local sub-box, global box)]: the TP-local `box` of `param` in the global tensor
    (pieces split where the stride's blocks end; vocabulary padding rows dropped)."""
    shards, dim, stride = _tp_split(param, tp_size)
    if not box[0]:
        return [(box, box)]
    offsets, lengths = box
    block = param.shape[dim] // stride  # local rows of one stride block
    shard = tp_rank // (tp_size // shards)
    pieces, start, end = [], offsets[dim], offsets[dim] + lengths[dim]
    while start < end:
        j = start // block
        stop = min(end, (j + 1) * block)
        local = (offsets[:dim] + (start,) + offsets[dim + 1:],
                 lengths[:dim] + (stop - start,) + lengths[dim + 1:])
        g = j * block * shards + shard * block + start - j * block
        pieces.append((local, (local[0][:dim] + (g,) + local[0][dim + 1:], local[1])))
        start = stop
    rows = getattr(param, "unpadded_rows", None)
    return [clipped for piece in pieces if (clipped := _clip_rows(piece, rows))]


def _clip_rows(piece: tuple[Box, Box], rows: int | None) -> tuple[Box, Box] | None:
    """`piece` without the global rows >= `rows` (vocabulary padding); None if nothing is left."""
    (lo, ln), (go, gn) = piece
    if rows is None or go[0] + gn[0] <= rows:
        return piece
    keep = rows - go[0]
    if keep <= 0:
        return None
    return (lo, (keep, *ln[1:])), (go, (keep, *gn[1:]))


def even_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s part [a, b) of `numel` elements split evenly over `size` ranks."""
    return numel * rank // size, numel * (rank + 1) // size


def box_view(flat: torch.Tensor, a: int, b: int, box: Box) -> torch.Tensor:
    """The elements [a, b) of the 1-D `flat` as `box` (a view: flat_boxes' boxes are
    contiguous)."""
    return flat[a:b].view(box[1])
