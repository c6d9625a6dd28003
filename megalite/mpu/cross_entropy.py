"""Cross entropy over vocab-parallel logits without ever gathering the full vocabulary.

Three all-reduces of [s, b] on the TP group: MAX of the local max, SUM of the target
logit (picked on the owning rank), SUM of the exp-sum. Backward is softmax - one_hot on
the local shard, with no communication.

The [tokens, V/tp] work is done in fp32 whatever the logits' dtype, a block of rows at a
time (on CPU small enough to stay in cache, on GPUs big enough that kernel launches do not
count). fp32 logits: forward keeps exp(logits - max) (the logits' size, in place of the
logits) and per-token statistics (max, exp-sum); backward turns it into the grad in place,
block by block (as Megatron does; no second exp). bf16 / fp16 logits: forward keeps the
logits themselves and backward recomputes the softmax block by block, writing the grad in
the logits' dtype, so no full-size fp32 tensor is ever allocated.
"""
import torch

from megalite.mpu import comm, parallel_state

# fp32 elements per block on CPU (16 MiB): stays in cache, and few enough blocks (8 for 4096
# tokens x 8192) that a loaded machine pays few thread synchronisations.
_CPU_BLOCK_ELEMENTS = 1 << 22
# ... and on GPUs (64 MiB): a bounded temporary, each block's kernels far longer than a launch.
_GPU_BLOCK_ELEMENTS = 1 << 24


def _blocks(logits: torch.Tensor) -> range:
    """Start rows of the blocks of logits [tokens, V/tp]."""
    elements = _CPU_BLOCK_ELEMENTS if logits.device.type == "cpu" else _GPU_BLOCK_ELEMENTS
    return range(0, logits.shape[0], max(elements // max(1, logits.shape[1]), 1))


def _shifted(logits: torch.Tensor, logits_max: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = logits - max in fp32 (out: an fp32 block of the same shape)."""
    if logits.dtype == torch.float32:
        return torch.sub(logits, logits_max.unsqueeze(-1), out=out)
    return out.copy_(logits).sub_(logits_max.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        shape, part = logits.shape, logits.shape[-1]
        flat = logits.reshape(-1, part)
        target = target.reshape(-1)
        logits_max = flat.amax(dim=-1).float()
        comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)

        rank = torch.distributed.get_rank(group) if comm.world_size(group) > 1 else 0
        start = rank * part
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        predicted = predicted.masked_fill(outside, 0.0)
        comm.all_reduce(predicted, group)

        sum_exp = torch.empty_like(logits_max)
        blocks = _blocks(flat)
        ctx.kept_exps = flat.dtype == torch.float32
        exps = torch.empty_like(flat) if ctx.kept_exps else None
        work = None if ctx.kept_exps else torch.empty(
            (min(blocks.step, flat.shape[0]), part), dtype=torch.float32, device=flat.device)
        for i in blocks:
            rows = slice(i, i + blocks.step)
            out = exps[rows] if ctx.kept_exps else work[:len(sum_exp[rows])]
            block = _shifted(flat[rows], logits_max[rows], out)
            torch.sum(block.exp_(), dim=-1, out=sum_exp[rows])
        comm.all_reduce(sum_exp, group)
        loss = torch.log(sum_exp) - predicted

        ctx.save_for_backward(exps if ctx.kept_exps else flat, logits_max, sum_exp, outside,
                              local_target)
        ctx.shape = shape
        return loss.view(shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.kept_exps and getattr(ctx, "consumed", False):
            raise RuntimeError("vocab_parallel_cross_entropy: a second backward of one fp32 "
                               "loss (retain_graph) is not supported: the first turned the "
                               "kept softmax into the grad in place")
        ctx.consumed = True
        saved, logits_max, sum_exp, outside, local_target = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1).float()
        inside = (~outside).float().unsqueeze(-1)
        grad = saved if ctx.kept_exps else torch.empty_like(saved)  # fp32: exps become it
        blocks = _blocks(saved)
        work = None if ctx.kept_exps else torch.empty(
            (min(blocks.step, saved.shape[0]), saved.shape[1]), dtype=torch.float32,
            device=saved.device)
        for i in blocks:
            rows = slice(i, i + blocks.step)
            if ctx.kept_exps:
                block = grad[rows]
            else:
                out = work[:len(sum_exp[rows])]
                block = _shifted(saved[rows], logits_max[rows], out).exp_()
            block.div_(sum_exp[rows].unsqueeze(-1))  # softmax
            block.scatter_add_(-1, local_target[rows].unsqueeze(-1), -inside[rows])
            block.mul_(grad_loss[rows].unsqueeze(-1))
            if work is not None:
                grad[rows].copy_(block)
        return grad.view(ctx.shape), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group=None) -> torch.Tensor:
    """Per-token loss [...] from logits [..., V/tp] (this rank's vocab slice) and target [...].

    Computed in fp32 whatever the logits' dtype; the grad has the logits' dtype and shape.
    """
    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group)
