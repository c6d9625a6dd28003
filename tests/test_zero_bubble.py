"""Zero-bubble schedules: ZB-H1 and ZBV tables as pure data, the split backward of the
column- and row-parallel linear layers, DP buckets firing on the last W, and a training run
whose loss curve equals 1F1B's.

Tables are checked against the test's own stage placement (loop: chunk c of rank r is stage
c*p + r; V: stages r and 2p-1-r) and against closed forms: ZB-H1 idles (p-1)(F+B-W) per rank
(Qi et al. 2024, Table 2), a third of 1F1B's (p-1)(F+B+W) with F = B = W, with 1F1B's
forwards in flight; ZBV idles only (p-1) chunk forwards, (p-1)F/2.
"""
from collections import Counter
from fractions import Fraction
from functools import cache

import pytest
import torch

from megalite.device import current_device
from megalite.mpu import ColumnParallelLinear, RowParallelLinear
from megalite.mpu.weight_grad import apply_weight_grads, defer_weight_grads
from megalite.schedules.accounting import bubble_fraction, peak_inflight_activations, simulate
from megalite.schedules.instructions import Kind
from megalite.schedules.tables import build_schedule
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err
from tests.helpers.schedule_checks import assert_dependencies_hold

F, B, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
CASES = [(name, p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p)
         for name in ("zb-h1", "zbv")] + [("zbv", 4, 1), ("zbv", 3, 2)]
each_case = pytest.mark.parametrize("case", CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])


def chunks(name):
    return 2 if name == "zbv" else 1


def stage(name, rank, chunk, p):
    return (rank if chunk == 0 else 2 * p - 1 - rank) if name == "zbv" else chunk * p + rank


@cache
def table(name, p, m):
    return build_schedule(name, p, m, chunks(name))


@each_case
def test_one_f_b_w_per_chunk_and_microbatch_w_after_b(case):
    name, p, m = case
    v = chunks(name)
    for rank, instructions in enumerate(table(*case)):
        computes = [(i.kind, i.chunk, i.microbatch) for i in instructions if i.kind in (F, B, W)]
        assert Counter(computes) == Counter((k, c, mb) for k in (F, B, W) for c in range(v)
                                            for mb in range(m)), rank
        assert Kind.BACKWARD not in {i.kind for i in instructions}
        for c in range(v):
            for mb in range(m):
                assert computes.index((F, c, mb)) < computes.index((B, c, mb)) \
                    < computes.index((W, c, mb)), (rank, c, mb)


@each_case
def test_sends_match_receives_between_neighbouring_stages(case):
    name, p, m = case
    v = chunks(name)
    sent, received = Counter(), Counter()
    for rank, instructions in enumerate(table(*case)):
        for i in instructions:
            s = stage(name, rank, i.chunk, p)
            if i.kind in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD):
                to = s + 1 if i.kind is Kind.SEND_FORWARD else s - 1
                assert stage(name, i.peer, i.peer_chunk, p) == to, (rank, i)
                sent[i.kind is Kind.SEND_FORWARD, s, to, i.microbatch] += 1
            elif i.kind in (Kind.RECV_FORWARD, Kind.RECV_BACKWARD):
                frm = s - 1 if i.kind is Kind.RECV_FORWARD else s + 1
                assert stage(name, i.peer, i.peer_chunk, p) == frm, (rank, i)
                received[i.kind is Kind.RECV_FORWARD, frm, s, i.microbatch] += 1
    assert sent == received and set(sent.values()) == {1}
    local = 1 if name == "zbv" else 0  # stage p-1 -> p stays on rank p-1 in V placement
    assert sum(sent.values()) == 2 * m * (v * p - 1 - local)  # p2p messages


@each_case
def test_simulated_timeline_respects_dependencies_without_deadlock(case):
    name, p, m = case
    spans = {(s.kind, stage(name, r, s.chunk, p), s.microbatch): s
             for r, rank in enumerate(simulate(table(*case)).spans) for s in rank}
    assert_dependencies_hold(spans, p * chunks(name) - 1, backward=B)


@pytest.mark.parametrize("p", (2, 3, 4, 8))
@pytest.mark.parametrize("k", (1, 2, 3))
def test_zb_h1_bubble_is_a_third_of_1f1b_with_1f1b_memory(p, k):
    m = k * p
    zb, ofob = table("zb-h1", p, m), build_schedule("1f1b", p, m)
    f = b = w = 1
    assert bubble_fraction(zb) == Fraction((p - 1) * (f + b - w), m * (f + b + w))
    assert bubble_fraction(zb) == bubble_fraction(ofob) / 3
    for rank in range(p):
        assert peak_inflight_activations(zb, rank) == peak_inflight_activations(ofob, rank)


@pytest.mark.parametrize("p", (2, 3, 4, 8))
@pytest.mark.parametrize("k", (1, 2, 3))
def test_zbv_idles_only_the_first_forwards_and_keeps_1f1b_memory(p, k):
    m = k * p
    zbv = table("zbv", p, m)
    assert bubble_fraction(zbv) == Fraction(p - 1, 2) / (3 * m)  # (p-1) F/2 over m (F+B+W)
    for rank in range(p):  # chunk units: 2p = p whole-rank microbatches, 1F1B's rank 0
        assert peak_inflight_activations(zbv, rank) <= 2 * min(p, m)


@pytest.mark.parametrize("build, arg", [
    (lambda: build_schedule("zb-h1", 4, 3), "m"),
    (lambda: build_schedule("zb-h1", 4, 8, 2), "v"),
    (lambda: build_schedule("zb-h1", 1, 8), "p"),
    (lambda: build_schedule("zbv", 4, 8, 1), "v"),
    (lambda: build_schedule("zbv", 4, 0, 2), "m"),
])
def test_invalid_arguments_raise_one_clear_line(build, arg):
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value).startswith(f"{arg}: expected ") and "\n" not in str(err.value)


def test_parallel_linears_defer_weight_grads_until_applied(device):
    """Column- then row-parallel linear (TP 1, as in an MLP) vs nn.Linear: inside
    defer_weight_grads the input and bias grads are final and the weight grads queued."""
    torch.manual_seed(0)
    column, row = ColumnParallelLinear(6, 5, device=device), RowParallelLinear(5, 4, device=device)
    x = torch.randn(4, 3, 6, requires_grad=True, device=device)
    grad_y = torch.randn(4, 3, 4, device=device)
    references = [torch.nn.Linear(6, 5, device=device), torch.nn.Linear(5, 4, device=device)]
    for reference, layer in zip(references, (column, row)):
        reference.load_state_dict(layer.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    torch.autograd.backward(references[1](references[0](x_ref)), grad_y)
    with defer_weight_grads() as work:
        torch.autograd.backward(row(column(x)[0])[0], grad_y)
    assert column.weight.grad is None and row.weight.grad is None and len(work) == 2
    assert rel_err(x.grad, x_ref.grad) < 1e-6
    for reference, layer in zip(references, (column, row)):
        assert rel_err(layer.bias.grad, reference.bias.grad) < 1e-6
    apply_weight_grads(work)
    for reference, layer in zip(references, (column, row)):
        assert rel_err(layer.weight.grad, reference.weight.grad) < 1e-6


class _NormedColumn(torch.nn.Module):
    """A column-parallel linear (deferrable weight grad) and a LayerNorm (fused backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = ColumnParallelLinear(4, 4, device=current_device())
        self.norm = torch.nn.LayerNorm(4, device=current_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)[0])


def _bucket_fires_on_last_w() -> dict:
    from megalite.distributed import DistributedDataParallel
    from megalite.mpu import initialize_model_parallel
    initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = DistributedDataParallel(_NormedColumn())
    loss = model(torch.randn(3, 4, device=current_device())).square().sum()
    with defer_weight_grads() as work:
        loss.backward()
    launched_after_b = [b.launched for b in model.buckets()]
    apply_weight_grads(work)
    return {"after B": launched_after_b, "after W": [b.launched for b in model.buckets()],
            "weight grad": model.module.linear.weight.main_grad.abs().sum().item()}


def test_dp_bucket_fires_when_the_last_w_lands():
    (result,) = run_on_ranks(1, _bucket_fires_on_last_w)
    assert result["after B"] == [False] and result["after W"] == [True], result
    assert result["weight grad"] > 0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("zb_data")))


def test_training_loss_curve_of_zero_bubble_equals_1f1b(tmp_path, data):
    """8 ranks, TP 2 x PP 2 x DP 2, distributed optimizer, dropout off (zbv places the layers
    on other ranks, whose dropout streams differ): 3 steps of 1f1b, zb-h1 and zbv."""
    curves = {}
    for schedule in ("1f1b", "zb-h1", "zbv"):
        argv = tiny_args(data, f"{tmp_path}/{schedule}", 3, "--tp", "2", "--pp", "2",
                         "--use-distributed-optimizer", "--pipeline-schedule", schedule,
                         "--hidden-dropout", "0", "--attention-dropout", "0")
        curves[schedule] = run_on_ranks(8, train, argv)[0]
    ref = torch.tensor(list(curves["1f1b"].values()))
    for schedule in ("zb-h1", "zbv"):
        assert list(curves[schedule]) == [1, 2, 3]
        assert rel_err(torch.tensor(list(curves[schedule].values())), ref) < 1e-5, curves
