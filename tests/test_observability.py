"""Every logged field reaches TensorBoard and W&B (stand-in modules record the calls when the
packages are absent; the real ones are used when installed), a clear line when a requested
package is missing, and the CPU reduced-precision warning."""
import importlib.machinery
import importlib.util
import functools
import math
import sys
import types

import pytest
import torch

from megalite.device import matmul_slowdown, reduced_precision_warning
from megalite.training.log_writers import check_available
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks

FIELDS = {"lm loss", "learning rate", "grad norm", "loss scale", "skipped steps",
          "ms per iteration", "data ms per iteration", "tokens per second",
          "TFLOP/s per device", "peak memory MB", "DP bytes per step",
          "validation lm loss", "validation perplexity"}


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    return module


def _train_with_recording_sinks(prefix: str, root: str) -> tuple[dict, dict]:
    """Train 4 steps (--log-interval 2, --eval-interval 2) with stand-in tensorboard and wandb
    modules; (TensorBoard scalars {tag: {step: value}}, W&B logs {step: {key: value}})."""
    board: dict = {}
    runs: dict = {}

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            board.setdefault(tag, {})[step] = float(value)

        def flush(self):
            pass

        def close(self):
            pass

    class Run:
        def log(self, values, step):
            runs.setdefault(step, {}).update(values)

        def finish(self):
            pass
    fakes = {"tensorboard": _module("tensorboard"),
             "torch.utils.tensorboard": _module("torch.utils.tensorboard",
                                                SummaryWriter=SummaryWriter),
             "wandb": _module("wandb", init=lambda project, dir, config: Run())}
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        argv = tiny_args(prefix, f"{root}/ck", 4, "--log-interval", "2", "--eval-interval", "2",
                         "--eval-iters", "1", "--split", "8,2,0", "--tensorboard-dir",
                         f"{root}/tb", "--wandb-project", "megalite-test")
        train(argv)
    finally:
        for name, module in saved.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module
    return board, runs


def test_every_log_field_goes_to_tensorboard_and_wandb(tmp_path):
    prefix = make_dataset(str(tmp_path))
    board, runs = run_on_ranks(1, _train_with_recording_sinks, prefix, str(tmp_path))[0]
    assert set(board) == FIELDS
    assert all(sorted(steps) == [2, 4] for steps in board.values()), board
    assert set(runs) == {2, 4} and all(set(v) == FIELDS for v in runs.values())
    for tag, steps in board.items():
        assert all(runs[step][tag] == value for step, value in steps.items())
    assert math.isclose(board["validation perplexity"][4], math.exp(board["validation lm loss"][4]),
                        rel_tol=1e-9)
    assert board["skipped steps"] == {2: 0.0, 4: 0.0} and board["loss scale"][2] == 1.0
    assert board["tokens per second"][2] > 0 and board["peak memory MB"][2] > 0


@pytest.mark.parametrize("flags,package", [(("tb", None), "tensorboard"),
                                           ((None, "proj"), "wandb")])
def test_missing_optional_package_is_one_line(flags, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(ValueError, match=f"needs the '{package}' package") as error:
        check_available(*flags)
    assert "\n" not in str(error.value)


def test_cpu_reduced_precision_warning_names_the_measured_ratio():
    line = reduced_precision_warning(torch.bfloat16, threshold=0.0)
    capability = torch.backends.cpu.get_cpu_capability()
    assert line.startswith("warning: bfloat16 matmuls run ") and f"capability {capability}" in line
    assert reduced_precision_warning(torch.bfloat16, threshold=1e9) is None


class SimulatedCpu:
    """A clock and a matmul whose cost depends on the dtype: each dtype's first `jit_calls`
    calls cost `jit` seconds more (oneDNN compiling its kernel) than later ones, `warm[dtype]`."""

    def __init__(self, warm: dict, jit: float = 1.8, jit_calls: int = 2) -> None:
        self.now, self.warm, self.jit, self.jit_calls = 0.0, warm, jit, jit_calls
        self.calls: dict = {}

    def clock(self) -> float:
        return self.now

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.calls[a.dtype] = self.calls.get(a.dtype, 0) + 1
        cold = self.calls[a.dtype] <= self.jit_calls and a.dtype != torch.float32
        self.now += self.warm[a.dtype] + (self.jit if cold else 0.0)


@pytest.mark.parametrize("bf16_seconds,warns", [(0.5, False), (40.0, True)])
def test_cpu_bf16_decision_excludes_the_kernel_jit(bf16_seconds, warns):
    """AMX CPU (bf16 warm at half fp32's time, its first calls JIT-slow): no warning;
    AVX2 CPU (bf16 40x fp32): the warning, with the warm ratio."""
    cpu = SimulatedCpu({torch.float32: 1.0, torch.bfloat16: bf16_seconds})
    slowdown = functools.partial(matmul_slowdown, n=4, clock=cpu.clock, matmul=cpu.matmul)
    assert slowdown(torch.bfloat16) == bf16_seconds
    line = reduced_precision_warning(torch.bfloat16, slowdown=slowdown)
    assert (line is not None) == warns
    assert not warns or "run 40x slower" in line
