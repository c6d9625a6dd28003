"""Optional scalar sinks for the training log: TensorBoard and Weights & Biases.

Both packages are optional; asking for one that is not installed is one clear error.
`ScalarWriters.write({name: value}, step)` sends the same scalars to every opened sink.
"""
import importlib.util

MISSING = {"tensorboard": "--tensorboard-dir needs the 'tensorboard' package (pip install "
                          "tensorboard)",
           "wandb": "--wandb-project needs the 'wandb' package (pip install wandb; "
                    "WANDB_MODE=offline runs without network)"}


def check_available(tensorboard_dir: str | None, wandb_project: str | None) -> None:
    """ValueError (one line) if a requested sink's package is missing; no import, no I/O."""
    for wanted, package in ((tensorboard_dir, "tensorboard"), (wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ValueError(MISSING[package])


def _tensorboard(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(MISSING["tensorboard"]) from None
    writer = SummaryWriter(directory)

    def write(scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)
        writer.flush()
    return write, writer.close


def _wandb(project: str, directory: str | None, config: dict):
    try:
        import wandb
    except ImportError:
        raise ValueError(MISSING["wandb"]) from None
    run = wandb.init(project=project, dir=directory, config=config)

    def write(scalars: dict[str, float], step: int) -> None:
        run.log(dict(scalars), step=step)
    return write, run.finish


class ScalarWriters:
    """The sinks a run asked for (none: writing is a no-op)."""

    def __init__(self, tensorboard_dir: str | None = None, wandb_project: str | None = None,
                 config: dict | None = None) -> None:
        self._sinks = []
        if tensorboard_dir:
            self._sinks.append(_tensorboard(tensorboard_dir))
        if wandb_project:
            self._sinks.append(_wandb(wandb_project, tensorboard_dir, config or {}))

    def __bool__(self) -> bool:
        return bool(self._sinks)

    def write(self, scalars: dict[str, float], step: int) -> None:
        for write, _ in self._sinks:
            write(scalars, step)

    def close(self) -> None:
        for _, close in self._sinks:
            close()
        self._sinks = []
