"""Split backward for zero-bubble pipeline schedules: input grads now (B), weight grads later (W).

`linear(x, weight, bias)` is F.linear whose backward, inside `defer_weight_grads()`, returns
only the grads of x and bias and queues (weight, x, grad of y) for the weight grad; outside
it, it is an ordinary fused backward. `apply_weight_grads(queue)` runs the queued work and
accumulates through autograd (`torch.autograd.backward` on the weights), so `param.grad`
and the hooks on it, e.g. the DP wrapper's main_grad accumulation and bucket readiness,
behave exactly as after a fused backward.
"""
import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megalite.mpu import comm

WeightGradWork = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (weight, x, grad of y)
_queue: list[WeightGradWork] | None = None  # global, not thread-local: autograd may run
                                             # backward on its own (CUDA) thread


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[list[WeightGradWork]]:
    """Backward passes inside compute input grads only; yields the list the deferred
    weight-grad work is appended to."""
    global _queue
    outer, _queue = _queue, []
    try:
        yield _queue
    finally:
        _queue = outer


def apply_weight_grads(work: list[WeightGradWork]) -> None:
    """dW = grad_y^T x (grad_y [..., out], x [..., in] -> [out, in]) for each queued item,
    summed per weight and accumulated into weight.grad through autograd."""
    grads: dict[torch.Tensor, torch.Tensor] = {}
    for weight, x, grad_y in work:
        dw = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        grads[weight] = grads[weight] + dw if weight in grads else dw
    if grads:
        torch.autograd.backward(list(grads), list(grads.values()))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grad_x_group):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.grad_x_group = bias is not None, grad_x_group
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        reducing = None if grad_x is None or ctx.grad_x_group is None else \
            comm.all_reduce(grad_x, ctx.grad_x_group, async_op=True)
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            if _queue is not None:
                _queue.append((weight, x, grad_y))
            else:
                grad_weight = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(
                    x.reshape(-1, x.shape[-1]))
        if reducing is not None:
            reducing.wait()
        return grad_x, grad_weight, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           grad_x_group=None) -> torch.Tensor:
    """y [..., out] = x [..., in] @ weight [out, in]^T + bias, with a deferrable weight grad.
    `grad_x_group`: the grad of x is all-reduced on that group (the TP group: x entered the
    TP region here, as through copy_to_tensor_model_parallel_region), asynchronously while
    the weight grad is computed (Megatron-core's overlap)."""
    return _Linear.apply(x, weight, bias, grad_x_group)
