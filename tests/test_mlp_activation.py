"""ParallelMLP's SwiGLU equals silu(gate) * up under plain autograd, output and input grad bit
for bit, below and above the size from which it runs its own backward (mlp._SwiGLU)."""
import torch
import torch.nn.functional as F

from megalite.mpu.mlp import SWIGLU_FUNCTION_FROM, ParallelMLP


def test_swiglu_equals_autograd_bit_for_bit_on_both_paths():
    mlp = ParallelMLP(8, 16, activation="swiglu", bias=False)
    gen = torch.Generator().manual_seed(0)
    for rows in (4, SWIGLU_FUNCTION_FROM // 32 + 1):  # [rows, 32]: autograd's ops, _SwiGLU
        hidden, grad = torch.randn(rows, 32, generator=gen), torch.randn(rows, 16, generator=gen)
        results = []
        for activate in (mlp.activate, lambda h: F.silu(h[:, :16]) * h[:, 16:]):
            x = hidden.clone().requires_grad_()
            out = activate(x)
            out.backward(grad)
            results.append((out, x.grad))
        (out, x_grad), (want, want_grad) = results
        assert torch.equal(out, want) and torch.equal(x_grad, want_grad), rows
        assert (out.grad_fn.name() == "_SwiGLUBackward") == (hidden.numel() > SWIGLU_FUNCTION_FROM)
