"""What keeps a run alive or stops it cleanly: the skipped-step limit, the SIGTERM handler
that makes every rank stop after the same step, and the fault-injection hook of the tests.

Fault injection (tests and drills only): the environment variable `MEGALITE_FAULT` holds
comma-separated `KIND@ITERATION[:RANK]` entries (RANK: global rank, default every rank).
During the forward step of that iteration on that rank:
  nan_loss   the microbatch loss (and its logged values) is multiplied by NaN, before backward
  sigterm    the process sends itself SIGTERM
  sigkill    the process sends itself SIGKILL (dies mid-step, as on a node failure)
e.g. `MEGALITE_FAULT=nan_loss@3:1 torchrun ...`. Unset, nothing changes.
"""
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.mpu import comm

FAULT_ENV = "MEGALITE_FAULT"
FAULT_KINDS = ("nan_loss", "sigterm", "sigkill")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps were skipped for a non-finite loss or grad norm."""


class SkipGuard:
    """Counts consecutive skipped steps that cannot recover by themselves: every skip without
    a loss scaler (bf16/fp32), and fp16 overflows once the loss scale is at its minimum."""

    def __init__(self, limit: int) -> None:
        self.limit, self.consecutive = limit, 0

    def update(self, iteration: int, stepped: bool, scaler) -> None:
        """Raise NonFiniteError (same iteration on every rank) once `limit` is reached."""
        if stepped:
            self.consecutive = 0
            return
        if scaler is not None and not scaler.at_minimum:
            return
        self.consecutive += 1
        if self.consecutive < self.limit:
            return
        cause = (f"fp16 overflow with the loss scale stuck at its minimum {scaler.scale:g}"
                 if scaler is not None else "non-finite loss or grad norm")
        raise NonFiniteError(
            f"iteration {iteration}: {self.consecutive} consecutive steps skipped ({cause}; "
            f"--max-skipped-steps {self.limit}); stopped without saving, the last checkpoint "
            f"is intact: resume it with --load (e.g. with a lower --lr or other data)")


class ExitSignalHandler:
    """While entered, SIGTERM only sets a flag. Once per step every rank calls `flag()` (a MAX
    all-reduce over the world, left on the device), reads it on the host with the step's
    other scalars and hands the value to `settle`, or `post_flag()` and, one step later,
    `settle_posted()`; `stop_requested` is then True on every rank once any rank got one."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received, self._previous = False, None
        self.stop_requested = False
        self._posted: tuple[torch.Tensor, object] | None = None  # post_flag's, not yet settled

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> "ExitSignalHandler":
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)

    def flag(self, device: torch.device) -> torch.Tensor:
        """[1] on `device`: 1.0 on every rank once any rank got SIGTERM (always 0.0, without
        communication, when disabled)."""
        return self._all_reduced(device, async_op=False)[0]

    def _all_reduced(self, device: torch.device, async_op: bool) -> tuple[torch.Tensor, object]:
        """(the flag [1], its MAX all-reduce's work when `async_op`); no collective when
        disabled."""
        flag = torch.full((1,), 1.0 if self.received else 0.0, device=device)
        work = comm.all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MAX,
                               async_op=async_op) if self.enabled else None
        return flag, work

    def settle(self, flag: float) -> None:
        """Take the host value of this step's `flag()`."""
        self.stop_requested = flag > 0

    def post_flag(self, device: torch.device) -> None:
        """Start this step's MAX all-reduce of the flag over the world without waiting for it
        (PipeDream-2BW between aligned steps, whose ranks do not meet); the next step's
        `settle_posted` takes its value."""
        if self.enabled:
            self._posted = self._all_reduced(device, async_op=True)

    def settle_posted(self) -> None:
        """Wait for the flag `post_flag` started (if any) and take its value."""
        if self._posted is not None:
            (flag, work), self._posted = self._posted, None
            if work is not None:
                work.wait()
            self.settle(flag.item())


@dataclass(frozen=True)
class Fault:
    kind: str
    iteration: int
    rank: int | None


def parse_faults(spec: str) -> list[Fault]:
    """`KIND@ITERATION[:RANK],...` -> faults; ValueError (one line) on a malformed entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, _, where = entry.partition("@")
        iteration, _, rank = where.partition(":")
        if kind not in FAULT_KINDS or not iteration.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected KIND@ITERATION[:RANK] entries with "
                             f"KIND one of {', '.join(FAULT_KINDS)}")
        faults.append(Fault(kind, int(iteration), int(rank) if rank else None))
    return faults


def _nan_loss(loss_func: Callable) -> Callable:
    def poisoned(*args, **kwargs):
        loss, logged = loss_func(*args, **kwargs)
        return loss * float("nan"), {k: v * float("nan") for k, v in logged.items()}
    return poisoned


def inject_faults(forward_step_func: Callable, iteration: int) -> Callable:
    """`forward_step_func`, with this rank's MEGALITE_FAULT entries for `iteration` applied."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    faults = [f for f in parse_faults(os.environ.get(FAULT_ENV, ""))
              if f.iteration == iteration and f.rank in (None, rank)]
    if not faults:
        return forward_step_func

    def faulty_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)
        for fault in faults:
            if fault.kind == "nan_loss":
                loss_func = _nan_loss(loss_func)
            else:
                os.kill(os.getpid(), signal.SIGTERM if fault.kind == "sigterm" else signal.SIGKILL)
        return output, loss_func
    return faulty_step
