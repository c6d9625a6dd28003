"""megalite.horovod against independent references, on the 4-rank pool.

DistributedOptimizer (SGD and Adam, backward_passes_per_step 2) equals one process stepping on
the mean loss of the whole batch; Tensor Fusion packs threshold // bytes-per-grad gradients per
collective (counted); fp16 compression stays within fp16 rounding of the exact mean and sends
2 bytes per element; broadcast_parameters and broadcast_optimizer_state make every rank equal
to the root's; allgather with uneven rows, broadcast_object and join follow Horovod's
semantics. Without ranks: the launcher's HOROVOD_* variables and init's node layout match a
layout worked out by hand, and refused arguments or bad settings are one clear error. Last, the
tutorial-shaped example runs under `tools/horovodrun -np 2` on 127.0.0.1.
"""
import contextlib
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import megalite.horovod as hvd
from megalite.device import current_device, free_port
from megalite.distributed.rank_pool import on_gpus
from megalite.horovod.basics import node_layout
from megalite.horovod.fusion import fusion_threshold
from tests.helpers.multirank import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
RANKS, PASSES, STEPS, MICRO = 4, 2, 2, 3
FUSED_LAYERS, WIDTH = 10, 4  # FUSED_LAYERS grads of WIDTH * WIDTH fp32 each


def _model(seed: int = 0) -> torch.nn.Module:
    """Built on the CPU (the same weights everywhere); rank code moves it to its device."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8, device="cpu"), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3, device="cpu"))


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [STEPS, PASSES, RANKS, MICRO, 6] and targets [..., 3]."""
    generator = torch.Generator().manual_seed(7)
    shape = (STEPS, PASSES, RANKS, MICRO)
    return (torch.randn(*shape, 6, generator=generator, device="cpu"),
            torch.randn(*shape, 3, generator=generator, device="cpu"))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _train_on_ranks(kind: str) -> dict:
    """STEPS steps of PASSES backward passes each on this rank's microbatches."""
    hvd.init()
    model = _model().to(current_device())
    optimizer = hvd.DistributedOptimizer(  # Adam's grads also go through the predivide split
        _optimizer(kind, model), model.named_parameters(), backward_passes_per_step=PASSES,
        gradient_predivide_factor=2.0 if kind == "adam" else 1.0)
    inputs, targets = (t.to(current_device()) for t in _batches())
    for step in range(STEPS):
        for micro in range(PASSES):
            x, y = inputs[step, micro, hvd.rank()], targets[step, micro, hvd.rank()]
            (F.mse_loss(model(x), y) / PASSES).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _train_one_process(kind: str) -> dict:
    model = _model()
    optimizer = _optimizer(kind, model)
    inputs, targets = _batches()
    for step in range(STEPS):
        F.mse_loss(model(inputs[step].reshape(-1, 6)), targets[step].reshape(-1, 3)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_distributed_optimizer_equals_one_process_mean_step():
    for kind in ("sgd", "adam"):
        want = _train_one_process(kind)
        for got in run_on_ranks(RANKS, _train_on_ranks, kind):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6,
                                           msg=f"{kind} {name}")


@contextlib.contextmanager
def _fusion_threshold(value: str | None):
    old = os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
    if value is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = value
    try:
        yield
    finally:
        os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        if old is not None:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = old


def _fusion_counts(thresholds: list[str | None]) -> list[list[tuple[int, int]]]:
    """(tensors, bytes) of each all-reduce of one DistributedOptimizer step, per threshold."""
    hvd.init()
    device = current_device()
    counts = []
    for threshold in thresholds:
        with _fusion_threshold(threshold):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False, device=device)
                                          for _ in range(FUSED_LAYERS)))
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            with hvd.count_collectives() as issued:
                model(torch.ones(2, WIDTH, device=device)).sum().backward()
                optimizer.step()
        counts.append([(c.tensors, c.bytes) for c in issued if c.kind == "allreduce"])
    return counts


def test_tensor_fusion_packs_as_many_grads_as_the_threshold_allows():
    grad_bytes = WIDTH * WIDTH * 4
    thresholds = [None, "0", str(3 * grad_bytes), str(3 * grad_bytes + grad_bytes // 2),
                  str(FUSED_LAYERS * grad_bytes - 1)]
    for counts in run_on_ranks(RANKS, _fusion_counts, thresholds):
        for threshold, got in zip(thresholds, counts):
            limit = 64 * 2**20 if threshold is None else int(threshold)
            per = max(1, min(FUSED_LAYERS, limit // grad_bytes))  # a grad over it goes alone
            sizes = [per] * (FUSED_LAYERS // per) + ([FUSED_LAYERS % per] if FUSED_LAYERS % per
                                                     else [])
            assert len(got) == math.ceil(FUSED_LAYERS / per), (threshold, got)
            assert got == [(n, n * grad_bytes) for n in sizes], (threshold, got)


def _fp16_allreduce() -> dict:
    hvd.init()
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    values = torch.randn(1000, generator=generator, device="cpu") * 10
    with hvd.count_collectives() as issued:
        got = hvd.allreduce(values.to(current_device()), compression=hvd.Compression.fp16)
    model = _model().to(current_device())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         compression=hvd.Compression.fp16)
    inputs, targets = (t[0, 0, hvd.rank()].to(current_device()) for t in _batches())
    F.mse_loss(model(inputs), targets).backward()
    optimizer.synchronize()
    return {"values": values, "mean": got, "bytes": [c.bytes for c in issued],
            "grads": [p.grad for p in model.parameters()]}


def _rank_grads() -> list[list[torch.Tensor]]:
    """Each rank's fp32 gradients of _fp16_allreduce's loss, computed here."""
    inputs, targets = _batches()
    grads = []
    for rank in range(RANKS):
        model = _model()
        F.mse_loss(model(inputs[0, 0, rank]), targets[0, 0, rank]).backward()
        grads.append([p.grad for p in model.parameters()])
    return grads


def test_fp16_compression_stays_within_fp16_rounding():
    """hvd.allreduce and DistributedOptimizer with Compression.fp16."""
    results = run_on_ranks(RANKS, _fp16_allreduce)
    values = torch.stack([r["values"] for r in results]).double()
    exact = values.mean(0)
    # fp16's unit roundoff u = 2^-11: rounding the inputs and three additions err by at most
    # 4 u sum|x_r| (a quarter of it after the exact division by 4), the result's rounding u|mean|
    bound = 2.0**-11 * (values.abs().sum(0) + exact.abs())
    for result in results:
        assert result["mean"].dtype == torch.float32
        assert result["bytes"] == [1000 * 2]  # fp16 on the wire
        assert ((result["mean"].double() - exact).abs() <= bound).all()
        assert not torch.equal(result["mean"], exact.float())  # it really went through fp16
    for index, per_rank in enumerate(zip(*_rank_grads())):
        grads = torch.stack(per_rank).double()
        exact = grads.mean(0)
        bound = 2.0**-11 * (grads.abs().sum(0) + exact.abs()) + 1e-7  # + fp32 backward noise
        for result in results:
            assert ((result["grads"][index].double() - exact).abs() <= bound).all(), index


def _broadcasts() -> dict:
    """Each rank starts from its own weights and optimizer state, then takes rank 1's."""
    hvd.init()
    device = current_device()
    model = _model(seed=hvd.rank()).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    F.mse_loss(model(torch.randn(4, 6, device=device)), torch.randn(4, 3, device=device)).backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = optimizer.state_dict()
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=1)
    gathered = hvd.allgather(torch.full((hvd.rank() + 1, 2), float(hvd.rank()), device=device))
    return {"before": before, "after": model.state_dict(), "state_before": state_before,
            "state_after": optimizer.state_dict(), "gathered": gathered,
            "object": hvd.broadcast_object({"rank": hvd.rank()}, root_rank=2),
            "objects": hvd.allgather_object(hvd.rank() * 10)}


def test_broadcast_parameters_and_optimizer_state_make_all_ranks_equal():
    results = run_on_ranks(RANKS, _broadcasts)
    root = results[1]
    assert not torch.equal(results[0]["before"]["0.weight"], root["before"]["0.weight"])
    rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(RANKS)])
    for result in results:
        for name, value in root["before"].items():
            assert torch.equal(result["after"][name], value), name
        assert result["state_after"]["param_groups"] == root["state_before"]["param_groups"]
        for index, state in root["state_before"]["state"].items():
            for key, value in state.items():
                assert torch.equal(result["state_after"]["state"][index][key], value), key
        assert torch.equal(result["gathered"], rows)
        assert result["object"] == {"rank": 2}
        assert result["objects"] == [0, 10, 20, 30]


def _uneven_steps() -> dict:
    """Rank r all-reduces r + 1 times, then joins: the others go on without it."""
    hvd.init()
    device = current_device()
    sums, means = [], []
    for _ in range(hvd.rank() + 1):
        sums.append(hvd.allreduce(torch.ones(3, device=device), op=hvd.Sum)[0].item())
        means.append(hvd.allreduce(torch.full((3,), float(hvd.rank()), device=device))[0].item())
    return {"sums": sums, "means": means, "last": hvd.join()}


def test_join_lets_ranks_with_less_data_stop_early():
    for rank, result in enumerate(run_on_ranks(RANKS, _uneven_steps)):
        active = [list(range(step, RANKS)) for step in range(rank + 1)]
        assert result["sums"] == [len(ranks) for ranks in active]
        assert result["means"] == [sum(ranks) / len(ranks) for ranks in active]
        assert result["last"] == RANKS - 1


def test_launcher_env_and_init_agree_on_the_node_layout():
    """-H a:2,b:3: (local_rank, local_size, cross_rank, cross_size) per rank, by hand."""
    want = [(0, 2, 0, 2), (1, 2, 0, 2), (0, 3, 1, 2), (1, 3, 1, 2), (2, 3, 0, 1)]
    hosts = ["a", "a", "b", "b", "b"]
    assert [node_layout(hosts, rank) for rank in range(5)] == want
    job = subprocess.run([sys.executable, "tools/horovodrun", "-np", "5", "-H", "a:2,b:3",
                          "--dry-run", "python", "x.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    names = ["LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"]
    for rank, line in enumerate(job.stdout.splitlines()):
        env = dict(item.split("=", 1) for item in shlex.split(line)[-1].split()
                   if item.startswith("HOROVOD_"))
        assert env["HOROVOD_RANK"] == str(rank) and env["HOROVOD_HOSTNAME"] == hosts[rank]
        assert tuple(int(env[f"HOROVOD_{name}"]) for name in names) == want[rank], line


def test_unsupported_arguments_and_bad_settings_are_one_clear_error(monkeypatch):
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="Adasum is not supported"):
        hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="process sets are not supported"):
        hvd.DistributedOptimizer(optimizer, process_set=object())
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB': expected a byte"):
        fusion_threshold()
    job = subprocess.run([sys.executable, "tools/horovodrun", "-np", "5", "-H", "127.0.0.1:4",
                          "python", "x.py"], cwd=ROOT, capture_output=True, text=True)
    assert job.returncode != 0
    assert job.stderr.strip() == "horovodrun: -np 5 but the hosts give 4 slots"


def test_example_runs_under_horovodrun():
    """Two workers: a launch of four would start two more processes importing torch, and the
    4-rank behaviour is checked above on the pool."""
    workers = 2
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           **({} if on_gpus(workers) else {"CUDA_VISIBLE_DEVICES": ""})}
    job = subprocess.run(
        [sys.executable, "tools/horovodrun", "-np", str(workers), "-H",
         f"127.0.0.1:{workers}", "--master-port", str(free_port()), sys.executable,
         "examples/horovod/pytorch_mnist.py", "--epochs", "1", "--num-samples", "64",
         "--batch-size", "16", "--log-interval", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    # 64 samples over 2 ranks: 32 each, 2 batches of 16 per rank, logged on every rank
    assert job.stdout.count("Train Epoch: 1 [16/32 (50%)]") == workers, job.stdout
    assert job.stdout.count("Test set: Average loss") == 1, job.stdout
