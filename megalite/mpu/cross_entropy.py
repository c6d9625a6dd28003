"""Cross entropy over vocab-parallel logits without ever gathering the full vocabulary.

Three all-reduces of [s, b] on the TP group: MAX of the local max, SUM of the target
logit (picked on the owning rank), SUM of the exp-sum. Backward is softmax - one_hot on
the local shard, with no communication.
"""
import torch

from megalite.mpu import comm, parallel_state


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        logits_max = logits.max(dim=-1)[0]
        comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)

        part = logits.shape[-1]
        rank = torch.distributed.get_rank(group) if comm.world_size(group) > 1 else 0
        start = rank * part
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        comm.all_reduce(predicted, group)

        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = torch.log(sum_exp) - predicted

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group=None) -> torch.Tensor:
    """Per-token loss [...] from logits [..., V/tp] (this rank's vocab slice) and target [...].

    Computed in fp32 whatever the logits' dtype; the grad has the logits' fp32 shape.
    """
    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group)
