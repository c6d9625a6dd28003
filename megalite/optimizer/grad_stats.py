"""Statistics of the gradients over all ranks holding a piece of the model: the global L2
norm (each parameter counted once across TP, PP and DP) and the fp16 overflow check. Both
stay on the device: the optimizer reads them on the host once per step, together."""
import torch
import torch.distributed as dist
from torch import nn

from megalite.mpu import comm, parallel_state


def counts_toward_norm(param: nn.Parameter) -> bool:
    """Whether this rank's copy of `param` enters the global norm.

    TP-replicated params (`tensor_model_parallel` False: norms, row-parallel biases, position
    embeddings) count on TP rank 0 only, a shard held by `tp_replicas` ranks (GQA's KV groups)
    on the first of them; the last stage's copy of the tied word embedding
    (`shared_embedding_copy`) never counts (the first stage's does).
    """
    if getattr(param, "shared_embedding_copy", False):
        return False
    rank = parallel_state.get_tensor_model_parallel_rank()
    if getattr(param, "tensor_model_parallel", False):
        return rank % getattr(param, "tp_replicas", 1) == 0
    return rank == 0


def global_grad_norm(grads: list[torch.Tensor], groups: list, device: torch.device,
                     expert_grads: list[torch.Tensor] = (), expert_groups: list = ()
                     ) -> torch.Tensor:
    """sqrt(sum of squares of `grads` and `expert_grads`) as an fp32 scalar on `device`, the
    sum all-reduced over each of `groups` in turn, the experts' part first over each of
    `expert_groups`.

    `grads` are this rank's counted grads (see counts_toward_norm); `groups` the
    model-parallel group, preceded by the DP group when each rank holds a shard.
    `expert_grads` (MoE experts, `expert_parallel`) differ across the EP group: their sum
    is first all-reduced there (`expert_groups`), unless the DP reduction already covers it.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    if expert_grads:
        experts += torch.nn.utils.get_total_norm(expert_grads).float() ** 2
    for group in expert_groups:
        comm.all_reduce(experts, group)
    if grads:
        total += torch.nn.utils.get_total_norm(grads).float() ** 2
    total += experts
    for group in groups:
        comm.all_reduce(total, group)
    return total.sqrt()


def found_inf_anywhere(found_inf: torch.Tensor, groups: list) -> torch.Tensor:
    """MAX-reduce a local 0/1 overflow flag over each of `groups`, in place; nonzero if any
    rank saw inf/NaN."""
    for group in groups:
        comm.all_reduce(found_inf, group, op=dist.ReduceOp.MAX)
    return found_inf


def nonfinite_anywhere(norm: torch.Tensor, group) -> torch.Tensor:
    """`norm` (an fp32 scalar), or NaN where it is not finite on some rank of `group` (one
    MAX all-reduce of a 0/1 flag over `group`)."""
    flag = found_inf_anywhere((~torch.isfinite(norm)).float().reshape(1), [group])
    return torch.where(flag[0] > 0, torch.full_like(norm, float("nan")), norm)
