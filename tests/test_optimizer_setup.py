"""Single-process checks of what get_optimizer builds and of the LR schedule's closed form."""
import math

import pytest
import torch

from megalite.config import OptimizerConfig, PrecisionConfig
from megalite.distributed import DistributedDataParallel
from megalite.models import GPTModel
from megalite.optimizer import OptimizerParamScheduler, check_decay_iters, get_optimizer
from tests.helpers.dp_reference import CONFIG


def _model(dtype: torch.dtype = torch.float32) -> DistributedDataParallel:
    return DistributedDataParallel(GPTModel(CONFIG, params_dtype=dtype))


def test_adamw_is_fused_on_cpu_and_skips_decay_on_biases_and_norms():
    model = _model()
    optimizer, _ = get_optimizer(OptimizerConfig(weight_decay=0.1), PrecisionConfig(), model, 100)
    decay, no_decay = optimizer.param_groups
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)
    assert optimizer.optimizer.defaults["fused"] is True
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # 2 layers x (4 biases + 2 norms x 2) + final norm x 2 = 18 one-dimensional params
    assert len(no_decay["params"]) == 18 and all(p.ndim == 1 for p in no_decay["params"])
    assert all(p.ndim == 2 for p in decay["params"])
    # fp32 params are their own main params (views of the same storage, no copy)
    params = list(model.parameters())
    assert all(f.main.data_ptr() == p.data_ptr() for f, p in zip(optimizer.fragments, params))


def test_bf16_keeps_fp32_main_copies_and_sgd_is_available():
    model = _model(torch.bfloat16)
    optimizer, _ = get_optimizer(OptimizerConfig(optimizer="sgd", sgd_momentum=0.5),
                                 PrecisionConfig(bf16=True), model, 100)
    assert isinstance(optimizer.optimizer, torch.optim.SGD)
    assert all(f.main.dtype == torch.float32 and f.target.dtype == torch.bfloat16
               for f in optimizer.fragments)
    assert optimizer.loss_scale == 1.0 and optimizer.scaler is None


def test_unwrapped_model_or_mismatched_sharding_is_refused():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        get_optimizer(OptimizerConfig(), PrecisionConfig(), GPTModel(CONFIG))
    with pytest.raises(ValueError, match="use-distributed-optimizer"):
        get_optimizer(OptimizerConfig(use_distributed_optimizer=True), PrecisionConfig(),
                      _model())


@pytest.mark.parametrize("style, expected", [
    # warm-up 10, decay to step 110, lr 1.0 -> 0.1; n = steps taken
    ("cosine", {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.1 + 0.45 * (1 + math.cos(math.pi / 4)),
                60: 0.55, 110: 0.1, 200: 0.1}),
    ("linear", {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.775, 60: 0.55, 110: 0.1, 200: 0.1}),
    ("constant", {0: 0.0, 5: 0.5, 10: 1.0, 60: 1.0, 200: 1.0}),
])
def test_lr_schedule_matches_closed_form(style, expected):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    scheduler = OptimizerParamScheduler(optimizer, max_lr=1.0, min_lr=0.1, warmup_iters=10,
                                        decay_iters=110, decay_style=style)
    for n, lr in expected.items():
        scheduler.step(increment=0, iteration=n)
        assert scheduler.get_lr() == pytest.approx(lr, rel=1e-12), (style, n)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12)
    scheduler.step(increment=0, iteration=42)
    scheduler.step()
    resumed = OptimizerParamScheduler(optimizer, 1.0, 0.1, 10, 110, style)
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.num_steps == 43 and resumed.get_lr() == scheduler.get_lr()


def test_decay_needs_a_length_beyond_the_warm_up():
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        OptimizerParamScheduler.from_config(None, OptimizerConfig(lr_decay_style="cosine"), None)
    with pytest.raises(ValueError, match="must exceed --lr-warmup-iters"):
        check_decay_iters("linear", warmup_iters=15, decay_iters=4)
    assert check_decay_iters("constant", warmup_iters=15, decay_iters=None) is None
