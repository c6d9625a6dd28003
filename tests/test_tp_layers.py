"""Each tensor-parallel layer equals its single-device torch counterpart at TP in {1,2,4,8}.

Every rank builds the same reference (nn.Linear / nn.Embedding / F.cross_entropy) from a
shared seed, copies its slice into the parallel layer, and compares the forward output,
the input grad and the weight/bias grads (sliced), all on the rank's device. Tolerance 1e-5
(fp32, sums reordered).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.device import current_device
from megalite.mpu import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                          initialize_model_parallel, parallel_state as ps,
                          vocab_parallel_cross_entropy)
from tests.helpers.multirank import run_on_ranks

TP_SIZES = (1, 2, 4, 8)
TOL = dict(rtol=1e-5, atol=1e-5)


def _slice(full: torch.Tensor, dim: int) -> torch.Tensor:
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=dim)[rank]


def _check_column(gather_output: bool) -> None:
    torch.manual_seed(0)
    dev = current_device()
    ref = nn.Linear(24, 40, device=dev)
    x = torch.randn(5, 3, 24, requires_grad=True, device=dev)
    layer = ColumnParallelLinear(24, 40, gather_output=gather_output, device=dev)
    with torch.no_grad():
        layer.weight.copy_(_slice(ref.weight, 0))
        layer.bias.copy_(_slice(ref.bias, 0))
    x_local = x.detach().clone().requires_grad_()
    out, bias = layer(x_local)
    assert bias is None
    want = ref(x)
    torch.testing.assert_close(out, want if gather_output else _slice(want, -1), **TOL)
    grad = torch.randn_like(want)
    want.backward(grad)
    out.backward(grad if gather_output else _slice(grad, -1))
    torch.testing.assert_close(x_local.grad, x.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, _slice(ref.weight.grad, 0), **TOL)
    torch.testing.assert_close(layer.bias.grad, _slice(ref.bias.grad, 0), **TOL)


def _check_row(input_is_parallel: bool) -> None:
    torch.manual_seed(1)
    dev = current_device()
    ref = nn.Linear(32, 12, device=dev)
    x = torch.randn(5, 3, 32, requires_grad=True, device=dev)
    layer = RowParallelLinear(32, 12, input_is_parallel=input_is_parallel, device=dev)
    with torch.no_grad():
        layer.weight.copy_(_slice(ref.weight, 1))
        layer.bias.copy_(ref.bias)
    x_local = (_slice(x, -1) if input_is_parallel else x).detach().clone().requires_grad_()
    out, _ = layer(x_local)
    want = ref(x)
    torch.testing.assert_close(out, want, **TOL)
    grad = torch.randn_like(want)
    want.backward(grad)
    out.backward(grad)
    want_x_grad = _slice(x.grad, -1) if input_is_parallel else x.grad
    torch.testing.assert_close(x_local.grad, want_x_grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, _slice(ref.weight.grad, 1), **TOL)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL)


def _check_embedding_and_cross_entropy(vocab: int) -> None:
    """vocab=50 is not divisible by any TP > 1 and pads to 128 * TP; padding never wins."""
    torch.manual_seed(2)
    dev = current_device()
    ref = nn.Embedding(vocab, 16, device=dev)
    ids = torch.randint(0, vocab, (4, 7), device=dev)
    layer = VocabParallelEmbedding(vocab, 16, device=dev)
    padded = layer.padded_num_embeddings
    assert padded % (128 * ps.get_tensor_model_parallel_world_size()) == 0
    with torch.no_grad():
        full = torch.cat([ref.weight, torch.zeros(padded - vocab, 16, device=dev)])
        layer.weight.copy_(_slice(full, 0))
    out = layer(ids)
    torch.testing.assert_close(out, ref(ids), **TOL)
    grad = torch.randn(4, 7, 16, device=dev)
    ref(ids).backward(grad)
    out.backward(grad)
    full_grad = torch.cat([ref.weight.grad, torch.zeros(padded - vocab, 16, device=dev)])
    torch.testing.assert_close(layer.weight.grad, _slice(full_grad, 0), **TOL)

    # Tied LM head + vocab-parallel cross entropy against F.cross_entropy on full logits.
    hidden = torch.randn(7, 4, 16, requires_grad=True, device=dev)
    target = torch.randint(0, vocab, (7, 4), device=dev)
    hidden_local = hidden.detach().clone().requires_grad_()
    layer.weight.grad = None
    logits = layer.lm_logits(hidden_local)
    loss = vocab_parallel_cross_entropy(logits, target)
    ref.weight.grad = None
    want_logits = hidden @ ref.weight.t()
    want = F.cross_entropy(want_logits.reshape(-1, vocab), target.reshape(-1),
                           reduction="none").view(7, 4)
    torch.testing.assert_close(loss, want, **TOL)
    loss_grad = torch.rand(7, 4, device=dev)
    want.backward(loss_grad)
    loss.backward(loss_grad)
    torch.testing.assert_close(hidden_local.grad, hidden.grad, **TOL)
    full_grad = torch.cat([ref.weight.grad, torch.zeros(padded - vocab, 16, device=dev)])
    torch.testing.assert_close(layer.weight.grad, _slice(full_grad, 0), **TOL)
    assert torch.isinf(logits[..., layer.weight.shape[0] - layer.num_padding_rows:]).all()


def _all_layer_checks() -> int:
    for tp in TP_SIZES:
        initialize_model_parallel(tp, 1)
        _check_column(gather_output=False)
        _check_column(gather_output=True)
        _check_row(input_is_parallel=True)
        _check_row(input_is_parallel=False)
        for vocab in (50, 1000):
            _check_embedding_and_cross_entropy(vocab)
        ps.destroy_model_parallel()
    return dist.get_rank()


def test_tp_layers_match_torch_on_8_ranks():
    assert run_on_ranks(8, _all_layer_checks) == list(range(8))


def _init_independent_of_tp() -> dict:
    """Same seed -> same full weights for TP=1 and TP=4."""
    from megalite.mpu.layers import gather_tensor_parallel
    out = {}
    for tp in (1, 4):
        initialize_model_parallel(tp, 1)
        torch.manual_seed(7)
        col = ColumnParallelLinear(8, 16, device=current_device())
        torch.manual_seed(7)
        emb = VocabParallelEmbedding(50, 8, device=current_device())
        out[tp] = (gather_tensor_parallel(col.weight.data, col.weight),
                   gather_tensor_parallel(emb.weight.data, emb.weight))
        ps.destroy_model_parallel()
    return out


def test_weight_init_independent_of_tp():
    for result in run_on_ranks(4, _init_independent_of_tp):
        for a, b in zip(result[1], result[4]):
            assert torch.equal(a, b)
