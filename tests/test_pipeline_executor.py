"""Executor pieces that need no process group: forward-only tables, freeing sent
activations, and the single-stage (PP = 1) step with loss scaling (on the test device)."""
import pytest
import torch

from megalite.schedules import SCHEDULE_KINDS, get_forward_backward_func
from megalite.schedules.accounting import simulate
from megalite.schedules.executor import free_output, observe_computes, rank_table
from megalite.schedules.instructions import Kind
from tests.helpers.reference import rel_err
from tests.test_pipeline_parity import CONFIG, MICRO, SEQ, batch, forward_step, provider

CASES = [(name, p, v, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4))]


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-p{p}-v{v}-m{m}" for n, p, v, m in CASES])
def test_forward_only_tables_run_every_forward_without_deadlock(case):
    name, p, v, m = case
    table = [list(rank_table(SCHEDULE_KINDS[name], p, m, v, rank, True)) for rank in range(p)]
    simulate(table)  # raises DeadlockError
    for rank in table:
        assert {ins.kind for ins in rank} <= {Kind.FORWARD, Kind.SEND_FORWARD, Kind.RECV_FORWARD}
        assert sum(ins.kind is Kind.FORWARD for ins in rank) == m * v


def test_free_output_releases_storage_and_backward_still_works(device):
    x = torch.randn(8, 2, 32, requires_grad=True, device=device)
    w = torch.randn(32, 32, device=device)
    out, grad = x @ w + 1.0, torch.randn(8, 2, 32, device=device)
    free_output(out)
    assert out.untyped_storage().nbytes() == out.element_size() and out.shape == x.shape
    torch.autograd.backward(out, grad_tensors=grad)
    assert rel_err(x.grad, grad @ w.t()) < 1e-6


def _single_stage_grads(m: int, loss_scale: float):
    """PP = 1, no process group: accumulation over m microbatches with `loss_scale`."""
    chunk = provider(CONFIG, pre_process=True, post_process=True)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batch(m).split(MICRO)), model=chunk,
        num_microbatches=m, seq_length=SEQ, micro_batch_size=MICRO, loss_scale=loss_scale)
    return losses, chunk.log, {n: p.grad for n, p in chunk.named_parameters()}


def test_single_stage_accumulates_mean_grads_with_loss_scale():
    m = 4
    losses, log, grads = _single_stage_grads(m, 1.0)
    _, _, scaled = _single_stage_grads(m, 8.0)
    whole = provider(CONFIG, pre_process=True, post_process=True)
    tokens = batch(m)
    whole(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    for name, param in whole.named_parameters():
        assert rel_err(grads[name], param.grad) < 1e-5, name
        assert rel_err(scaled[name], 8.0 * param.grad) < 1e-5, name
    assert len(losses) == m and log == [True] * (m - 1) + [False]


def test_observers_see_every_compute_in_table_order():
    seen = []
    chunk = provider(CONFIG, pre_process=True, post_process=True)
    with observe_computes(lambda ins, seconds: seen.append((ins.kind, ins.microbatch, seconds > 0))):
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batch(2).split(MICRO)), model=chunk,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=MICRO)
    F, B = Kind.FORWARD, Kind.BACKWARD
    assert seen == [(F, 0, True), (B, 0, True), (F, 1, True), (B, 1, True)]
