"""The command-line runner of every task: parse its flags, train it, end the process.

The error-exit policy, in one place: a run that cannot start (a bad flag, file or data:
StartError, the same line on every rank) ends with one line `error: ...` on stderr and exit
status 2 (a flag argparse or a config section refuses exits the same way from
parse_configs); NonFiniteError (too many consecutive skipped steps) with one line and exit
status 1. A task module offers `run(argv)` (train in this process, raising NonFiniteError)
and `main(argv)` = `runner.main(run, argv)`, which its entry script calls.
"""
import sys
from collections.abc import Callable, Collection
from typing import NoReturn, TypeVar

import torch.distributed as dist

from megalite.config import Configs, default_checkpoint_dirs, parse_configs
from megalite.training import StartError, Task, TrainResult
from megalite.training import train as train_task
from megalite.training.resilience import NonFiniteError

Result = TypeVar("Result")


def exit_with(error: Exception, code: int) -> NoReturn:
    """End this process with one line on stderr."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse(argv: list[str] | None, description: str, defaults: dict,
          optional: Collection[str] = (), offer: dict[str, Collection[str]] | None = None
          ) -> Configs:
    """A task's configs from its flags (parse_configs: `optional` task sections, `offer` the
    shared flags it honours), with the entry scripts' --save/--load defaults: neither given,
    the run saves to and resumes from `defaults["save"]`; --load alone writes no checkpoint
    (as in Megatron-LM: only --save does), so the loaded one is never overwritten."""
    configs = parse_configs(argv, description, defaults, optional, offer)
    default_checkpoint_dirs(configs)
    return configs


def train(configs: Configs, task: Task) -> TrainResult:
    """megalite.training.train; a run that cannot start ends this process (exit status 2)."""
    try:
        return train_task(configs, task)
    except StartError as error:
        exit_with(error, 2)


def main(run: Callable[[list[str] | None], Result], argv: list[str] | None = None) -> Result:
    """An entry script's main: `run(argv)`, NonFiniteError ending the process (exit status 1);
    then every rank leaves the process group together."""
    try:
        result = run(argv)
    except NonFiniteError as error:
        exit_with(error, 1)
    dist.barrier()
    dist.destroy_process_group()
    return result
