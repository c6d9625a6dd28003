"""The vocab-parallel cross entropy works a block of rows at a time on every device (bounded
fp32 temporaries): with blocks of a few rows (93 blocks here) loss and grad equal
F.cross_entropy on the full logits, in fp32 and bf16 (one process, TP 1)."""
import pytest
import torch
import torch.nn.functional as F

from megalite.mpu import cross_entropy


@pytest.mark.parametrize("dtype,grad_tol", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
def test_small_row_blocks_give_the_full_cross_entropy(monkeypatch, dtype, grad_tol):
    monkeypatch.setattr(cross_entropy, "_CPU_BLOCK_ELEMENTS", 64)  # 2 rows of 24 per block
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 5, 24, generator=generator).to(dtype).requires_grad_()
    target = torch.randint(0, 24, (37, 5), generator=generator)
    reference = logits.detach().float().requires_grad_()
    want = F.cross_entropy(reference.reshape(-1, 24), target.reshape(-1), reduction="none")
    loss = cross_entropy.vocab_parallel_cross_entropy(logits, target)
    grad = torch.rand(37, 5, generator=generator)
    want.view(37, 5).backward(grad)
    loss.backward(grad)
    assert len(cross_entropy._blocks(logits.detach().reshape(-1, 24))) == 93
    torch.testing.assert_close(loss, want.view(37, 5), rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), reference.grad, rtol=0, atol=grad_tol)


def test_a_second_backward_of_an_fp32_loss_is_one_clear_error():
    """fp32: backward turns the kept softmax into the grad in place, so it runs once."""
    logits = torch.randn(4, 2, 8).requires_grad_()
    loss = cross_entropy.vocab_parallel_cross_entropy(logits, torch.zeros(4, 2, dtype=torch.long))
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward of one fp32 loss"):
        loss.sum().backward()
