"""The training loop and what it runs.

One API: a `Task` (task.py) says what to build, what to feed it, what to check and which
state of its own a checkpoint carries; `train(configs, task)` (loop.py) runs any task and
hands its hooks the `Run` in progress; `pretrain(configs, model_provider, forward_step_func,
datasets_provider)` (pretrain.py) is Megatron's entry point, a thin constructor of a Task
(`PretrainTask`) from provider functions passed to `train`. The tasks themselves (GPT
pretraining, BERT classification, chat SFT) and the command-line runner are megalite.tasks.
A run that cannot start raises `StartError` (checks.py, with the start-up checks). Also: run
set-up (setup.py), logging and its writers (logger.py, log_writers.py), SIGTERM, NaN skips and
fault injection (resilience.py).
"""
from megalite.training.checks import StartError
from megalite.training.loop import TrainResult, evaluate, train
from megalite.training.pretrain import PretrainTask, pretrain, pretrain_samples
from megalite.training.task import Run, Task

__all__ = ["Task", "Run", "TrainResult", "train", "evaluate", "pretrain", "PretrainTask",
           "pretrain_samples", "StartError"]
