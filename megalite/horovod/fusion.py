"""Handles of asynchronous operations, and Tensor Fusion of the all-reduces.

An all-reduce submitted asynchronously waits in the fusion buffer with the others of its dtype,
op and scale factors: the buffer is sent as one collective when the next tensor would take it
past HOROVOD_FUSION_THRESHOLD bytes (default 64 MiB, Horovod's; 0 sends every tensor alone),
when a tensor of another kind arrives, or when a waiting handle is synchronized or polled. A
tensor larger than the threshold goes alone. Every rank packs the same tensors into the same
collectives because the packing depends only on the order of submission, which is the same on
every rank (Horovod negotiates by name in timed cycles instead; see docs/lightning_horovod.md).

`count_collectives()` records each data collective: its kind, how many tensors it carried,
and its payload bytes.
"""
import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator

import torch

from megalite.horovod import protocol
from megalite.horovod.basics import topology
from megalite.mpu import comm

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024


@dataclasses.dataclass
class Collective:
    """One data collective this rank issued."""

    kind: str
    tensors: int
    bytes: int


_log: list[Collective] | None = None


@contextlib.contextmanager
def count_collectives() -> Iterator[list[Collective]]:
    """Yield the list of data collectives this rank issues inside the block."""
    global _log
    outer, _log = _log, []
    try:
        yield _log
    finally:
        inner, _log = _log, outer
        if outer is not None:
            outer.extend(inner)


def fusion_threshold() -> int:
    """HOROVOD_FUSION_THRESHOLD in bytes (default 64 MiB)."""
    value = os.environ.get("HOROVOD_FUSION_THRESHOLD", str(DEFAULT_FUSION_THRESHOLD))
    try:
        threshold = int(value)
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={value!r}: expected a byte count >= 0")
    return threshold


class Handle:
    """An asynchronous operation: launched (or waiting in the fusion buffer), finished on
    `wait()`, which returns its output."""

    def __init__(self) -> None:
        self.launched = False
        self.works: list = []
        self.finish: Callable[[], object] | None = None
        self.output: object = None

    def poll(self) -> bool:
        """Whether the collective has completed (sends the fusion buffer holding it)."""
        if not self.launched:
            flush()
        return all(work is None or work.is_completed() for work in self.works)

    def wait(self) -> object:
        """Block until done; finish it once (unpack, scale); the output."""
        if not self.launched:
            flush()
        for work in self.works:
            if work is not None:
                work.wait()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            self.output = finish()
        return self.output


def launched(output: object, works: list, finish: Callable[[], object] | None) -> Handle:
    handle = Handle()
    handle.launched, handle.works, handle.output, handle.finish = True, works, output, finish
    return handle


def log(kind: str, tensors: int, payload: torch.Tensor) -> None:
    if _log is not None:
        _log.append(Collective(kind, tensors, payload.numel() * payload.element_size()))


@dataclasses.dataclass
class _Entry:
    handle: Handle
    tensor: torch.Tensor  # the input, read when the buffer is sent
    output: torch.Tensor  # where the reduced values go (the input itself when in place)


@dataclasses.dataclass
class _Buffer:
    key: tuple = ()  # (dtype, op, prescale, postscale): only equal keys fuse
    entries: list[_Entry] = dataclasses.field(default_factory=list)
    bytes: int = 0


_pending = _Buffer()


def submit_allreduce(tensor: torch.Tensor, output: torch.Tensor, op: int, prescale: float,
                     postscale: float) -> Handle:
    """Queue `tensor` for a fused all-reduce into `output`; send the buffer when it is full."""
    key = (tensor.dtype, op, prescale, postscale)
    nbytes = tensor.numel() * tensor.element_size()
    threshold = fusion_threshold()
    if _pending.entries and (key != _pending.key or _pending.bytes + nbytes > threshold):
        flush()
    handle = Handle()
    _pending.key = key
    _pending.entries.append(_Entry(handle, tensor, output))
    _pending.bytes += nbytes
    if _pending.bytes >= threshold:
        flush()
    return handle


def flush() -> None:
    """Send the fusion buffer as one all-reduce (a control round first)."""
    global _pending
    buffer, _pending = _pending, _Buffer()
    if not buffer.entries:
        return
    dtype, op, prescale, postscale = buffer.key
    topo = topology()
    fused = torch.cat([e.tensor.detach().reshape(-1).to(topo.device) for e in buffer.entries])
    if prescale != 1.0:
        fused.mul_(prescale)
    announcement = protocol.announce(protocol.Descriptor("allreduce", dtype, fused.numel(), op=op))
    log("allreduce", len(buffer.entries), fused)
    work = comm.all_reduce(fused, topo.group, op=protocol.REDUCE_OPS[op], async_op=True)

    done: list[bool] = []

    def finish_buffer() -> None:
        if done:
            return
        done.append(True)
        active = announcement.active_ranks()
        scale = postscale / active if op == protocol.Average else postscale
        if scale != 1.0 and fused.is_floating_point():
            fused.mul_(scale)
        elif scale != 1.0:
            fused.copy_(fused.double().mul_(scale))
        offset = 0
        for entry in buffer.entries:
            numel = entry.output.numel()
            entry.output.copy_(fused[offset:offset + numel].view_as(entry.output))
            offset += numel

    for entry in buffer.entries:
        entry.handle.launched, entry.handle.works = True, [announcement.work, work]
        entry.handle.finish = functools.partial(_finish_entry, finish_buffer, entry.output)


def _finish_entry(finish_buffer: Callable[[], None], output: torch.Tensor) -> torch.Tensor:
    finish_buffer()
    return output


def reset() -> None:
    """Drop the fusion buffer (shutdown)."""
    global _pending
    _pending = _Buffer()
