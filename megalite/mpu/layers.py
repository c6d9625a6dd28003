"""Tensor-parallel layers: vocab-parallel embedding, column- and row-parallel linear.

The linear layers' weight grads can be deferred (`megalite.mpu.weight_grad`, for the
zero-bubble pipeline schedules). Weights are drawn at full size on the CPU (from the
`megalite.mpu.random.seeded` scope's generator, else the global one), a bounded block of rows
at a time, and each rank keeps its slice, so the same seed gives the same full weights for
any TP size and any device. Sharded parameters carry `tensor_model_parallel = True`,
`partition_dim`, `partition_stride` (the full tensor is `stride` blocks along that dim, each
split over the shards: SwiGLU's [gate; up]) and `tp_replicas` (consecutive TP ranks holding
the same shard: GQA with fewer KV groups than TP ranks); replicated ones carry
`tensor_model_parallel = False`. A parameter whose copies each see only part of its gradient
carries `tp_grad_partial = True` (see `allreduce_tp_partial_grads`): with sequence
parallelism that includes every replicated parameter applied to s/t tokens (norm weights,
the row-parallel bias).
"""
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megalite.mpu import comm, parallel_state
from megalite.mpu.mappings import (gather_from_sequence_parallel_region,
                                   gather_from_tensor_model_parallel_region,
                                   reduce_from_tensor_model_parallel_region,
                                   reduce_scatter_to_sequence_parallel_region,
                                   scatter_to_tensor_model_parallel_region)
from megalite.mpu.random import init_generator, skips_init
from megalite.mpu.weight_grad import linear

# Fills a CPU tensor in place. The TP layers apply it to consecutive blocks of rows of the
# full tensor, in order: it must draw every element on its own (as normal and uniform inits
# do), from `init_generator()` inside a seeded scope.
InitMethod = Callable[[torch.Tensor], None]
# fp32 elements of one block of rows drawn by the TP weight initialisation (16 MiB)
_INIT_BLOCK_ELEMENTS = 1 << 22


def init_method_normal(std: float) -> InitMethod:
    def init_(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=0.0, std=std, generator=init_generator())
    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """GPT-2's init for output projections feeding the residual: std / sqrt(2 * layers)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         partition_dim: int = 0, stride: int = 1,
                                         replicas: int = 1) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.tp_replicas = replicas


def _split_shards(full: torch.Tensor, dim: int, stride: int, shards: int) -> list[torch.Tensor]:
    """`shards` slices of `full` along `dim`: slice i is the i-th chunk of each of `stride` blocks."""
    blocks = [block.chunk(shards, dim=dim) for block in full.chunk(stride, dim=dim)]
    return [torch.cat([block[i] for block in blocks], dim=dim) for i in range(shards)]


def _join_shards(parts: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of _split_shards."""
    blocks = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([blocks[i][j] for j in range(stride) for i in range(len(parts))], dim=dim)


def _group_info(group) -> tuple[object, int, int]:
    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    size = comm.world_size(group)
    rank = torch.distributed.get_rank(group) if size > 1 else 0
    return group, size, rank


def _row_blocks(rows: int, row_numel: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `rows` rows of `row_numel` elements, about
    _INIT_BLOCK_ELEMENTS each: every block but the last a multiple of 16 elements, the last at
    least 16 (or the only one). Drawn in order with normal_, they hold exactly the values of
    one draw over all rows: torch's CPU normal_ turns the stream into values 16 at a time and
    redraws a last partial group as a whole group of 16."""
    step = max(16, _INIT_BLOCK_ELEMENTS // max(row_numel, 1) // 16 * 16)
    starts = list(range(0, rows, step))
    if len(starts) > 1 and (rows - starts[-1]) * row_numel < 16:
        starts.pop()
    return list(zip(starts, starts[1:] + [rows]))


def _sharded_parameter(full_shape: tuple[int, ...], partition_dim: int, size: int, rank: int,
                       init_method: InitMethod, dtype: torch.dtype, device, stride: int = 1,
                       replicas: int = 1, init_rows: int | None = None) -> nn.Parameter:
    """This rank's shard along partition_dim (one of size / replicas shards, `stride` blocks
    each split) of the full fp32 tensor whose first `init_rows` rows (default: all)
    `init_method` fills, the others zero. The full tensor is never held: it is drawn on the
    CPU a block of rows at a time (`_row_blocks`) and each block's share kept. On the meta
    device nothing is drawn; inside `megalite.mpu.random.weights_loaded_next` it is zero."""
    shards = size // replicas
    index = _split_shards(torch.arange(full_shape[partition_dim]), 0, stride, shards)[
        rank // replicas]
    shape = list(full_shape)
    shape[partition_dim] = len(index)
    if torch.device(device or "cpu").type == "meta":  # shapes only (e.g. checking names)
        local = torch.empty(shape, device="meta")
    elif skips_init():
        local = torch.zeros(shape)
    else:
        local = _draw_shard(shape, index, full_shape, partition_dim, init_method, init_rows)
    param = nn.Parameter(local.to(device=device, dtype=dtype))
    set_tensor_model_parallel_attributes(param, shards > 1, partition_dim, stride, replicas)
    return param


def _draw_shard(shape: list[int], index: torch.Tensor, full_shape: tuple[int, ...],
                partition_dim: int, init_method: InitMethod, init_rows: int | None
                ) -> torch.Tensor:
    """The rows/columns `index` (along partition_dim) of the full fp32 tensor, drawn on the
    CPU one bounded block of rows at a time."""
    local = torch.zeros(shape)
    rest = tuple(full_shape[1:])
    for start, end in _row_blocks(full_shape[0] if init_rows is None else init_rows,
                                  math.prod(rest)):
        block = torch.empty((end - start,) + rest)
        init_method(block)
        if partition_dim == 0:
            inside = (index >= start) & (index < end)
            local[inside] = block[index[inside] - start]
        else:
            local[start:end] = block.index_select(partition_dim, index)
    return local


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size "
                         f"({denominator})")
    return numerator // denominator


def _bias(size: int, dtype: torch.dtype, device, parallel: bool) -> nn.Parameter:
    bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
    set_tensor_model_parallel_attributes(bias, parallel, 0)
    return bias


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split along its output columns: weight [out/tp, in].

    forward(x [..., in]) -> (y [..., out/tp] or [..., out] if gather_output, bias or None).
    The grad of x is all-reduced on the TP group, overlapped with the weight grad (`linear`).
    `stride` > 1: the output is `stride` blocks (SwiGLU's [gate; up]), each split over TP.
    `tp_replicas` > 1: groups of that many consecutive TP ranks hold the same out/(tp/replicas)
    slice (GQA's KV groups when TP > groups); their weight grads are partial sums, added up by
    `allreduce_tp_partial_grads`. gather_output needs tp_replicas = 1.
    `sequence_parallel`: x is this rank's [s/t, b, in]; it is all-gathered along s on the TP
    group (backward: reduce-scatter) instead of the grad all-reduce.
    `disable_grad_reduce` (Megatron's name): x is used as it is and its grad left to this
    rank's share (the caller sums it over TP, e.g. through a replicated layer before).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod | None = None,
                 skip_bias_add: bool = False, group=None, params_dtype: torch.dtype = torch.float32,
                 device=None, stride: int = 1, tp_replicas: int = 1,
                 sequence_parallel: bool = False, disable_grad_reduce: bool = False) -> None:
        super().__init__()
        self.group, size, rank = _group_info(group)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.sequence_parallel = sequence_parallel and size > 1 and not disable_grad_reduce
        if size % tp_replicas:
            raise ValueError(f"tp_replicas ({tp_replicas}) must divide the tensor-parallel size "
                             f"({size})")
        shards = size // tp_replicas
        self.output_size_per_partition = _divide(output_size, shards, "output_size")
        init_method = init_method or init_method_normal(0.02)
        self.weight = _sharded_parameter((output_size, input_size), 0, size, rank, init_method,
                                         params_dtype, device, stride, tp_replicas)
        self.bias = None
        if bias:
            self.bias = _bias(self.output_size_per_partition, params_dtype, device, shards > 1)
            set_tensor_model_parallel_attributes(self.bias, shards > 1, 0, stride, tp_replicas)
        for param in self.parameters():
            param.tp_grad_partial = tp_replicas > 1 and size > 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        reduce_grad_x = not (self.sequence_parallel or self.disable_grad_reduce)
        bias = None if self.skip_bias_add else self.bias
        y = linear(x, self.weight, bias, self.group if reduce_grad_x else None)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split along its input rows: weight [out, in/tp].

    forward(x [..., in/tp] if input_is_parallel else [..., in]) -> (y [..., out], bias or None).
    Partial products are all-reduced on the TP group; the bias is added once, after.
    `sequence_parallel`: they are reduce-scattered along s instead (-> [s/t, b, out]); the
    bias then sees only s/t tokens per rank, so its grad is marked `tp_grad_partial`.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = False, init_method: InitMethod | None = None,
                 skip_bias_add: bool = False, group=None, params_dtype: torch.dtype = torch.float32,
                 device=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, size, rank = _group_info(group)
        self.sequence_parallel = sequence_parallel and size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.input_size_per_partition = _divide(input_size, size, "input_size")
        init_method = init_method or init_method_normal(0.02)
        self.weight = _sharded_parameter((output_size, input_size), 1, size, rank, init_method,
                                         params_dtype, device)
        self.bias = _bias(output_size, params_dtype, device, False) if bias else None
        if self.bias is not None:
            self.bias.tp_grad_partial = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        reduce = reduce_scatter_to_sequence_parallel_region if self.sequence_parallel \
            else reduce_from_tensor_model_parallel_region
        y = reduce(linear(x, self.weight), self.group)
        if self.skip_bias_add or self.bias is None:
            return y, self.bias
        return y + self.bias, None


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by * TP."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across TP ranks: weight [V_padded/tp, h].

    The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp`; padding
    rows are zero and their logits are masked to -inf in `lm_logits`, so they never win.
    forward(ids [...]) -> [..., h]: ids outside this rank's range are zeroed, then the
    partial embeddings are all-reduced on the TP group.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: InitMethod | None = None, make_vocab_size_divisible_by: int = 128,
                 group=None, params_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.group, size, rank = _group_info(group)
        self.num_embeddings = num_embeddings
        self.padded_num_embeddings = pad_vocab_size(num_embeddings, make_vocab_size_divisible_by,
                                                    size)
        per_rank = self.padded_num_embeddings // size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = _sharded_parameter((self.padded_num_embeddings, embedding_dim), 0, size,
                                         rank, init_method or init_method_normal(0.02),
                                         params_dtype, device, init_rows=num_embeddings)
        num_real = min(max(num_embeddings - self.vocab_start, 0), per_rank)
        self.num_padding_rows = per_rank - num_real
        self.weight.unpadded_rows = num_embeddings
        self.weight.local_padding_rows = self.num_padding_rows
        self.weight.is_embedding_or_output_parameter = True  # not a hidden matrix (Muon)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.shape[0] == self.padded_num_embeddings:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.group)

    def lm_logits(self, hidden: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """Output layer: hidden [s, b, h] -> vocab-parallel logits [s, b, V_padded/tp].
        `sequence_parallel`: hidden is [s/t, b, h], all-gathered along s on the TP group."""
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.group)
        logits = linear(hidden, self.weight, None, None if sequence_parallel else self.group)
        if not self.num_padding_rows:
            return logits
        return _MaskVocabPadding.apply(logits, self.num_padding_rows)


class _MaskVocabPadding(torch.autograd.Function):
    """Set the last `n` (padding) columns of the logits to -inf in place; the grad passes
    through unchanged.

    Cheaper than computing the real columns and concatenating -inf ones (a full copy of
    the logits): the padding rows of the weight are zero, so their columns cost a few
    extra matmul rows and add nothing to the hidden states' grad. Softmax-based losses give
    those columns exact zero grads; whatever another loss gives them reaches only the
    weight's padding rows, whose grads `zero_vocab_padding_grads` clears once per step
    (checking here would read the grad on the host in every backward).
    """

    @staticmethod
    def forward(ctx, logits, n):
        logits[..., -n:].fill_(float("-inf"))
        ctx.mark_dirty(logits)
        return logits

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def zero_vocab_padding_grads(params: list[nn.Parameter]) -> None:
    """Zero the grads (`main_grad` when present, else `grad`) of the vocabulary padding rows
    of output-layer weights (`local_padding_rows`, the last rows of this rank's shard), so
    the optimizer keeps them zero. No communication."""
    for param in params:
        rows = getattr(param, "local_padding_rows", 0)
        grad = getattr(param, "main_grad", param.grad)
        if rows and grad is not None:
            grad[-rows:].zero_()


def _is_sharded(param: torch.Tensor, size: int) -> bool:
    return getattr(param, "tensor_model_parallel", False) and size > 1


def gather_tensor_parallel(tensor: torch.Tensor, param: torch.Tensor, group=None) -> torch.Tensor:
    """The full tensor (e.g. a weight or its grad) from every TP rank's shard of `param`.

    All-gathers along `param.partition_dim` on the TP group (one copy of each replicated
    shard kept, strided blocks reassembled); vocabulary padding is dropped.
    """
    group, size, _ = _group_info(group)
    if _is_sharded(param, size):
        shards = comm.all_gather_stacked(tensor, group).unbind(0)[::param.tp_replicas]
        tensor = _join_shards(list(shards), param.partition_dim, param.partition_stride)
    rows = getattr(param, "unpadded_rows", None)
    return tensor[:rows] if rows is not None else tensor


def shard_tensor_parallel(full: torch.Tensor, param: torch.Tensor, group=None) -> torch.Tensor:
    """This TP rank's slice of a full (unpadded) tensor, shaped like `param`."""
    group, size, rank = _group_info(group)
    rows = getattr(param, "unpadded_rows", None)
    if rows is not None:
        if full.shape[0] != rows:
            raise ValueError(f"embedding has {full.shape[0]} rows, expected vocab size {rows}")
        padded = param.shape[0] * (size if _is_sharded(param, size) else 1)
        full = torch.cat([full, full.new_zeros((padded - rows,) + full.shape[1:])])
    if _is_sharded(param, size):
        replicas = param.tp_replicas
        full = _split_shards(full, param.partition_dim, param.partition_stride,
                             size // replicas)[rank // replicas]
    if full.shape != param.shape:
        raise ValueError(f"shape {tuple(full.shape)} does not fit parameter {tuple(param.shape)}")
    return full


def allreduce_tp_partial_grads(params: list[nn.Parameter], group=None) -> None:
    """Sum the grads of parameters marked `tp_grad_partial` over the TP ranks that hold the
    same shard (one all-reduce on the TP group for all of them; each rank adds its grad into
    its shard's slot of a zero buffer). Reads and writes `main_grad` when present, else `grad`.
    """
    group, size, rank = _group_info(group)
    grads = [(p, getattr(p, "main_grad", p.grad)) for p in params
             if getattr(p, "tp_grad_partial", False)]
    grads = [(p, g) for p, g in grads if g is not None]
    if size == 1 or not grads:
        return
    slots = []
    for param, grad in grads:
        replicas = param.tp_replicas if _is_sharded(param, size) else size
        slot = grad.new_zeros(size // replicas, grad.numel())
        slot[rank // replicas] = grad.reshape(-1)
        slots.append(slot)
    flat = torch.cat([slot.reshape(-1) for slot in slots])
    comm.all_reduce(flat, group)
    for (param, grad), summed in zip(grads, flat.split([slot.numel() for slot in slots])):
        replicas = param.tp_replicas if _is_sharded(param, size) else size
        grad.copy_(summed.view(size // replicas, -1)[rank // replicas].view_as(grad))
