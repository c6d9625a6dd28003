"""The extension records are the single source of sharding strategies and optimizers
(megalite.config.sharding, megalite.optimizer.kinds), and a gradient reducer plugged in through an
optimizer kind is what the DP buckets call (megalite.distributed.reducers).

Closed forms written out here: model-state bytes per parameter on one rank are (4 + 4 + k)/N
under FSDP2, p + g + (m + k)/N on the grad buffer when the optimizer is sharded, else
p + g + m + k, with (p, g, m) = (4, 4, 0) fp32, (2, 4, 4) bf16, (2, 2, 8) fp16 and k the
optimizer's state (AdamW m, v: 8; SGD's momentum: 4; none without momentum). The reducer
test scales the reduced grads by 3 with SGD (no momentum, no decay, no clipping): the update
on 2 DP ranks must equal a single process stepping with 3 times the learning rate.
"""
import dataclasses
from pathlib import Path

import pytest
import torch

from megalite.config import sharding
from megalite.config import OptimizerConfig, build_parser, parse_configs
from megalite.device import current_device
from megalite.distributed.reducers import GradReducer, default_reducer
from megalite.layout import RunLayout
from megalite.models import GPTModel
from megalite.optimizer import get_optimizer, kinds
from megalite.planning.planner import plan
from megalite.planning.state_bytes import state_bytes_per_param
from megalite.tasks import gpt as pretrain_gpt
from megalite.training.setup import build_model
from tests.helpers.dp_reference import (CONFIG, Reference, batches, compute_grads, full_params,
                                        init_grid, local_slice, max_rel_err, opt_config)
from tests.helpers.multirank import run_on_ranks
from tests.test_imports import imports

OPTIMIZERS = {"adam": (OptimizerConfig(), 8), "sgd": (OptimizerConfig(optimizer="sgd"), 4),
              "sgd, no momentum": (OptimizerConfig(optimizer="sgd", sgd_momentum=0.0), 0)}
BUFFER = {"fp32": (4, 4, 0), "bf16": (2, 4, 4), "fp16": (2, 2, 8)}  # params, grads, masters
FACTOR = 3.0


def test_the_strategy_records_are_a_leaf_the_config_may_read():
    path = Path(sharding.__file__)
    assert not {name for name in imports(path) if name.startswith("megalite")}


def test_every_strategy_the_parser_accepts_is_a_record():
    parser = build_parser([OptimizerConfig])
    action = next(a for a in parser._actions if a.dest == "data_parallel_sharding_strategy")
    assert tuple(action.choices) == sharding.STRATEGY_NAMES
    assert [sharding.sharding_strategy(name) for name in action.choices] == \
        list(sharding.STRATEGIES)
    legacy = sharding.sharding_strategy(OptimizerConfig(use_distributed_optimizer=True).sharding)
    assert legacy.shards_optimizer and not legacy.fsdp  # ZeRO-1 on the grad buffer
    with pytest.raises(ValueError, match="--data-parallel-sharding-strategy must be one of "
                                         "no_shard, optim, optim_grads, optim_grads_params"):
        sharding.sharding_strategy("zero3")


def test_every_optimizer_record_runs_and_another_name_is_one_line(monkeypatch, tmp_path,
                                                                  capsys):
    for kind in kinds.OPTIMIZER_KINDS:  # the 1-bit family: DP >= 2, no clipping, a run that
        # goes past the freeze step (zero_one_adam's default: DeepSpeed's 100,000)
        extra = ["--clip-grad", "0", "--train-iters", "200000"] if kind.check_run else []
        RunLayout.from_configs(parse_configs(["--optimizer", kind.name, *extra]), 2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.main(["--optimizer", "lamb"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --optimizer must be one of adam, sgd, muon, onebit_adam, onebit_lamb, zero_one_adam "
        "(got 'lamb')"]


@pytest.mark.parametrize("n", (1, 4))
def test_planner_bytes_are_the_records_closed_forms(n):
    for strategy in sharding.STRATEGIES:
        for precision, (p, g, m) in BUFFER.items():
            for config, k in OPTIMIZERS.values():
                if strategy.fsdp:
                    want = (4 + 4 + k) / n
                elif strategy.shards_optimizer:
                    want = p + g + (m + k) / n
                else:
                    want = p + g + m + k
                got = state_bytes_per_param(precision, strategy.name, n, optimizer=config)
                assert got.total == pytest.approx(want), (strategy.name, precision, config)
    first = plan(parse_configs(["--optimizer", "sgd"])).stages["first"]
    assert first.state.total == 4 + 4 + 4  # fp32 no_shard: params, grads, SGD momentum


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_kinds_state_is_what_its_torch_optimizer_keeps(name):
    config, k = OPTIMIZERS[name]
    kind = kinds.optimizer_kind(config.optimizer)
    assert kind.state_bytes(config) == k
    weight, bias = torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(5))
    optimizer = kind.build([{"params": [weight], "weight_decay": 0.1},
                            {"params": [bias], "weight_decay": 0.0}], config)
    (weight.sum() + bias.square().sum()).backward()
    optimizer.step()
    for param in (weight, bias):
        state = optimizer.state[param]
        per_element = {key for key, value in state.items() if value.shape == param.shape}
        assert per_element == set(kind.state_keys(config))
        assert sum(state[key].nbytes for key in per_element) == k * param.numel()
        assert set(state) - per_element == set(kind.scalar_keys)


class ScaledReducer(GradReducer):
    """The default reducer of the bucket, then the reduced grads times FACTOR; logs its calls
    to CALLS."""

    def __init__(self, sharded: bool) -> None:
        self.inner, self.flat = default_reducer(sharded), None

    def start(self, flat: torch.Tensor, group) -> object:
        CALLS.append("start")
        self.flat = flat
        return self.inner.start(flat, group)

    def wait(self, handle: object) -> None:
        CALLS.append("wait")
        self.inner.wait(handle)
        self.flat.mul_(FACTOR)


CALLS: list[str] = []
SCALED_SGD = dataclasses.replace(kinds.SGD, name="scaled_sgd", reducer=ScaledReducer)


def test_a_kind_with_its_own_reducer_cannot_run_on_fsdp(monkeypatch):
    monkeypatch.setattr(kinds, "OPTIMIZER_KINDS", kinds.OPTIMIZER_KINDS + (SCALED_SGD,))
    for strategy in sharding.STRATEGIES:
        configs = parse_configs(["--optimizer", "scaled_sgd",
                                 "--data-parallel-sharding-strategy", strategy.name])
        if not strategy.fsdp:
            RunLayout.from_configs(configs, 2)
            continue
        with pytest.raises(ValueError, match="--optimizer scaled_sgd sends gradients through "
                                             "its own reducer"):
            RunLayout.from_configs(configs, 2)


def _sgd(lr: float, **kw) -> OptimizerConfig:
    return opt_config(optimizer="sgd", lr=lr, sgd_momentum=0.0, weight_decay=0.0,
                      clip_grad=1e9, **kw)


def _scaled_step(sharded: bool) -> dict:
    """One step on the DP group of the world (built by training.setup.build_model with the
    scaled_sgd kind, 1000-element buckets) against one process at FACTOR x the lr."""
    init_grid(1)
    saved = kinds.OPTIMIZER_KINDS
    kinds.OPTIMIZER_KINDS = saved + (SCALED_SGD,)
    try:
        opt = dataclasses.replace(_sgd(0.5, use_distributed_optimizer=sharded,
                                       ddp_bucket_size=1000), optimizer="scaled_sgd")
        configs = dataclasses.replace(parse_configs([]), optimizer=opt)
        model = build_model(configs, lambda pre_process, post_process: GPTModel(
            CONFIG, pre_process, post_process, device=current_device()))
        optimizer, _ = get_optimizer(opt, configs.precision, model)
    finally:
        kinds.OPTIMIZER_KINDS = saved
    chunk, ref = model[0], Reference(_sgd(0.5 * FACTOR))
    CALLS.clear()
    for param in chunk.parameters():
        param.register_post_accumulate_grad_hook(lambda _: CALLS.append("grad"))
    tokens = batches(1, 8)[0]
    before, ref_before = full_params(chunk), ref.params()
    compute_grads(chunk, optimizer, local_slice(tokens, chunk.data_parallel_group))
    ref.grads(tokens)
    assert optimizer.step()[0]
    ref.step()
    update = {n: p - before[n] for n, p in full_params(chunk).items()}
    ref_update = {n: p - ref_before[n] for n, p in ref.params().items()}
    return {"err": max_rel_err(update, ref_update), "buckets": len(chunk.buckets()),
            "starts": CALLS.count("start"), "waits": CALLS.count("wait"),
            "grads_after_first_start": CALLS[CALLS.index("start"):].count("grad")}


@pytest.mark.parametrize("sharded", (False, True), ids=("no_shard", "optim"))
def test_a_kinds_reducer_is_what_the_buckets_call(sharded):
    for result in run_on_ranks(2, _scaled_step, sharded):
        assert result["err"] < 1e-5, result
        assert result["buckets"] > 5, result
        assert result["starts"] == result["waits"] == result["buckets"], result
        assert result["grads_after_first_start"] > 0, result  # overlapped with backward
