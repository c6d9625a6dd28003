"""Megatron's `pretrain(configs, model_provider, forward_step_func, datasets_provider)`: a thin
constructor of a `Task` from provider functions, passed to `train`.
"""
from collections.abc import Callable, Iterator

import torch

from megalite.config import Configs
from megalite.layout import RunLayout
from megalite.training.loop import TrainResult, train
from megalite.training.task import Task


def pretrain_samples(configs: Configs, layout: RunLayout) -> tuple[int, int, int]:
    """Samples (train, valid, test) a pretraining run reads: --train-iters global batches, and
    --eval-iters global batches at every validation point."""
    t = configs.train
    evals = t.train_iters // t.eval_interval + 1 if t.eval_interval else 0
    return (t.train_iters * layout.global_batch_size,
            evals * t.eval_iters * layout.global_batch_size, 0)


class PretrainTask(Task):
    """The provider functions of `pretrain()` as a task."""

    def __init__(self, model_provider: Callable, forward_step_func: Callable,
                 datasets_provider: Callable, prepare: Callable | None = None,
                 check_inputs: Callable | None = None) -> None:
        self._model_provider, self._forward_step = model_provider, forward_step_func
        self._datasets_provider, self._prepare, self._check = datasets_provider, prepare, \
            check_inputs

    def check_inputs(self, configs: Configs, world_size: int) -> None:
        if self._check:
            self._check(configs)

    def prepare(self, configs: Configs) -> None:
        if self._prepare:
            self._prepare(configs)

    def model_provider(self, configs: Configs, pre_process: bool,
                       post_process: bool) -> torch.nn.Module:
        return self._model_provider(pre_process=pre_process, post_process=post_process)

    def forward_step(self, data_iterator: Iterator, model: torch.nn.Module):
        return self._forward_step(data_iterator, model)

    def batches(self, configs: Configs, layout: RunLayout, consumed: int):
        return self._datasets_provider(configs, pretrain_samples(configs, layout), consumed)


def pretrain(configs: Configs, model_provider: Callable, forward_step_func: Callable,
             datasets_provider: Callable, prepare: Callable | None = None,
             check_inputs: Callable | None = None) -> TrainResult:
    """`train()` with Megatron's provider functions.

    check_inputs(configs): runs first, before any process group (e.g. resolve the vocabulary
      size from --tokenizer); raise ValueError/OSError for one clear line on every rank.
    prepare(configs): runs after the process grid exists, before the model is built
      (e.g. build the default corpus once and set the vocabulary size).
    model_provider(pre_process=..., post_process=...) -> this rank's model chunk.
    datasets_provider(configs, num_samples (train, valid, test), consumed_samples) ->
      (train_iterator, valid_iterator or None) yielding this DP rank's microbatches.
    """
    return train(configs, PretrainTask(model_provider, forward_step_func, datasets_provider,
                                       prepare, check_inputs))
