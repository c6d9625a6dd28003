"""Learning-rate schedule: linear warm-up, then cosine, linear or no decay (Megatron's formula).

With n the number of steps taken, W the warm-up and D the decay iterations:
  n <= W (W > 0):  lr = max_lr * n / W
  constant:        lr = max_lr
  n > D:           lr = min_lr
  otherwise, with r = (n - W) / (D - W):
    linear: lr = min_lr + (max_lr - min_lr) * (1 - r)
    cosine: lr = min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi r))
"""
import math

from megalite.config import OptimizerConfig


class OptimizerParamScheduler:
    """Sets `lr` on every param group of `optimizer` (anything with `param_groups`)."""

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_iters: int,
                 decay_iters: int | None, decay_style: str) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.decay_iters = check_decay_iters(decay_style, warmup_iters, decay_iters)
        self.warmup_iters, self.decay_style = warmup_iters, decay_style
        self.num_steps = 0
        self.step(0)

    @classmethod
    def from_config(cls, optimizer, config: OptimizerConfig,
                    train_iters: int | None) -> "OptimizerParamScheduler":
        decay_iters = config.lr_decay_iters if config.lr_decay_iters is not None else train_iters
        return cls(optimizer, config.lr, config.min_lr, config.lr_warmup_iters, decay_iters,
                   config.lr_decay_style)

    def get_lr(self) -> float:
        """The learning rate for the next optimizer step."""
        n, warmup = self.num_steps, self.warmup_iters
        if warmup > 0 and n <= warmup:
            return self.max_lr * n / warmup
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        ratio = (n - warmup) / (self.decay_iters - warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1, iteration: int | None = None) -> None:
        """Advance by `increment` successful steps (from `iteration` if given) and set the lr."""
        if iteration is not None:
            self.num_steps = iteration
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count; the schedule's shape comes from this run's flags."""
        self.step(0, iteration=state["num_steps"])


def check_decay_iters(decay_style: str, warmup_iters: int, decay_iters: int | None) -> int | None:
    """`decay_iters`, or a ValueError (one line, naming the flags) when the schedule has none
    or decays for no steps. No process groups needed: call it when validating flags."""
    if decay_style == "constant":
        return decay_iters
    if decay_iters is None:
        raise ValueError(f"--lr-decay-style {decay_style} needs --lr-decay-iters "
                         "(or --train-iters)")
    if decay_iters <= warmup_iters:
        raise ValueError(f"--lr-decay-iters ({decay_iters}, default --train-iters) must exceed "
                         f"--lr-warmup-iters ({warmup_iters})")
    return decay_iters
