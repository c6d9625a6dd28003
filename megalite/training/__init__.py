"""The training loop and what it runs: the `Task` interface (task.py), `train` (loop.py),
Megatron's `pretrain` with provider functions (pretrain.py), run set-up (setup.py), start-up
checks (checks.py), logging and its writers (logger.py, log_writers.py), SIGTERM, NaN skips
and fault injection (resilience.py)."""
from megalite.training.loop import TrainResult, evaluate, train
from megalite.training.pretrain import PretrainTask, pretrain
from megalite.training.task import Run, Task

__all__ = ["Task", "Run", "TrainResult", "train", "evaluate", "pretrain", "PretrainTask"]
