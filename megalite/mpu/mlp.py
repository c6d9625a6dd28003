"""Tensor-parallel MLP from plain arguments: GeLU (exact or tanh) or SwiGLU."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.mpu.layers import ColumnParallelLinear, InitMethod, RowParallelLinear

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
# [gate; up] elements above which SwiGLU runs as _SwiGLU: the copy of the grad it saves then
# costs more than its ~40 us of Python per call (fwd + bwd on one CPU thread, autograd's over
# _SwiGLU's: 0.80 at [256, 128], 0.93 at [1024, 128], 1.00 at [1024, 512], 1.19 at [1024, 2752])
SWIGLU_FUNCTION_FROM = 1 << 17


class ParallelMLP(nn.Module):
    """h -> ffn/tp (column-parallel) -> activation -> h (row-parallel, one all-reduce on the
    TP group). [s, b, h] -> [s, b, h]; with `sequence_parallel` [s/t, b, h] in and out
    (all-gather before, reduce-scatter after, on the TP group).

    SwiGLU: the first projection is [gate; up] (2 ffn outputs, each split over TP, so every
    rank holds matching halves) and the activation is silu(gate) * up.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu_tanh",
                 bias: bool = True, init_method: InitMethod | None = None,
                 output_init_method: InitMethod | None = None, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        self.activation = activation
        gated = activation == "swiglu"
        kw = dict(bias=bias, group=group, params_dtype=params_dtype, device=device,
                  sequence_parallel=sequence_parallel)
        self.dense_h_to_4h = ColumnParallelLinear(
            hidden_size, 2 * ffn_hidden_size if gated else ffn_hidden_size,
            init_method=init_method, stride=2 if gated else 1, **kw)
        if gated:  # [gate; up]: two matrices (megalite.optimizer.muon)
            self.dense_h_to_4h.weight.fused_matrices = (1, 2)
        self.dense_4h_to_h = RowParallelLinear(ffn_hidden_size, hidden_size,
                                               input_is_parallel=True,
                                               init_method=output_init_method, **kw)

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """The activation on this rank's [..., (2 x) ffn/tp] first-projection output."""
        if self.activation == "swiglu":
            if hidden.numel() > SWIGLU_FUNCTION_FROM:
                return _SwiGLU.apply(hidden)
            gate, up = hidden.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(hidden, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.dense_h_to_4h(x)
        out, _ = self.dense_4h_to_h(self.activate(hidden))
        return out


class _SwiGLU(torch.autograd.Function):
    """[..., 2f] = [gate; up] -> silu(gate) * up [..., f].

    Backward writes d gate and d up straight into the halves of one [..., 2f] grad, where
    autograd's chunk backward would concatenate them (a copy of the whole grad: about 1% of
    the bench's Llama step on CPU). Saves what autograd would: [gate; up] and silu(gate).
    Output and grad equal autograd's bit for bit; used above SWIGLU_FUNCTION_FROM elements.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = hidden.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(hidden, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        hidden, activated = ctx.saved_tensors
        gate, up = hidden.chunk(2, dim=-1)
        grad_hidden = torch.empty_like(hidden)
        grad_gate, grad_up = grad_hidden.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_hidden
